#!/usr/bin/env bash
# Pygmy in containers, offline: set up, build, run and test the docker-compose stack.
#
#   bash scripts/compose.sh ci-setup   install what is missing: docker.io + debootstrap (apt), the Compose
#                                      plugin (built with Go, cached), then start the engine
#   bash scripts/compose.sh engine     start the Docker engine if installed but not running (root)
#   bash scripts/compose.sh build      base image (debootstrap, cached) + host-built wheels + image, offline
#   bash scripts/compose.sh secrets    write a random PYGMY_SECRET and PYGMY_ADMIN_TOKEN to .env (read by docker
#                                      compose, ignored by git) for each set neither there nor in the environment
#   bash scripts/compose.sh up         secrets, build, then `docker compose up -d --wait`  (make compose-up)
#   bash scripts/compose.sh down [-v]  stop the stack; -v also deletes its volumes (make compose-down)
#   bash scripts/compose.sh test       build, start a throw-away stack on a free port, smoke test, kill the
#                                      leaders, check service goes on and they catch up, tear down
#                                      (make compose-test)
#   bash scripts/compose.sh stack-test deploy the same file with `docker stack deploy` on a single-node
#                                      swarm, smoke-test it, remove it
#
# Environment: PYGMY_IMAGE (pygmy:latest), PYGMY_PROXY_IMAGE (pygmy-proxy:latest), PYGMY_BASE_IMAGE (default: python:3.11-slim if present
# locally, else pygmy-base:bookworm built here with debootstrap), PYGMY_HTTP_PORT (8000 for up),
# COMPOSE_PROJECT_NAME (pygmy for up/down), PYGMY_CACHE_DIR (~/.cache/pygmy), PYGMY_SECRET (the internal
# secret between services) and PYGMY_ADMIN_TOKEN (for POST /update), both required by docker-compose.yml.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

COMPOSE_VERSION="v2.29.7"
CACHE_DIR="${PYGMY_CACHE_DIR:-$HOME/.cache/pygmy}"
USER_IMAGE="${PYGMY_IMAGE:-}"
IMAGE="${PYGMY_IMAGE:-pygmy:latest}"
PROXY_IMAGE="${PYGMY_PROXY_IMAGE:-pygmy-proxy:latest}"
LOCAL_BASE="pygmy-base:bookworm"
WHEELS="$ROOT/build/wheels"
export PYGMY_IMAGE="$IMAGE" PYGMY_PROXY_IMAGE="$PROXY_IMAGE"

log() { printf '[compose] %s\n' "$*" >&2; }
die() { printf '[compose] ERROR: %s\n' "$*" >&2; exit 1; }
is_root() { [[ $(id -u) == 0 ]]; }

host_python() {
    if [[ -x "$ROOT/.venv/bin/python" ]]; then echo "$ROOT/.venv/bin/python"; else command -v python3; fi
}

# ---------------------------------------------------------------------------------------------- setup
apt_install() {
    local missing=("$@")
    is_root || die "missing ${missing[*]}; install them as root: apt-get install ${missing[*]}"
    log "apt-get install ${missing[*]}"
    mkdir -p "$CACHE_DIR"
    local logf="$CACHE_DIR/apt.log"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive NEEDRESTART_SUSPEND=1 \
            apt-get install -y -qq "${missing[@]}"; } >"$logf" 2>&1; then
        tail -n 20 "$logf" >&2
        die "apt-get install ${missing[*]} failed (log: $logf)"
    fi
}

