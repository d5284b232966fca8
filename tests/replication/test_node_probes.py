"""``ReplicaNode.liveness`` and ``readiness`` (behind ``/livez`` and ``/readyz``) on threaded nodes
over real sockets: a replica alone, recovering, is live and not ready; a leader holding its lease and
caught-up followers are ready; a replica whose loop takes no turn is not live; a stopped one neither."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_raft_node import Harness


def test_ready_only_with_a_leader_live_throughout(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    try:
        leader = h.leader()
        leader.propose({"k": "a", "add": 1}, 5.0)
        h.converge()
        h.until(lambda: all(n.readiness() is None for n in h.nodes.values()))
        # Two of three stopped: the last one has no leader (or leads without a lease), and is live.
        survivor = next(n for n in h.nodes if n != leader.name)
        for name in [n for n in list(h.nodes) if n != survivor]:
            h.stop(name)
        node = h.nodes[survivor]
        h.until(lambda: node.readiness() is not None)
        assert node.liveness() is None
        # Restarted alone, with no leader to catch up from: recovering, then a candidate; never ready.
        h.stop(survivor)
        node = h.start(survivor)
        reasons = []
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            why = node.readiness()
            assert why is not None, node.status()
            reasons.append(why)
            time.sleep(0.01)
        assert "recovering" in reasons[0], reasons[:3]  # before its first election timeout
        assert node.liveness() is None
        # The others back: a leader again, and every replica ready.
        for name in h.peers:
            if name not in h.nodes:
                h.start(name)
        h.leader()
        h.until(lambda: all(n.readiness() is None for n in h.nodes.values()))
    finally:
        h.close()


def test_a_loop_that_takes_no_turn_is_not_live_and_a_stopped_node_neither(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    try:
        node = h.leader()
        assert node.liveness() is None
        with node._core_lock:  # a turn that never ends: a deadlock, say
            why = node.liveness(turn_within=0.3)
        assert why is not None and "no replication turn" in why, why
        assert node.liveness() is None
        name = node.name
        h.stop(name)
        assert "not running" in (node.liveness() or "")
    finally:
        h.close()


@pytest.mark.allow_faults("storage", "error")
@pytest.mark.parametrize("storage", [True, False], ids=["storage", "bug"])
def test_a_replica_failing_on_every_reload_is_live_only_while_its_disk_is_at_fault(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, storage: bool) -> None:
    """Every reload fails: on a full disk a restart would cure nothing and the replica stays live
    (it recovers once space returns); on any other error (a bug, such as a migration that raises)
    it is not live after ``STUCK_FAULT_S``, so an orchestrator restarts it and the failure shows."""
    import sqlite3

    from pygmy.replication import node as node_module

    monkeypatch.setattr(node_module, "STUCK_FAULT_S", 0.5)
    h = Harness(tmp_path)
    try:
        node = next(n for n in h.nodes.values() if not n.is_leader())
        error = sqlite3.OperationalError("database or disk is full") if storage else ValueError("a bug")

        def failing() -> None:
            raise error

        monkeypatch.setattr(node, "_load_core", failing)
        monkeypatch.setattr(node, "_process_ready", lambda tick_wall: failing())
        deadline = time.monotonic() + 5
        while node.fault is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert node.fault is not None
        time.sleep(1.0)
        why = node.liveness()
        if storage:
            assert why is None, why
        else:
            assert why is not None and "failing for over" in why and "a bug" in why, why
    finally:
        monkeypatch.undo()
        h.close()


@pytest.mark.allow_faults("storage", "error")
def test_a_bug_after_a_long_full_disk_is_timed_from_its_own_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk full for longer than ``STUCK_FAULT_S``, then a bug on every reload: the bug's streak
    counts from its own first error, not from the disk's (which would fail liveness at once)."""
    import sqlite3

    from pygmy.replication import node as node_module

    monkeypatch.setattr(node_module, "STUCK_FAULT_S", 1.0)
    h = Harness(tmp_path)
    try:
        node = next(n for n in h.nodes.values() if not n.is_leader())
        errors: list[Exception] = [sqlite3.OperationalError("database or disk is full")]

        def failing(*args: object) -> None:
            raise errors[0]

        monkeypatch.setattr(node, "_load_core", failing)
        monkeypatch.setattr(node, "_process_ready", failing)
        deadline = time.monotonic() + 5
        while node.fault is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(1.5)
        assert node.liveness() is None  # a full disk: live however long
        errors[0] = ValueError("a bug")
        while node._fault_is_storage and time.monotonic() < deadline + 5:
            time.sleep(0.005)
        assert not node._fault_is_storage
        assert node.liveness() is None  # the bug's streak has just begun
        deadline = time.monotonic() + 5
        while node.liveness() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "failing for over" in (node.liveness() or "")
    finally:
        monkeypatch.undo()
        h.close()


@pytest.mark.allow_faults("error")
def test_a_replica_that_reloaded_after_a_bug_is_live_while_its_tier_has_no_leader(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One error in a turn, a reload that works, then no leader to catch up with: the replica stays
    ``failed`` (not caught up), but it is not stuck, and a liveness probe must not restart it while
    its tier elects."""
    from pygmy.replication import node as node_module

    monkeypatch.setattr(node_module, "STUCK_FAULT_S", 0.5)
    h = Harness(tmp_path)
    try:
        node = next(n for n in h.nodes.values() if not n.is_leader())
        for name in [n for n in h.nodes if n != node.name]:
            h.stop(name)
        real, calls = node._process_ready, [0]

        def once(tick_wall: float) -> None:
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("one bug")
            real(tick_wall)

        monkeypatch.setattr(node, "_process_ready", once)
        deadline = time.monotonic() + 5
        while not (node.fault is not None and node._broken is None) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert node.fault is not None and node._broken is None  # reloaded, still failed: no leader
        time.sleep(1.0)
        assert node.fault is not None and node.liveness() is None
    finally:
        monkeypatch.undo()
        h.close()
