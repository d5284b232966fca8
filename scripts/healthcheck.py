"""Container HEALTHCHECK, standard library only: a startup probe, then a liveness probe.

Docker and Swarm have one health check per container, where Kubernetes has three probes. Until the
service has once been ready (``GET /readyz``: a replica with a leader of its term, caught up; a
frontend that reaches both tiers' leaders), the check asks ``/readyz``, so ``docker compose up --wait``
and ``depends_on: service_healthy`` wait for a working store. From then on it asks ``/livez`` only
(the process works; it asks no other service): Swarm must not replace a replica or a frontend that
is alive while its tier elects a leader. "Once ready" is kept in a file stamped with the start time
of the container's first process, so a restarted container starts over. Exit 0 healthy, else 1.
"""

import os
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


def main() -> int:
    port = os.environ.get("PYGMY_PORT", "8000")
    boot = started_at()
    try:
        seen = MARK.read_text() == boot
    except OSError:
        seen = False
    url = f"http://127.0.0.1:{port}/{'livez' if seen else 'readyz'}"
    try:
        with urllib.request.urlopen(url, timeout=2.5) as resp:
            ok = resp.status == 200
    except Exception as exc:  # HTTPError (503), connection refused, timeout
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
