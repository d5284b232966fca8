"""A deterministic Raft state machine, in the style of etcd's raft library.

``RaftCore`` does no I/O, starts no threads, reads no clock and uses no global randomness, so the
same inputs (ticks, messages, proposals, a seeded ``random.Random``) always give the same outputs.
That is what lets the tests drive thousands of random schedules through it in-process. The driver
(``pygmy.replication.node.ReplicaNode`` or the test simulator) loops::

    core.tick() / core.step(msg) / core.propose(cmd)
    rd = core.ready()
    for step in rd.steps():   # persist BEFORE send, except on a leader (rd.send_first)
        PERSIST: write rd.snapshot, rd.truncate_from, rd.entries, rd.hard_state durably
        SEND:    send rd.messages
        APPLY:   apply rd.committed_entries
    core.advance(rd)

Features: PreVote, CheckQuorum (with a leader lease for local reads), a no-op entry on election,
commit of current-term entries only (Raft paper section 5.4.2), fast log backtracking with conflict
hints, pipelined and batched appends, snapshots for followers needing compacted entries, and
membership changes one server at a time (Raft dissertation, chapter 4): learners, promotion, removal
and leadership transfer (``Membership``, ``RaftCore.add_learner`` and the methods after it).
"""

from __future__ import annotations

import base64
import random
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

FOLLOWER = "follower"
PRE_CANDIDATE = "precandidate"
CANDIDATE = "candidate"
LEADER = "leader"

VOTE = "vote"
VOTE_RESP = "vote_resp"
PRE_VOTE = "pre_vote"
PRE_VOTE_RESP = "pre_vote_resp"
APPEND = "append"
APPEND_RESP = "append_resp"
HEARTBEAT = "heartbeat"
HEARTBEAT_RESP = "heartbeat_resp"
SNAPSHOT = "snapshot"
#: A leader handing over: the (caught-up) voter it names starts an election at once.
TIMEOUT_NOW = "timeout_now"
MESSAGE_TYPES = frozenset(
    {VOTE, VOTE_RESP, PRE_VOTE, PRE_VOTE_RESP, APPEND, APPEND_RESP, HEARTBEAT, HEARTBEAT_RESP, SNAPSHOT,
     TIMEOUT_NOW}
)
_FROM_LEADER = frozenset({APPEND, HEARTBEAT, SNAPSHOT})
#: Requests taken from any sender, member of our configuration or not (Raft dissertation, 4.1): a
#: leader added after our latest configuration must reach us to give us the entry that adds it, and
#: a candidate we do not know of may need our vote. Answers count only from members.
_FROM_ANYONE = frozenset({APPEND, HEARTBEAT, SNAPSHOT, VOTE, PRE_VOTE, TIMEOUT_NOW})
#: Answers a leader takes, at its term, from a server it replicates to that its configuration no
#: longer names (one being removed, until its removal commits): they move only that server's
#: progress, which counts toward nothing (commit, lease and quorum checks count voters), so that
#: an append lost on its way there is sent again and the server learns of its removal.
_TO_LEADER = frozenset({APPEND_RESP, HEARTBEAT_RESP})

# The driver's steps for one Ready, in the order ``Ready.steps`` gives.
PERSIST = "persist"
SEND = "send"
APPLY = "apply"

# Progress states of a follower as seen by the leader (etcd's names).
PROBE = "probe"  # one append in flight until we learn where the follower's log matches ours
REPLICATE = "replicate"  # matching point known: stream appends, up to max_inflight at once
SNAPSHOTTING = "snapshot"  # follower needs compacted entries; a snapshot is on its way


@dataclass(frozen=True, slots=True)
class Entry:
    """One log entry; ``command is None`` is the no-op a new leader appends."""

    index: int
    term: int
    command: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"i": self.index, "t": self.term, "c": self.command}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Entry:
        return cls(int(d["i"]), int(d["t"]), d.get("c"))


@dataclass(frozen=True, slots=True)
class HardState:
    """What must be durable before any message that depends on it is sent."""

    term: int = 0
    vote: str | None = None
    commit: int = 0
    #: The election window (ticks) the last leader heard announced: a restarted follower still keeps
    #: out of elections that long, as the leases counted on its acknowledgements assumed.
    floor: int = 0
    #: The term and ``ctx`` of the leader message that announced ``floor``: after a restart, a
    #: message sent before it (queued for us while we were down) does not undo it.
    floor_term: int = 0
    floor_ctx: int = 0


#: ``op`` of the log entry that holds a configuration (``Membership.command``); the driver hands
#: the state machine a no-op in its place.
MEMBERSHIP_OP = "_raft_membership"


class MembershipRefused(Exception):
    """A membership change or a leadership transfer that is not made; nothing changed.

    ``kind`` says why, for the caller's answer: ``not_leader``, ``pending`` (a change not yet
    committed, or a leader that has not committed an entry of its term), ``transferring``,
    ``invalid``, ``unknown``, ``duplicate``, ``not_learner``, ``lagging``, ``last_voter``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Membership:
    """A configuration: ``voters`` elect leaders and make every majority (commit, lease,
    CheckQuorum); ``learners`` get entries and snapshots and never count nor campaign. ``urls``
    (name -> HTTP URL) is for the driver, which dials its members; the core only carries it.

    A configuration is a log entry (``command``), in force from the moment it is in a server's log,
    committed or not; one that is truncated away takes the previous one back into force."""

    voters: frozenset[str]
    learners: frozenset[str] = frozenset()
    urls: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def members(self) -> frozenset[str]:
        return self.voters | self.learners

    @property
    def quorum(self) -> int:
        return len(self.voters) // 2 + 1

    def to_dict(self) -> dict[str, Any]:
        members = self.members
        return {"voters": sorted(self.voters), "learners": sorted(self.learners),
                "urls": {n: u for n, u in sorted(self.urls.items()) if n in members}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Membership:
        urls = d.get("urls") or {}
        return cls(frozenset(str(v) for v in d["voters"]), frozenset(str(v) for v in d.get("learners", ())),
                   {str(k): str(v) for k, v in urls.items()})

    def command(self) -> dict[str, Any]:
        """The log entry's command that puts this configuration in force."""
        return {"op": MEMBERSHIP_OP, **self.to_dict()}

    @classmethod
    def of(cls, command: Any) -> Membership | None:
        """The configuration a log entry's command holds, or None for any other command."""
        if isinstance(command, dict) and command.get("op") == MEMBERSHIP_OP:
            return cls.from_dict(command)
        return None

    # -- one change at a time ------------------------------------------------------------------
    def with_learner(self, name: str, url: str | None) -> Membership:
        if not name or name in self.members:
            raise MembershipRefused("duplicate", f"{name!r} is already a member")
        urls = {**self.urls, name: url} if url else dict(self.urls)
        return Membership(self.voters, self.learners | {name}, urls)

    def promoted(self, name: str) -> Membership:
        if name not in self.members:
            raise MembershipRefused("unknown", f"{name!r} is not a member")
        if name not in self.learners:
            raise MembershipRefused("not_learner", f"{name!r} is a voter already, not a learner")
        return Membership(self.voters | {name}, self.learners - {name}, dict(self.urls))

    def without(self, name: str) -> Membership:
        if name not in self.members:
            raise MembershipRefused("unknown", f"{name!r} is not a member")
        if self.voters == {name}:
            raise MembershipRefused("last_voter", f"{name!r} is the last voter")
        return Membership(self.voters - {name}, self.learners - {name},
                          {n: u for n, u in self.urls.items() if n != name})


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A snapshot received from the leader, to install before applying later entries; with the
    configuration in force at its index (None from a leader that sent none)."""

    index: int
    term: int
    data: Any
    membership: Membership | None = None


@dataclass(slots=True)
class Message:
    """A Raft message. Field meaning depends on ``type``:

    - vote / pre_vote: ``index``/``log_term`` = candidate's last log index/term.
    - *_resp of votes: ``success`` = vote granted.
    - append: ``index``/``log_term`` = the entry preceding ``entries``; ``commit`` = leader commit.
    - append_resp: ``index`` = last matching index on success, else the rejected ``index``, with
      ``conflict_index``/``conflict_term`` hints for fast backtracking.
    - heartbeat: ``commit`` = min(follower match, leader commit) (safe to commit without a log check).
    - heartbeat_resp: ``index`` = the follower's commit index (committed, hence matching the leader);
      ``conflict_index`` = its last index + 1, so a leader notices a follower that lost its log.
    - snapshot: ``snapshot_index``/``snapshot_term``; ``payload`` = the state, as the driver has it
      (the node: the file it streamed the state into; the simulator: bytes). The core only passes it on.
    ``leader_commit`` is the leader's real commit (for the follower's "recovering" status) and ``ctx``
    the leader's tick when it sent the request, echoed back so the leader lease counts from send time.
    ``quiet`` (a granted vote) = ticks since the voter last heard from a leader or was one.
    ``floor`` (from a leader) = the election window it announces: its followers keep out of
    elections that long after hearing from it, and its lease counts on that; (a granted vote) the
    window the voter last heard announced, so a new leader knows how long the old lease lasted.
    ``transfer`` (a vote) = 1 when the candidate campaigns on its leader's ``timeout_now``: voters
    that still hear that leader vote anyway. ``conf`` (a snapshot) = the configuration at its index.
    """

    type: str
    src: str
    dst: str
    term: int
    index: int = 0
    log_term: int = 0
    entries: list[Entry] = field(default_factory=list)
    commit: int = 0
    leader_commit: int = 0
    success: bool = False
    conflict_index: int = 0
    conflict_term: int = 0
    snapshot_index: int = 0
    snapshot_term: int = 0
    ctx: int = 0
    quiet: int = 0
    floor: int = 0
    payload: Any = None
    transfer: int = 0
    conf: dict[str, Any] | None = None

    _INT_FIELDS = (
        "index",
        "log_term",
        "commit",
        "leader_commit",
        "conflict_index",
        "conflict_term",
        "snapshot_index",
        "snapshot_term",
        "ctx",
        "quiet",
        "floor",
        "transfer",
    )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form; zero/empty fields are left out to keep heartbeats small."""
        d: dict[str, Any] = {"type": self.type, "src": self.src, "dst": self.dst, "term": self.term}
        for name in self._INT_FIELDS:
            value = getattr(self, name)
            if value:
                d[name] = value
        if self.success:
            d["success"] = True
        if self.entries:
            d["entries"] = [e.to_dict() for e in self.entries]
        if isinstance(self.payload, bytes):
            d["payload"] = base64.b64encode(self.payload).decode("ascii")
        if self.conf is not None:
            d["conf"] = self.conf
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Message:
        """Inverse of ``to_dict``; raises ``ValueError``/``KeyError``/``TypeError`` on malformed input."""
        mtype = d["type"]
        if mtype not in MESSAGE_TYPES:
            raise ValueError(f"unknown message type {mtype!r}")
        msg = cls(type=mtype, src=str(d["src"]), dst=str(d["dst"]), term=int(d["term"]))
        for name in cls._INT_FIELDS:
            if name in d:
                setattr(msg, name, int(d[name]))
        msg.success = bool(d.get("success", False))
        msg.entries = [Entry.from_dict(e) for e in d.get("entries", ())]
        if d.get("payload") is not None:
            msg.payload = base64.b64decode(d["payload"])
        if isinstance(d.get("conf"), dict):
            msg.conf = Membership.from_dict(d["conf"]).to_dict()  # checked here, not in a turn
        return msg


