#!/usr/bin/env bash
# Build the local base image pygmy-base:bookworm (Debian bookworm + python3 3.11 + venv, and nginx-light
# for the reverse proxy's image, deploy/proxy/Dockerfile) without any
# container registry: debootstrap a minimal root file system from Debian's package mirror, then
# `docker import` it. The root file system tarball is cached, so a second run needs no network.
#
#   bash scripts/build-base-image.sh [--force]
#
# Environment: PYGMY_BASE_IMAGE (default pygmy-base:bookworm), PYGMY_CACHE_DIR (default ~/.cache/pygmy),
# PYGMY_DEBIAN_MIRROR (default: the first Debian mirror in this machine's apt sources, else deb.debian.org).
set -euo pipefail

IMAGE="${PYGMY_BASE_IMAGE:-pygmy-base:bookworm}"
CACHE_DIR="${PYGMY_CACHE_DIR:-$HOME/.cache/pygmy}"
# What the image holds: a cached tarball or an image made with another list is made again.
PACKAGES="python3,python3-venv,ca-certificates,nginx-light"
STAMP=$(printf '%s' "$PACKAGES" | sha256sum | cut -c1-12)
TARBALL="$CACHE_DIR/pygmy-base-bookworm-$STAMP.tar"
FORCE=0
[[ "${1:-}" == "--force" ]] && FORCE=1

log() { printf '[base-image] %s\n' "$*" >&2; }
die() { printf '[base-image] ERROR: %s\n' "$*" >&2; exit 1; }

command -v docker >/dev/null || die "docker is not installed (run: bash scripts/compose.sh ci-setup)"
docker info >/dev/null 2>&1 || die "the Docker engine is not reachable (run: bash scripts/compose.sh engine)"

if [[ $FORCE == 0 ]] && [[ $(docker image inspect -f '{{index .Config.Labels "pygmy.base.packages"}}' "$IMAGE" 2>/dev/null) == "$PACKAGES" ]]; then
    log "$IMAGE already present"
    exit 0
fi

mirror() {
    if [[ -n "${PYGMY_DEBIAN_MIRROR:-}" ]]; then echo "$PYGMY_DEBIAN_MIRROR"; return; fi
    local m
    m=$( (grep -hsE '^URIs:' /etc/apt/sources.list.d/*.sources; grep -hsE '^deb ' /etc/apt/sources.list) \
        | grep -oE 'https?://[^ ]*/debian/?$|https?://[^ ]*/debian ' | grep -v security | head -n1 | tr -d ' ')
    echo "${m:-http://deb.debian.org/debian}"
}

mkdir -p "$CACHE_DIR"
if [[ $FORCE == 1 || ! -s "$TARBALL" ]]; then
    command -v debootstrap >/dev/null || die "debootstrap is not installed (run: bash scripts/compose.sh ci-setup)"
    [[ $(id -u) == 0 ]] || die "debootstrap needs root"
    MIRROR=$(mirror)
    ROOTFS=$(mktemp -d "$CACHE_DIR/rootfs.XXXXXX")
    trap 'rm -rf "$ROOTFS"' EXIT
    log "debootstrap bookworm from $MIRROR (a few minutes; log: $CACHE_DIR/debootstrap.log)"
    if ! debootstrap --variant=minbase --include="$PACKAGES" \
            bookworm "$ROOTFS" "$MIRROR" >"$CACHE_DIR/debootstrap.log" 2>&1; then
        tail -n 20 "$CACHE_DIR/debootstrap.log" >&2
        die "debootstrap failed (see $CACHE_DIR/debootstrap.log)"
    fi
    # Slim it down: no package lists, caches, docs or man pages are needed at run time.
    rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/* "$ROOTFS"/var/log/* \
        "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* \
        "$ROOTFS"/usr/share/locale/* "$ROOTFS"/tmp/* 2>/dev/null || true
    tar -C "$ROOTFS" --numeric-owner -cf "$TARBALL.tmp" .
    mv "$TARBALL.tmp" "$TARBALL"
    rm -rf "$ROOTFS"
    trap - EXIT
    log "cached root file system: $TARBALL ($(du -h "$TARBALL" | cut -f1))"
else
    log "using cached root file system $TARBALL"
fi

docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    --change "LABEL pygmy.base.packages=$PACKAGES" \
    --message "pygmy base: debootstrap bookworm minbase + $PACKAGES" \
    "$TARBALL" "$IMAGE" >/dev/null
log "imported $IMAGE ($(docker run --rm --network none "$IMAGE" python3 --version))"
