"""The suite's own rules (tests/conftest.py), run on a tiny suite of their own in a subprocess: a
skipped test fails the run where every test must run (``PYGMY_NO_SKIP=1``, as in CI), and only there,
whether the skip comes from inside a test or from a whole module, on one process or on xdist workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SKIPS = """
import pytest

def test_runs():
    pass

def test_skips():
    pytest.skip("needs a tool this machine lacks")
"""
MODULE_SKIP = """
import pytest

pytest.skip("needs a browser this machine lacks", allow_module_level=True)
"""


def run(tmp: Path, *args: str, no_skip: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", "-p", "xdist.plugin", "-p", "conftest",
           "-c", os.devnull, "--rootdir", str(tmp), *args, str(tmp)]
    # Only the plugins under test (the installed ones, hypothesis and schemathesis among them, take
    # seconds to import in each of the runs and xdist workers here).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "PYGMY_NO_SKIP": no_skip, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp)


@pytest.mark.parametrize("workers", [(), ("-n", "2")], ids=["one-process", "xdist"])
def test_a_skip_fails_the_run_only_where_every_test_must_run(tmp_path: Path, workers: tuple[str, ...]) -> None:
    (tmp_path / "test_skips.py").write_text(SKIPS)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    loose = run(tmp_path, *workers, no_skip="")
    assert loose.returncode == 0 and "1 passed, 2 skipped" in loose.stdout, loose.stdout + loose.stderr
    assert "needs a tool this machine lacks" in loose.stdout  # locally a skip says what it needs
    strict = run(tmp_path, *workers, no_skip="1")
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "PYGMY_NO_SKIP=1: 2 test(s) skipped" in strict.stdout, strict.stdout
    assert "needs a tool this machine lacks" in strict.stdout and "needs a browser" in strict.stdout


def test_the_long_modules_lead_each_workers_share(pytestconfig: pytest.Config) -> None:
    """xdist's ``worksteal`` cuts the collected order into one contiguous share per worker: each
    share must start with long modules, each module whole (its fixtures built once), not the first
    share with all of them."""
    from types import SimpleNamespace

    # tests/conftest.py as pytest loaded it (``import conftest`` may find another folder's).
    ours = next(p for p in pytestconfig.pluginmanager.get_plugins()
                if getattr(p, "__file__", None) == str(TESTS / "conftest.py"))

    def config(workers: int, dist: str) -> SimpleNamespace:
        return SimpleNamespace(workerinput={"workercount": workers}, getoption=lambda name, default=None: dist)

    short = [SimpleNamespace(path=TESTS / "kit" / f"test_{i}.py") for i in range(20)]
    a = [SimpleNamespace(path=TESTS / "system" / "test_a.py") for _ in range(3)]
    b = [SimpleNamespace(path=TESTS / "system" / "test_b.py") for _ in range(2)]
    c = [SimpleNamespace(path=TESTS / "verify" / "test_c.py") for _ in range(2)]
    d = [SimpleNamespace(path=TESTS / "experiments" / "test_d.py")]
    items = short[:10] + d + c + b + a + short[10:]
    ours.pytest_collection_modifyitems(config(3, "worksteal"), items)
    assert sorted(map(id, items)) == sorted(map(id, short + a + b + c + d))  # every test, once
    shares = [items[:9], items[9:18], items[18:]]  # 28 // 3, then 19 // 2, then the rest: xdist's cut
    assert [s[:len(m)] for s, m in zip(shares, [a, c, b], strict=True)] == [a, c, b]  # the largest first, whole
    assert shares[1][2:3] == d  # then to the share with the fewest long tests
    for dist in ("load", "no"):
        one = short[:10] + a + short[10:]
        ours.pytest_collection_modifyitems(config(3 if dist == "load" else 1, dist), one)
        assert one == a + short  # otherwise simply the long ones first
