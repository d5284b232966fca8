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


def test_the_long_tests_lead_each_workers_share(pytestconfig: pytest.Config) -> None:
    """xdist's ``worksteal`` cuts the collected order into one contiguous share per worker: each
    share must start with its turn of the long tests, not the first share with all of them."""
    from types import SimpleNamespace

    # tests/conftest.py as pytest loaded it (``import conftest`` may find another folder's).
    ours = next(p for p in pytestconfig.pluginmanager.get_plugins()
                if getattr(p, "__file__", None) == str(TESTS / "conftest.py"))
    pytest_collection_modifyitems = ours.pytest_collection_modifyitems

    short = [SimpleNamespace(path=TESTS / "kit" / f"test_{i}.py") for i in range(20)]
    long = [SimpleNamespace(path=TESTS / "system" / f"test_{i}.py") for i in range(6)]
    items = short[:10] + long + short[10:]
    pytest_collection_modifyitems(SimpleNamespace(workerinput={"workercount": 3}), items)  # type: ignore[arg-type]
    assert sorted(map(id, items)) == sorted(map(id, short + long))  # every test, once
    shares = [items[:8], items[8:17], items[17:]]  # 26 // 3, then 18 // 2, then the rest: xdist's cut
    assert [s[:2] for s in shares] == [[long[0], long[3]], [long[1], long[4]], [long[2], long[5]]]
    one = short[:10] + long + short[10:]
    pytest_collection_modifyitems(SimpleNamespace(), one)  # type: ignore[arg-type]
    assert one == long + short  # one process: the long ones first
