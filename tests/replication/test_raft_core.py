"""Focused scenarios for ``RaftCore`` driven through the deterministic simulator."""

from __future__ import annotations

from raft_sim import SIM_CONFIG, Cluster, make_leader

from pygmy.replication.core import APPEND, CoreConfig, Entry, HardState, Message, RaftCore


def elect(c: Cluster, max_ticks: int = 500):
    assert c.wait_for(lambda: c.stable_leader() is not None, max_ticks)
    return c.stable_leader()


def test_basic_election_and_commit():
    c = Cluster(3, seed=1)
    leader = elect(c)
    assert sum(1 for n in c.nodes.values() if n.core.is_leader()) == 1
    assert leader.core.term_start_index == 1
    assert c.commit_everywhere()
    for n in c.nodes.values():
        assert n.core.commit == leader.core.commit
        assert n is leader or n.core.first_leader_commit is not None


def test_single_node_cluster_commits_alone():
    c = Cluster(1, seed=2)
    elect(c)
    idx = c.propose(3)
    c.tick(1)
    assert c.nodes["n1"].storage.sm_index == idx[-1]


def test_reelection_after_leader_crash():
    c = Cluster(5, seed=3)
    old = elect(c)
    c.propose(5)
    c.tick(5)
    c.crash(old.name)
    new = elect(c)
    assert new.name != old.name and new.core.term > old.core.term
    assert c.commit_everywhere()
    # The committed entries survived the change of leader.
    assert all(len(n.storage.sm_applied) >= 6 for n in c.nodes.values() if n.alive)


def test_follower_catches_up_after_missing_entries():
    c = Cluster(3, seed=4)
    leader = elect(c)
    lagger = next(n for n in c.nodes.values() if n is not leader)
    c.crash(lagger.name)
    for _ in range(20):
        c.propose(5)
        c.tick(1)
    c.restart(lagger.name)
    assert c.wait_for(lambda: lagger.storage.sm_index == leader.storage.sm_index, 300)
    assert lagger.core.snap_index == 0  # caught up from the log, no snapshot


def test_snapshot_install_after_compaction():
    c = Cluster(3, seed=5)
    leader = elect(c)
    lagger = next(n for n in c.nodes.values() if n is not leader)
    c.crash(lagger.name)
    for _ in range(10):
        c.propose(5)
        c.tick(2)
    c.compact(leader.name, keep=2)
    assert leader.core.snap_index > lagger.storage.sm_index + 1
    c.restart(lagger.name)
    assert c.wait_for(lambda: lagger.storage.sm_index == leader.storage.sm_index, 300)
    assert lagger.core.snap_index >= leader.core.snap_index  # it installed a snapshot
    assert lagger.storage.sm_applied == leader.storage.sm_applied
    assert c.commit_everywhere()


def test_prevote_prevents_disruption_by_rejoining_node():
    c = Cluster(3, seed=6)
    leader = elect(c)
    term = leader.core.term
    other = next(n for n in c.nodes.values() if n is not leader)
    c.partition({other.name}, set(c.names) - {other.name})
    c.tick(200)  # the isolated node keeps pre-campaigning but never raises its term
    assert other.core.term == term
    c.heal()
    c.tick(100)
    assert leader.core.is_leader() and leader.core.term == term
    assert other.core.leader == leader.name


def test_rejoining_node_without_prevote_would_disrupt():
    """Control experiment: the same partition without PreVote bumps terms and deposes the leader."""
    cfg = CoreConfig(
        heartbeat_ticks=2, election_ticks_min=10, election_ticks_max=20, pre_vote=False, check_quorum=False
    )
    c = Cluster(3, seed=6, config=cfg)
    leader = elect(c)
    term = leader.core.term
    other = next(n for n in c.nodes.values() if n is not leader)
    c.partition({other.name}, set(c.names) - {other.name})
    c.tick(200)
    assert other.core.term > term + 3
    c.heal()
    c.tick(100)
    assert leader.core.term > term


def test_check_quorum_steps_down_partitioned_leader_and_minority_never_commits():
    c = Cluster(5, seed=7)
    leader = elect(c)
    assert c.commit_everywhere()
    commit_before = leader.core.commit
    minority = {leader.name, next(n for n in c.names if n != leader.name)}
    c.partition(minority, set(c.names) - minority)
    for _ in range(5):
        leader.core.propose({"lost": True})
        c.process(leader)
        c.tick(2)
    assert leader.core.commit == commit_before  # the minority side acknowledges nothing
    assert not leader.core.has_quorum_contact()
    c.tick(SIM_CONFIG.election_ticks_min * 2)
    assert not leader.core.is_leader()  # CheckQuorum
    majority_leader = c.leader()
    assert majority_leader is not None and majority_leader.name not in minority
    c.heal()
    assert c.commit_everywhere()
    for n in c.nodes.values():  # the minority's proposals were discarded everywhere
        assert all('"lost"' not in cmd for _, _, cmd in n.storage.sm_applied)


