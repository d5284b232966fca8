"""Container HEALTHCHECK, standard library only: a startup probe, then a liveness probe.

Docker and Swarm have one health check per container, where Kubernetes has three probes. Until the
service has once been ready (``GET /readyz``: a replica with a leader of its term, caught up; a
frontend that reaches both tiers' leaders), the check asks ``/readyz``, so ``docker compose up --wait``
and ``depends_on: service_healthy`` wait for a working store. From then on it asks ``/livez`` only
(the process works; it asks no other service): Swarm must not replace a replica or a frontend that
is alive while its tier elects a leader. "Once ready" is kept in a file stamped with the start time
of the container's first process, so a restarted container starts over. Exit 0 healthy, else 1.

``healthcheck.py live`` asks ``/livez`` only, from the start: what the replicas use under Compose and
Swarm. Swarm puts a task in its service's DNS only once it is healthy, and the replicas of a tier must
reach each other by name before any of them can be ready (none is ready before they elect a leader).

With ``PYGMY_TLS`` set, over HTTPS: trusting ``ca.pem`` in ``PYGMY_CERTS_DIR`` and showing the
service's own certificate from there (the one ``<name>.pem`` with its key beside the CA's: a
replica takes callers of its own tier), as a container is handed just its own (docker-compose.tls.yml).
"""

import os
import ssl
import sys
import urllib.request
from pathlib import Path

MARK = Path(os.environ.get("PYGMY_PROBE_MARK", "/tmp/pygmy-ready-once"))


def started_at() -> str:
    """The start time of process 1 (field 22 of /proc/1/stat, after the command's parenthesis)."""
    try:
        return Path("/proc/1/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def tls_context(folder: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(folder / "ca.pem"))
    ctx.check_hostname = False  # 127.0.0.1 is in every certificate, but the name we dial is not the point
    own = sorted(p for p in folder.glob("*.pem") if not p.name.endswith("-key.pem") and p.name != "ca.pem"
                 and (folder / f"{p.stem}-key.pem").exists())
    if own:
        ctx.load_cert_chain(str(own[0]), str(folder / f"{own[0].stem}-key.pem"))
    return ctx


def main() -> int:
    port = os.environ.get("PYGMY_PORT", "8000")
    tls = os.environ.get("PYGMY_TLS", "").strip().lower() in ("1", "true", "yes", "on")
    boot = started_at()
    try:
        seen = sys.argv[1:] == ["live"] or MARK.read_text() == boot
    except OSError:
        seen = False
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}/{'livez' if seen else 'readyz'}"
    try:
        context = tls_context(Path(os.environ.get("PYGMY_CERTS_DIR", "/certs"))) if tls else None
        with urllib.request.urlopen(url, timeout=2.5, context=context) as resp:
            ok = resp.status == 200
    except Exception as exc:  # HTTPError (503), connection refused, timeout, a handshake refused
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    if ok and not seen:
        try:
            MARK.write_text(boot)
        except OSError as exc:  # a read-only /tmp: it stays a readiness check
            print(f"cannot keep {MARK}: {exc}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
