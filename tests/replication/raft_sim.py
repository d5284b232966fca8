"""Deterministic in-process simulation of a Raft cluster built from ``RaftCore``s.

A fake clock (ticks) and a fake network that drops, delays, duplicates, reorders and partitions
messages. A stall (``Cluster.stall``: SIGSTOP, a long pause) freezes a node, which then resumes as the
real driver does, counting only some of the ticks it missed. A crash loses everything not yet written to the simulated durable ``Storage``; a restart
rebuilds the core from storage. A crash lands either between ticks (every ``Ready`` handled) or, to
exercise the persist-before-send rule, inside the handling of one ``Ready`` (``arm_crash``): before
it is persisted, between persisting and sending, or before applying. ``send_before_persist`` swaps
the order on purpose, to show that the simulator catches the broken rule. Safety invariants are
checked as the simulation runs (``SafetyError``). Membership changes: ``add_node`` starts a server
that joins as a learner; the checks go by the configuration each entry was committed in.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pygmy.replication import timers
from pygmy.replication.core import (
    APPLY,
    PERSIST,
    SEND,
    SNAPSHOT,
    TIMEOUT_NOW,
    VOTE,
    VOTE_RESP,
    CoreConfig,
    Entry,
    HardState,
    Membership,
    Message,
    RaftCore,
    Ready,
)

SIM_CONFIG = CoreConfig(
    heartbeat_ticks=2,
    election_ticks_min=10,
    election_ticks_max=20,
    max_entries_per_msg=5,
    max_inflight=4,
    snapshot_timeout_ticks=30,
)


#: Where a crash armed with ``Cluster.arm_crash`` lands in the handling of one ``Ready``: just
#: before that step, after the steps that precede it in ``Ready.steps()`` (the order the real node
#: takes; send, persist, apply when ``send_before_persist``). Steps not done are lost with the
#: node's memory.
CRASH_POINTS = ("before_persist", "before_send", "before_apply")


class SafetyError(AssertionError):
    pass


def persists(rd: Ready) -> bool:
    """True if ``rd`` changes durable Raft state (so a crash before persisting it loses something)."""
    return bool(rd.hard_state or rd.snapshot or rd.entries or rd.truncate_from is not None)


@dataclass
class Storage:
    """What survives a crash: the persisted Raft state and the (durable) state machine."""

    hard_state: HardState = field(default_factory=HardState)
    snapshot: tuple[int, int] = (0, 0)
    entries: dict[int, Entry] = field(default_factory=dict)
    sm_applied: list[tuple[int, int, Any]] = field(default_factory=list)
    sm_index: int = 0
    #: The configuration in force at ``snapshot`` (recorded with it, as the log store does).
    snap_membership: Membership | None = None

    def log(self) -> list[Entry]:
        out = []
        i = self.snapshot[0] + 1
        while i in self.entries:
            out.append(self.entries[i])
            i += 1
        return out


class SimNode:
    def __init__(self, name: str, names: list[str], config: CoreConfig, seed: int,
                 learners: tuple[str, ...] = ()) -> None:
        self.name = name
        self.names = names
        self.learners = learners
        self.config = config
        self.seed = seed
        self.storage = Storage()
        self.alive = True
        self.restarts = 0
        #: While stalled: the tick it stood still at, and the tick it runs again at.
        self.stalled_since: int | None = None
        self.stalled_until = 0
        self.backlog: list[Message] = []  # what reached it while it stood still, read once it runs
        self.core = self._new_core()

    def _new_core(self) -> RaftCore:
        s = self.storage
        return RaftCore(
            self.name,
            self.names,
            hard_state=s.hard_state,
            entries=s.log(),
            snapshot=s.snapshot,
            applied=s.sm_index,
            config=self.config,
            rng=random.Random(f"{self.seed}-{self.name}-{self.restarts}"),
            learners=self.learners,
            snapshot_membership=s.snap_membership,
        )

    def crash(self) -> None:
        self.alive = False
        self.stalled_since, self.backlog = None, []

    def restart(self) -> None:
        self.restarts += 1
        self.alive = True
        self.core = self._new_core()

    @property
    def running(self) -> bool:
        return self.alive and self.stalled_since is None


class Network:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.drop = 0.0
        self.dup = 0.0
        self.max_delay = 0
        self.groups: list[set[str]] | None = None
        self.queue: list[tuple[int, int, Message]] = []
        self.seq = 0

    def connected(self, a: str, b: str) -> bool:
        if self.groups is None:
            return True
        return any(a in g and b in g for g in self.groups)

    def send(self, now: int, m: Message) -> None:
        copies = 1
        if self.rng.random() < self.drop:
            copies = 0
        elif self.rng.random() < self.dup:
            copies = 2
        for _ in range(copies):
            self.seq += 1
            delay = 1 + (self.rng.randint(0, self.max_delay) if self.max_delay else 0)
            self.queue.append((now + delay, self.seq, m))

    def due(self, now: int) -> list[Message]:
        ready = [item for item in self.queue if item[0] <= now]
        self.queue = [item for item in self.queue if item[0] > now]
        self.rng.shuffle(ready)
        return [m for _, _, m in ready]


class Cluster:
    """N simulated nodes plus invariant checking."""

    def __init__(
        self, n: int = 3, seed: int = 0, config: CoreConfig = SIM_CONFIG, *, send_before_persist: bool = False
    ) -> None:
        #: Test-only mutation: send a Ready's messages before persisting it (breaks Raft on crashes).
        self.send_before_persist = send_before_persist
        #: Off: a node back from a stall drops the ticks it does not count, its clock with them.
        self.count_lost = True
        self.names = [f"n{i}" for i in range(1, n + 1)]
        self.rng = random.Random(seed)
        self.nodes = {name: SimNode(name, self.names, config, seed) for name in self.names}
        self.net = Network(random.Random(seed + 1))
        self.now = 0
        self.leaders: dict[int, str] = {}
        self.committed: dict[int, tuple[int, str]] = {}
        #: Lowest term in which some node observed the entry committed (>= the real commit term).
        self.commit_term: dict[int, int] = {}
        self.next_cmd = 0
        self.proposed: dict[int, str] = {}
        #: (term, voter) -> the candidate it granted its vote to, from the grants it sent.
        self.votes: dict[tuple[int, str], str] = {}
        #: term -> the latest tick to which its leader's lease ever reached.
        self.lease_ends: dict[int, int] = {}
        #: term -> (tick its leader was elected, the core's ``election_gap``).
        self.elections: dict[int, tuple[int, int]] = {}
        #: Crashes armed per node: the point in its next durable Ready where it dies.
        self.armed: dict[str, str] = {}
        #: How many armed crashes fired, per crash point; "leader_sent_unpersisted" counts those that
        #: hit a leader after it sent a ``send_first`` Ready and before it persisted it.
        self.ready_crashes: Counter[str] = Counter()
        #: index -> the voters of the configuration its leader committed it in (whose majority
        #: must hold it on disk), and the highest index recorded so.
        self.commit_voters: dict[int, frozenset[str]] = {}
        self._commit_recorded = 0
        #: term -> the tick its leader gave up its lease for a transfer (sent ``timeout_now``).
        self.relinquished: dict[int, int] = {}
        self.config = config
        self.seed = seed

    # -- running -------------------------------------------------------------------------------
    def tick(self, n: int = 1) -> None:
        for _ in range(n):
            self.now += 1
            for node in self.nodes.values():
                if node.running:
                    node.core.tick()
                elif node.alive and self.now >= node.stalled_until:
                    self._resume(node)
            for m in self.net.due(self.now):
                dst = self.nodes[m.dst]
                if dst.alive and self.net.connected(m.src, m.dst):
                    if dst.running:
                        dst.core.step(m)
                    else:
                        dst.backlog.append(m)
            for node in self.nodes.values():
                if node.running:
                    self.process(node)
            self.check()

    def stall(self, name: str, ticks: int) -> None:
        """Freeze ``name`` for ``ticks`` (SIGSTOP, a long pause): it neither ticks nor reads, and
        what is sent to it waits in its socket (``backlog``)."""
        node = self.nodes[name]
        if node.running:
            node.stalled_since, node.stalled_until = self.now, self.now + ticks

    def _resume(self, node: SimNode) -> None:
        """Run a stalled node again as ``ReplicaNode._tick_until`` does: the ticks it missed, of
        which ``timers.ticks_due`` are counted and the rest passed as ``lost`` (dropped altogether
        when ``count_lost`` is off). What waited for it is read from the next tick on: the first
        thing it does is take its turn, as a driver whose tick comes before its readers."""
        missed = self.now - (node.stalled_since or self.now)
        due = timers.ticks_due(missed - 1, 1.0, node.core.ticks_until_timer(), 2 * self.config.election_ticks_max)
        node.core.tick(due, lost=missed - due if self.count_lost else 0)
        node.stalled_since = None
        for m in node.backlog:
            self.net.seq += 1
            self.net.queue.append((self.now + 1, self.net.seq, m))
        node.backlog = []

    def process(self, node: SimNode) -> None:
        """Handle one Ready as the real driver does: its steps in the order ``rd.steps()`` gives
        (the same call ``ReplicaNode._process_ready`` makes; send, persist, apply if
        ``send_before_persist``), then ``advance``; an armed crash stops it part-way."""
        core = node.core
        if core.is_leader() and core.commit > self._commit_recorded:
            voters = core.membership.voters
            for index in range(self._commit_recorded + 1, core.commit + 1):
                self.commit_voters.setdefault(index, voters)
            self._commit_recorded = core.commit
        rd = node.core.ready()
        point = self.armed.get(node.name) if persists(rd) else None
        steps = (SEND, PERSIST, APPLY) if self.send_before_persist else rd.steps()
        for step in steps:
            if point == f"before_{step}":
                del self.armed[node.name]
                self.ready_crashes[point] += 1
                if rd.send_first and step == PERSIST and rd.entries:
                    self.ready_crashes["leader_sent_unpersisted"] += 1
                node.crash()
                return
            if step == PERSIST:
                self.persist(node, rd)
            elif step == SEND:
                self.send(node, rd.messages)
            else:
                for e in rd.committed_entries:
                    self.apply(node, e)
        node.core.advance(rd)

    def send(self, node: SimNode, messages: list[Message]) -> None:
        for m in messages:
            if m.type == VOTE or (m.type == VOTE_RESP and m.success):
                # Election safety rests on this: a node votes (for itself or a peer) once a term.
                candidate = m.src if m.type == VOTE else m.dst
                voted = self.votes.setdefault((m.term, m.src), candidate)
                if voted != candidate:
                    raise SafetyError(f"{m.src} voted twice in term {m.term}: for {voted} and {candidate}")
            if m.type == SNAPSHOT:
                m.snapshot_index = node.storage.sm_index
                m.snapshot_term = node.core.term_at(m.snapshot_index) or 0
                m.payload = json.dumps(node.storage.sm_applied).encode()
                m.conf = node.core.membership_at(m.snapshot_index).to_dict()  # as the node's pin does
            if m.type == TIMEOUT_NOW:
                # Voters may elect the target at once: the sender must hold no lease from now on.
                if node.core.lease_remaining():
                    raise SafetyError(f"{node.name} sent timeout_now while it holds a lease")
                self.relinquished.setdefault(m.term, self.now)
            if self.net.connected(m.src, m.dst):
                self.net.send(self.now, m)

    def persist(self, node: SimNode, rd: Ready) -> None:
        s = node.storage
        if rd.snapshot is not None:
            snap = rd.snapshot
            assert snap.data is not None
            applied = [tuple(x) for x in json.loads(snap.data)]
            for index, term, cmd in applied:
                self.observe_committed(node, index, term, cmd)
            s.sm_applied = applied
            s.sm_index = snap.index
            s.snapshot = (snap.index, snap.term)
            s.snap_membership = snap.membership
            s.entries = {}
        if rd.truncate_from is not None:
            for i in [i for i in s.entries if i >= rd.truncate_from]:
                del s.entries[i]
        for e in rd.entries:
            s.entries[e.index] = e
        if rd.hard_state is not None:
            s.hard_state = rd.hard_state

    def apply(self, node: SimNode, e: Entry) -> None:
        s = node.storage
        if e.index <= s.sm_index:
            return
        if e.index != s.sm_index + 1:
            raise SafetyError(f"{node.name} applies {e.index} after {s.sm_index}")
        cmd = json.dumps(e.command, sort_keys=True)
        self.observe_committed(node, e.index, e.term, cmd)
        s.sm_applied.append((e.index, e.term, cmd))
        s.sm_index = e.index

    def observe_committed(self, node: SimNode, index: int, term: int, cmd: str) -> None:
        seen = self.committed.get(index)
        self.commit_term[index] = min(self.commit_term.get(index, node.core.term), node.core.term)
        if seen is None:
            self.committed[index] = (term, cmd)
        elif seen != (term, cmd):
            raise SafetyError(f"{node.name}: committed entry {index} changed: {seen} -> {(term, cmd)}")

    def compact(self, name: str, keep: int = 3) -> None:
        node = self.nodes[name]
        if not node.alive:
            return
        res = node.core.compact(node.core.applied - keep)
        if res is not None:
            s = node.storage
            s.snapshot = res
            s.snap_membership = node.core.snap_membership
            for i in [i for i in s.entries if i <= res[0]]:
                del s.entries[i]

    # -- actions -------------------------------------------------------------------------------
    def leader(self) -> SimNode | None:
        live = [n for n in self.nodes.values() if n.running and n.core.is_leader()]
        if not live:
            return None
        return max(live, key=lambda n: n.core.term)

    def propose(self, count: int = 1) -> list[int]:
        node = self.leader()
        out = []
        if node is None:
            return out
        for _ in range(count):
            self.next_cmd += 1
            index = node.core.propose({"n": self.next_cmd})
            if index is not None:
                out.append(index)
        self.process(node)
        return out

    def crash(self, name: str) -> None:
        self.nodes[name].crash()

    def add_node(self, name: str) -> SimNode:
        """A new server that joins the running group: it starts as a learner of the group as it
        is now (its address is all it needs; the log tells it the rest)."""
        leader = self.leader()
        current = sorted(leader.core.membership.members) if leader else list(self.names)
        node = SimNode(name, [*current, name], self.config, self.seed, learners=(name,))
        self.nodes[name] = node
        return node

    def members(self) -> list[SimNode]:
        """The nodes in the configuration of the newest leader (every node before any change)."""
        leader = self.leader()
        if leader is None:
            return list(self.nodes.values())
        return [n for n in self.nodes.values() if n.name in leader.core.membership.members]

    def arm_crash(self, name: str, point: str) -> None:
        """Crash ``name`` at ``point`` (see ``CRASH_POINTS``) of the next Ready it handles that
        changes durable state, losing whatever of that Ready it had not persisted or sent."""
        if point not in CRASH_POINTS:
            raise ValueError(f"unknown crash point {point!r}")
        self.armed[name] = point

    def disarm(self) -> None:
        self.armed.clear()

    def restart(self, name: str) -> None:
        node = self.nodes[name]
        if not node.alive:
            node.restart()

    def partition(self, *groups: set[str]) -> None:
        self.net.groups = [set(g) for g in groups]

    def heal(self) -> None:
        self.net.groups = None

    def wait_for(self, predicate, max_ticks: int) -> bool:
        for _ in range(max_ticks):
            if predicate():
                return True
            self.tick()
        return predicate()

    def stable_leader(self) -> SimNode | None:
        """A leader that every live member of its configuration follows in its own term."""
        node = self.leader()
        if node is None:
            return None
        for other in self.members():
            if other.alive and (other.core.term != node.core.term or other.core.leader != node.name):
                return None
        return node

    def commit_everywhere(self, max_ticks: int = 2000) -> bool:
        """Liveness: with a healed network, a new proposal commits and is applied on all nodes."""

        def attempt() -> bool:
            leader = self.stable_leader()
            if leader is None:
                return False
            idx = self.propose(1)
            return bool(idx) and self.wait_for(
                lambda: all(n.storage.sm_index >= idx[0] for n in self.members() if n.alive), 300
            )

        for _ in range(max_ticks // 50):
            if attempt():
                return True
            self.tick(50)
        return False

    # -- invariants ----------------------------------------------------------------------------
    def check(self) -> None:
        for node in self.nodes.values():
            if not node.running:  # (a stalled node serves nothing: its lease is checked when it runs)
                continue
            core = node.core
            if core.is_leader():
                prev = self.leaders.setdefault(core.term, node.name)
                if prev != node.name:
                    raise SafetyError(f"two leaders in term {core.term}: {prev} and {node.name}")
                self.check_lease(core)
                # Leader completeness: a leader of a later term holds every committed entry.
                for index, (term, _cmd) in self.committed.items():
                    later = core.term > self.commit_term[index]
                    if later and index > core.snap_index and core.term_at(index) != term:
                        raise SafetyError(f"leader {node.name} t{core.term} lacks committed entry {index}")
            # Committed prefix in the log agrees with what anybody observed as committed.
            for e in core.entries(core.applied + 1, core.commit):
                seen = self.committed.get(e.index)
                if seen is not None and seen != (e.term, json.dumps(e.command, sort_keys=True)):
                    raise SafetyError(f"{node.name} committed log entry {e.index} disagrees")
        if self.now % 10 == 0:
            self.check_log_matching()
            self.check_committed_durable()

    def check_lease(self, core: RaftCore) -> None:
        """No leader's lease reaches past ``election_gap - 1`` ticks before any later leader's
        election (after it, if negative), as ``ReplicaNode.vote_quiet_s`` counts: what a new catalog
        leader's wait counts on, whatever windows the leaders announced. That holds of the lease as
        it ever stood, for what the leader promised under it (the catalog's cache grants); and of
        the lease for reads, which a leader that handed over (``timeout_now``) gave up then, at least
        0 ticks before. Checked whenever an election is seen or a lease grows."""
        if core.term not in self.elections:
            elected, gap = self.elections[core.term] = (self.now, core.election_gap)
            earlier = [(t, e) for t, e in self.lease_ends.items() if t < core.term]
            ended = max((e for _, e in earlier), default=None)
            if ended is not None and ended > elected - (gap - 1):
                raise SafetyError(f"{core.id} elected at {elected} in t{core.term} counting on leases ended "
                                  f"{gap - 1} ticks before, but an earlier lease reached {ended}")
            # A leader that handed over gave its lease for reads up when it said so (``relinquished``).
            read = max((min(e, self.relinquished.get(t, e)) for t, e in earlier), default=None)
            if read is not None and read > elected - max(0, gap - 1):
                raise SafetyError(f"{core.id} elected at {elected} in t{core.term}, but an earlier lease for "
                                  f"reads reached {read}")
        remaining = core.lease_remaining()
        end = self.now + remaining
        if remaining and end > self.lease_ends.get(core.term, end - 1):
            self.lease_ends[core.term] = end
            for term, (elected, gap) in self.elections.items():
                # A lease that grows is not given up: what both bounds count on, the stricter one.
                if term > core.term and end > elected - max(0, gap - 1):
                    raise SafetyError(f"t{core.term}'s lease reached {end}, past what the leader of "
                                      f"t{term} counted on (leases ended {gap - 1} ticks before {elected})")

    def check_committed_durable(self) -> None:
        """Every entry observed committed is on the disks of a majority (crashed nodes count):
        committing promised that no crash of a minority can lose it."""
        for index, (term, _cmd) in self.committed.items():
            voters = self.commit_voters.get(index, frozenset(self.names))
            quorum = len(voters) // 2 + 1
            holders = 0
            for node in (self.nodes[v] for v in voters if v in self.nodes):
                s = node.storage
                e = s.entries.get(index)
                if s.snapshot[0] >= index or (e is not None and e.term == term):
                    holders += 1
            if holders < quorum:
                raise SafetyError(f"committed entry {index} (t{term}) is durable on {holders} nodes only")

    def check_log_matching(self) -> None:
        """If two logs hold an entry with the same index and term, they agree up to it."""
        logs = {}
        for node in self.nodes.values():
            c = node.core
            logs[node.name] = {e.index: e for e in c.entries(c.snap_index + 1, c.last_index)}
        names = list(logs)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                la, lb = logs[a], logs[b]
                common = sorted(set(la) & set(lb), reverse=True)
                agree = False
                for idx in common:
                    if la[idx].term == lb[idx].term:
                        agree = True
                    if agree and la[idx] != lb[idx]:
                        raise SafetyError(f"log matching violated between {a} and {b} at {idx}")


def make_leader(core: RaftCore) -> RaftCore:
    """Drive ``core`` through pre-vote and vote with every peer granting."""
    for _ in range(500):
        core.tick()
        if core.role != "follower":
            break
    for _ in range(2):
        for m in core.ready().messages:
            core.step(Message(m.type + "_resp", m.dst, core.id, m.term, success=True))
    assert core.is_leader()
    return core