compose_plugin() {
    local plugin_dir="${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins"
    local cached="$CACHE_DIR/bin/docker-compose-$COMPOSE_VERSION"
    if docker compose version >/dev/null 2>&1; then
        log "compose plugin: $(docker compose version --short 2>/dev/null || echo present)"
        return
    fi
    if [[ ! -x "$cached" ]]; then
        local go="${GO:-}"
        [[ -n "$go" ]] || go=$(command -v go || true)
        [[ -n "$go" ]] || { [[ -x /usr/local/go/bin/go ]] && go=/usr/local/go/bin/go; }
        [[ -n "$go" ]] || die "no Compose plugin and no Go toolchain to build it (need go in PATH or /usr/local/go)"
        local gobin
        gobin=$(mktemp -d)
        log "building the Compose plugin $COMPOSE_VERSION with go install (a few minutes, cached afterwards)"
        if ! GOBIN="$gobin" CGO_ENABLED=0 "$go" install \
                -ldflags "-s -w -X github.com/docker/compose/v2/internal.Version=$COMPOSE_VERSION" \
                "github.com/docker/compose/v2/cmd@$COMPOSE_VERSION" >"$CACHE_DIR/go-install.log" 2>&1; then
            tail -n 20 "$CACHE_DIR/go-install.log" >&2
            die "go install of docker compose failed (log: $CACHE_DIR/go-install.log)"
        fi
        mkdir -p "$CACHE_DIR/bin"
        mv "$gobin/cmd" "$cached"
        rm -rf "$gobin"
    fi
    mkdir -p "$plugin_dir"
    cp "$cached" "$plugin_dir/docker-compose"
    chmod +x "$plugin_dir/docker-compose"
    docker compose version >/dev/null 2>&1 || die "installed $plugin_dir/docker-compose but 'docker compose' fails"
    log "compose plugin: installed $plugin_dir/docker-compose ($COMPOSE_VERSION)"
}