@dataclass(frozen=True, slots=True)
class CoreConfig:
    """Timing (in ticks) and flow-control knobs of the core."""

    heartbeat_ticks: int = 5
    #: While every follower has every entry (an idle cluster), each follower hears from the leader
    #: this often, still inside every election timeout (None: two thirds of the shortest, at least
    #: ``heartbeat_ticks``). The leader sends those heartbeats one follower at a time, evenly
    #: spread, so the answers of a majority (its lease) are never more than about half this old
    #: (docs/replication.md): an idle cluster sends, and wakes for, a quarter as many as when busy.
    #: A follower that has not answered what it was last sent is heartbeated every round instead,
    #: so that with followers down the rest still answer as often for the lease.
    idle_heartbeat_ticks: int | None = None
    election_ticks_min: int = 30
    election_ticks_max: int = 60
    #: A leader serves local reads while a majority acknowledged a message it sent within this
    #: many ticks; kept below ``election_ticks_min`` so a follower's lease outlives the leader's.
    lease_ticks: int | None = None
    max_entries_per_msg: int = 2048
    max_inflight: int = 32
    #: A follower that holds every entry learns a new commit index from the next append or
    #: heartbeat it is sent, or, if none goes to it within this many ticks, from an append that
    #: carries only the commit (0: at once, each time the commit advances). Under load the next
    #: entry carries it: no append, answer and turn on each side for the commit alone. A follower
    #: about to serve a read asks for it at once (``hurry_commit``); a configuration change, a
    #: hand-over or a peer being removed gets it at once as well (docs/replication.md).
    commit_delay_ticks: int = 2
    max_apply_batch: int = 4096
    pre_vote: bool = True
    check_quorum: bool = True
    #: A snapshot not acknowledged within this many ticks is sent again.
    snapshot_timeout_ticks: int = 300
    #: The longest election window a leader may announce (``Timing``): the slowest network the
    #: timers follow, and the longest a tier can go without a leader after a crash.
    election_ticks_cap: int = 1000
    #: Worst relative clock-rate difference between two replicas, in percent: a lease longer than
    #: the configured one gives up this share of the extra ticks (a follower's clock may run fast).
    drift_percent: int = 1

    def effective_idle_heartbeat_ticks(self, election_ticks: int | None = None) -> int:
        if self.idle_heartbeat_ticks is not None:
            return self.idle_heartbeat_ticks
        return max(self.heartbeat_ticks, 2 * (election_ticks or self.election_ticks_min) // 3)

    def effective_lease_ticks(self, floor: int | None = None) -> int:
        """The lease of a leader whose followers keep out of elections ``floor`` ticks (the
        configured minimum if None) after hearing from it: the configured margin below the
        window, and ``drift_percent`` of whatever the window has beyond the configured one."""
        if self.lease_ticks is not None:
            base = self.lease_ticks
        else:
            base = max(1, self.election_ticks_min - 2 * self.heartbeat_ticks)
        extra = max(0, (floor or self.election_ticks_min) - self.election_ticks_min)
        drift = -(-extra * self.drift_percent // 100)  # rounded up
        return base + extra - drift

    def problems(self) -> list[str]:
        """What makes these settings unsafe or unable to elect (empty: none): checked at start."""
        out = []
        if not 0 < self.election_ticks_min <= self.election_ticks_max:
            out.append("need 0 < election_ticks_min <= election_ticks_max")
        if self.heartbeat_ticks < 1 or self.heartbeat_ticks >= self.election_ticks_min:
            out.append("need 1 <= heartbeat_ticks < election_ticks_min: followers would time out between heartbeats")
        if self.effective_lease_ticks() >= self.election_ticks_min:
            out.append("need lease_ticks < election_ticks_min: a follower could elect another leader "
                       "while this one still serves reads from its lease")
        if self.effective_idle_heartbeat_ticks() >= self.election_ticks_min:
            out.append("need idle_heartbeat_ticks < election_ticks_min: an idle leader would lose its followers")
        if self.election_ticks_cap < self.election_ticks_min:
            out.append("need election_ticks_cap >= election_ticks_min")
        if not 0 <= self.drift_percent < 50:
            out.append("need 0 <= drift_percent < 50")
        if self.commit_delay_ticks < 0:
            out.append("need commit_delay_ticks >= 0 (0: every commit told at once)")
        return out


@dataclass(frozen=True, slots=True)
class Timing:
    """What the driver measured the network to need (``pygmy.replication.timers``), in ticks: each
    is raised to the configured value, never below it. A leader announces ``election_ticks`` as its
    followers' election window (``Message.floor``) and heartbeats every ``heartbeat_ticks``; an
    append unanswered after ``probe_ticks`` counts as lost."""

    heartbeat_ticks: int = 0
    election_ticks: int = 0
    probe_ticks: int = 0


@dataclass
class Ready:
    """Everything the driver must do after a batch of inputs, in the order ``steps()`` gives:
    persist (install ``snapshot``, then ``truncate_from``, ``entries``, ``hard_state``) durably,
    send ``messages``, apply ``committed_entries``; then call ``advance``.

    ``send_first``: the driver may send before persisting. True only on a leader whose Ready changes
    no term or vote: its messages are appends and heartbeats, and a leader may replicate entries it
    has not yet written itself, since it counts its own copy toward no commit before they are (its
    acknowledgements are stepped only after this Ready is done). Raft thesis 10.2.1; it overlaps the
    leader's disk write with the followers'."""

    hard_state: HardState | None = None
    snapshot: Snapshot | None = None
    truncate_from: int | None = None
    entries: list[Entry] = field(default_factory=list)
    committed_entries: list[Entry] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    send_first: bool = False

    def is_empty(self) -> bool:
        return not (
            self.hard_state
            or self.snapshot
            or self.entries
            or self.committed_entries
            or self.messages
            or self.truncate_from is not None
        )

    def steps(self) -> tuple[str, str, str]:
        """The order of ``PERSIST``, ``SEND`` and ``APPLY`` for this Ready: the one decision both
        drivers (``ReplicaNode`` and the test simulator) take from here.

        - persist, send, apply, unless ``send_first``: a vote, or a follower's acknowledgement of
          appended entries, promises only what is already on its disk;
        - send, persist, apply: a leader's appends (``send_first`` with entries): its disk write
          overlaps the followers';
        - persist, apply, send: a leader's Ready without entries (``send_first``): what goes out
          (if anything: a new commit index may wait for the next entry, ``commit_delay_ticks``)
          tells the followers the new commit index; their applying can wait for ours, and the
          proposers waiting for ours should not wait for those sends."""
        if not self.send_first:
            return (PERSIST, SEND, APPLY)
        if self.entries:
            return (SEND, PERSIST, APPLY)
        return (PERSIST, APPLY, SEND)


@dataclass(slots=True)
class Progress:
    """The leader's view of one follower."""

    match: int = 0
    next: int = 1
    state: str = PROBE
    paused: bool = False
    inflight: deque[int] = field(default_factory=deque)
    pending_snapshot: int = 0
    snapshot_elapsed: int = 0
    sent_commit: int = 0
    recent_active: bool = True
    last_heard: int = -(10**9)
    #: Tick when ``match`` last advanced; a stalled pipeline (lost append) falls back to probing.
    last_progress: int = 0
    #: Tick when the leader last sent this follower anything: an idle leader heartbeats the one
    #: it has been quiet to longest.
    last_sent: int = 0
    #: Tick since which it has been sent every entry but not the commit (``commit_delay_ticks``);
    #: None once it was sent the commit, or while entries are on their way (they carry it).
    #: ``hurry_commit`` dates it back, so that the next ``ready`` sends the commit.
    commit_owed_since: int | None = None
    #: Answers to messages sent before this tick (their ``ctx``) are not this follower's: a member
    #: added under the name of one removed is another replica (an empty disk), and what its
    #: predecessor answered late must not count as its progress.
    since: int = -(10**9)


class RaftCore:
    """One Raft participant as a pure state machine (see the module docstring for the driver loop)."""

    def __init__(
        self,
        node_id: str,
        peers: list[str],
        *,
        hard_state: HardState | None = None,
        entries: list[Entry] | tuple[Entry, ...] = (),
        snapshot: tuple[int, int] = (0, 0),
        applied: int = 0,
        config: CoreConfig | None = None,
        rng: random.Random | int | None = None,
        learners: Iterable[str] = (),
        urls: Mapping[str, str] | None = None,
        snapshot_membership: Membership | None = None,
    ) -> None:
        """``peers`` (this node among them) and ``learners`` (some of them) are the configuration the
        group starts from, in force until a configuration in the snapshot or the log replaces it:
        ``snapshot_membership`` is the one in force at the snapshot's index."""
        if node_id not in peers:
            raise ValueError(f"{node_id} is not among the peers {peers}")
        self.id = node_id
        self.peers = sorted(set(peers))
        self.others = [p for p in self.peers if p != node_id]
        self.cfg = config or CoreConfig()
        if self.cfg.problems():
            raise ValueError("; ".join(self.cfg.problems()))
        self._rng = rng if isinstance(rng, random.Random) else random.Random(rng)
        self._quorum = len(self.peers) // 2 + 1
        hs = hard_state or HardState()
        self.term = hs.term
        self.vote = hs.vote
        #: The election window (ticks) the leader we last heard announced, or we announce as leader;
        #: 0: the configured ``election_ticks_min``. Durable (``HardState.floor``).
        self.floor = hs.floor
        #: As follower: (term, ``ctx``) of the newest leader message whose window we took. One sent
        #: earlier (a snapshot sent after its stream, a frame overtaken on another connection or by
        #: the loop's direct send) may carry a lower window, announced before a higher one whose
        #: acknowledgement the leader already counts a lease on: its window is not taken.
        self._leader_sent: tuple[int, int] = (hs.floor_term, hs.floor_ctx)
        #: (term, ctx) of the message whose window ``floor`` is: durable with it (``HardState``).
        self._floor_at: tuple[int, int] = (hs.floor_term, hs.floor_ctx)
        #: What the driver measured the network to need (``set_timing``).
        self._timing = Timing()
        #: As leader: a raised window is to be told to every follower at the next tick, not at the
        #: next heartbeat of the raised window's (longer) idle pace: a follower still holding the
        #: lower one would time out first and campaign.
        self._raised = False
        #: As leader: the driver has told us its timing since we took office. Until then a window
        #: is not lowered at heartbeats (``_tick_leader``): the one we took over stands.
        self._timing_told = False
        #: As leader: (tick, window announced from then on), oldest first; the lease counted on an
        #: acknowledgement uses the least window announced since the message acknowledged was sent.
        self._floors: list[tuple[int, int]] = []
        #: As leader: the furthest tick any lease we reported reached (a lower window waits for it).
        self._lease_reach = 0
        #: Campaigns since we last heard from a leader or led (``_reset_timeout`` backs off on them),
        #: and the tick the last one began.
        self._campaigns = 0
        self._campaign_started = 0
        self.snap_index, self.snap_term = snapshot
        self._log: list[Entry] = list(entries)
        for offset, e in enumerate(self._log):
            if e.index != self.snap_index + 1 + offset:
                raise ValueError("log entries must be contiguous after the snapshot")
        self.commit = min(max(hs.commit, self.snap_index), self.last_index)
        #: Highest index handed to the driver for applying and confirmed by ``advance``.
        self.applied = max(self.snap_index, min(applied, self.commit))
        self._handed = self.applied
        self.role = FOLLOWER
        self.leader: str | None = None
        self.now = 0
        self._election_elapsed = 0
        #: Ticks since this node last heard from a leader (a message it acknowledged) or was one;
        #: from its start if it has not since. Unlike the election timer, votes do not reset it.
        self._quiet = 0
        self._heartbeat_elapsed = 0
        self._timeout = 0
        self._votes: dict[str, bool] = {}
        #: Of the votes granted to this candidate, each voter's ``quiet`` and ``floor`` when it voted.
        self._vote_quiet: dict[str, tuple[int, int]] = {}
        #: As leader: every earlier leader's lease ended this many ticks or more before we won, less
        #: one (docs/replication.md). Each of our voters heard its leader last ``quiet`` ticks ago,
        #: and that leader's lease lasted at most the lease of the window it announced.
        self.election_gap = 0
        self._prs: dict[str, Progress] = {}
        self._msgs: list[Message] = []
        self._persist_from = self.last_index + 1
        self._truncated = False
        self._snapshot_in: Snapshot | None = None
        self._prev_hs = HardState(self.term, self.vote, self.commit, self.floor, *self._floor_at)
        #: The first leader commit index this node heard of since it started (None: none yet).
        self.first_leader_commit: int | None = None
        #: Index of this leader's no-op; reads are only safe once it is applied.
        self.term_start_index = 0
        #: A leadership transfer under way: its target, the tick it began, whether ``timeout_now``
        #: went out (from then on this leader holds no lease: the target's voters vote at once).
        self.lead_transferee: str | None = None
        self._transfer_started = 0
        self._timeout_now_sent = False
        boot = Membership(frozenset(self.peers) - frozenset(learners), frozenset(learners) & frozenset(self.peers),
                          dict(urls or {}))
        #: The configuration in force at ``snap_index`` (what a compaction or a snapshot left).
        self.snap_membership = snapshot_membership or boot
        self.membership = self.snap_membership
        self._membership_index = self.snap_index
        self._set_membership(*self._latest_membership())
        self._reset_timeout()

    # -- log -------------------------------------------------------------------------------------
    @property
    def last_index(self) -> int:
        return self.snap_index + len(self._log)

    @property
    def last_term(self) -> int:
        return self._log[-1].term if self._log else self.snap_term

    def term_at(self, index: int) -> int | None:
        """Term of the entry at ``index``; None if compacted away or beyond the log."""
        if index == self.snap_index:
            return self.snap_term
        if self.snap_index < index <= self.last_index:
            return self._log[index - self.snap_index - 1].term
        return None

    def entries(self, lo: int, hi: int) -> list[Entry]:
        """Entries with ``lo <= index <= hi`` still in the log (compacted ones are skipped)."""
        lo = max(lo, self.snap_index + 1)
        hi = min(hi, self.last_index)
        if lo > hi:
            return []
        base = self.snap_index + 1
        return self._log[lo - base : hi - base + 1]

    def _append_local(self, new: list[Entry]) -> None:
        if new:
            self._persist_from = min(self._persist_from, new[0].index)
            self._log.extend(new)
            for e in reversed(new):  # the latest configuration in the log is in force at once
                if (m := Membership.of(e.command)) is not None:
                    self._set_membership(m, e.index)
                    break

    def _truncate_after(self, index: int) -> None:
        if index < self.commit:
            raise AssertionError(f"{self.id}: truncating committed entries ({index} < {self.commit})")
        del self._log[index - self.snap_index :]
        self._persist_from = min(self._persist_from, index + 1)
        self._truncated = True
        if self._membership_index > index:  # an uncommitted configuration went: the one before is back
            self._set_membership(*self._latest_membership())

    # -- membership ------------------------------------------------------------------------------
    def membership_at(self, index: int) -> Membership:
        """The configuration in force once the entry at ``index`` (``snap_index <= index``) is in a log."""
        for e in reversed(self.entries(self.snap_index + 1, index)):
            if (m := Membership.of(e.command)) is not None:
                return m
        return self.snap_membership

    def _latest_membership(self) -> tuple[Membership, int]:
        for e in reversed(self._log):
            if (m := Membership.of(e.command)) is not None:
                return m, e.index
        return self.snap_membership, self.snap_index

    def _set_membership(self, m: Membership, index: int) -> None:
        """Put ``m`` (at log ``index``) in force: who votes, who counts, whom a leader replicates to."""
        old = self.membership
        self.membership, self._membership_index = m, index
        self.peers = sorted(m.members)
        self.others = sorted(m.voters - {self.id})  # whom a candidate asks for votes
        self._quorum = m.quorum
        if self.role == LEADER:
            # Every member new to the configuration starts afresh, even under a name whose removal
            # has just committed (its progress kept until ``ready`` prunes it): a new replica there
            # has none of that one's entries, and must not look caught up on what it never answered.
            for p in sorted(m.members - {self.id} - (self._prs.keys() & old.members)):
                # After this tick: messages of this very tick may have gone to the old one.
                self._prs[p] = Progress(next=self.last_index + 1, last_progress=self.now, since=self.now + 1)
            # A server being removed still gets entries (counting for nothing) until its removal
            # commits (``ready``): it then holds it, and knows not to campaign.
            if self.lead_transferee is not None and self.lead_transferee not in m.voters:
                self._end_transfer()

    def is_voter(self) -> bool:
        return self.id in self.membership.voters

    def replicating_to(self) -> list[str]:
        """Whom this leader sends entries to: its configuration's members, and a server being
        removed until its removal commits."""
        return list(self._prs)

    def membership_pending(self) -> bool:
        """A configuration in the log is not yet committed: no other change may start."""
        return self._membership_index > self.commit

    # -- public queries --------------------------------------------------------------------------
    @property
    def public_role(self) -> str:
        """leader / follower / candidate (a pre-candidate shows as candidate)."""
        return CANDIDATE if self.role == PRE_CANDIDATE else self.role

    def is_leader(self) -> bool:
        return self.role == LEADER

    def lease_remaining(self) -> int:
        """Ticks for which a majority is known to have heard from this leader (0: no lease)."""
        if self.role != LEADER or self._timeout_now_sent:
            return 0
        voters = self.membership.voters
        ends = sorted((pr.last_heard + self._lease_after(pr.last_heard) for p, pr in self._prs.items()
                       if p in voters), reverse=True)
        if self.id in voters:  # a leader removing itself counts only the others
            ends.insert(0, self.now + self.cfg.effective_lease_ticks(self.floor))  # self
        end = ends[self._quorum - 1]
        self._lease_reach = max(self._lease_reach, end)
        return max(0, end - self.now)

    def _lease_after(self, sent: int) -> int:
        """The lease an acknowledgement of a message sent at tick ``sent`` gives: that of the least
        window announced since (a follower keeps out of elections for the window of the last
        message it heard, and a window may have been lowered after this one went out)."""
        if sent < self.now - 2 * self.cfg.election_ticks_cap:
            return 0  # any lease it gave is long over (and the windows of then may be forgotten)
        least = self._window()
        for since, window in reversed(self._floors):
            least = min(least, window)
            if since < sent:  # in force when it went (one announced in the same tick may have come after)
                break
        return self.cfg.effective_lease_ticks(least)

    def _window(self) -> int:
        """Ticks a follower keeps out of elections after hearing from its leader (and a leader
        waits for a majority to answer): the configured minimum or the window the leader announced."""
        return max(self.cfg.election_ticks_min, self.floor)

    def _heartbeat(self) -> int:
        return max(self.cfg.heartbeat_ticks, self._timing.heartbeat_ticks)

    def _probe(self) -> int:
        """Ticks without progress after which a leader takes appends in flight for lost."""
        return max(2 * self._heartbeat(), self._timing.probe_ticks)

    def timers(self) -> dict[str, int]:
        """The timers in force here, in ticks: heartbeat interval (as leader), election window, the
        lease that window gives, and the lost-append timeout."""
        return {"heartbeat": self._heartbeat(), "election": self._window(),
                "lease": self.cfg.effective_lease_ticks(self.floor), "probe": self._probe()}

    def set_timing(self, timing: Timing) -> None:
        """Follow what the driver measured the network to need. As leader, announce the new window
        at once (the next heartbeat or append carries it); as follower, it counts if we lead."""
        self._timing = timing
        self._timing_told = True
        if self.role == LEADER:
            self._announce(self._wanted_window())

    def _as_floor(self, window: int) -> int:
        """0 for the configured window: heartbeats on a LAN carry no floor, as before there was one."""
        return 0 if window <= self.cfg.election_ticks_min else window

    def _wanted_window(self) -> int:
        return min(max(self.cfg.election_ticks_min, self._timing.election_ticks), self.cfg.election_ticks_cap)

    def _announce(self, window: int) -> None:
        """Announce ``window`` from now on. A lower one only as far as every lease end already
        given stays safe: a follower that hears it keeps out of elections that much less, from
        then, so the leases counted so far must end by the lease it gives from now."""
        if window < self._window():
            while window < self._window() and self.now + self.cfg.effective_lease_ticks(window) < self._lease_reach:
                window += 1
        if window == self._window():
            return
        if window > self._window():  # (a lowering in the same tick leaves the round owed)
            self._raised = True
        self.floor = self._as_floor(window)
        self._floors.append((self.now, window))
        # Windows older than every acknowledgement we count no longer matter, nor do any older than
        # the longest lease (an answer to a message sent before then gives a lease already over).
        oldest = min((pr.last_heard for pr in self._prs.values()), default=self.now)
        oldest = max(oldest, self.now - 2 * self.cfg.election_ticks_cap)
        while len(self._floors) > 1 and self._floors[1][0] < oldest:
            self._floors.pop(0)

    def has_quorum_contact(self) -> bool:
        """True on a leader that a majority has acknowledged recently enough for local reads."""
        return self.lease_remaining() > 0

    def progress(self, peer: str) -> Progress | None:
        return self._prs.get(peer)

    # -- role changes ----------------------------------------------------------------------------
    def _reset_timeout(self) -> None:
        """A random timeout in the configured range, stretched as the window is, and doubled for
        each campaign after the fourth that brought no leader: an election can only succeed within
        one timeout, so on a link slower than the configured ones the timeouts grow until it fits
        (then the leader measures the link and announces a window for it). Not sooner: a LAN's
        failed campaigns (a split vote, a partition) retry at the configured pace."""
        self._election_elapsed = 0
        window = self._window()
        spread = (self.cfg.election_ticks_max - self.cfg.election_ticks_min) * window // self.cfg.election_ticks_min
        timeout = self._rng.randint(window, window + spread) << min(max(0, self._campaigns - 4), 10)
        self._timeout = min(timeout, max(window + spread, self.cfg.election_ticks_cap))

    def _become_follower(self, term: int, leader: str | None) -> None:
        if self.role == LEADER:
            self._quiet = 0  # it led until now: its lease may have counted on messages it just sent
        if term != self.term:
            self.term = term
            self.vote = None
        self.role = FOLLOWER
        self.leader = leader
        self._votes = {}
        self._prs = {}
        self._end_transfer()
        self._reset_timeout()

    def _become_pre_candidate(self) -> None:
        self.role = PRE_CANDIDATE
        self.leader = None
        self._votes = {self.id: True}
        self._reset_timeout()
        for p in self.others:
            self._send(
                Message(PRE_VOTE, self.id, p, self.term + 1, index=self.last_index, log_term=self.last_term)
            )
        self._poll()

    def _become_candidate(self, transfer: bool = False) -> None:
        self.term += 1
        self.vote = self.id
        self.role = CANDIDATE
        self.leader = None
        self._votes = {self.id: True}
        self._vote_quiet = {}
        self._reset_timeout()
        for p in self.others:
            self._send(Message(VOTE, self.id, p, self.term, index=self.last_index, log_term=self.last_term,
                               transfer=int(transfer)))
        self._poll()

    def _become_leader(self) -> None:
        # The campaign that won took two round trips (pre-vote and vote): a window shorter than a
        # few would lose the followers before their first answers, and the leadership with them.
        # On a LAN it took a tick or two, far below the configured window.
        # Only once campaigns backed off (a slow link): a busy LAN's slow campaign is no reason.
        won_with = min(2 * (self.now - self._campaign_started), self.cfg.election_ticks_cap) if self._campaigns > 4 else 0
        self.role = LEADER
        self.leader = self.id
        self._campaigns = 0
        # Those who voted for us form a majority, and every leader's lease counted on a majority:
        # one of us heard from it last, ``quiet`` ticks ago, and its lease lasted at most the lease
        # of the window that message announced.
        voters = [qf for p, qf in self._vote_quiet.items() if self._votes.get(p)]
        self.election_gap = min(q - self.cfg.effective_lease_ticks(f) for q, f in [(self._quiet, self.floor), *voters])
        # No shorter a window than the longest one we or our voters last heard announced: we have
        # measured nothing yet, and a voter may have heard a raise that never reached us. Announcing
        # less would undo a slow link's window on every follower at once, and the next election with it.
        heard = min(max((f for _, f in voters), default=0), self.cfg.election_ticks_cap)
        window = max(self._window(), self._wanted_window(), won_with, heard)
        self.floor = self._as_floor(window)
        self._floors = [(self.now, window)]
        self._lease_reach = 0
        self._timing_told = self._raised = False
        self._votes = {}
        self._vote_quiet = {}
        self._election_elapsed = 0
        self._heartbeat_elapsed = 0
        nxt = self.last_index + 1
        self._prs = {p: Progress(next=nxt, last_progress=self.now) for p in self.peers if p != self.id}
        self._append_local([Entry(nxt, self.term, None)])
        self.term_start_index = nxt
        self._maybe_commit()

    def _campaign(self) -> None:
        if not self.is_voter():
            # A learner, or a server removed from the group, never campaigns; after an election
            # timeout without a word from a leader it no longer names one.
            self.leader = None
            self._reset_timeout()
            return
        self._campaigns += 1
        self._campaign_started = self.now
        if self.cfg.pre_vote:
            self._become_pre_candidate()
        else:
            self._become_candidate()

    def _poll(self) -> None:
        voters = self.membership.voters  # answers of others do not count
        granted = sum(1 for p, v in self._votes.items() if v and p in voters)
        rejected = sum(1 for p, v in self._votes.items() if not v and p in voters)
        if granted >= self._quorum:
            if self.role == PRE_CANDIDATE:
                self._become_candidate()
            else:
                self._become_leader()
        elif rejected > len(voters) - self._quorum:
            self._become_follower(self.term, None)

    def _in_lease(self) -> bool:
        """A node that heard from a live leader (or just started) ignores vote requests, so a
        rejoining node cannot disrupt a healthy leader and the leader's read lease holds."""
        if not self.cfg.check_quorum:
            return False
        if self.now < self._window():
            return True
        return self.leader is not None and self._election_elapsed < self._window()

    # -- inputs ----------------------------------------------------------------------------------
    def tick(self, n: int = 1, lost: int = 0) -> None:
        """Advance logical time by ``n`` ticks, exactly as ``n`` single ticks would. The ticks before
        the next timer falls due (``ticks_until_timer``) only count, so they are counted at once: a
        driver that slept through many ticks pays for the timers that fell due, not for each tick.

        ``lost``: ticks that passed before these and that no timer is to count (a driver back from a
        stall counts only some, ``timers.ticks_due``). The clock moves past them all the same, so a
        lease, measured on it from a message a majority heard, runs out as it did in real time: a
        leader paused past its lease must not come back with the part it did not count."""
        self.now += lost
        while n > 0:
            counted = min(n, self.ticks_until_timer()) - 1 if n > 1 else 0
            if counted > 0:
                self.now += counted
                self._election_elapsed += counted
                if self.role == LEADER:
                    self._quiet = 0
                    self._heartbeat_elapsed += counted
                else:
                    self._quiet += counted
                n -= counted
            self._tick()
            n -= 1

    def _tick(self) -> None:
        self.now += 1
        if self.role == LEADER:
            self._quiet = 0
            self._tick_leader()
            return
        self._quiet += 1
        self._election_elapsed += 1
        if self._election_elapsed >= self._timeout:
            self._campaign()

    def ticks_until_timer(self) -> int:
        """How many ticks can pass, with no input, before a ``tick`` does more than count (a
        heartbeat, a quorum check, an election): a driver may sleep that long and then tick that
        many times at once, so an idle replica wakes at its heartbeats, not at every tick."""
        if self.role == LEADER:
            if self._raised or any(pr.state == SNAPSHOTTING for pr in self._prs.values()):
                return 1  # a raised window's round, a snapshot's resend timer: the next tick
            n = min(self._heartbeat_interval(self._idle()) - self._heartbeat_elapsed,
                    self._window() - self._election_elapsed)
            for pr in self._prs.values():
                if pr.commit_owed_since is not None:  # the append of the commit alone (``_flush``)
                    n = min(n, pr.commit_owed_since + self.cfg.commit_delay_ticks - self.now)
        else:
            n = self._timeout - self._election_elapsed
        return max(1, n)

    def _idle(self) -> bool:
        """Every follower has every entry and all of them are committed: nothing is on its way."""
        last = self.last_index
        return self.commit == last and all(pr.match == last for pr in self._prs.values())

    def _heartbeat_interval(self, idle: bool) -> int:
        """Ticks between heartbeat rounds: every ``heartbeat_ticks`` to every follower while entries
        are on their way; once none are (``idle``), a round is one follower (``_tick_leader``) and
        they come ``idle_heartbeat_ticks / followers`` apart. Followers' election timers and the
        leader lease are reset by any message, so either rate keeps them."""
        if idle and self._prs:
            return max(1, self.cfg.effective_idle_heartbeat_ticks(self._window()) // len(self._prs))
        return self._heartbeat()

    def _tick_leader(self) -> None:
        self._heartbeat_elapsed += 1
        self._election_elapsed += 1
        if self._election_elapsed >= self._window():
            self._election_elapsed = 0
            if self.cfg.check_quorum:
                voters = self.membership.voters
                active = (self.id in voters) + sum(1 for p, pr in self._prs.items() if pr.recent_active and p in voters)
                for pr in self._prs.values():
                    pr.recent_active = False
                if active < self._quorum:
                    self._become_follower(self.term, None)
                    return
        for pr in self._prs.values():
            if pr.state == SNAPSHOTTING:
                pr.snapshot_elapsed += 1
                if pr.snapshot_elapsed >= self.cfg.snapshot_timeout_ticks:
                    self._to_probe(pr, pr.match + 1)
        idle = self._idle()
        if self._raised or self._heartbeat_elapsed >= self._heartbeat_interval(idle):
            if self._raised:
                self._raised, idle = False, False  # a round to every follower
            self._heartbeat_elapsed = 0
            if self._timing_told and self._window() > self._wanted_window():
                # A lower window is announced only as far as the leases given allow (``_announce``):
                # the rest of the way as time passes, one heartbeat at a time, without waiting for
                # the driver to measure anything new (on a steady link it never did, and a window
                # stretched once stayed stretched, durable, across leaders).
                self._announce(self._wanted_window())
            targets = list(self._prs.items())
            if idle and targets:
                # Every follower that has not answered what we last sent it (it may be down: then
                # the others must answer often enough for the lease on their own), and of those
                # that have, the one we have been quiet to longest (the first named, on a tie).
                answered = [t for t in targets if t[1].last_heard >= t[1].last_sent]
                rotation = min(answered, key=lambda t: t[1].last_sent)[0] if answered else None
                targets = [t for t in targets if t[0] == rotation or t[1].last_heard < t[1].last_sent]
            for p, pr in targets:
                commit = min(pr.match, self.commit)
                if commit > pr.sent_commit:
                    pr.sent_commit = commit  # no append owed for it (``_flush``)
                self._send(
                    Message(
                        HEARTBEAT,
                        self.id,
                        p,
                        self.term,
                        commit=commit,
                        leader_commit=self.commit,
                        ctx=self.now,
                        floor=self.floor,
                    )
                )

    def hurry_commit(self, peer: str, known: int | None = None) -> None:
        """``peer`` is about to serve a read at our commit index, and knows the commit ``known`` (if
        it says): if it has been sent every entry but not the commit, the next ``ready`` sends it the
        commit without waiting for ``commit_delay_ticks``; and again if what told it was lost."""
        pr = self._prs.get(peer)
        if self.role == LEADER and pr is not None:
            if known is not None and known < pr.sent_commit:
                pr.sent_commit = known  # the append or heartbeat that carried it never arrived (yet)
            pr.commit_owed_since = self.now - self.cfg.commit_delay_ticks  # due now (``_flush``)

    def propose(self, command: dict[str, Any] | None) -> int | None:
        """Append a command to the leader's log; returns its index, or None when not leader.

        Nothing is sent here: ``ready()`` sends all new entries in one append per follower. None too
        while leadership is being handed over (``transfer_leadership``). A configuration goes in
        only through ``add_learner``, ``promote`` and ``remove``, which check it."""
        if Membership.of(command) is not None:
            raise ValueError("a configuration is proposed with add_learner, promote or remove")
        if self.role != LEADER or self.lead_transferee is not None:
            return None
        index = self.last_index + 1
        self._append_local([Entry(index, self.term, command)])
        self._maybe_commit()
        return index

    # -- membership changes (Raft dissertation, chapter 4: one server at a time) -----------------
    def add_learner(self, name: str, url: str | None = None) -> int:
        """Append the configuration that adds ``name`` (served at ``url``) as a learner; its index.
        Raises ``MembershipRefused`` (nothing appended)."""
        return self._change(self.membership.with_learner(name, url))

    def caught_up(self, name: str, max_lag: int) -> bool:
        """Whether this leader's follower ``name`` holds all but at most ``max_lag`` of our entries
        and answered a message sent within the election window: what ``promote`` asks of a learner."""
        pr = self._prs.get(name)
        return pr is not None and pr.match + max_lag >= self.last_index and self.now - pr.last_heard <= self._window()

    def promote(self, name: str, max_lag: int) -> int:
        """Make learner ``name`` a voter, only if it is caught up: it holds all but at most
        ``max_lag`` of our entries and answered within the election window (``caught_up``). A voter that
        lags would hold the majority back (with one server down, a 3->4 change needs it to commit)."""
        new = self.membership.promoted(name)
        self._check_change()
        pr = self._prs.get(name)
        if not self.caught_up(name, max_lag):
            behind = self.last_index - (pr.match if pr else 0)
            heard = "never answered" if pr is None or pr.last_heard < 0 else \
                f"last answered {self.now - pr.last_heard} ticks ago"
            raise MembershipRefused("lagging", f"{name} is not caught up: {behind} entries behind (at most "
                                               f"{max_lag}), {heard}")
        return self._change(new)

    def remove(self, name: str) -> int:
        """Append the configuration without ``name``. A leader may remove itself: it goes on leading
        a group it is not in (counting no vote of its own) until that configuration commits, then
        hands over and steps down (``ready``); routers can rather ``transfer_leadership`` first."""
        return self._change(self.membership.without(name))

    def _check_change(self) -> None:
        if self.role != LEADER:
            raise MembershipRefused("not_leader", f"{self.id} is not the leader")
        if self.lead_transferee is not None:
            raise MembershipRefused("transferring", f"{self.id} is handing leadership to {self.lead_transferee}")
        if self.commit < self.term_start_index:
            # The single-server bug (raft-dev, 2015): a configuration appended by a leader that has
            # committed nothing of its term can be overwritten by one of an earlier leader that
            # was never committed, after a majority of the new configuration acted on it.
            raise MembershipRefused("pending", f"{self.id} has not yet committed an entry of term {self.term}")
        if self.membership_pending():
            raise MembershipRefused("pending", f"the change at index {self._membership_index} is not yet committed")

    def _change(self, new: Membership) -> int:
        self._check_change()
        if len(new.voters ^ self.membership.voters) > 1 or not new.voters:
            raise MembershipRefused("invalid", "one voter at a time, and never none")
        index = self.last_index + 1
        self._append_local([Entry(index, self.term, new.command())])
        self._maybe_commit()
        return index

    def transfer_leadership(self, to: str) -> None:
        """Hand leadership to voter ``to``: once it holds every entry we have, it is told to campaign
        at once (``timeout_now``), and its voters vote even though they still hear us. From that
        message on we hold no lease (``lease_remaining``): voters may elect ``to`` at any moment.
        Proposals are refused meanwhile. Abandoned after the longest election timeout: if
        ``timeout_now`` went out we step down (we cannot take the lease back), else we lead on."""
        if self.role != LEADER:
            raise MembershipRefused("not_leader", f"{self.id} is not the leader")
        if to == self.id or to not in self.membership.voters:
            raise MembershipRefused("invalid", f"{to!r} is not another voter")
        if self.lead_transferee is not None:
            raise MembershipRefused("transferring", f"{self.id} is handing leadership to {self.lead_transferee}")
        self.lead_transferee, self._transfer_started, self._timeout_now_sent = to, self.now, False
        self._maybe_send_timeout_now()

    def _maybe_send_timeout_now(self) -> None:
        to = self.lead_transferee
        pr = self._prs.get(to) if to is not None else None
        if pr is not None and not self._timeout_now_sent and pr.match == self.last_index:
            self._timeout_now_sent = True
            self._send(Message(TIMEOUT_NOW, self.id, to, self.term))  # type: ignore[arg-type]

    def _check_transfer(self) -> None:
        # As long as an election may take, on this network (the configured range, stretched as the window is).
        longest = self._window() * self.cfg.election_ticks_max // self.cfg.election_ticks_min
        if self.lead_transferee is not None and self.now - self._transfer_started >= longest:
            if self._timeout_now_sent:
                self._become_follower(self.term, None)
            else:
                self._end_transfer()

    def _end_transfer(self) -> None:
        self.lead_transferee, self._timeout_now_sent = None, False

    def handover_target(self) -> tuple[int, str] | None:
        """The other voter a hand-over goes to, with how much of our log it holds: one that answered
        a message sent within the election window before one that did not (a voter that died while
        caught up would be told to campaign, and the tier would wait out an election timeout for
        nothing), then the one holding most of our log, then the name."""
        window = self._window()
        best = max(((self.now - pr.last_heard <= window, pr.match, p) for p, pr in self._prs.items()
                    if p in self.membership.voters and p != self.id), default=None)
        return None if best is None else (best[1], best[2])

    def _hand_over_removed(self) -> None:
        """A leader whose removal committed steps down; the voter ``handover_target`` names is told
        to campaign now, if it holds all our log, rather than wait out an election timeout."""
        best = self.handover_target()
        self._become_follower(self.term, None)
        if best is not None and best[0] == self.last_index:
            self._send(Message(TIMEOUT_NOW, self.id, best[1], self.term))

    def step(self, m: Message) -> None:
        """Handle one message from a peer."""
        if m.dst != self.id or m.src == self.id or (
                m.src not in self.peers and m.type not in _FROM_ANYONE
                and not (m.type in _TO_LEADER and self.role == LEADER and m.term == self.term and m.src in self._prs)):
            return
        if m.term > self.term:
            if m.type in (VOTE, PRE_VOTE) and self._in_lease() and not m.transfer:
                return
            if m.type == PRE_VOTE or (m.type == PRE_VOTE_RESP and m.term == self.term + 1):
                pass  # pre-votes never change our term
            else:
                self._become_follower(m.term, m.src if m.type in _FROM_LEADER else None)
        elif m.term < self.term:
            if m.type in (APPEND, HEARTBEAT):
                # Tell a stale leader about the newer term so it steps down.
                self._send(Message(APPEND_RESP, self.id, m.src, self.term))
            elif m.type == PRE_VOTE:
                self._send(Message(PRE_VOTE_RESP, self.id, m.src, self.term, success=False))
            return

        t = m.type
        if t in (VOTE, PRE_VOTE):
            self._handle_vote_request(m)
        elif t == VOTE_RESP:
            if self.role == CANDIDATE:
                self._votes[m.src] = m.success
                if m.success:  # a duplicate answer may come later, with more quiet counted
                    quiet, floor = self._vote_quiet.get(m.src, (m.quiet, m.floor))
                    self._vote_quiet[m.src] = (min(m.quiet, quiet), max(m.floor, floor))
                self._poll()
        elif t == PRE_VOTE_RESP:
            if self.role == PRE_CANDIDATE and m.term == self.term + 1:
                self._votes[m.src] = m.success
                self._poll()
        elif t in _FROM_LEADER:
            if self.role == LEADER:
                return  # impossible with election safety; ignore defensively
            if self.role != FOLLOWER:
                self._become_follower(self.term, m.src)
            self.leader = m.src
            self._quiet = 0
            self._campaigns = 0
            if (m.term, m.ctx) >= self._leader_sent:
                self._leader_sent = (m.term, m.ctx)
                if m.floor != self.floor or m.term > self._floor_at[0]:
                    # Durable before we answer (HardState): leases count on it. A new term's leader
                    # may announce the window we hold: its first message is recorded all the same,
                    # or after a restart one it sent earlier, with a lower window, would be taken.
                    changed, self.floor, self._floor_at = m.floor != self.floor, m.floor, (m.term, m.ctx)
                    if changed:
                        self._reset_timeout()  # stretched as the window now is
            self._election_elapsed = 0
            if self.first_leader_commit is None:
                self.first_leader_commit = m.leader_commit
            if t == APPEND:
                self._handle_append(m)
            elif t == HEARTBEAT:
                self._commit_to(min(m.commit, self.last_index))
                self._send(Message(HEARTBEAT_RESP, self.id, m.src, self.term, index=self.commit,
                                   conflict_index=self.last_index + 1, ctx=m.ctx))
            else:
                self._handle_snapshot(m)
        elif t == APPEND_RESP:
            if self.role == LEADER:
                self._handle_append_resp(m)
        elif t == HEARTBEAT_RESP and self.role == LEADER:
            self._handle_heartbeat_resp(m)
        elif t == TIMEOUT_NOW and self.role == FOLLOWER and self.leader in (m.src, None) and self.is_voter():
            # Our leader hands over to us (we hold all it has): campaign now, without a pre-vote.
            self._become_candidate(transfer=True)

    # -- follower side ---------------------------------------------------------------------------
    def _handle_vote_request(self, m: Message) -> None:
        pre = m.type == PRE_VOTE
        can_vote = (
            self.vote == m.src or (self.vote is None and self.leader is None) or (pre and m.term > self.term)
        )
        up_to_date = m.log_term > self.last_term or (
            m.log_term == self.last_term and m.index >= self.last_index
        )
        grant = can_vote and up_to_date
        if grant and not pre:
            self.vote = m.src
            self._election_elapsed = 0
        counted = grant and not pre
        self._send(Message(PRE_VOTE_RESP if pre else VOTE_RESP, self.id, m.src, m.term, success=grant,
                           quiet=self._quiet if counted else 0, floor=self.floor if counted else 0))

    def _handle_append(self, m: Message) -> None:
        if m.index < self.commit:
            # Everything up to our commit matches the leader; tell it so it can skip ahead.
            self._send(
                Message(APPEND_RESP, self.id, m.src, self.term, index=self.commit, success=True, ctx=m.ctx)
            )
            return
        prev_term = self.term_at(m.index)
        if prev_term != m.log_term:
            resp = Message(APPEND_RESP, self.id, m.src, self.term, index=m.index, ctx=m.ctx)
            if prev_term is None:
                resp.conflict_index = self.last_index + 1
            else:
                # Skip back over the whole conflicting term in one round trip.
                ci = m.index
                floor = max(self.commit, self.snap_index)
                while ci - 1 > floor and self.term_at(ci - 1) == prev_term:
                    ci -= 1
                resp.conflict_index = ci
                resp.conflict_term = prev_term
            self._send(resp)
            return
        for pos, e in enumerate(m.entries):
            existing = self.term_at(e.index)
            if existing == e.term:
                continue
            if existing is not None:
                self._truncate_after(e.index - 1)
            self._append_local(m.entries[pos:])
            break
        last_new = m.index + len(m.entries)
        self._commit_to(min(m.commit, last_new))
        self._send(Message(APPEND_RESP, self.id, m.src, self.term, index=last_new, success=True, ctx=m.ctx))

    def _handle_snapshot(self, m: Message) -> None:
        idx, term = m.snapshot_index, m.snapshot_term
        if idx > self.commit:
            if self.term_at(idx) == term:
                self._commit_to(idx)  # we already have it; no need to replace the state
            else:
                self._log = []
                self.snap_index, self.snap_term = idx, term
                self.commit = self.applied = self._handed = idx
                if m.conf is not None:
                    self.snap_membership = Membership.from_dict(m.conf)
                else:  # a leader that sends none: keep what we had (our log is gone)
                    self.snap_membership = self.membership
                self._set_membership(self.snap_membership, idx)
                self._snapshot_in = Snapshot(idx, term, m.payload, self.snap_membership)
                self._persist_from = idx + 1
                self._truncated = False
        self._send(
            Message(APPEND_RESP, self.id, m.src, self.term, index=self.commit, success=True, ctx=m.ctx)
        )

    def _commit_to(self, index: int) -> None:
        if index > self.commit:
            self.commit = index

    # -- leader side -----------------------------------------------------------------------------
    def _to_probe(self, pr: Progress, nxt: int) -> None:
        pr.state = PROBE
        pr.next = max(pr.match + 1, nxt)
        pr.paused = False
        pr.inflight.clear()

    def _to_replicate(self, pr: Progress) -> None:
        pr.state = REPLICATE
        pr.next = pr.match + 1
        pr.paused = False
        pr.inflight.clear()

    def _heard(self, pr: Progress, m: Message) -> None:
        pr.recent_active = True
        if m.ctx > pr.last_heard:
            pr.last_heard = m.ctx

    def _handle_append_resp(self, m: Message) -> None:
        pr = self._prs.get(m.src)
        if pr is None or m.ctx < pr.since:
            return  # removed from the configuration since, or an answer of a removed replica of that name
        self._heard(pr, m)
        if not m.success:
            if m.index <= pr.match or pr.state == SNAPSHOTTING:
                return  # stale
            if pr.state == PROBE and m.index != pr.next - 1:
                return  # answer to an older probe
            nxt = m.conflict_index
            if m.conflict_term:
                j = min(m.index, self.last_index)
                while j > self.snap_index and self.term_at(j) > m.conflict_term:
                    j -= 1
                if j > self.snap_index and self.term_at(j) == m.conflict_term:
                    nxt = j + 1
            self._to_probe(pr, min(nxt, m.index))
            return
        if m.index > pr.match:
            pr.match = m.index
            pr.last_progress = self.now
        pr.next = max(pr.next, pr.match + 1)
        while pr.inflight and pr.inflight[0] <= m.index:
            pr.inflight.popleft()
        if pr.state == PROBE or (pr.state == SNAPSHOTTING and pr.match >= pr.pending_snapshot):
            self._to_replicate(pr)
        pr.paused = False
        self._maybe_commit()
        if m.src == self.lead_transferee:
            self._maybe_send_timeout_now()

    def _handle_heartbeat_resp(self, m: Message) -> None:
        pr = self._prs.get(m.src)
        if pr is None or m.ctx < pr.since:
            return
        self._heard(pr, m)
        pr.paused = False
        if 0 < m.conflict_index <= pr.match and m.ctx > pr.last_progress:
            # Asked after we saw it hold ``match`` entries, it now has fewer: it lost its disk.
            # Find the end of its log anew (a snapshot follows if that is behind our compaction).
            pr.match = m.conflict_index - 1
            self._to_probe(pr, m.conflict_index)
            return
        known = min(m.index, self.last_index)
        if known > pr.match:
            pr.match = known
            pr.last_progress = self.now
            pr.next = max(pr.next, known + 1)
            self._maybe_commit()
            if m.src == self.lead_transferee:
                self._maybe_send_timeout_now()
        if pr.state == SNAPSHOTTING and pr.match >= pr.pending_snapshot:
            self._to_replicate(pr)
        elif (
            pr.state == REPLICATE
            and pr.match < self.last_index
            and self.now - pr.last_progress >= self._probe()
        ):
            # Appends in flight were probably lost: resend from the last known match.
            pr.last_progress = self.now
            self._to_probe(pr, pr.match + 1)

    def _maybe_commit(self) -> None:
        voters = self.membership.voters  # learners do not count; nor does a leader removing itself
        matches = [pr.match for p, pr in self._prs.items() if p in voters]
        if self.id in voters:
            matches.append(self.last_index)
        matches.sort(reverse=True)
        q = matches[self._quorum - 1]
        # Only entries of the current term are committed by counting replicas (section 5.4.2).
        if q > self.commit and self.term_at(q) == self.term:
            self.commit = q

    def _flush(self) -> None:
        """Send every follower what it lacks: new entries (batched), or the new commit alone once it
        has waited ``commit_delay_ticks`` for an entry to carry it."""
        cfg = self.cfg
        # Followers learn the commit late only in the steady state: not while a configuration
        # change is being committed (a removed peer hears of its removal, as before) or leadership
        # handed over, nor from a leader leaving the configuration.
        steady = (cfg.commit_delay_ticks > 0 and self.lead_transferee is None and self.is_voter()
                  and not self.membership_pending())
        members = self.membership.members if steady else frozenset()
        for p, pr in self._prs.items():
            if pr.state == SNAPSHOTTING or (pr.state == PROBE and pr.paused):
                continue
            while True:
                if pr.state == REPLICATE and len(pr.inflight) >= cfg.max_inflight:
                    break
                if pr.next > self.last_index:
                    if pr.sent_commit >= self.commit:
                        pr.commit_owed_since = None
                        break
                    if pr.state == REPLICATE and p in members:
                        if pr.commit_owed_since is None:
                            pr.commit_owed_since = self.now
                        if self.now - pr.commit_owed_since < cfg.commit_delay_ticks:
                            break
                prev = pr.next - 1
                prev_term = self.term_at(prev)
                if prev_term is None:
                    self._send_snapshot(p, pr)
                    break
                batch = self.entries(pr.next, pr.next + cfg.max_entries_per_msg - 1)
                self._send(
                    Message(
                        APPEND,
                        self.id,
                        p,
                        self.term,
                        index=prev,
                        log_term=prev_term,
                        entries=batch,
                        commit=self.commit,
                        leader_commit=self.commit,
                        ctx=self.now,
                        floor=self.floor,
                    )
                )
                pr.sent_commit = self.commit
                pr.commit_owed_since = None
                if pr.state == PROBE:
                    pr.paused = True
                    break
                if not batch:
                    break
                pr.next = batch[-1].index + 1
                pr.inflight.append(batch[-1].index)

    def _send_snapshot(self, p: str, pr: Progress) -> None:
        # The driver replaces index/term with those of the state it actually snapshots (>= these).
        idx = self.applied
        pr.state = SNAPSHOTTING
        pr.pending_snapshot = idx
        pr.snapshot_elapsed = 0
        pr.inflight.clear()
        self._send(
            Message(
                SNAPSHOT,
                self.id,
                p,
                self.term,
                snapshot_index=idx,
                snapshot_term=self.term_at(idx) or 0,
                commit=self.commit,
                leader_commit=self.commit,
                ctx=self.now,
                floor=self.floor,
                conf=self.membership_at(idx).to_dict(),
            )
        )

    def _send(self, m: Message) -> None:
        pr = self._prs.get(m.dst)  # only a leader has any
        if pr is not None:
            pr.last_sent = self.now
        self._msgs.append(m)

    # -- output ----------------------------------------------------------------------------------
    def ready(self) -> Ready:
        """Collect everything to persist, send and apply since the previous call."""
        if self.role == LEADER:
            self._check_transfer()
        if self.role == LEADER:
            self._flush()
            if not self.membership_pending():
                for p in [p for p in self._prs if p not in self.membership.members]:
                    del self._prs[p]  # its removal went out with the commit above: done with it
                if not self.is_voter():
                    self._hand_over_removed()
        rd = Ready()
        hs = HardState(self.term, self.vote, self.commit, self.floor, *self._floor_at)
        vote_kept = (hs.term, hs.vote) == (self._prev_hs.term, self._prev_hs.vote)
        if hs != self._prev_hs:
            rd.hard_state = hs
            self._prev_hs = hs
        if self._snapshot_in is not None:
            rd.snapshot = self._snapshot_in
            self._snapshot_in = None
        if self._truncated:
            rd.truncate_from = self._persist_from
            self._truncated = False
        if self._persist_from <= self.last_index:
            rd.entries = self.entries(self._persist_from, self.last_index)
        self._persist_from = self.last_index + 1
        hi = min(self.commit, self._handed + self.cfg.max_apply_batch)
        if hi > self._handed:
            rd.committed_entries = self.entries(self._handed + 1, hi)
            self._handed = hi
        rd.messages, self._msgs = self._msgs, []
        rd.send_first = (self.role == LEADER and vote_kept and rd.snapshot is None and rd.truncate_from is None)
        return rd

    def advance(self, rd: Ready) -> None:
        """Confirm that ``rd`` was persisted, sent and applied."""
        if rd.snapshot is not None:
            self.applied = max(self.applied, rd.snapshot.index)
        if rd.committed_entries:
            self.applied = max(self.applied, rd.committed_entries[-1].index)

    def compact(self, index: int) -> tuple[int, int] | None:
        """Drop entries up to ``index`` (at most ``applied``); returns the new (snap index, term)."""
        index = min(index, self.applied)
        if index <= self.snap_index:
            return None
        term = self.term_at(index)
        assert term is not None
        self.snap_membership = self.membership_at(index)  # the log no longer holds what put it in force
        del self._log[: index - self.snap_index]
        self.snap_index, self.snap_term = index, term
        return index, term
