"""Validate the Kubernetes manifests (deploy/kubernetes) offline, with no cluster: ``tools/k8scheck``.

No cluster can run on the project's machines, so the manifests are checked the way an API server would
decode them (strictly, with the Kubernetes API's own Go types) and then across documents (a
StatefulSet's headless Service, selectors, probe ports and paths, PodDisruptionBudgets, Secrets,
Pygmy's peer URLs). The checker is a small Go program, built on first use into build/k8scheck, as
the Porcupine checker is (``pygmy.verify.lincheck``).

    python -m pygmy.verify.k8scheck [DIR_OR_FILE ...]     (default: deploy/kubernetes)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from pygmy import ROOT
from pygmy.verify.gobuild import build_go_tool

SOURCE = ROOT / "tools" / "k8scheck"
BINARY = ROOT / "build" / "k8scheck" / "k8scheck"
MANIFESTS = ROOT / "deploy" / "kubernetes"
PROXY_RENDER = ROOT / "deploy" / "proxy" / "render.py"
#: Where the GET routes of the services are declared: a probe may only ask a path each of them answers.
ROUTE_SOURCES = (ROOT / "frontend" / "app.py", ROOT / "pygmy" / "replication" / "service.py")


def build() -> Path:
    """Build tools/k8scheck only when the binary is missing or older than its sources (the first
    build downloads the Kubernetes API modules and takes a minute or two)."""
    return build_go_tool(SOURCE, BINARY, "the manifest checker (tools/k8scheck)")


def probe_paths(sources: Iterable[Path] = ROUTE_SOURCES) -> list[str]:
    """The fixed GET paths every service answers (frontend and replica alike): what a probe may ask.

    Read from the route declarations, so that a probe on a path the code does not serve (or a
    route renamed under the manifests) fails the check rather than a pod on a real cluster."""
    sets = [set(re.findall(r'@app\.get\("(/[A-Za-z0-9_/-]*)"\)', Path(s).read_text())) for s in sources]
    return sorted(set.intersection(*sets)) if sets else []


def known_env() -> list[str]:
    """Every ``PYGMY_*`` variable a service reads: its settings (``pygmy.cluster.cli.SETTINGS``), the
    credentials, the learners, the log level and the replication timing (``PYGMY_RAFT_<FIELD>``),
    and the reverse proxy's (read from ``deploy/proxy/render.py``, which has no Pygmy to import).
    Pygmy ignores any other, so a misspelt one in a manifest would silently not apply."""
    from dataclasses import fields

    from pygmy.cluster.cli import SETTINGS
    from pygmy.replication.node import ReplicationConfig

    return sorted({env for _, _, env in SETTINGS.values()}
                  | {"PYGMY_SECRET", "PYGMY_ADMIN_TOKEN", "PYGMY_CATALOG_LEARNERS", "PYGMY_ORDER_LEARNERS",
                     "PYGMY_LOG_LEVEL"}
                  | {f"PYGMY_RAFT_{f.name.upper()}" for f in fields(ReplicationConfig)}
                  | set(re.findall(r'"(PYGMY_PROXY_[A-Z_]+)"', PROXY_RENDER.read_text())))


def check(paths: Sequence[Path | str] = (MANIFESTS,), external_secrets: Iterable[str] = (),
          timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the checker on ``paths`` (directories or files); returncode 0: valid, 1: problems (on stdout)."""
    cmd = [str(build())]
    for name in external_secrets:
        cmd += ["-external-secret", name]
    for path in probe_paths():
        cmd += ["-probe-path", path]
    for env in known_env():
        cmd += ["-known-env", env]
    return subprocess.run([*cmd, *map(str, paths)], capture_output=True, text=True, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pygmy.verify.k8scheck", description="Validate Kubernetes manifests offline (tools/k8scheck).")
    parser.add_argument("paths", nargs="*", default=[str(MANIFESTS)], help="directories or files (default: %(default)s)")
    parser.add_argument("--external-secret", action="append", default=[],
                        help="a Secret created outside the files (repeatable)")
    args = parser.parse_args(argv)
    proc = check(args.paths, args.external_secret)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
