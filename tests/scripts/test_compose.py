"""No known secrets in the container deployment: ``docker-compose.yml`` has no default for the internal
secret or the admin token and refuses to start without them; ``scripts/compose.sh`` (``make
compose-up``) makes random ones in an ignored ``.env`` when none is set."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SECRETS = ("PYGMY_SECRET", "PYGMY_ADMIN_TOKEN")


def environments() -> dict[str, dict[str, str]]:
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return {name: svc.get("environment", {}) for name, svc in doc["services"].items()}


def test_the_compose_file_requires_both_secrets_and_has_no_default() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    for name in SECRETS:
        uses = re.findall(r"\$\{" + name + r"([^}]*)\}", text)
        assert uses, name
        # ${VAR:?message}: compose refuses to run when VAR is unset or empty, and says what to set.
        assert all(u.startswith(":?") and f"set {name}" in u for u in uses), uses
        # `docker stack deploy` reads what follows a '-' in the message as a default value: every
        # service got the message's tail ("up creates one)") as its secret, and the frontends refused
        # to start with a token equal to the secret.
        assert not any("-" in u for u in uses), uses
    envs = environments()
    assert envs.pop("proxy") == {}, "the proxy knows no secret: it only passes requests on"
    assert all(env["PYGMY_SECRET"].startswith("${PYGMY_SECRET:?") for env in envs.values())
    # Only the frontends know the admin token: a replica has no use for it.
    assert [n for n, env in envs.items() if "PYGMY_ADMIN_TOKEN" in env] == ["frontend-1", "frontend-2"]


def test_each_frontend_advertises_its_own_name_and_only_the_proxy_publishes_a_port() -> None:
    """The catalog pushes to each frontend worker at the host it advertises: two frontends under one
    name would have their pushes misrouted. Clients reach them through the proxy alone."""
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = doc["services"]
    fronts = sorted(n for n in services if n.startswith("frontend"))
    assert fronts == ["frontend-1", "frontend-2"]
    assert [services[n]["environment"]["PYGMY_ADVERTISE_HOST"] for n in fronts] == fronts
    assert [n for n, svc in services.items() if svc.get("ports")] == ["proxy"]
    conf = (ROOT / "deploy" / "proxy" / "nginx.conf").read_text()
    assert all(f"server {n}:8000" in conf for n in fronts), "the proxy spreads over every frontend"


def compose_available() -> bool:
    try:
        return subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not compose_available(), reason="docker compose is not installed (.ci/run checks it)")
@pytest.mark.parametrize("missing", SECRETS)
def test_docker_compose_config_refuses_without_a_secret(tmp_path: Path, missing: str) -> None:
    # A copy, so that a developer's own .env next to the real file plays no part.
    for f in ("docker-compose.yml", "docker-compose.override.yml"):
        shutil.copy(ROOT / f, tmp_path / f)
    given = {"PYGMY_SECRET": "s3cret-for-the-test", "PYGMY_ADMIN_TOKEN": "admin-for-the-test"}
    ok = subprocess.run(["docker", "compose", "config", "-q"], cwd=tmp_path, capture_output=True, text=True,
                        env={**os.environ, **given}, timeout=60)
    assert ok.returncode == 0, ok.stderr
    r = subprocess.run(["docker", "compose", "config", "-q"], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, **given, missing: ""}, timeout=60)
    assert r.returncode != 0 and f"set {missing} to a long random value" in r.stderr, r.stderr


def run_secrets(root: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in SECRETS}
    return subprocess.run(["bash", str(root / "scripts" / "compose.sh"), "secrets"], capture_output=True,
                          text=True, env={**clean, **env}, timeout=60)


def test_compose_up_makes_random_secrets_in_an_ignored_env_file(tmp_path: Path) -> None:
    """``make compose-up`` runs ``compose.sh secrets`` first: a random value for each secret set
    neither in the environment nor in ``.env``, written once (mode 0600) and kept afterwards."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "compose.sh", tmp_path / "scripts" / "compose.sh")  # its ROOT: tmp_path
    env_file = tmp_path / ".env"
    env_file.write_text("PYGMY_HTTP_PORT=8080")  # the user's own line, left open
    r = run_secrets(tmp_path, {})
    assert r.returncode == 0, r.stderr
    values = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert values["PYGMY_HTTP_PORT"] == "8080"
    assert all(re.fullmatch(r"[0-9a-f]{48}", values[name]) for name in SECRETS), values
    assert values["PYGMY_SECRET"] != values["PYGMY_ADMIN_TOKEN"]
    assert env_file.stat().st_mode & 0o077 == 0
    before = env_file.read_text()
    assert run_secrets(tmp_path, {}).returncode == 0
    assert env_file.read_text() == before, "made once, then kept"
    env_file.unlink()
    assert run_secrets(tmp_path, {"PYGMY_SECRET": "from-the-environment"}).returncode == 0
    assert [line.split("=")[0] for line in env_file.read_text().splitlines()] == ["PYGMY_ADMIN_TOKEN"]


def test_the_env_file_stays_out_of_git_and_images() -> None:
    r = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=ROOT, timeout=30)
    assert r.returncode == 0, ".env is not ignored by git"
    assert ".env" in (ROOT / ".dockerignore").read_text().split()


def test_the_tls_overlay_hands_each_service_the_ca_and_its_own_pair_only() -> None:
    """docker-compose.tls.yml (#38): every service of docker-compose.yml runs with PYGMY_TLS and gets
    as secrets the CA certificate and its own certificate and key, named as ``pygmy certs`` names
    them, and never the CA's key."""
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    tls = yaml.safe_load((ROOT / "docker-compose.tls.yml").read_text())
    assert set(tls["services"]) == set(base)
    for name, svc in tls["services"].items():
        # The proxy shows clients its own certificate, and the frontends the client one.
        holders = ["proxy", "client"] if name == "proxy" else [name]
        assert svc["environment"] == {"PYGMY_TLS": "1", "PYGMY_CERTS_DIR": "/run/secrets"}
        targets = {s["target"]: s["source"] for s in svc["secrets"]}
        assert set(targets) == {"ca.pem", *(f"{h}.pem" for h in holders), *(f"{h}-key.pem" for h in holders)}, name
        for target, source in targets.items():
            assert tls["secrets"][source]["file"] == "${PYGMY_CERTS:-./certs}/" + target
    assert not any("ca-key" in s["file"] for s in tls["secrets"].values())