ci_setup() {
    mkdir -p "$CACHE_DIR"
    local missing=()
    command -v dockerd >/dev/null || missing+=(docker.io)
    command -v docker >/dev/null || missing+=(docker.io)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    if ((${#missing[@]})); then
        # shellcheck disable=SC2207
        missing=($(printf '%s\n' "${missing[@]}" | sort -u))
        apt_install "${missing[@]}"
    else
        log "docker and debootstrap already installed"
    fi
    compose_plugin
    engine
    log "Docker engine $(docker version --format '{{.Server.Version}}' 2>/dev/null) running"
}

# --------------------------------------------------------------------------------------------- engine
engine() {
    command -v docker >/dev/null || die "docker is not installed (run: bash scripts/compose.sh ci-setup)"
    if docker info >/dev/null 2>&1; then
        return
    fi
    command -v dockerd >/dev/null || die "the Docker engine is not running and dockerd is not installed (run: bash scripts/compose.sh ci-setup)"
    is_root || die "the Docker engine is not running; start it (e.g. sudo systemctl start docker) or run this as root"
    mkdir -p "$CACHE_DIR"
    local logf="$CACHE_DIR/dockerd.log"
    log "starting the Docker engine (dockerd, log: $logf)"
    # setsid: the engine outlives this script and is not in its process group.
    setsid nohup dockerd >"$logf" 2>&1 </dev/null &
    local i
    for i in $(seq 1 60); do
        if [[ -S /var/run/docker.sock ]] && docker info >/dev/null 2>&1; then
            log "Docker engine ready after ${i}s"
            return
        fi
        sleep 1
    done
    tail -n 20 "$logf" >&2
    die "the Docker engine did not come up within 60s (log: $logf)"
}

require_compose() {
    docker compose version >/dev/null 2>&1 || die "'docker compose' is not available (run: bash scripts/compose.sh ci-setup)"
}

# ---------------------------------------------------------------------------------------------- build
base_image() {
    if [[ -n "${PYGMY_BASE_IMAGE:-}" ]]; then
        echo "$PYGMY_BASE_IMAGE"
    elif docker image inspect python:3.11-slim >/dev/null 2>&1; then
        echo python:3.11-slim
    else
        bash "$ROOT/scripts/build-base-image.sh" >&2 || die "could not build the base image $LOCAL_BASE"
        echo "$LOCAL_BASE"
    fi
}

# Wheels for the image, built on the host (which reaches PyPI; the image build has no network).
# Dependencies are fetched for CPython 3.11 on Linux whatever the host's Python, and cached in
# $CACHE_DIR/wheels, so a later build needs no network at all unless pyproject.toml changed.
wheels() {
    local py arch
    py=$(host_python)
    arch=$(uname -m)
    local cache="$CACHE_DIR/wheels"
    mkdir -p "$cache" "$WHEELS"
    rm -f "$WHEELS"/*.whl
    # A stale build/lib could put deleted modules into the wheel.
    rm -rf "$ROOT/build/lib" "$ROOT"/build/bdist.*
    local pipq=("$py" -m pip --disable-pip-version-check -q)
    local offline=(--no-index --find-links "$cache")
    if ! "${pipq[@]}" wheel --no-deps "${offline[@]}" -w "$WHEELS" "$ROOT" >/dev/null 2>&1; then
        log "building the pygmy wheel (fetching build requirements from PyPI)"
        "${pipq[@]}" download --only-binary=:all: -d "$cache" 'setuptools>=68' wheel >/dev/null \
            || die "could not download setuptools/wheel from PyPI"
        "${pipq[@]}" wheel --no-deps --find-links "$cache" -w "$WHEELS" "$ROOT" >/dev/null \
            || die "could not build the pygmy wheel (pip wheel . failed)"
    fi
    local whl
    whl=$(ls "$WHEELS"/pygmy-*.whl 2>/dev/null | head -n1)
    [[ -n "$whl" ]] || die "no pygmy wheel in $WHEELS"
    local target=(--only-binary=:all: --implementation cp --python-version 3.11 --abi cp311 --abi abi3 --abi none
                  --platform "manylinux2014_$arch" --platform "manylinux_2_17_$arch"
                  --platform "manylinux_2_28_$arch" --platform "linux_$arch" --platform any)
    if ! "${pipq[@]}" download "${offline[@]}" "${target[@]}" -d "$cache" "$whl" >/dev/null 2>&1; then
        log "fetching dependency wheels from PyPI into $cache"
        "${pipq[@]}" download --find-links "$cache" "${target[@]}" -d "$cache" "$whl" >/dev/null \
            || die "could not download the dependency wheels (pip download failed)"
    fi
    # Copy into the build context only what the image needs (not setuptools/wheel, not old versions).
    "${pipq[@]}" download "${offline[@]}" "${target[@]}" -d "$WHEELS" "$whl" >/dev/null \
        || die "could not collect the wheels into $WHEELS"
    rm -f "$cache"/pygmy-*.whl
    log "wheels: $(ls "$WHEELS" | wc -l) in build/wheels"
}

build() {
    engine
    local base
    base=$(base_image)
    wheels
    local net=(--network none)
    # Without the buildx plugin, use the classic builder (it also honours --network none for RUN).
    if ! docker buildx version >/dev/null 2>&1; then export DOCKER_BUILDKIT=0; fi
    log "docker build $IMAGE (BASE_IMAGE=$base, no network)"
    local logf="$CACHE_DIR/docker-build.log"
    mkdir -p "$CACHE_DIR"
    if ! docker build "${net[@]}" --build-arg "BASE_IMAGE=$base" -t "$IMAGE" "$ROOT" >"$logf" 2>&1; then
        tail -n 30 "$logf" >&2
        die "docker build failed (log: $logf)"
    fi
    # The proxy's image: nginx comes with the local base (the build has no network to fetch it).
    local proxy_base="${PYGMY_PROXY_BASE_IMAGE:-}"
    if [[ -z "$proxy_base" ]]; then
        bash "$ROOT/scripts/build-base-image.sh" >&2 || die "could not build the base image $LOCAL_BASE"
        proxy_base="$LOCAL_BASE"
    fi
    log "docker build $PROXY_IMAGE (BASE_IMAGE=$proxy_base, no network)"
    if ! docker build "${net[@]}" --build-arg "BASE_IMAGE=$proxy_base" -f "$ROOT/deploy/proxy/Dockerfile" \
            -t "$PROXY_IMAGE" "$ROOT" >>"$logf" 2>&1; then
        tail -n 30 "$logf" >&2
        die "docker build of the proxy failed (log: $logf)"
    fi
    # Drop what earlier builds left untagged: replaced images, and (classic builder) old build stages.
    docker image prune -f --filter label=pygmy.image=true >/dev/null 2>&1 || true
    docker image prune -f --filter label=pygmy.build-stage=true --filter until=1h >/dev/null 2>&1 || true
    log "built $IMAGE and $PROXY_IMAGE"
}

# --------------------------------------------------------------------------------------------- up/down
compose() { docker compose -f "$ROOT/docker-compose.yml" -f "$ROOT/docker-compose.override.yml" "$@"; }
# Progress lines only where a person watches; the test prints its own summary (and logs on failure).
quiet_compose() { docker compose --progress quiet -f "$ROOT/docker-compose.yml" -f "$ROOT/docker-compose.override.yml" "$@"; }

# docker-compose.yml has no default secrets. Give each one that is neither in the environment nor in .env
# (which docker compose reads by itself; ignored by git) a random value there, made once and kept.
ensure_secrets() {
    local envf="$ROOT/.env" name value
    for name in PYGMY_SECRET PYGMY_ADMIN_TOKEN; do
        [[ -n "${!name:-}" ]] && continue
        [[ -f "$envf" ]] && grep -Eq "^${name}=.+" "$envf" && continue
        value=$("$(host_python)" -c 'import secrets; print(secrets.token_hex(24))')
        [[ -s "$envf" && -n $(tail -c1 "$envf") ]] && echo >>"$envf"  # end a last line left open
        (umask 077 && printf '%s=%s\n' "$name" "$value" >>"$envf")
        chmod 600 "$envf"
        log "created a random $name in .env"
    done
}

up() {
    require_compose
    ensure_secrets
    build
    export COMPOSE_PROJECT_NAME="${COMPOSE_PROJECT_NAME:-pygmy}"
    log "docker compose up (project $COMPOSE_PROJECT_NAME)"
    compose up -d --wait --wait-timeout "${PYGMY_WAIT_TIMEOUT:-180}" --no-build \
        || { compose ps -a >&2 || true; compose logs --tail 30 >&2 || true; die "the stack did not become healthy"; }
    log "ready http://127.0.0.1:${PYGMY_HTTP_PORT:-8000}  (stop: make compose-down)"
}

down() {
    require_compose
    if ! docker info >/dev/null 2>&1; then
        log "the Docker engine is not running: nothing to stop"
        return
    fi
    export COMPOSE_PROJECT_NAME="${COMPOSE_PROJECT_NAME:-pygmy}"
    # Compose interpolates the whole file even to stop it; the secrets' values do not matter here.
    export PYGMY_SECRET="${PYGMY_SECRET:-unused}" PYGMY_ADMIN_TOKEN="${PYGMY_ADMIN_TOKEN:-unused-too}"
    compose down --remove-orphans "$@"
}

# ------------------------------------------------------------------------------------------------ test
free_port() {
    "$(host_python)" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

test_stack() {
    require_compose
    TEST_START=$SECONDS
    # Globals, not locals: the EXIT trap runs after this function has returned.
    TEST_PROJECT="pygmy-test-$$-$RANDOM"
    # Its own image tag (unless PYGMY_IMAGE is set), so that tests from two checkouts at once do not run
    # each other's code; removed again at the end.
    if [[ -z "$USER_IMAGE" ]]; then
        IMAGE="pygmy:$TEST_PROJECT"
        export PYGMY_IMAGE="$IMAGE" PYGMY_PROXY_IMAGE="$PROXY_IMAGE"
    fi
    build
    local built=$SECONDS
    log "build took $((built - TEST_START))s"
    TEST_PORT="${PYGMY_TEST_PORT:-$(free_port)}"
    export COMPOSE_PROJECT_NAME="$TEST_PROJECT" PYGMY_HTTP_PORT="$TEST_PORT"
    export PYGMY_SECRET="${PYGMY_SECRET:-test-secret-$RANDOM$RANDOM}"
    export PYGMY_ADMIN_TOKEN="${PYGMY_ADMIN_TOKEN:-test-admin-$RANDOM$RANDOM}"
    # shellcheck disable=SC2317
    cleanup() {
        local rc=$?
        if ((rc != 0)); then
            log "test failed: container state and recent logs follow"
            compose ps -a >&2 || true
            compose logs --no-color --tail 40 >&2 || true
        fi
        log "tearing down $TEST_PROJECT"
        # With the spare file too: its replicas and volumes, if the test started them, go as well.
        compose -f "$ROOT/docker-compose.spare.yml" down -v --remove-orphans --timeout 5 >/dev/null 2>&1 || true
        [[ -n "$USER_IMAGE" ]] || docker image rm "$IMAGE" >/dev/null 2>&1 || true
        exit "$rc"
    }
    trap cleanup EXIT
    trap 'exit 130' INT TERM
    log "starting stack $TEST_PROJECT on 127.0.0.1:$TEST_PORT"
    quiet_compose up -d --wait --wait-timeout "${PYGMY_WAIT_TIMEOUT:-180}" --no-build \
        || die "the stack did not become healthy"
    log "stack healthy $((SECONDS - built))s after 'up'; running the smoke and failover test"
    "$(host_python)" "$ROOT/scripts/compose_test.py" --url "http://127.0.0.1:$TEST_PORT" \
        --compose "docker compose -f $ROOT/docker-compose.yml -f $ROOT/docker-compose.override.yml" \
        --spare "$ROOT/docker-compose.spare.yml"
    log "compose test passed in $((SECONDS - TEST_START))s in all"
}

# Swarm: deploy docker-compose.yml with `docker stack deploy` on this node (a single-node swarm is made
# for the test and left again if this node was in none), smoke-test it, remove it.
stack_test() {
    local start=$SECONDS
    build
    STACK_NAME="pygmy-stack-$$-$RANDOM"
    STACK_PORT="${PYGMY_TEST_PORT:-$(free_port)}"
    STACK_INIT=0
    if [[ $(docker info --format '{{.Swarm.LocalNodeState}}') != active ]]; then
        log "docker swarm init (single node, for this test)"
        docker swarm init --advertise-addr 127.0.0.1 >/dev/null || die "docker swarm init failed"
        STACK_INIT=1
    fi
    # shellcheck disable=SC2317
    stack_cleanup() {
        local rc=$?
        if ((rc != 0)); then
            docker stack ps "$STACK_NAME" --no-trunc >&2 || true
        fi
        log "removing stack $STACK_NAME"
        docker stack rm "$STACK_NAME" >/dev/null 2>&1 || true
        local i
        for i in $(seq 1 60); do
            [[ -z $(docker ps -aq -f "label=com.docker.stack.namespace=$STACK_NAME") ]] && break
            sleep 1
        done
        sleep 2  # the stack's network goes after its containers
        docker volume ls -q -f "label=com.docker.stack.namespace=$STACK_NAME" | xargs -r docker volume rm >/dev/null 2>&1 || true
        if ((STACK_INIT)); then
            docker swarm leave --force >/dev/null 2>&1 || true
            docker network rm docker_gwbridge >/dev/null 2>&1 || true
        fi
        exit "$rc"
    }
    trap stack_cleanup EXIT
    trap 'exit 130' INT TERM
    log "docker stack deploy $STACK_NAME on 127.0.0.1:$STACK_PORT"
    export PYGMY_SECRET="${PYGMY_SECRET:-test-secret-$RANDOM$RANDOM}"
    export PYGMY_ADMIN_TOKEN="${PYGMY_ADMIN_TOKEN:-test-admin-$RANDOM$RANDOM}"
    PYGMY_HTTP_PORT="$STACK_PORT" \
        docker stack deploy --resolve-image never -c "$ROOT/docker-compose.yml" "$STACK_NAME" >/dev/null 2>&1 \
        || die "docker stack deploy failed"
    "$(host_python)" "$ROOT/scripts/compose_test.py" --url "http://127.0.0.1:$STACK_PORT" --smoke-only --ready-timeout 180
    log "stack test passed in $((SECONDS - start))s"
}

# ------------------------------------------------------------------------------------------------ main
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

cmd="${1:-}"
[[ $# -gt 0 ]] && shift
case "$cmd" in
    ci-setup) ci_setup ;;
    engine) engine ;;
    build) require_compose; build ;;
    secrets) ensure_secrets ;;
    up) up ;;
    down) down "$@" ;;
    test) test_stack ;;
    stack-test) stack_test ;;
    -h | --help | help) usage ;;
    *) usage >&2; die "unknown command '${cmd}'" ;;
esac
