"""``Ready.steps``: the one place that orders persist, send and apply, for both drivers.

``ReplicaNode._process_ready`` and the simulator (``raft_sim.Cluster.process``) both handle a Ready
in the order ``rd.steps()`` gives, so the simulator's crash points test the real node's order. The
real processes are tested at the same points by tests/system/test_crash_points.py.
"""

from __future__ import annotations

import pytest
from raft_sim import Cluster, SafetyError, make_leader

from pygmy.replication.core import APPEND, APPEND_RESP, APPLY, PERSIST, SEND, Message, RaftCore, Ready

REAL_STEPS = Ready.steps


def ack_before_persist(rd: Ready) -> tuple[str, str, str]:
    """The broken order of the ``ack-before-persist`` mutation (tests/mutations/sitecustomize.py):
    a follower acknowledges appended entries before writing them."""
    if rd.entries and not rd.send_first and any(m.type == APPEND_RESP for m in rd.messages):
        return (SEND, PERSIST, APPLY)
    return REAL_STEPS(rd)


def test_each_kind_of_ready_gets_its_order() -> None:
    leader = make_leader(RaftCore("a", ["a", "b", "c"], rng=1))
    rd = leader.ready()  # the new leader's no-op and its appends
    leader.advance(rd)
    appends = [m for m in rd.messages if m.type == APPEND]
    assert {m.dst for m in appends} == {"b", "c"}

    follower = RaftCore("b", ["a", "b", "c"], rng=2)
    follower.step(next(m for m in appends if m.dst == "b"))
    rd = follower.ready()
    assert rd.entries and any(m.type == APPEND_RESP and m.success for m in rd.messages)
    assert not rd.send_first and rd.steps() == (PERSIST, SEND, APPLY)  # acknowledged once on disk

    for m in appends:
        leader.step(Message(APPEND_RESP, m.dst, "a", leader.term, index=m.index + len(m.entries), success=True,
                            ctx=m.ctx))
    rd = leader.ready()
    assert rd.committed_entries and not rd.entries and rd.send_first
    assert rd.steps() == (PERSIST, APPLY, SEND)  # a leader's commit: applied (answered), then told
    leader.advance(rd)
    leader.propose({"op": "x"})
    rd = leader.ready()
    assert rd.send_first and rd.entries and rd.steps() == (SEND, PERSIST, APPLY)  # a leader's appends


@pytest.mark.parametrize("broken", [False, True], ids=["real-order", "ack-before-persist"])
def test_the_simulator_takes_its_order_from_ready_steps(monkeypatch: pytest.MonkeyPatch, broken: bool) -> None:
    """Break ``Ready.steps`` the way the ``ack-before-persist`` mutation breaks the real node, and
    the simulator, which has no order of its own, loses an acknowledged entry: the leader replicates
    it to one follower (the other is cut off), that follower dies right after acknowledging it,
    and the two followers then elect a leader without it."""
    if broken:
        monkeypatch.setattr(Ready, "steps", ack_before_persist)
    c = Cluster(3, seed=0)
    assert c.commit_everywhere()
    leader = c.stable_leader()
    assert leader is not None
    f1, f2 = [n for n in c.nodes.values() if n is not leader]
    c.partition({leader.name, f1.name}, {f2.name})
    [index] = c.propose(1)
    point = "before_persist" if broken else "before_apply"  # right after its acknowledgement left
    c.arm_crash(f1.name, point)
    c.tick(1)
    assert not f1.alive and c.ready_crashes == {point: 1}
    c.disarm()
    assert c.wait_for(lambda: leader.storage.sm_index >= index, 30)  # acknowledged: committed and applied
    c.restart(f1.name)
    c.partition({leader.name}, {f1.name, f2.name})

    def new_leader() -> bool:
        return f1.core.is_leader() or f2.core.is_leader()

    if broken:
        with pytest.raises(SafetyError, match=f"committed entry {index} .* is durable on 1 nodes only"):
            c.wait_for(new_leader, 300)
    else:
        assert c.wait_for(new_leader, 300)
        new = f1 if f1.core.is_leader() else f2
        assert new.core.term_at(index) == leader.core.term
