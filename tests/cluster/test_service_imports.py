"""``pygmy serve``: what a service process loads."""

from __future__ import annotations

import subprocess
import sys

from pygmy.cluster.local import ROOT


def test_a_service_process_never_imports_requests_or_the_launcher() -> None:
    """Requests is the client's library; the services talk over urllib3 and frames. A service
    process that imported it anyway (through the client's commands, the launcher, or a helper)
    would pay it at every start: about a tenth of a cluster's start-up CPU, measured over seven
    processes. Checked in a fresh interpreter, as ``python -m pygmy.cluster.cli serve`` starts one."""
    code = (
        "import sys\n"
        "from pygmy.cluster import cli\n"
        "cli.build_parser(serving=True).parse_args(['serve', 'catalog'])\n"
        "import pygmy.cluster.serve, pygmy.catalog.app, pygmy.order.app, pygmy.frontend.app\n"
        "print(sorted(m for m in ('requests', 'pygmy.client.api', 'pygmy.cluster.launcher') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_serve_command_imports_nothing_before_its_metrics_folder_is_set(tmp_path) -> None:
    """What ``pygmy serve``'s own checks import runs before ``serve`` sets the folder that the
    Gunicorn workers' metrics are shared through: prometheus_client fixes how it keeps values
    when first imported, and a replica's request counters then lived in each worker alone and
    never reached ``/metrics`` (a restore check that imported the backup module did that)."""
    code = (
        "import sys\n"
        "from pygmy.cluster import cli, serve\n"
        "serve.serve = lambda *a: print(sorted(m for m in ('prometheus_client', 'requests', 'flask',\n"
        "    'pygmy.cluster.backup', 'pygmy.cluster.launcher') if m in sys.modules))\n"
        f"cli.main(['serve', 'order', '--id', '1', '--data-dir', {str(tmp_path)!r}])\n"
    )
    env = {"PYGMY_SECRET": "s" * 32, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
