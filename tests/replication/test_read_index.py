"""The follower's batched read index: callers share rounds, but never one begun before they arrived."""

from __future__ import annotations

import threading
import time

from pygmy.replication.node import ReplicationConfig, _ReadIndexBatcher


class LeaderNode:
    """Just enough of a ReplicaNode: it is its own leader, and its read index blocks on a gate."""

    name = "catalog-1"
    secret = "s"
    config = ReplicationConfig()

    def __init__(self) -> None:
        self.value = 5
        self.calls = 0
        self.entered = threading.Event()
        self.gate = threading.Event()

    def leader(self) -> tuple[str, str]:
        return self.name, "http://unused"

    def wait_read_index(self, timeout: float) -> int:
        self.calls += 1
        value = self.value  # taken on arrival, as the leader does; the answer then travels back
        self.entered.set()
        assert self.gate.wait(5)
        return value


def test_a_read_arriving_during_a_round_waits_for_the_next_one() -> None:
    node = LeaderNode()
    batcher = _ReadIndexBatcher(node)  # type: ignore[arg-type]
    got: dict[str, int] = {}

    def read(name: str) -> None:
        got[name] = batcher.get(5)

    first = threading.Thread(target=read, args=("first",))
    first.start()
    assert node.entered.wait(5)  # round 1 is at the leader, which answered 5
    node.value = 7  # a write commits; then two reads arrive while round 1 is still on its way back
    late = [threading.Thread(target=read, args=(n,)) for n in ("second", "third")]
    for t in late:
        t.start()
    time.sleep(0.05)  # let them queue behind round 1 (no effect on the outcome, only on coverage)
    node.gate.set()
    for t in [first, *late]:
        t.join(5)
    assert got == {"first": 5, "second": 7, "third": 7}, "a late read must not use an answer older than itself"
    assert node.calls == 2, "the late reads share one round"
    batcher.http.clear()


def test_a_round_that_raises_ends_and_the_next_read_starts_another() -> None:
    """An error ``_ask`` does not expect (a bug, an answer it cannot read) costs that round only:
    left busy, no round would start again and every later follower read would time out."""
    import pytest

    from pygmy.replication.node import ReadIndexUnavailable

    node = LeaderNode()
    node.gate.set()
    batcher = _ReadIndexBatcher(node)  # type: ignore[arg-type]
    real = batcher._ask
    calls = [0]

    def once_broken(timeout: float) -> tuple[int, str | None]:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("an answer it could not read")
        return real(timeout)

    batcher._ask = once_broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        batcher.get(1.0)
    assert batcher.get(1.0) == 5 and calls[0] == 2  # (stuck, it would have timed out instead)
    with pytest.raises(ReadIndexUnavailable):  # nor is the failed round's outcome taken for an answer
        node.leader = lambda: None  # type: ignore[method-assign]
        batcher.get(1.0)
    batcher.http.clear()
