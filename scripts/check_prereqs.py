"""What `make test` needs beyond Python, checked in its first seconds rather than half-way through.

Required: Go 1.26 or newer, and the Go module proxy (or a module cache) to build the Porcupine
checker (tools/lincheck, Go 1.22+) and the Kubernetes manifest checker (tools/k8scheck, whose
Kubernetes API modules need Go 1.26), which are built here, once, before the test workers start. Optional, each for a few tests that are skipped
without it (and named in pytest's summary): root with iproute2 and iptables (the nemesis, chaos and
full-disk tests), Chromium with chromium-driver (the dashboard in a real browser), nginx (the reverse
proxy's test), Docker with its Compose plugin (the compose file's checks). With ``PYGMY_NO_SKIP=1`` (as ``.ci/run`` sets) a missing
optional one is an error too, since the suite then fails on any skip.

Exit status 0 when the suite can run, 1 otherwise, with one line per missing prerequisite.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _compose() -> bool:
    try:
        return subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


OPTIONAL: list[tuple[str, str, object]] = [
    ("root", "tests/verify/test_nemesis.py, test_chaos.py, tests/system/test_disk_full.py",
     lambda: os.geteuid() == 0),
    ("iproute2 (ip, ss)", "the nemesis and chaos tests (apt-get install iproute2)",
     lambda: bool(shutil.which("ip") and shutil.which("ss"))),
    ("iptables", "the nemesis and chaos tests (apt-get install iptables)", lambda: bool(shutil.which("iptables"))),
    ("chromium, chromium-driver", "tests/frontend/test_dashboard_browser.py (apt-get install chromium chromium-driver)",
     lambda: bool(shutil.which("chromium") and shutil.which("chromedriver"))),
    ("nginx", "tests/deploy/test_proxy.py (apt-get install nginx-light)", lambda: bool(shutil.which("nginx"))),
    ("docker compose", "tests/scripts/test_compose.py (bash scripts/compose.sh ci-setup installs it)", _compose),
]


def main() -> int:
    strict = os.environ.get("PYGMY_NO_SKIP") == "1"
    errors: list[str] = []
    try:
        from pygmy.verify.lincheck import build_checker

        build_checker()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        errors.append(f"the Porcupine checker (tools/lincheck) cannot be built: {exc}".strip())
    try:
        from pygmy.verify.k8scheck import build

        build()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        errors.append(f"the manifest checker (tools/k8scheck) cannot be built: {exc}".strip())
    for name, used_by, present in OPTIONAL:
        if not present():  # type: ignore[operator]
            line = f"{name} missing: {used_by} will be skipped"
            if strict:
                errors.append(line.replace("will be skipped", "cannot run, and PYGMY_NO_SKIP=1 forbids skips"))
            else:
                print(f"test prerequisites: {line}", file=sys.stderr)
    for e in errors:
        print(f"test prerequisites: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