def test_leader_lease_and_quorum_contact():
    c = Cluster(3, seed=8)
    leader = elect(c)
    c.tick(10)
    assert leader.core.has_quorum_contact()
    c.partition({leader.name}, set(c.names) - {leader.name})
    c.tick(SIM_CONFIG.effective_lease_ticks() + 1)
    assert not leader.core.has_quorum_contact()


def test_proposals_are_batched_into_one_append_per_follower():
    core = RaftCore("a", ["a", "b", "c"], rng=1)
    for _ in range(200):
        core.tick()
        if core.role != "follower":
            break
    for _ in range(2):  # pre-vote round, then vote round
        for m in core.ready().messages:
            core.step(Message(m.type + "_resp", m.dst, "a", m.term, success=True))
    assert core.is_leader()
    rd = core.ready()
    for m in rd.messages:  # acknowledge the no-op so both followers are in replicate state
        core.step(Message("append_resp", m.dst, "a", core.term, index=1, success=True))
    core.ready()
    for i in range(10):
        core.propose({"i": i})
    appends = [m for m in core.ready().messages if m.type == APPEND]
    assert sorted(m.dst for m in appends) == ["b", "c"]
    assert all(len(m.entries) == 10 for m in appends)


def test_fast_backtracking_skips_a_whole_term():
    # Follower b has a long divergent suffix of term 2; the leader (term 3) must not probe one by one.
    entries_b = [Entry(1, 1)] + [Entry(i, 2, {"x": i}) for i in range(2, 50)]
    b = RaftCore("b", ["a", "b", "c"], hard_state=HardState(2, None, 1), entries=entries_b, rng=1)
    leader_log = [Entry(1, 1), Entry(2, 3)]
    probe = Message(APPEND, "a", "b", 3, index=2, log_term=3, commit=1)
    b.step(probe)
    resp = b.ready().messages[-1]
    assert not resp.success and resp.conflict_term in (0, 2)
    assert resp.conflict_index <= 3
    append = Message(APPEND, "a", "b", 3, index=1, log_term=1, entries=leader_log[1:], commit=2)
    b.step(append)
    rd = b.ready()
    assert rd.truncate_from == 2 and rd.entries == [Entry(2, 3)]
    assert b.last_index == 2 and b.commit == 2


def test_message_json_round_trip():
    m = Message(
        APPEND,
        "a",
        "b",
        3,
        index=4,
        log_term=2,
        entries=[Entry(5, 3, {"k": [1, 2]}), Entry(6, 3, None)],
        commit=4,
        leader_commit=4,
        ctx=17,
        payload=b"\x00\xffbytes",
    )
    assert Message.from_dict(m.to_dict()) == m
    hb = Message("heartbeat", "a", "b", 3)
    assert hb.to_dict() == {"type": "heartbeat", "src": "a", "dst": "b", "term": 3}


def test_old_term_entries_commit_only_with_a_current_term_entry():
    """Raft section 5.4.2 (Figure 8): replicating an old-term entry to a majority does not commit it."""
    peers = ["a", "b", "c", "d", "e"]
    core = RaftCore("a", peers, hard_state=HardState(3, None, 1), entries=[Entry(1, 1), Entry(2, 2)], rng=3)
    make_leader(core)
    assert core.term == 4 and core.last_index == 3  # the no-op of term 4 at index 3
    core.ready()
    for peer in ("b", "c"):
        core.step(Message("append_resp", peer, "a", 4, index=2, success=True))
    core.ready()
    assert core.commit == 1  # index 2 (term 2) is on a majority but must not be committed yet
    for peer in ("b", "c"):
        core.step(Message("append_resp", peer, "a", 4, index=3, success=True))
    assert core.commit == 3


def test_ticks_until_timer_is_a_sleep_that_misses_nothing():
    """Ticking ``ticks_until_timer() - 1`` times with no input changes nothing observable (no
    message, no role, term or vote change), for followers, candidates and leaders across many
    schedules: so a driver may sleep that long and wake only at its heartbeats."""
    for seed in range(20):
        c = Cluster(3, seed=seed)
        elect(c)
        c.propose(2)
        c.tick(3)
        for n in c.nodes.values():
            core = n.core
            core.ready()  # drain
            k = core.ticks_until_timer()
            assert k >= 1
            before = (core.role, core.term, core.vote, core.leader, core.commit)
            for _ in range(k - 1):
                core.tick()
            rd = core.ready()
            assert not rd.messages and (core.role, core.term, core.vote, core.leader, core.commit) == before
            core.tick()  # the timer itself fires on the k-th tick
            fired = core.ready()
            assert fired.messages or core.role != before[0], (seed, n.name, before[0], k)
