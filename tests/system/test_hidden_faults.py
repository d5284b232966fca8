"""The teardown check of tests/conftest.py catches what clients never see: a replica whose event
loop keeps failing (it reloads from disk and serves on), and a traceback in a service's log.
(The in-process nodes' check: ``tests/replication/test_raft_node.py``.)

The first test runs a build broken on purpose and declares its faults with ``allow_faults``, so the
autouse check lets them through; the test itself asserts that the check's function reports them.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from harness import FAULTS_AT_STOP, cluster_env, hidden_faults, start_cluster

from pygmy.client.api import PygmyError
from pygmy.cluster.local import LocalCluster


def _buy_some(c: LocalCluster, n: int) -> int:
    client = c.client(timeout=10)
    done = 0
    for i in range(n):
        try:
            done += client.buy(1 + i % 7, 1, key=f"hidden-{i}").get("order_number") is not None
        except PygmyError as exc:  # the broken build may show: the check must not depend on it
            assert exc.status == 503, exc
    return done


@pytest.mark.allow_faults("error", logs=[r"replication loop error: RuntimeError: test fault"])
def test_a_replica_whose_turns_keep_failing_fails_the_test(tmp_path: Path) -> None:
    """Every twentieth turn of every catalog replica raises (``PYGMY_TEST_TURN_FAULT``). The cluster
    still serves, as before this check existed; the check names the faults and their tracebacks."""
    c = start_cluster(tmp_path, env=cluster_env(PYGMY_TEST_TURN_FAULT="catalog"))
    try:
        assert _buy_some(c, 20) > 0  # from outside, little or nothing is wrong
        deadline = time.monotonic() + 20
        while not any(f.get("error") for f in c.loop_faults().values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        status = c.replica_get("catalog-1", "/status").json()
        assert "loop_faults" in status and "last_loop_fault" in status
        metrics = c.replica_get("catalog-1", "/metrics").text
        assert 'pygmy_replica_loop_faults_total{kind="error",service="catalog-1"}' in metrics
    finally:
        c.stop()
    problems = hidden_faults(c)
    assert any("loop fault(s) of kind 'error'" in p and p.startswith("catalog-") for p in problems), problems
    assert any("replication loop error: RuntimeError: test fault" in p for p in problems), problems
    assert not any(p.startswith("order-") for p in problems), problems
    # Declared, they pass: what the marker above does for this test.
    assert hidden_faults(c, ("error",), (r"RuntimeError: test fault",)) == []


def test_a_correct_cluster_hides_nothing(tmp_path: Path) -> None:
    """The control: the same load on a correct build counts no fault and logs no traceback."""
    c = start_cluster(tmp_path, env=cluster_env())
    try:
        assert _buy_some(c, 20) == 20
    finally:
        c.stop()
    seen = FAULTS_AT_STOP[c]
    assert seen and all(not any(f.values()) for f in seen.values())
    assert hidden_faults(c) == []
