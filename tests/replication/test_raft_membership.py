"""Membership changes in the simulator: one server at a time (Raft dissertation, chapter 4).

Each known pitfall has a scenario of its own, and a 3 -> 4 -> 3 replacement (of a follower, then of
the leader) runs under message loss, duplication, delay, partitions and crashes with the
simulator's safety checks on every tick (``raft_sim.Cluster.check``): one leader per term, one vote
per voter per term, log matching, leader completeness, every committed entry on the disks of a
majority of the configuration it was committed in, and no lease overlapping a later leader's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable

import pytest
from raft_sim import SIM_CONFIG, Cluster, SafetyError, SimNode

from pygmy.replication.core import (
    CANDIDATE,
    HEARTBEAT,
    LEADER,
    SNAPSHOT,
    TIMEOUT_NOW,
    VOTE,
    Membership,
    MembershipRefused,
    Message,
    RaftCore,
)

MAX_LAG = 2


def elect(c: Cluster, max_ticks: int = 1000) -> SimNode:
    assert c.wait_for(lambda: c.stable_leader() is not None, max_ticks)
    leader = c.stable_leader()
    assert leader is not None
    return leader


def settled(c: Cluster, max_ticks: int = 1000) -> SimNode:
    """A stable leader that has committed an entry of its term (it may change the configuration)."""
    assert c.wait_for(lambda: (lead := c.stable_leader()) is not None
                      and lead.core.commit >= lead.core.term_start_index, max_ticks)
    leader = c.stable_leader()
    assert leader is not None
    return leader


def change(c: Cluster, op: Callable[[RaftCore], int]) -> int:
    """``op`` on the leader's core, as the node does it in a turn, then that turn's Ready."""
    leader = c.leader()
    assert leader is not None
    c.process(leader)  # what the leader knows so far is recorded before the change
    index = op(leader.core)
    c.process(leader)
    return index


def committed(c: Cluster, index: int, max_ticks: int = 500) -> bool:
    return c.wait_for(lambda: (lead := c.leader()) is not None and lead.core.commit >= index, max_ticks)


def voters(node: SimNode) -> set[str]:
    return set(node.core.membership.voters)


def caught_up(c: Cluster, name: str) -> bool:
    leader = c.leader()
    return leader is not None and c.nodes[name].storage.sm_index >= leader.core.commit > 0


def test_a_learner_catches_up_and_is_promoted_then_counts() -> None:
    c = Cluster(3, seed=11)
    settled(c)
    c.propose(5)
    c.tick(5)
    n4 = c.add_node("n4")
    index = change(c, lambda core: core.add_learner("n4"))
    assert committed(c, index)
    assert c.wait_for(lambda: caught_up(c, "n4"), 300)
    assert n4.core.membership.learners == {"n4"} and not n4.core.is_voter()
    assert n4.core.role == "follower" and n4.core.term == c.leader().core.term
    index = change(c, lambda core: core.promote("n4", MAX_LAG))
    assert committed(c, index)
    assert all(voters(n) == {"n1", "n2", "n3", "n4"} for n in c.nodes.values())
    assert c.commit_everywhere()
    # Four voters: a majority is three, so with two voters down nothing commits any more.
    leader = c.leader()
    down = [n for n in ("n1", "n2", "n3", "n4") if n != leader.name][:2]
    for name in down:
        c.crash(name)
    [index] = c.propose(1)
    c.tick(30)
    assert leader.core.commit < index


def test_a_learner_counts_for_nothing_and_never_campaigns() -> None:
    """Leader plus learner are two of four members but one of three voters: no commit, no lease,
    CheckQuorum steps the leader down, and the learner stays out of every election."""
    c = Cluster(3, seed=12)
    leader = settled(c)
    n4 = c.add_node("n4")
    assert committed(c, change(c, lambda core: core.add_learner("n4")))
    assert c.wait_for(lambda: caught_up(c, "n4"), 300)
    for other in ("n1", "n2", "n3"):
        if other != leader.name:
            c.crash(other)
    [index] = c.propose(1)
    term = leader.core.term
    c.tick(5)
    assert leader.core.commit < index
    assert c.wait_for(lambda: not leader.core.is_leader(), 100)  # CheckQuorum counts voters only
    assert leader.core.lease_remaining() == 0
    c.tick(200)
    assert n4.core.term == term and n4.core.role == "follower" and n4.core.leader is None
    assert not any(t > term for t in c.leaders)


def test_a_lagging_learner_is_not_promoted() -> None:
    c = Cluster(3, seed=13)
    settled(c)
    c.add_node("n4")
    assert committed(c, change(c, lambda core: core.add_learner("n4")))
    c.crash("n4")
    for _ in range(5):
        c.propose(3)
        c.tick(2)
    with pytest.raises(MembershipRefused) as refused:
        change(c, lambda core: core.promote("n4", MAX_LAG))
    assert refused.value.kind == "lagging"
    assert voters(c.leader()) == {"n1", "n2", "n3"}
    c.restart("n4")
    assert c.wait_for(lambda: caught_up(c, "n4"), 300)
    c.tick(SIM_CONFIG.heartbeat_ticks * 2)
    assert committed(c, change(c, lambda core: core.promote("n4", MAX_LAG)))


def test_one_change_at_a_time_and_bad_changes_change_nothing() -> None:
    c = Cluster(3, seed=14)
    leader = settled(c)
    c.add_node("n4")
    c.add_node("n5")
    c.partition({leader.name}, {"n1", "n2", "n3", "n4", "n5"} - {leader.name})  # nothing commits
    index = change(c, lambda core: core.add_learner("n4"))
    for op, kind in ((lambda core: core.add_learner("n5"), "pending"),
                     (lambda core: core.remove("n2"), "pending"),
                     (lambda core: core.promote("n4", MAX_LAG), "pending")):
        with pytest.raises(MembershipRefused) as refused:
            change(c, op)
        assert refused.value.kind == kind
    assert leader.core.last_index == index
    c.heal()
    assert committed(c, index)
    for op, kind in ((lambda core: core.add_learner("n4"), "duplicate"),
                     (lambda core: core.promote("n9", MAX_LAG), "unknown"),
                     (lambda core: core.promote("n2", MAX_LAG), "not_learner"),
                     (lambda core: core.remove("n9"), "unknown")):
        last = c.leader().core.last_index
        with pytest.raises(MembershipRefused) as refused:
            change(c, op)
        assert refused.value.kind == kind and c.leader().core.last_index == last
    with pytest.raises(ValueError):  # a configuration never comes in as an ordinary command
        c.leader().core.propose(Membership(frozenset({"n1"})).command())
    follower = next(n for n in c.nodes.values() if n.name in ("n1", "n2", "n3") and not n.core.is_leader())
    with pytest.raises(MembershipRefused) as refused:
        follower.core.add_learner("n5")
    assert refused.value.kind == "not_leader"


def test_the_last_voter_cannot_be_removed() -> None:
    c = Cluster(1, seed=15)
    settled(c)
    with pytest.raises(MembershipRefused) as refused:
        change(c, lambda core: core.remove("n1"))
    assert refused.value.kind == "last_voter"


def _single_server_bug(c: Cluster) -> None:
    """The scenario of the single-server bug (Ongaro, raft-dev, 2015), with a learner promoted in
    place of a new server: voters n1..n4, n5 a learner. The leader n1 promotes n5, and only n1 and
    n5 hold that configuration (C1: five voters) when n1 is cut off. n2, n3, n4 elect one of them,
    which removes another, the victim (C2: the other three voters), committed by the two left.
    Then n1 asks for votes with C1: the victim (removed, and behind if it lacks the new leader's
    no-op) and n5 grant them, three of five; as leader n1 would overwrite the committed C2."""
    n1 = c.nodes["n1"]
    assert n1.core.is_leader()
    c.partition({"n1", "n5"}, {"n2", "n3", "n4"})
    change(c, lambda core: core.promote("n5", MAX_LAG))  # never committed: only n1 and n5 get it
    c.tick(3)
    assert voters(c.nodes["n5"]) == {"n1", "n2", "n3", "n4", "n5"}
    c.partition({"n1"}, {"n5"}, {"n2", "n3", "n4"})
    assert c.wait_for(lambda: any(c.nodes[n].core.is_leader() for n in ("n2", "n3", "n4")), 500)
    leader = c.leader()
    victim, other = [n for n in ("n2", "n3", "n4") if n != leader.name]
    for _ in range(100):
        try:
            index = change(c, lambda core: core.remove(victim))
            break
        except MembershipRefused as refused:  # until its no-op commits, on all three
            assert refused.kind == "pending"
            c.tick(1)
    c.partition({"n1"}, {"n5"}, {leader.name, other}, {victim})
    assert committed(c, index, 100)
    c.partition({"n1", victim, "n5"}, {leader.name, other})
    c.wait_for(lambda: n1.core.is_leader() and n1.core.commit > index, 500)
    assert voters(leader) == {"n1", leader.name, other}


def _bug_cluster() -> Cluster:
    """Without PreVote: it would only delay n1's campaign here (the victim voted in the new term),
    not prevent it; the rule must hold on its own."""
    c = Cluster(5, seed=16, config=dataclasses.replace(SIM_CONFIG, pre_vote=False))
    for name in c.names:
        c.nodes[name] = SimNode(name, c.names, c.config, c.seed, learners=("n5",))
    for name in ("n2", "n3", "n4", "n5"):  # n1 leads first: it times out first
        c.nodes[name].core._timeout = 10_000
    assert c.wait_for(lambda: c.nodes["n1"].core.is_leader(), 200)
    assert committed(c, 1)
    assert c.wait_for(lambda: caught_up(c, "n5"), 100)
    c.tick(2 * SIM_CONFIG.heartbeat_ticks)
    return c


def test_the_single_server_bug_is_refused() -> None:
    """The new leader may change the configuration only once an entry of its term has committed:
    its no-op then is on n2, n3 and n4 (three of C0's four), so the victim's log is newer than
    n1's and n1 cannot win its vote: C2 stays."""
    c = _bug_cluster()
    _single_server_bug(c)
    assert not c.nodes["n1"].core.is_leader()


def test_the_single_server_bug_is_caught_without_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the rule the new leader appends C2 before its no-op reaches the victim (cut off just
    then). A server holding C1 (n1 or n5) is then elected by n1, n5 and the victim, a majority of C1
    disjoint from C2's: a leader that lacks the committed C2 (leader completeness), found first as
    its election while the C2 leader's lease runs. The test above is not vacuous."""
    check = RaftCore._check_change

    def without_the_rule(self: RaftCore) -> None:
        start, self.term_start_index = self.term_start_index, 0
        try:
            check(self)
        finally:
            self.term_start_index = start

    monkeypatch.setattr(RaftCore, "_check_change", without_the_rule)
    c = _bug_cluster()
    real_change = change

    def change_at_once(c: Cluster, op: Callable[[RaftCore], int]) -> int:
        leader = c.leader()
        if leader is not None and leader.name != "n1":  # its no-op is in flight: the victim misses it
            victim = [n for n in ("n2", "n3", "n4") if n != leader.name][0]
            c.partition({"n1"}, {"n5"}, set(c.names) - {"n1", "n5", victim}, {victim})
        return real_change(c, op)

    monkeypatch.setitem(globals(), "change", change_at_once)
    with pytest.raises(SafetyError, match="earlier lease|lacks committed entry"):
        _single_server_bug(c)


def test_a_removed_leader_steps_down_once_its_removal_commits_and_hands_over() -> None:
    c = Cluster(3, seed=17)
    old = settled(c)
    c.propose(3)
    index = change(c, lambda core: core.remove(old.name))
    assert old.core.is_leader() and not old.core.is_voter()  # leads a group it is not in
    assert c.wait_for(lambda: not old.core.is_leader(), 50)
    assert old.core.commit >= index
    new = elect(c, 50)  # told to campaign at once (timeout_now), not after an election timeout
    assert new is not old and voters(new) == {"n1", "n2", "n3"} - {old.name}
    term = new.core.term
    assert c.commit_everywhere()
    c.tick(300)
    assert old.core.role == "follower" and new.core.term == term and new.core.is_leader()
    assert all(name != old.name for t, name in c.leaders.items() if t > index)


def test_a_removal_of_the_leader_in_a_lossy_group_never_loses_a_majority() -> None:
    for seed in range(20):
        c = Cluster(3, seed=100 + seed)
        c.net.drop, c.net.max_delay = 0.1, 3
        old = settled(c)
        index = change(c, lambda core, old=old: core.remove(old.name))
        for _ in range(20):
            c.propose(1)
            c.tick(3)
        c.net.drop, c.net.max_delay = 0.0, 0
        assert c.wait_for(lambda c=c, old=old, index=index: (lead := c.leader()) is not None and lead is not old
                          and lead.core.commit >= index, 1000)
        assert c.commit_everywhere()


def test_leadership_transfer_hands_over_at_once_and_refuses_writes_meanwhile() -> None:
    c = Cluster(3, seed=18)
    old = settled(c)
    target = next(n for n in c.nodes.values() if n is not old)
    c.crash(target.name)  # behind: the transfer waits for it to catch up
    c.propose(4)
    c.tick(2)
    old.core.transfer_leadership(target.name)
    assert old.core.propose({"n": -1}) is None and old.core.lease_remaining() > 0
    c.restart(target.name)
    assert c.wait_for(lambda: target.core.is_leader(), 60)
    assert old.core.role == "follower" and target.core.term == old.core.term
    assert c.relinquished  # the old leader gave its lease up before the new one could be elected
    assert c.commit_everywhere()


def test_what_a_leader_promised_under_its_lease_may_outlast_a_hand_over_by_what_the_gap_says() -> None:
    """A leader that hands over gives its lease up for its own reads, but what it granted under it
    before (the catalog's cache leases, capped at the lease's end) runs on: its voters still heard
    it, so the successor's ``election_gap`` is below zero, and ``ReplicaNode.vote_quiet_s`` must not
    clip it at 0 (the old lease ran past the election). The bound holds, signed."""
    # The real node's proportions (a lease two thirds of the shortest election timeout), so that
    # a hand-over's election falls well inside it.
    config = dataclasses.replace(SIM_CONFIG, election_ticks_min=30, election_ticks_max=60)
    for seed in (21, 22, 23):
        c = Cluster(3, seed=seed, config=config)
        old = settled(c)
        c.propose(1)
        others = [n for n in c.nodes.values() if n is not old]
        assert c.wait_for(lambda c=c, others=others: any(caught_up(c, n.name) for n in others), 200)
        target = next(n for n in others if caught_up(c, n.name))
        c.net.max_delay = 0  # a quick hand-over: its election well inside the lease
        best = config.effective_lease_ticks() - config.heartbeat_ticks
        assert c.wait_for(lambda old=old, best=best: old.core.lease_remaining() >= best, 100)
        old_term = old.core.term
        old.core.transfer_leadership(target.name)
        assert c.wait_for(lambda target=target: target.core.is_leader(), 60)
        elected, gap = c.elections[target.core.term]
        ended = c.lease_ends[old_term]
        assert gap - 1 < 0 and ended > elected, (seed, gap, ended, elected)  # clipped, it would not hold
        assert ended <= elected - (gap - 1), (seed, gap, ended, elected)


def test_a_transfer_that_does_not_complete_ends() -> None:
    c = Cluster(3, seed=19)
    old = settled(c)
    target = next(n for n in c.nodes.values() if n is not old)
    c.crash(target.name)
    c.propose(2)
    old.core.transfer_leadership(target.name)
    c.tick(SIM_CONFIG.election_ticks_max + SIM_CONFIG.heartbeat_ticks * 4)
    assert old.core.is_leader() and old.core.lead_transferee is None  # never sent: it leads on
    assert c.propose(1)
    # Once timeout_now went out, it cannot take its lease back: it steps down instead.
    c.restart(target.name)
    assert c.wait_for(lambda: caught_up(c, target.name), 200)
    c.partition({old.name, target.name}, set(c.names) - {old.name, target.name})
    target.core._timeout = 10_000  # it gets the message and is then cut off before it campaigns
    old.core.transfer_leadership(target.name)
    c.process(old)
    c.partition({old.name}, set(c.names) - {old.name})
    c.tick(SIM_CONFIG.election_ticks_max + 1)
    assert not old.core.is_leader()
    with pytest.raises(MembershipRefused):
        old.core.transfer_leadership(target.name)


def test_a_removed_server_that_never_heard_of_it_does_not_disrupt() -> None:
    """n3, cut off, is removed without knowing: it keeps its old configuration and, never hearing
    a leader, keeps timing out. Pre-votes the others do not answer (they hear their leader) keep
    its term where it was, so no term rises and the leader stays."""
    c = Cluster(3, seed=20)
    leader = settled(c)
    victim = next(n for n in c.nodes.values() if n is not leader)
    c.partition({victim.name}, set(c.names) - {victim.name})
    assert committed(c, change(c, lambda core: core.remove(victim.name)))
    c.heal()
    term = leader.core.term
    for _ in range(10):
        c.propose(1)
        c.tick(50)
    assert leader.core.is_leader() and leader.core.term == term
    assert victim.core.is_voter() and victim.core.term <= term  # it still believes it is a voter
    assert c.commit_everywhere()
    # And one that holds its removal (committed or not: the latest configuration is in force)
    # never even tries, though the leader no longer sends it anything.
    c2 = Cluster(3, seed=21)
    leader = settled(c2)
    victim = next(n for n in c2.nodes.values() if n is not leader)
    index = change(c2, lambda core: core.remove(victim.name))
    assert c2.wait_for(lambda: victim.core.last_index >= index, 50)
    c2.crash(leader.name)
    c2.tick(500)
    assert victim.core.role == "follower" and not victim.core.is_voter()


def test_a_server_being_removed_gets_its_removal_again_after_a_lost_append() -> None:
    """Until its removal commits, a leader still sends entries to the server it removes, so that it
    learns of it and never campaigns: it takes that server's answers too (counting them toward
    nothing), or an append lost on its way there would never be sent again. Here the removal's
    appends to both followers are lost; the server being removed comes back while the change still
    cannot commit, and gets it from the leader's next heartbeat round."""
    c = Cluster(3, seed=30)
    leader = settled(c)
    victim, other = [n for n in c.nodes.values() if n is not leader]
    c.partition({leader.name}, {victim.name}, {other.name})
    index = change(c, lambda core: core.remove(victim.name))
    c.tick(3)  # its appends are lost
    assert victim.core.last_index < index
    c.partition({leader.name, victim.name}, {other.name})
    assert c.wait_for(lambda: victim.core.last_index >= index, 8)  # within one election window
    assert leader.core.commit < index  # its answers made no majority of the new configuration
    assert not victim.core.is_voter()


def test_a_hand_over_without_a_named_target_goes_to_a_voter_that_answers() -> None:
    """An idle tier: every voter holds all the log, one of them has died. A hand-over to "the
    voter holding most of the log" goes to one that answered within the election window, not to
    the dead one (the greater name, which won the tie before): a new leader within a window."""
    c = Cluster(3, seed=31)
    leader = settled(c)
    assert c.commit_everywhere()
    alive, dead = sorted(n.name for n in c.nodes.values() if n is not leader)
    c.crash(dead)
    c.tick(60)  # idle, longer than the window: it answers nothing
    assert leader.core.is_leader() and leader.core.progress(dead).match == leader.core.last_index
    c.process(leader)
    match, target = leader.core.handover_target()  # as ReplicaNode.transfer_leadership(None) picks it
    assert (match, target) == (leader.core.last_index, alive)
    leader.core.transfer_leadership(target)
    c.process(leader)
    assert c.wait_for(lambda: c.nodes[alive].core.is_leader(), SIM_CONFIG.election_ticks_min)


def test_a_leader_outside_our_configuration_is_followed() -> None:
    """A voter that missed the entry adding the leader (it was behind) must still take its
    appends, or it could never learn that configuration (Raft dissertation, 4.1)."""
    core = RaftCore("n3", ["n1", "n2", "n3"], config=SIM_CONFIG, rng=1)
    core.step(Message(HEARTBEAT, "n4", "n3", 3, commit=0, ctx=1))
    assert (core.term, core.leader) == (3, "n4")
    assert [m.type for m in core.ready().messages] == ["heartbeat_resp"]


def test_an_uncommitted_configuration_is_rolled_back_with_its_entry() -> None:
    c = Cluster(3, seed=22)
    old = settled(c)
    c.add_node("n4")
    c.partition({old.name}, set(c.names) - {old.name})
    change(c, lambda core: core.add_learner("n4"))
    assert old.core.membership.learners == {"n4"} and old.core.membership_pending()
    assert c.wait_for(lambda: (lead := c.leader()) is not None and lead is not old, 500)
    c.propose(2)
    c.heal()
    assert c.commit_everywhere()
    assert old.core.membership.members == {"n1", "n2", "n3"} and not old.core.membership_pending()
    assert old.core.progress("n4") is None


def test_a_restart_rebuilds_the_configuration_from_snapshot_and_log() -> None:
    c = Cluster(3, seed=23)
    settled(c)
    c.add_node("n4")
    assert committed(c, change(c, lambda core: core.add_learner("n4")))
    assert c.wait_for(lambda: caught_up(c, "n4"), 300)
    c.tick(4)
    assert committed(c, change(c, lambda core: core.promote("n4", MAX_LAG)))
    for _ in range(4):
        c.propose(3)
        c.tick(2)
    for name in ("n1", "n2", "n3", "n4"):  # the configurations are compacted away on some
        if name in ("n1", "n4"):
            c.compact(name, keep=1)
    assert committed(c, change(c, lambda core: core.remove("n3")))  # and the last one is in the log
    c.crash("n3")
    expected = {"n1", "n2", "n4"}
    for name in ("n1", "n2", "n4"):
        c.crash(name)
        c.restart(name)
        assert voters(c.nodes[name]) == expected, name
    n1 = c.nodes["n1"]
    c.compact("n1", keep=0)
    c.crash("n1")
    c.restart("n1")
    assert n1.core.snap_membership.voters == expected and voters(n1) == expected
    assert c.commit_everywhere()


def test_a_snapshot_brings_the_configuration_to_a_new_learner() -> None:
    c = Cluster(3, seed=24)
    leader = settled(c)
    c.add_node("n4")
    assert committed(c, change(c, lambda core: core.add_learner("n4", "http://h4:1")))
    c.crash("n4")
    for _ in range(6):
        c.propose(3)
        c.tick(2)
    for name in ("n1", "n2", "n3"):
        c.compact(name, keep=1)
    sent = []
    send = c.send

    def spy(node: SimNode, messages: list[Message]) -> None:
        sent.extend(m for m in messages if m.type == SNAPSHOT)
        send(node, messages)

    c.send = spy  # type: ignore[method-assign]
    c.restart("n4")
    n4 = c.nodes["n4"]
    assert c.wait_for(lambda: caught_up(c, "n4"), 300)
    assert sent and sent[0].conf == leader.core.membership.to_dict()
    assert n4.core.snap_index > 0 and n4.core.membership == leader.core.membership
    assert n4.storage.snap_membership == leader.core.membership
    assert n4.core.membership.urls == {"n4": "http://h4:1"}


def test_messages_carry_a_transfer_and_a_configuration() -> None:
    conf = Membership(frozenset({"a", "b"}), frozenset({"c"}), {"c": "http://c:1"}).to_dict()
    for m in (Message(VOTE, "a", "b", 3, transfer=1), Message(SNAPSHOT, "a", "c", 3, conf=conf),
              Message(TIMEOUT_NOW, "a", "b", 3)):
        again = Message.from_dict(m.to_dict())
        assert (again.type, again.transfer, again.conf) == (m.type, m.transfer, m.conf)
    assert Membership.of(Membership.from_dict(conf).command()) == Membership.from_dict(conf)
    assert Membership.of({"op": "decrement"}) is None


# -- a 3 -> 4 -> 3 replacement under faults -----------------------------------------------------------
class Nemesis:
    """Load and faults, a tick at a time: proposals, partitions that come and go, crashes and
    restarts of any server but the one lost for good."""

    def __init__(self, c: Cluster, seed: int) -> None:
        self.c, self.rng, self.lost = c, random.Random(seed), ""
        self.faults = 0

    def tick(self) -> None:
        c, rng = self.c, self.rng
        c.propose(rng.randint(0, 1))
        live = [n for n in c.nodes if n != self.lost]
        r = rng.random()
        if r < 0.01:
            side = set(rng.sample(live, rng.randint(1, max(1, len(live) // 2))))
            c.partition(side, set(c.nodes) - side)
            self.faults += 1
        elif r < 0.05:
            c.heal()
        elif r < 0.055:
            c.crash(rng.choice(live))
            self.faults += 1
        elif r < 0.10:
            for name in live:
                c.restart(name)
        c.tick(1)

    def phase(self, ticks: int = 60) -> None:
        """``ticks`` of load with at least two faults: a server cut off for a while, and another
        (or the same) crashed and restarted."""
        c, rng = self.c, self.rng
        live = [n for n in c.nodes if n != self.lost]
        cut, crashed = rng.choice(live), rng.choice(live)
        for t in range(ticks):
            if t == 5:
                c.partition({cut}, set(c.nodes) - {cut})
                self.faults += 1
            elif t == 25:
                c.heal()
            elif t == 30:
                c.crash(crashed)
                self.faults += 1
            elif t == 40:
                c.restart(crashed)
            self.tick()

    def calm(self) -> None:
        self.c.heal()
        for name in self.c.nodes:
            if name != self.lost:
                self.c.restart(name)

    def change(self, op: Callable[[RaftCore], int], done: Callable[[Membership], bool],
               max_ticks: int = 20_000) -> None:
        """``op`` on whoever leads, again and again under faults, until a leader has ``done``
        committed (an attempt whose commit was not seen may have gone through meanwhile). Calm
        returns now and then (a promotion needs the learner caught up)."""
        c = self.c
        for attempt in range(max_ticks):
            if attempt % 300 == 299:
                self.calm()
            leader = c.leader()
            if leader is not None and done(leader.core.membership) and not leader.core.membership_pending():
                return
            if leader is not None:
                with contextlib.suppress(MembershipRefused):
                    change(c, op)
            self.tick()
        raise AssertionError("the change never went through")


@pytest.mark.parametrize("leader_too", [False, True], ids=["follower", "leader"])
@pytest.mark.parametrize("seed", range(10))
def test_a_replacement_3_4_3_under_loss_and_partitions_is_safe(seed: int, leader_too: bool) -> None:
    """A server's machine is lost for good (n3, or the leader); n4 joins as a learner, catches up,
    is promoted, and the lost one is removed, all while the network drops, duplicates and delays
    messages, partitions come and go and the other servers crash and restart. Safety is checked at
    every tick; at the end the group of three commits and agrees, and so do their states."""
    c = Cluster(3, seed=1000 + seed)
    c.net.drop, c.net.dup, c.net.max_delay = 0.05, 0.05, 3
    nemesis = Nemesis(c, seed)
    lead = settled(c)
    nemesis.lost = lost = lead.name if leader_too else next(n for n in ("n3", "n2") if n != lead.name)
    c.crash(lost)
    nemesis.phase()
    c.add_node("n4")
    nemesis.change(lambda core: core.add_learner("n4"), lambda m: "n4" in m.learners)
    nemesis.phase()
    nemesis.change(lambda core: core.promote("n4", 4 * MAX_LAG), lambda m: "n4" in m.voters)  # load: more lag
    nemesis.phase()
    nemesis.change(lambda core: core.remove(lost), lambda m: lost not in m.members)
    nemesis.phase()
    nemesis.calm()
    c.net.drop, c.net.dup, c.net.max_delay = 0.0, 0.0, 0
    assert c.commit_everywhere(max_ticks=3000)
    final = {"n1", "n2", "n3", "n4"} - {lost}
    members = c.members()
    assert {n.name for n in members} == final
    assert all(voters(n) == final for n in members)
    assert len({tuple(n.storage.sm_applied) for n in members}) == 1
    c.check_log_matching()
    c.check_committed_durable()
    assert sum(1 for _, cmd in c.committed.values() if "_raft_membership" in cmd) == 3
    assert nemesis.faults >= 8


def test_learners_and_roles_after_a_change() -> None:
    c = Cluster(3, seed=25)
    leader = settled(c)
    n4 = c.add_node("n4")
    assert committed(c, change(c, lambda core: core.add_learner("n4")))
    assert c.wait_for(lambda: caught_up(c, "n4"), 300)
    assert leader.core.progress("n4") is not None and n4.core.role == "follower"
    assert leader.core.role == LEADER and n4.core.role != CANDIDATE


def test_a_live_leader_hands_over_and_is_removed_under_faults() -> None:
    """What the replica service does to remove its leader: transfer leadership to a caught-up
    voter, then the new leader removes the old one, under the same faults; the old leader's lease
    ends before anyone can be elected on its ``timeout_now`` (checked by the simulator). A fault
    may depose the old leader first: most seeds hand over."""
    handed_over = 0
    for seed in range(8):
        c = Cluster(3, seed=2000 + seed)
        c.net.drop, c.net.dup, c.net.max_delay = 0.05, 0.05, 3
        nemesis = Nemesis(c, seed)
        nemesis.phase()
        old = settled(c).name
        for _ in range(20_000):
            leader = c.leader()
            if leader is not None and leader.name != old:
                break
            if leader is not None and leader.core.lead_transferee is None:
                target = max((pr.match, p) for p, pr in leader.core._prs.items())[1]
                leader.core.transfer_leadership(target)
                c.process(leader)
            nemesis.tick()
        handed_over += bool(c.relinquished)
        nemesis.change(lambda core, old=old: core.remove(old), lambda m, old=old: old not in m.members)
        nemesis.phase()
        nemesis.calm()
        c.net.drop, c.net.dup, c.net.max_delay = 0.0, 0.0, 0
        assert c.commit_everywhere(max_ticks=3000)
        assert {n.name for n in c.members()} == set(c.names) - {old}
        c.check_committed_durable()
    assert handed_over >= 6


# -- what a mutation run found untested (docs/testing.md, "Mutation score") -------------------------
def test_a_removed_leader_tells_the_voter_holding_its_whole_log_to_campaign() -> None:
    """Once its removal commits, the old leader sends ``timeout_now``, itself as the sender, to the
    voter that holds all its log: that voter campaigns at once, not after an election timeout."""
    c = Cluster(3, seed=17)
    old = settled(c)
    c.propose(3)
    assert c.commit_everywhere()
    told: list[Message] = []
    send = c.send

    def spy(node: SimNode, messages: list[Message]) -> None:
        told.extend(m for m in messages if m.type == TIMEOUT_NOW)
        send(node, messages)

    c.send = spy  # type: ignore[method-assign]
    change(c, lambda core: core.remove(old.name))
    assert c.wait_for(lambda: not old.core.is_leader(), 50)
    (m,) = told
    assert (m.src, m.term) == (old.name, old.core.term) and m.dst in voters(old) - {old.name}
    new = elect(c, SIM_CONFIG.election_ticks_min)  # sooner than any election timeout would bring one
    assert new.name == m.dst


def with_a_learner(seed: int, name: str) -> tuple[Cluster, SimNode]:
    """Three voters and learner ``name``, caught up; the cluster and its leader."""
    c = Cluster(3, seed=seed)
    leader = settled(c)
    c.add_node(name)
    assert committed(c, change(c, lambda core: core.add_learner(name)))
    assert c.wait_for(lambda: caught_up(c, name), 300)
    return c, leader


def test_a_hand_over_goes_to_a_voter_heard_within_the_window_and_never_to_a_learner() -> None:
    """``handover_target``: a voter heard exactly a window ago still counts as heard, before one
    heard a tick earlier (whatever its name); a caught-up learner is never the target."""
    c, leader = with_a_learner(31, "n9")
    core = leader.core
    for pr in core._prs.values():  # every one as caught up and as lately heard: the name decides
        pr.match, pr.last_heard = core.last_index, core.now
    assert core.handover_target()[1] == max(voters(leader) - {leader.name})  # not n9, the greatest name
    first, second = sorted(voters(leader) - {leader.name})
    core._prs[first].last_heard = core.now - core._window()
    core._prs[second].last_heard = core.now - core._window() - 1
    assert core.handover_target() == (core._prs[first].match, first)


def test_leadership_goes_only_to_another_voter() -> None:
    """A transfer to a learner, to itself or to a stranger is refused as invalid; by a follower, as
    not the leader; during a transfer, any transfer or change is refused as transferring."""
    c = Cluster(3, seed=32)
    leader = settled(c)
    c.add_node("n4")
    assert committed(c, change(c, lambda core: core.add_learner("n4")))
    for to in ("n4", leader.name, "n9"):
        with pytest.raises(MembershipRefused) as refused:
            leader.core.transfer_leadership(to)
        assert refused.value.kind == "invalid" and leader.core.lead_transferee is None
        assert str(refused.value) == f"{to!r} is not another voter"
    follower = next(n for n in c.nodes.values() if n.name in voters(leader) - {leader.name})
    for attempt in (lambda core: core.transfer_leadership(leader.name), lambda core: core.remove("n4")):
        with pytest.raises(MembershipRefused) as refused:
            attempt(follower.core)
        assert (refused.value.kind, str(refused.value)) == ("not_leader", f"{follower.name} is not the leader")
    c.partition({leader.name}, set(c.nodes) - {leader.name})  # the transfer cannot finish meanwhile
    leader.core.transfer_leadership(follower.name)
    for attempt in (lambda core: core.transfer_leadership(follower.name), lambda core: core.remove("n4")):
        with pytest.raises(MembershipRefused) as refused:
            attempt(leader.core)
        assert (refused.value.kind, str(refused.value)) == (
            "transferring", f"{leader.name} is handing leadership to {follower.name}")


def test_a_learner_heard_just_now_but_too_far_behind_is_not_caught_up() -> None:
    c, leader = with_a_learner(33, "n4")
    core = leader.core
    assert core.caught_up("n4", MAX_LAG)
    pr = core._prs["n4"]
    pr.last_heard = core.now - core._window()  # heard exactly a window ago: still in time
    assert core.caught_up("n4", MAX_LAG)
    pr.match, pr.last_heard = core.last_index - MAX_LAG - 1, core.now - 5
    assert not core.caught_up("n4", MAX_LAG)
    with pytest.raises(MembershipRefused) as refused:
        core.promote("n4", MAX_LAG)
    assert refused.value.kind == "lagging"
    assert str(refused.value) == f"n4 is not caught up: {MAX_LAG + 1} entries behind (at most {MAX_LAG}), " \
                                 "last answered 5 ticks ago"
    pr.last_heard = -1
    with pytest.raises(MembershipRefused) as refused:
        core.promote("n4", MAX_LAG)
    assert str(refused.value).endswith("entries behind (at most 2), never answered")


def test_each_change_keeps_the_urls_of_the_members_it_keeps() -> None:
    m = Membership(frozenset({"a", "b"}), frozenset({"c"}), {"a": "http://a:1", "c": "http://c:1"})
    assert m.promoted("c").urls == {"a": "http://a:1", "c": "http://c:1"}
    assert m.without("c").urls == {"a": "http://a:1"} and m.without("b").urls == m.urls
    assert m.with_learner("d", "").urls == m.urls  # no URL given: none recorded, not an empty one
    assert m.with_learner("d", "http://d:1").urls == {**m.urls, "d": "http://d:1"}
    for refused, why in ((lambda: m.without("z"), "'z' is not a member"),
                         (lambda: m.promoted("z"), "'z' is not a member"),
                         (lambda: m.promoted("a"), "'a' is a voter already"),
                         (lambda: m.with_learner("a", None), "'a' is already a member"),
                         (lambda: Membership(frozenset({"a"})).without("a"), "'a' is the last voter")):
        with pytest.raises(MembershipRefused) as e:
            refused()
        assert why in str(e.value)  # says why


def test_a_configuration_just_after_the_snapshot_is_found() -> None:
    """The entry right after the snapshot's index is the first ``membership_at`` must look at."""
    c = Cluster(3, seed=34)
    leader = settled(c)
    c.propose(2)
    assert c.commit_everywhere()
    c.add_node("n4")
    index = change(c, lambda core: core.add_learner("n4"))
    assert committed(c, index) and c.commit_everywhere()
    core = leader.core
    assert core.compact(index - 1) is not None and core.snap_index == index - 1
    assert "n4" not in core.snap_membership.members
    assert "n4" in core.membership_at(core.last_index).members and "n4" in core.membership_at(index).members


def test_a_name_added_again_in_the_turn_its_removal_commits_starts_afresh() -> None:
    """A removal's commit and the same name's addition (a new replica, an empty disk) taken in one
    turn: the old replica's progress is still kept until ``ready`` prunes it, and the new member
    must not inherit it (caught up on entries it never received, promotable at once)."""
    from raft_sim import make_leader

    from pygmy.replication.core import APPEND_RESP, CoreConfig, Message, RaftCore

    cfg = CoreConfig(heartbeat_ticks=2, election_ticks_min=10, election_ticks_max=20)
    a = make_leader(RaftCore("a", list("abcd"), config=cfg, rng=1))
    for p in "bcd":
        a.step(Message(APPEND_RESP, p, "a", a.term, index=a.last_index, success=True, ctx=a.now))
    a.ready()
    removal = a.remove("d")
    for p in "bc":
        a.step(Message(APPEND_RESP, p, "a", a.term, index=removal, success=True, ctx=a.now))
    assert a.commit >= removal and a.progress("d") is not None  # pruned by the next ``ready``
    a.add_learner("d", "http://new:1")  # the same turn
    a.ready()
    for p in "bc":
        a.step(Message(APPEND_RESP, p, "a", a.term, index=a.last_index, success=True, ctx=a.now))
    a.ready()
    pr = a.progress("d")
    assert pr is not None and pr.match == 0 and not a.caught_up("d", 64)
    with pytest.raises(MembershipRefused, match="never answered"):
        a.promote("d", 64)


@pytest.mark.parametrize("late", ["append", "heartbeat"])
def test_a_late_answer_of_a_removed_replica_says_nothing_of_its_successor_under_that_name(late: str) -> None:
    """Remove ``d``, wipe it, add a new replica under the name ``d``: an answer the old one sent
    before its removal, arriving only now (a slow link), must not count as the new one's: it would
    look caught up on entries its empty disk never held, be promoted, and count towards a majority
    for them."""
    from raft_sim import make_leader

    from pygmy.replication.core import APPEND_RESP, HEARTBEAT_RESP, CoreConfig, Message, RaftCore

    cfg = CoreConfig(heartbeat_ticks=2, election_ticks_min=10, election_ticks_max=20)
    a = make_leader(RaftCore("a", list("abcd"), config=cfg, rng=1))
    for p in "bcd":
        a.step(Message(APPEND_RESP, p, "a", a.term, index=a.last_index, success=True, ctx=a.now))
    a.ready()
    for _ in range(5):
        a.propose({"k": 1})
    a.ready()
    sent_at, held = a.now, a.last_index  # the old d's answer to these, delayed on its way
    removal = a.remove("d")
    for p in "bc":
        a.step(Message(APPEND_RESP, p, "a", a.term, index=removal, success=True, ctx=a.now))
    a.ready()
    assert a.progress("d") is None  # pruned
    for _ in range(3):
        a.tick()
    a.ready()
    a.add_learner("d", "http://new:1")
    a.ready()
    answer = (Message(APPEND_RESP, "d", "a", a.term, index=held, success=True, ctx=sent_at) if late == "append" else
              Message(HEARTBEAT_RESP, "d", "a", a.term, index=held, conflict_index=held + 1, ctx=sent_at))
    a.step(answer)
    for _ in range(3):
        a.tick()
    for p in "bc":  # the addition commits
        a.step(Message(APPEND_RESP, p, "a", a.term, index=a.last_index, success=True, ctx=a.now))
    a.ready()
    pr = a.progress("d")
    assert pr is not None and pr.match == 0, pr
    with pytest.raises(MembershipRefused, match="never answered"):
        a.promote("d", 64)
