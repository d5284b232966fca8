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
