"""``ReplicaNode``: runs a ``RaftCore`` inside a service process (threads, SQLite, HTTP).

Threads, all owned and joined by ``stop()``:

- the event loop: runs the core's timers (ticks, sleeping until the next one falls due) and takes
  every turn no other thread could. A *turn* drains an inbox of peer messages and proposals, ticks,
  then handles the core's ``Ready``: persist (durably) -> send -> apply -> advance. Turns are taken
  under one lock, the only way to touch the core, the log store and (for writes) the state machine;
  whoever puts an input in the inbox takes the turn itself when the lock is free (``_drive``), so
  a proposal, an append and its answer are handled on the thread that brought them, not handed to
  the loop thread and woken there (a hand-off each). A thread that finds the lock taken leaves its
  input to the holder, which looks at the inbox again once it lets go, so concurrent inputs still
  share one turn (one append, one synced write);
- one sender per peer: coalesces queued messages into one frame on a long-lived connection
  (``pygmy.replication.transport``; drops on error: Raft retransmits), and streams snapshots to that
  peer in chunks (``pygmy.replication.snapshots``);
- the frame server's accept thread and one reader per connected peer: they put what arrives in the
  inbox;
- one notifier: runs leader listeners, so a listener may itself call ``propose``.

Membership: the replicas a node talks to are those of the configuration in force in its log
(``RaftCore.membership``), each at the URL the configuration gives (its peer port: URL port + 50);
senders come and go with it, after the turn that changed it and before that turn's messages go out.
A server outside our configuration (a leader added after it) says its URL in its hello, so we can
answer it. ``add_learner``, ``promote``, ``remove`` and ``transfer_leadership`` change it.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import urllib3
from flask import Blueprint, Response, jsonify, request
from prometheus_client import Histogram

from pygmy.kit import codec, tls
from pygmy.kit.web import plain_int, secret_refusal
from pygmy.replication.core import (
    APPEND,
    CANDIDATE,
    HEARTBEAT,
    HEARTBEAT_RESP,
    PERSIST,
    SEND,
    SNAPSHOT,
    TIMEOUT_NOW,
    VOTE,
    CoreConfig,
    Entry,
    HardState,
    Membership,
    MembershipRefused,
    Message,
    Progress,
    RaftCore,
    Ready,
    Timing,
)
from pygmy.replication.log_store import LogStore
from pygmy.replication.snapshots import Incoming, stream_frames
from pygmy.replication.statemachine import Pin, StateMachine
from pygmy.replication.storage import describe, is_storage_fault
from pygmy.replication.timers import HOLD, Hold, RttMeter, derive, implied, ticks_due
from pygmy.replication.transport import (
    CLIENT_ROLES,
    RAFT_CHANNEL,
    Channel,
    FrameClient,
    FrameServer,
    raft_address,
)

#: Requests a replica sends only at its own current term, as leader (appends, heartbeats,
#: snapshots, ``timeout_now``) or candidate (votes): one of these at our term, after our step,
#: comes from the process that holds that name now, so its connection's hello tells where it serves.
_SAYS_WHERE = frozenset({APPEND, HEARTBEAT, SNAPSHOT, TIMEOUT_NOW, VOTE})

log = logging.getLogger("pygmy.replication")
#: Longest a leader not yet sure of its lease waits for it before refusing a read index.
LEADER_READ_WAIT = 0.25
#: A replica failing this long on errors other than storage's (a bug: every reload fails the same
#: way) is not live, so that an orchestrator restarts it; one whose disk is full stays live.
STUCK_FAULT_S = 60.0
#: First wait before reloading after a fault; doubles up to 1 s, back to this once working again.
_FAULT_BACKOFF_MIN = 0.05
#: Turns one thread takes in a row for inputs that keep arriving before it leaves the rest to the
#: loop thread: a frame reader or a proposer lends itself to the node only for a while.
_INLINE_TURNS = 3
#: How often the loop derives the timers from the round trips measured (``ReplicaNode._retune``).
RETUNE_EVERY = 1.0
#: A turn this late after its timer fell due means the process stood still (``_turn``).
STALLED = 0.25

COMMIT_SECONDS = Histogram(
    "pygmy_replica_commit_seconds", "Time from a proposal on the leader to its commit and local apply",
    ["service"], buckets=(0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 1),
)


class NotLeader(Exception):
    """This replica cannot take the write; retry on ``leader_name`` (None while unknown)."""

    def __init__(self, leader: str | None, url: str | None) -> None:
        super().__init__(f"not the leader (leader: {leader})")
        self.leader_name, self.leader_url = leader, url


class ProposalTimeout(Exception):
    """The outcome is unknown: the command may still commit later (retry with an idempotency key).

    ``index`` is the log index the command was appended at (None if it is not known): whoever must
    act once the outcome is known (the catalog's invalidation holds) waits for that index.
    """

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


class ReadIndexUnavailable(Exception):
    """No read index could be had (no leader, or it is not sure it still leads): try another replica."""


@dataclass(frozen=True, slots=True)
class ReplicationConfig(CoreConfig):
    """The core's knobs plus the driver's: clock, log compaction, transport."""

    tick_ms: float = 10.0
    #: Applied entries kept in the log for lagging followers; older ones are compacted away.
    keep_entries: int = 10_000
    #: ... but no more than replaying costs less than copying the state: a follower further behind
    #: gets a snapshot, which costs the state's size, not the entries it missed. One applied command
    #: costs about as much as sending and installing this many bytes of state (docs/performance.md,
    #: "Catch-up: replaying or copying the state"); 0: keep ``keep_entries`` whatever the state's size.
    replay_bytes_per_entry: int = 2048
    #: Never fewer than this many, however small the state (a follower a moment behind, after a
    #: pause or a brief partition, catches up from the log, not by a snapshot).
    min_keep_entries: int = 1_000
    #: Compact only once this many more entries accumulated (amortises the DELETE).
    compact_slack: int = 2_000
    #: And by size: applied entries are compacted away once the log holds more than
    #: ``keep_bytes + compact_slack_bytes`` of commands, down to ``keep_bytes`` (batched entries of
    #: hundreds of buys each would otherwise keep hundreds of MiB on disk and in memory).
    keep_bytes: int = 16 * 2**20
    compact_slack_bytes: int = 4 * 2**20
    connect_timeout: float = 0.2
    #: Longest a frame may take to leave (a peer that stopped reading: the connection is dropped).
    send_timeout: float = 0.5
    #: Longest one chunk of a snapshot may take to leave.
    snapshot_send_timeout: float = 10.0
    #: A snapshot streams, then installs, for seconds at a million books: the core waits this long
    #: for its acknowledgement before sending it again (a repeat queued while a stream is under way
    #: is dropped: the stream answers it).
    snapshot_timeout_ticks: int = 1000
    #: Cap on messages per frame (heartbeats and appends are coalesced up to it).
    max_batch_messages: int = 64
    #: Follow the network: a leader times its heartbeats and stretches heartbeats, election window
    #: and lease to the round trips (``pygmy.replication.timers``); False keeps the configured ones.
    adapt: bool = True
    #: Seconds a lower timing must have been asked for before it replaces a higher one
    #: (``timers.Hold``): one quiet minute after a slow one does not shrink the windows back and forth.
    timing_hold_s: float = HOLD
    #: A learner is promoted only while it holds all but at most this many of the leader's entries
    #: (and answered within an election timeout): caught up, so that as a voter it does not hold
    #: back commits. Entries, not commands: an entry carries a batch, so a learner keeping up under
    #: load is a few entries behind; one still copying a snapshot or replaying the log is far more.
    promote_max_lag: int = 64

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ReplicationConfig:
        """Defaults overridden by ``PYGMY_RAFT_<FIELD>`` variables (e.g. ``PYGMY_RAFT_TICK_MS=5``),
        so experiments can tune timing without code changes."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"PYGMY_RAFT_{f.name.upper()}")
            if raw is None:
                continue
            default = f.default
            if isinstance(default, bool):
                values[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
            elif isinstance(default, float):
                values[f.name] = float(raw)
            else:
                values[f.name] = int(raw)
        config = cls(**values)
        if config.problems():
            raise ValueError("unsafe PYGMY_RAFT_* settings: " + "; ".join(config.problems()))
        return config

#: Guards ``_Proposal.taken`` of the calls of ``in_turn``: taken by a turn, or given up by the caller.
_CALLS = threading.Lock()


class _Proposal:
    __slots__ = ("command", "change", "done", "settled", "index", "term", "result", "error", "taken")

    def __init__(self, command: dict[str, Any] | None, change: Callable[[RaftCore], int] | None = None) -> None:
        self.command = command
        #: A membership change instead of a command: appends the configuration, returns its index.
        self.change = change
        self.done = threading.Event()
        self.settled = threading.Event()  # the loop has seen our "forget": ``index`` is final
        self.index = 0
        self.term = 0
        self.result: Any = None
        self.error: BaseException | None = None
        #: An ``in_turn`` call's: False while queued, True once a turn runs it, None if its caller gave up.
        self.taken: bool | None = False

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class _Stopping(Exception):
    """The node stops: a snapshot stream in progress is abandoned."""


class _Sender:
    """Delivers messages to one peer on its own thread, so a slow peer delays nobody else."""

    def __init__(self, node: ReplicaNode, peer: str, address: tuple[str, int]) -> None:
        self.node, self.peer, self.address = node, peer, address
        self.queue: queue.Queue[Message | None] = queue.Queue()
        self.client = FrameClient(address, node.secret, node.name, RAFT_CHANNEL, node.config.connect_timeout,
                                  extra={"url": node.url}, server=peer)
        self.thread = threading.Thread(target=self._run, name=f"raft-send-{node.name}->{peer}", daemon=True)
        self._stop = False

    def offer(self, m: Message) -> None:
        """From the event loop: straight onto the wire when that cannot block and nothing is queued
        (no thread hand-off on the commit path), else to the sender thread."""
        if m.type != SNAPSHOT and self.queue.empty() and self.client.send_nowait({"messages": [m.to_dict()]}):
            return
        self.queue.put(m)

    def _run(self) -> None:
        """Supervised: an unexpected error costs the batch in hand (Raft retransmits), not the thread."""
        cfg = self.node.config
        while not self._stop:
            first = self.queue.get()
            if first is None:
                break
            batch = [first]
            self._drain(batch, cfg.max_batch_messages)
            try:
                rest = [m for m in batch if m.type != SNAPSHOT]
                if rest:
                    self._send(rest, cfg.send_timeout)
                snaps = [m for m in batch if m.type == SNAPSHOT]
                if snaps and not self._stop:
                    self._stream_snapshot(snaps[-1])  # the core's repeats of one request: one is enough
            except _Stopping:
                break
            except Exception as exc:
                self.node.loop_faults["sender"] += 1
                self.node.last_loop_fault = f"sender to {self.peer}: {type(exc).__name__}: {exc}"
                log.exception("%s -> %s: sending failed; dropping the batch", self.node.name, self.peer)
        self.client.close()

    def _send(self, msgs: list[Message], timeout: float) -> None:
        try:
            self.client.send({"messages": [m.to_dict() for m in msgs]}, timeout)
        except OSError as exc:
            log.debug("%s -> %s: %s", self.node.name, self.peer, exc)

    def _stream_snapshot(self, m: Message) -> None:
        """Copy the state to a file and stream it in chunks, then the message (see
        ``pygmy.replication.snapshots``). Heartbeats and appends queued meanwhile go out between chunks,
        so the peer keeps hearing from its leader. A failure drops the stream: the core sends the
        snapshot again once its acknowledgement is overdue."""
        node, cfg = self.node, self.node.config
        if node._stopping.is_set():
            return
        # A file of its own: a peer removed and added again has a new sender while the old one may
        # still be writing or deleting its copy (``pin.write`` cannot be cut short).
        path = node.snapshot_out / f"{self.peer}-{secrets.token_hex(6)}.db"
        try:
            pin, term, membership = node._pin_state()
            try:
                if not term:
                    return  # the pinned index's term is not known here yet: the core asks again
                m.snapshot_index, m.snapshot_term, m.conf = pin.index, term, membership.to_dict()
                pin.write(path)
            finally:
                pin.close()
            sid = f"{m.term}-{m.snapshot_index}-{secrets.token_hex(4)}"
            log.info("%s: streaming a snapshot at index %d to %s (%d bytes)", node.name, m.snapshot_index,
                     self.peer, path.stat().st_size)
            connects = None
            for frame in stream_frames(sid, path):
                self._between_chunks()
                if "snapshot" in frame:
                    frame["messages"] = [m.to_dict()]
                self.client.send(frame, cfg.snapshot_send_timeout)
                if connects is None:
                    connects = self.client.connects
                elif self.client.connects != connects:
                    # A frame went out on a new connection: the peer may read the two connections'
                    # chunks out of order and drop the stream, so it is not worth finishing.
                    raise ConnectionResetError("the connection was replaced during the stream")
        except (OSError, sqlite3.Error) as exc:
            log.warning("%s: the snapshot stream to %s broke: %s", node.name, self.peer, exc)
        finally:
            path.unlink(missing_ok=True)

    def _between_chunks(self) -> None:
        """Send what the loop queued for this peer meanwhile (another snapshot request is the one
        being served); stop the stream if the node is stopping."""
        queued: list[Message] = []
        self._drain(queued, self.queue.qsize() + 1)
        if self._stop:
            raise _Stopping
        msgs = [m for m in queued if m.type != SNAPSHOT]
        if msgs:  # as patient as a chunk: a timeout here would reset the connection mid-stream
            self._send(msgs, self.node.config.snapshot_send_timeout)

    def _drain(self, batch: list[Message], limit: int) -> None:
        """Move what is queued into ``batch``, up to ``limit`` messages; a stop request sets ``_stop``."""
        while len(batch) < limit:
            try:
                m = self.queue.get_nowait()
            except queue.Empty:
                return
            if m is None:
                self._stop = True
                return
            batch.append(m)


class _ReadIndexBatcher:
    """A follower's read index, asked of the leader once for every batch of concurrent reads.

    A read may use only an answer the leader gave *after* the read arrived (an answer already on
    its way may predate a write acknowledged before the read began), so callers wait for the next
    round to start; all callers waiting then share it. At most one round is in flight.
    """

    def __init__(self, node: ReplicaNode) -> None:
        self.node = node
        #: urllib3, not Requests: nothing of a session is wanted here, and a service process that
        #: never imports Requests starts faster (``pygmy.cluster.cli``).
        self.http = urllib3.PoolManager(num_pools=8, maxsize=4, block=False, retries=False, **tls.pool_options())
        self._cond = threading.Condition()
        self._started = 0  # rounds started
        self._done = 0  # rounds finished
        self._busy = False
        self._value = 0
        self._error: str | None = None

    def get(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._started + 1
            while self._done < target:
                if not self._busy:
                    self._busy = True
                    self._started += 1
                    mine = self._started
                    self._cond.release()
                    value, error = 0, f"{self.node.name}: asking for the read index failed"
                    try:
                        value, error = self._ask(max(0.05, deadline - time.monotonic()))
                    finally:  # whatever ``_ask`` raised, the round ends: or no round would start again
                        self._cond.acquire()
                        self._busy, self._done, self._value, self._error = False, mine, value, error
                        self._cond.notify_all()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ReadIndexUnavailable(f"{self.node.name}: no read index within {timeout:.3g}s")
                self._cond.wait(left)
            if self._error is not None:
                raise ReadIndexUnavailable(self._error)
            return self._value

    def _ask(self, timeout: float) -> tuple[int, str | None]:
        leader = self.node.leader()
        if leader is None:
            return 0, f"{self.node.name} knows no leader"
        name, url = leader
        if name == self.node.name:
            try:
                return self.node.wait_read_index(min(timeout, LEADER_READ_WAIT)), None
            except ReadIndexUnavailable as exc:
                return 0, str(exc)
        try:
            # Who asks, and the commit it knows: a leader tells a follower short of the read index
            # its commit at once, instead of with the next entry (``commit_delay_ticks``).
            known = {"from": self.node.name, "commit": str(self.node._view.get("commit", 0))}
            r = self.http.request("GET", tls.fit(url) + "/raft/read_index", fields=known,
                                  headers={"Authorization": f"Bearer {self.node.secret}"},
                                  timeout=urllib3.Timeout(connect=self.node.config.connect_timeout,
                                                          read=min(timeout, 1.0)), redirect=False)
            if r.status != 200:
                return 0, f"{name} gave no read index: HTTP {r.status}"
            return int(codec.loads(r.data)["index"]), None
        except (urllib3.exceptions.HTTPError, ValueError, KeyError, TypeError, OverflowError) as exc:
            return 0, f"{name} gave no read index: {type(exc).__name__}"


def durable(hs: HardState) -> tuple[int, str | None, int, int, int]:
    """What of a hard state must be on disk before a message built on it goes out: term, vote and
    the announced window with what announced it (not commit: a restarted replica relearns it)."""
    return hs.term, hs.vote, hs.floor, hs.floor_term, hs.floor_ctx


class ReplicaNode:
    """One replica of a Raft group; see the module docstring for its threads."""

    def __init__(
        self,
        name: str,
        peers: Mapping[str, str],
        state_machine: StateMachine,
        data_dir: Path | str,
        secret: str,
        config: ReplicationConfig | None = None,
        *,
        seed: int | None = None,
        listen: tuple[str, int] | None = None,
        addresses: Mapping[str, tuple[str, int]] | None = None,
        learners: Iterable[str] = (),
    ) -> None:
        """``peers`` are the replicas' HTTP URLs, the configuration the group starts from with
        ``learners`` among them (a new replica joining a running group names itself); the one in
        the log, once there is one, replaces it. ``addresses`` pin peer transport addresses for good
        (a link routed through a proxy); any other peer is dialled where its URL in the current
        configuration says (``transport.raft_address``), so it is followed when a name is added
        again elsewhere. ``listen`` is where this one accepts its peers (default: its own address)."""
        if name not in peers:
            raise ValueError(f"{name} is not among the peers {list(peers)}")
        self.name = name
        #: Where each replica we know of serves HTTP: the configuration's URLs, then the ones we
        #: started with, then those heard in hellos. Replaced whole, never changed in place, so
        #: other threads may read it at any time.
        self.peers = dict(peers)
        self._boot_peers = dict(peers)
        self._boot_learners = tuple(learners)
        self._heard_urls: dict[str, str] = {}
        #: Where a replica serves by the hello of the connection that brought its latest request at
        #: our term, with its URL in our configuration then (``_sync_members``); and whether that
        #: changed in this turn. The connection's hello URL, per reader thread (one per connection).
        self._told_urls: dict[str, tuple[str, str | None]] = {}
        self._told_news = False
        self._connection = threading.local()
        self._peers_lock = threading.Lock()  # the address book is written by turns and by hellos
        self.url = self.peers[name]
        self.sm = state_machine
        self.secret = secret
        self.config = config or ReplicationConfig()
        #: Entries kept by count at the last look (``keep_entries()``); 0: not looked yet.
        self._keep = 0
        self.data_dir = Path(data_dir)
        self.store = LogStore(self.data_dir / "raft.db")
        #: Snapshots: received ones land in ``snapshots/in``, copies for peers in ``snapshots/out``;
        #: both emptied at start (a crash may leave a stream half-written in either).
        self._incoming = Incoming(self.data_dir / "snapshots" / "in")
        self._stepped_snapshots: list[Path] = []
        self.snapshot_out = self.data_dir / "snapshots" / "out"
        shutil.rmtree(self.snapshot_out, ignore_errors=True)
        self.snapshot_out.mkdir(parents=True, exist_ok=True)
        self._seed = seed
        #: Round trips to each follower (timed on our heartbeats while we lead) and the timing they
        #: ask for (``pygmy.replication.timers``), given to the core every ``RETUNE_EVERY``.
        self._forget_timing()
        self._retune_at = 0.0
        self._timers: dict[str, Any] = {}
        self.core = self._load_core()
        #: (kind, value, when it arrived): ticks that fell due before an input arrived are handled
        #: before it (``_turn``), so a timer counts only time that passed after it.
        self._inbox: queue.Queue[tuple[str, Any, float]] = queue.Queue()
        #: Held for a turn (``_turn``): whoever holds it owns the core, the log store and the applier.
        self._core_lock = threading.Lock()
        self._turn_thread: int | None = None  # the thread taking a turn (propose() must not be it)
        #: Wakes the loop thread: a stop, an error in a turn, a timer made earlier by another thread's
        #: turn, or inputs a busy thread left to it.
        self._wake = threading.Event()
        self._loop_sleeps_until = 0.0  # the loop thread's next timer (monotonic), as it last saw it
        self._wake_at = 0.0  # when the core's next timer falls due, as of the last turn
        #: A turn's error, for the loop thread to handle (a fault, then a reload from disk); no other
        #: thread takes a turn while it is set.
        self._broken: BaseException | None = None
        #: A turn (on whichever thread) is installing a snapshot (a copy and a sync as long as the state is
        #: large): live, however long no turn is taken.
        self._installing = False
        self._next_tick = 0.0  # when (monotonic) the core's next tick falls due
        self._proposals: dict[int, _Proposal] = {}
        self._apply_cond = threading.Condition()
        #: The core's commit index as of the last ``Ready``, set *before* its messages go out, so a
        #: read index taken on the leader covers every entry any follower may already have applied.
        self._commit_seen = 0
        self._apply_lock = threading.Lock()
        self._view: dict[str, Any] = {}
        self._lease_until = 0.0
        #: (term, monotonic time we became its leader, the core's ``election_gap`` in that term)
        self._leader_since: tuple[int, float, int] = (-1, 0.0, 0)
        #: Why the node is not working (a storage fault it is retrying), or None. While set it is no
        #: leader, serves no reads, fails health checks and acknowledges nothing.
        self.fault: str | None = None
        #: Faults the node survived, by kind: ``storage`` (a full or failing disk: expected under
        #: such faults), ``error`` (any other exception in a turn: a bug, which the supervisor hides
        #: from clients but ``/status``, ``/metrics`` and the tests' teardown check do not) and
        #: ``sender`` (a sender thread's unexpected error). Never reset.
        self.loop_faults: dict[str, int] = {"storage": 0, "error": 0, "sender": 0}
        #: The last fault's description, kept after the node works again (``fault`` is cleared).
        self.last_loop_fault: str | None = None
        self._fault_at = 0.0
        #: Since when every reload has failed with faults of the last one's kind (None: the last
        #: reload worked, or none was needed), and whether that kind is storage (``liveness``).
        self._stuck_since: float | None = None
        self._fault_is_storage = True
        self._fault_backoff = _FAULT_BACKOFF_MIN
        self.snapshots_installed = 0
        self._caught_up = False
        self._was_leader = False
        self._apply_listeners: list[Callable[[int, Any, Any], None]] = []
        self._leader_listeners: list[Callable[[bool, int], None]] = []
        self._notify: queue.Queue[tuple[bool, int] | None] = queue.Queue()
        self._addresses = dict(addresses) if addresses else {}
        #: One per replica we send to, made when first needed (``_sender``); those of replicas that
        #: left the configuration are stopped and kept here until ``stop`` joins them.
        self._senders: dict[str, _Sender] = {}
        self._retired: list[_Sender] = []
        self._listen = listen or self._address(name)
        self._server: FrameServer | None = None
        # Any replica of the tier may connect (a leader added after our configuration must reach
        # us); the core decides what to take from whom.
        self._channels = {RAFT_CHANNEL: Channel(self._on_frame, self._admits, self._on_hello,
                                                roles=frozenset({name.rpartition("-")[0]}))}
        self._membership_seen: Membership | None = None
        self._stopping = threading.Event()
        self._loop_thread = threading.Thread(target=self._run, name=f"raft-loop-{name}", daemon=True)
        self._notify_thread = threading.Thread(
            target=self._run_notifier, name=f"raft-notify-{name}", daemon=True
        )
        self._started = False
        self._sync_members()
        self.commit_seconds = COMMIT_SECONDS.labels(name)
        self.elections = 0
        self.leader_changes = 0
        self.catch_up_seconds: float | None = None
        self._created = time.monotonic()
        self._last_raw_role: str | None = None
        self._last_leader: str | None = None
        self._refresh_view()
        self._read_index = _ReadIndexBatcher(self)
        self.blueprint = self._make_blueprint()

    @property
    def faults(self) -> int:
        """Faults of the event loop, storage or other (each cost a reload from disk)."""
        return self.loop_faults["storage"] + self.loop_faults["error"]

    def _load_core(self) -> RaftCore:
        """A core from what is on disk: at start, and again after a fault (an in-process restart)."""
        persisted = self.store.load()
        if persisted.installing is not None:
            idx, term = persisted.installing
            if self.sm.applied_index() >= idx:
                # The state machine was restored but the log store not updated: finish the install,
                # with the snapshot's configuration (the log that held it is being replaced), the
                # restore made durable first (a process killed before its sync left it unsynced).
                self.sm.sync()
                self.store.save(snapshot=(idx, term), membership=persisted.installing_membership)
            else:
                self.store.abort_install()
            persisted = self.store.load()
        self._applied = self.sm.applied_index()
        if self._applied < persisted.snapshot[0]:
            # Entries between them are in neither: applying on would skip them (the state was rolled
            # back under a compacted log: lost writes of the disk). Catch up from nothing instead.
            raise RuntimeError(f"{self.name}: the state is at index {self._applied}, behind the log's start at "
                               f"{persisted.snapshot[0]}: replace this replica (pygmy member remove, delete its "
                               "data directory, pygmy member add, start, promote: docs/operations.md)")
        hs = persisted.hard_state
        self._durable_vote = durable(hs)
        core = RaftCore(
            self.name,
            list(self._boot_peers),
            hard_state=persisted.hard_state,
            entries=persisted.entries,
            snapshot=persisted.snapshot,
            applied=self._applied,
            config=self.config,
            rng=self._seed,
            learners=self._boot_learners,
            urls=self._boot_peers,
            snapshot_membership=persisted.snapshot_membership,
        )
        core.set_timing(self._timing)  # a core reloaded after a fault keeps what was measured
        #: The index and term of the last entry the state machine applied, and the configuration in
        #: force there (under the apply lock): what a snapshot pinned by a sender thread, away from
        #: the core, is labelled with.
        self._applied_at = (self._applied, core.term_at(self._applied) or 0)
        self._applied_membership = core.membership_at(max(self._applied, core.snap_index))
        return core

    def _pin_state(self) -> tuple[Pin, int, Membership]:
        """The state held still for a snapshot, the term of its last applied entry (0: unknown) and
        the configuration in force there. Microseconds under the apply lock; the copy is made
        afterwards, by the caller."""
        with self._apply_lock:
            pin = self.sm.pin()
            index, term = self._applied_at
            membership = self._applied_membership
        return pin, (term if index == pin.index else 0), membership

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        if self._started:
            return
        with self._core_lock:  # no turn meanwhile: one that makes a sender from now on starts it itself
            self._started = True
            self._count_ticks_from_now()
            for s in self._senders.values():
                s.thread.start()
        # Then the listener: a frame it brings may take a turn that makes a sender (a leader heard
        # in a hello); started before the loop above, that sender was started twice.
        self._server = FrameServer(*self._listen, self.secret, self._channels, name=self.name)
        self._server.start()
        self._notify_thread.start()
        self._loop_thread.start()

    def stop(self) -> None:
        """Stop and join every thread; pending proposals fail with ProposalTimeout."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._started:
            if self._server is not None:
                self._server.stop()
            self._wake.set()  # the loop thread sees _stopping; other threads take no turn now
            self._loop_thread.join(timeout=10)
            senders = [*self._senders.values(), *self._retired]
            for s in senders:
                s.queue.put(None)
            for s in senders:
                if s.thread.is_alive():
                    s.thread.join(timeout=10)
            self._notify.put(None)
            self._notify_thread.join(timeout=10)
        self._read_index.http.clear()
        # A turn another thread began before the stop ends first (one stuck in a disk write is not
        # waited for longer than the loop thread was); none begins after: they check _stopping.
        locked = self._core_lock.acquire(timeout=10)
        try:
            while True:  # proposals that arrived after the loop ended
                try:
                    kind, value, _ = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "propose":
                    value.finish(error=ProposalTimeout(f"{self.name} stopped"))
            for p in list(self._proposals.values()):
                p.finish(error=ProposalTimeout(f"{self.name} stopped"))
            self._proposals.clear()
            with self._apply_cond:
                self._apply_cond.notify_all()
            self._incoming.close()
            self.store.close()
        finally:
            if locked:
                self._core_lock.release()

    # -- public API ------------------------------------------------------------------------------
    def propose(self, command: dict[str, Any], timeout: float) -> Any:
        """Replicate ``command``; returns ``state_machine.apply``'s result once committed and applied
        here. Raises NotLeader (not written), or ProposalTimeout (outcome unknown)."""
        return self._propose(_Proposal(command), timeout)

    def _propose(self, prop: _Proposal, timeout: float) -> Any:
        if threading.current_thread() is self._loop_thread or self._turn_thread == threading.get_ident():
            raise RuntimeError("propose() called from a replication turn (e.g. an apply listener)")
        if self._stopping.is_set() or not self._started:
            raise ProposalTimeout(f"{self.name} is not running")
        if not self.is_leader():
            raise NotLeader(*(self.leader() or (None, None)))
        started = time.perf_counter()
        self._submit("propose", prop)
        if not prop.done.wait(timeout):
            self._submit("forget", prop)
            prop.settled.wait(1.0)  # the loop answers in a tick; a stalled loop leaves it unknown
            raise ProposalTimeout(f"{self.name}: not committed within {timeout:.3g}s",
                                  index=(prop.index or None) if prop.settled.is_set() else None)
        if prop.error is not None:
            raise prop.error
        self.commit_seconds.observe(time.perf_counter() - started)
        return prop.result

    # -- membership changes -------------------------------------------------------------------------
    def add_learner(self, name: str, url: str, timeout: float) -> dict[str, Any]:
        """Add ``name``, serving at ``url``, as a learner; the new configuration once committed and
        applied here. Raises MembershipRefused (nothing done), NotLeader, or ProposalTimeout."""
        return self._propose(_Proposal(None, lambda core: core.add_learner(name, url)), timeout)

    def promote(self, name: str, timeout: float) -> dict[str, Any]:
        """Make learner ``name`` a voter, if it is caught up (``promote_max_lag``)."""
        lag = self.config.promote_max_lag
        return self._propose(_Proposal(None, lambda core: core.promote(name, lag)), timeout)

    def remove(self, name: str, timeout: float) -> dict[str, Any]:
        """Remove ``name`` from the configuration (this leader too: see ``RaftCore.remove``)."""
        return self._propose(_Proposal(None, lambda core: core.remove(name)), timeout)

    def in_turn(self, fn: Callable[[RaftCore], Any], timeout: float = 2.0) -> Any:
        """``fn(core)`` in a turn (the only way another thread may touch the core); its result, or
        its exception. ProposalTimeout if no turn came within ``timeout``."""
        if self._stopping.is_set() or not self._started:
            raise ProposalTimeout(f"{self.name} is not running")
        prop = _Proposal(None)
        self._submit("call", (fn, prop))
        if not prop.done.wait(timeout):
            with _CALLS:
                gave_up = prop.taken is False
                if gave_up:
                    prop.taken = None  # never run later: its caller has been told it was not
            if gave_up or not prop.done.wait(timeout):  # (a turn is running it: its outcome is moments away)
                raise ProposalTimeout(f"{self.name}: no turn within {timeout:.3g}s")
        if prop.error is not None:
            raise prop.error
        return prop.result

    def members(self, leased: bool = False) -> dict[str, Any]:
        """The leader's view of the configuration: each member's role, URL and how far its log is
        behind ours (``lag``, entries) and whether it could be promoted now (``caught_up``).
        ``leased``: only while its lease holds (else ReadIndexUnavailable): a leader cut off past
        its lease may have been replaced, its view with it, without knowing it yet."""
        lag_max = self.config.promote_max_lag

        def look(core: RaftCore) -> dict[str, Any]:
            if not core.is_leader():
                raise NotLeader(*(self._leader_tuple() or (None, None)))
            if leased and core.lease_remaining() <= 0:
                raise ReadIndexUnavailable(f"{self.name} leads but its lease has lapsed: another may lead now")
            m = core.membership
            out = []
            for name in sorted(m.members):
                pr = core.progress(name)
                lag = 0 if name == core.id else core.last_index - (pr.match if pr else 0)
                out.append({"name": name, "url": self.peers.get(name, ""),
                            "role": "voter" if name in m.voters else "learner",
                            "lag": lag, "caught_up": name == core.id or core.caught_up(name, lag_max)})
            return {"leader": core.id, "term": core.term, "last_index": core.last_index,
                    "pending": core.membership_pending(), "members": out}

        return self.in_turn(look)

    def transfer_leadership(self, to: str | None, timeout: float) -> str | None:
        """Hand leadership to voter ``to`` (None: ``RaftCore.handover_target``'s), and wait up to
        ``timeout`` for another to lead; the new leader's name (None if none is known yet; ours if
        the hand-over ended without one, as it does when ``to`` did not catch up within an election
        timeout). Raises MembershipRefused (nothing done) or NotLeader."""

        def begin(core: RaftCore) -> str:
            if not core.is_leader():
                raise NotLeader(*(self._leader_tuple() or (None, None)))
            target = to
            if target is None:
                best = core.handover_target()
                if best is None:
                    raise MembershipRefused("invalid", f"{core.id} is the only voter")
                target = best[1]
            core.transfer_leadership(target)
            return target

        target = self.in_turn(begin)
        log.info("%s: handing leadership over to %s", self.name, target)
        deadline = time.monotonic() + timeout
        looked = time.monotonic()
        while (now := time.monotonic()) < deadline:
            leader = self._view.get("leader")
            if leader not in (None, self.name):
                return str(leader)
            if leader == self.name and now - looked >= 0.05:  # (a turn each time: not every tick)
                looked = now
                try:
                    if self.in_turn(lambda core: core.is_leader() and core.lead_transferee is None,
                                    max(0.05, deadline - now)):
                        return self.name  # the hand-over ended: we lead on
                except ProposalTimeout:
                    return None
            time.sleep(self.config.tick_ms / 1000.0)
        return None

    def wait_applied(self, index: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._apply_cond:
            while self._applied < index:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping.is_set():
                    return False
                self._apply_cond.wait(left)
            return True

    def applied_index(self) -> int:
        return self._applied

    def is_leader(self) -> bool:
        return self._view.get("role") == "leader" and self.fault is None

    def term(self) -> int:
        return int(self._view.get("term", 0))

    def leadership_start(self) -> float | None:
        """When (monotonic) this node became the leader of its current term; None if it does not lead it."""
        term, since, _ = self._leader_since
        return since if self.is_leader() and term == self.term() else None

    def leader_lease_until(self) -> float:
        """Until when (monotonic) our leader lease holds: no other leader can exist before then."""
        return self._lease_until

    def vote_quiet_s(self) -> float:
        """How long, at least, before we became leader every earlier leader's lease had ended (0 when
        we do not lead); negative: how long after it, at most, one may still have run. Each leader's
        lease lasts the lease of the window it announced from a message a majority heard; a majority
        voted for us, so one of our voters heard it, and it told us in its vote how many ticks it had
        heard no leader and the window it last heard announced (the core's ``election_gap``: the
        least, over our voters, of quiet less that lease). Less one tick: a count starts at the first
        tick after the hearing, which may come at once. Usually ``election_ticks_min -
        effective_lease_ticks - 1`` ticks (90 ms by default) or more, since a follower of a live
        leader votes no sooner; less (a longer wait) from a voter that had dropped its leader for a
        newer term; as much as a whole lease when the voters had long heard nothing. Below zero after
        a hand-over (``timeout_now``): its voters still heard their leader. That leader gave its lease
        up for its own reads then, but what it promised under the lease before (the catalog's cache
        leases, capped at its end) may run that much past our election, so it is not clipped at 0."""
        term, _, gap = self._leader_since
        if not self.is_leader() or term != self.term():
            return 0.0
        return (gap - 1) * self.config.tick_ms / 1000.0

    def leader(self) -> tuple[str, str] | None:
        name = self._view.get("leader")
        return None if name is None else (name, self.peers.get(name, ""))

    def can_serve_reads(self) -> bool:
        """Whether local reads reflect every acknowledged write (leader) or a caught-up follower."""
        view = self._view
        if self.fault is not None:
            return False
        if view.get("role") == "leader":
            return time.monotonic() < self._lease_until and self._applied >= view["term_start"]
        return view.get("role") in ("follower", "learner") and view.get("leader") is not None

    def read_index(self) -> int:
        """On the leader: an index every linearizable read must wait for (Raft's ReadIndex).

        Confirmed by the leader lease instead of a heartbeat round: while it holds, no other leader
        can have committed anything, so our commit index covers every acknowledged write.
        """
        if not self.can_serve_reads() or not self.is_leader():
            raise ReadIndexUnavailable(f"{self.name} is not a leader sure of its lease")
        return max(self._commit_seen, self._applied)

    def wait_read_index(self, timeout: float) -> int:
        """``read_index()``, waiting up to ``timeout`` while we lead but are not yet sure of it: a new
        leader's first heartbeat round, or a lease that lapsed for a moment (a busy machine), is a
        wait of a few ticks, not a reason to refuse the read. A node that stops leading refuses."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.read_index()
            except ReadIndexUnavailable:
                if not self.is_leader() or time.monotonic() >= deadline:
                    raise
            if self._stopping.wait(min(self.config.tick_ms / 1000.0, max(0.0, deadline - time.monotonic()))):
                raise ReadIndexUnavailable(f"{self.name} is stopping")

    def linearizable_index(self, timeout: float) -> int:
        """The read index for a read arriving now, here: our own on the leader, else the leader's
        (batched). Raises ReadIndexUnavailable."""
        if self.is_leader():
            return self.wait_read_index(timeout)
        return self._read_index.get(timeout)

    def status(self) -> dict[str, Any]:
        view = self._view
        applied, digest = self.sm.applied_and_digest()  # one read of the same state: O(1), no lock
        fault = self.fault
        return {
            "name": self.name,
            "url": self.url,
            "role": "failed" if fault else view["role"],
            "term": view["term"],
            "leader": None if fault else view["leader"],
            #: A leader says whether its leader lease holds: one whose lease lapsed may already
            #: have been replaced by a leader of a newer term it has not heard of.
            "leader_lease": bool(view["role"] == "leader" and not fault and time.monotonic() < self._lease_until),
            "error": fault,
            #: Faults survived since start, by kind, and the last one: nonzero ``error`` or
            #: ``sender`` means a bug the supervisor kept from clients.
            "loop_faults": dict(self.loop_faults),
            "last_loop_fault": self.last_loop_fault,
            "commit_index": max(view["commit"], applied),
            "applied_index": applied,
            "state_digest": digest,
            #: The timers in force (ms) and, on a leader, the round trips they follow
            #: (docs/replication.md, "Timers that follow the network").
            "timers": view.get("timers", {}),
            #: The configuration in force here (the latest in this replica's log; ``pending`` until
            #: committed): routers learn the tier's members and their URLs from it.
            "membership": view["membership"],
        }

    def liveness(self, turn_within: float = 2.0) -> str | None:
        """Why this replica is not live (None: it is): its event loop has exited, or takes no turn
        within ``turn_within`` s (a deadlock; a restart is the cure) and is not installing a
        snapshot (a large one takes longer, and a restart would begin it again). A storage fault the
        supervisor is retrying (a full disk) is live: a restart would not cure it, and the node
        recovers by itself once the cause clears; any other error that every reload meets for
        ``STUCK_FAULT_S`` is not. Asks no other replica."""
        if not self._started or self._stopping.is_set():
            return f"{self.name} is not running"
        if not self._loop_thread.is_alive():
            return f"{self.name}: its replication loop has exited"
        stuck = self._stuck_since
        if stuck is not None and not self._fault_is_storage and time.monotonic() - stuck > STUCK_FAULT_S:
            # A bug's error on every reload for that long (a storage fault is the disk's, which a
            # restart would not cure): what a restart may cure, and an orchestrator should see.
            return f"{self.name}: failing for over {STUCK_FAULT_S:g} s: {self.fault}"
        if self._broken is None and not self._installing:  # installing: at once (a probe times out too)
            try:
                self.in_turn(lambda core: None, turn_within)
            except ProposalTimeout:
                if self._installing:  # begun meanwhile: a restart would only begin it again
                    return None
                return f"{self.name}: no replication turn within {turn_within:g} s"
        return None

    def readiness(self, st: dict[str, Any] | None = None) -> str | None:
        """Why this replica cannot do its job now (None: it can): faulted, recovering (its log not
        yet caught up with a leader's first commit), a candidate, removed, a leader without its
        lease, or a follower or learner that knows no leader of its term. A ready follower has
        heard from its leader within an election timeout (else it would be a candidate). ``st``: a
        ``status()`` just read, if the caller has one."""
        st = st if st is not None else self.status()
        role = st["role"]
        if st["error"]:
            return f"{self.name}: {st['error']}"
        if role == "recovering":
            return f"{self.name} is recovering: catching up with the leader's log"
        if role == "leader":
            return None if st["leader_lease"] else f"{self.name} leads without its leader lease"
        if role in ("follower", "learner"):
            return None if st["leader"] else f"{self.name} knows no leader of term {st['term']}"
        return f"{self.name} is {role}"

    def add_channel(self, name: str, handle: Callable[[str, Any], Any]) -> None:
        """Serve another kind of frame connection on the peer port (before ``start``): the catalog's
        lease renewals. ``handle(client_name, frame)`` runs on the connection's reader thread."""
        if self._started:
            raise RuntimeError("channels are added before start()")
        self._channels[name] = Channel(handle, roles=CLIENT_ROLES.get(name))

    def add_leader_listener(self, cb: Callable[[bool, int], None]) -> None:
        """``cb(is_leader, term)`` on every leadership change, from the node's notifier thread."""
        self._leader_listeners.append(cb)

    def add_apply_listener(self, cb: Callable[[int, Any, Any], None]) -> None:
        """``cb(index, command, result)`` after each applied command (not no-ops), in the turn that
        applied it (on whichever thread took it) before the proposer is answered; it must be quick
        and must not call ``propose``."""
        self._apply_listeners.append(cb)

    # -- HTTP ------------------------------------------------------------------------------------
    def _make_blueprint(self) -> Blueprint:
        bp = Blueprint(f"raft_{self.name}", __name__)

        @bp.get("/raft/read_index")
        def raft_read_index() -> tuple[Response, int]:
            refused = (secret_refusal(request.headers.get("Authorization"), f"Bearer {self.secret}".encode())
                       or tls.role_refusal(request.environ, (tls.OWN_TIER,)))  # a follower of this tier
            if refused is not None:
                return jsonify({"error": {"code": refused[0], "message": refused[1]}}), refused[0]
            try:
                # Within the asking follower's own wait (its READ_WAIT is longer than this).
                index = self.wait_read_index(LEADER_READ_WAIT)
            except ReadIndexUnavailable as exc:
                return jsonify({"error": {"code": 503, "message": str(exc)}}), 503
            # A follower asking says who it is and the commit it knows: it will wait to apply
            # ``index``, so it is told the commit now (the core ignores a name it does not replicate to).
            asker, known = request.args.get("from", ""), plain_int(request.args.get("commit", ""))
            if asker and (known is None or known < index):
                self._submit("hurry", (asker, known))
            return jsonify({"index": index, "term": self.term()}), 200

        return bp

    def _parse(self, raw: list[Any]) -> list[Message]:
        """Well-formed messages addressed to us; anything else is ignored (the core takes requests
        from any replica and answers only from members of its configuration)."""
        out = []
        for d in raw:
            try:
                m = Message.from_dict(d)
            except (KeyError, ValueError, TypeError, AttributeError):
                continue
            if m.src != self.name and m.dst == self.name:
                out.append(m)
        return out

    def _on_frame(self, peer: str, frame: Any) -> None:
        """A frame from an authenticated connection (a reader thread): its messages from ``peer`` to us
        go to the event loop; anything else is ignored, as a lost message would be. A snapshot
        message goes only with the stream it closes, and only if the whole stream arrived."""
        if not isinstance(frame, dict):
            return
        if "chunk" in frame:
            self._incoming.chunk(peer, frame["chunk"])
            return
        raw = frame.get("messages")
        if not isinstance(raw, list):
            return
        msgs = [m for m in self._parse(raw) if m.src == peer]
        snaps = [m for m in msgs if m.type == SNAPSHOT]
        if snaps:
            msgs = [m for m in msgs if m.type != SNAPSHOT]
            path = self._incoming.finish(peer, frame.get("snapshot")) if len(snaps) == 1 else None
            if path is not None:
                snaps[0].payload = path
                msgs.append(snaps[0])
        if msgs:
            self._submit("msgs", (msgs, getattr(self._connection, "url", None)))

    # -- event loop ------------------------------------------------------------------------------
    def _submit(self, kind: str, value: Any) -> None:
        """Put an input in the inbox (stamped with when it arrived) and see it handled."""
        self._inbox.put((kind, value, time.monotonic()))
        self._drive()

    def _drive(self) -> None:
        """Take the next turn on this thread if nobody holds the core; if somebody does, it looks at
        the inbox again once it lets go, so the input is not left behind. After a few turns in a row
        (inputs keep coming), or while the node stops or recovers from a fault, the loop thread
        takes over."""
        for _ in range(_INLINE_TURNS):
            if self._inbox.empty():
                return
            if not self._core_lock.acquire(blocking=False):
                return
            try:
                if self._broken is not None or self._stopping.is_set():
                    break
                self._turn_thread = threading.get_ident()
                self._turn()
                if self._wake_at < self._loop_sleeps_until:
                    self._wake.set()  # e.g. elected: its heartbeats fall due before what the loop waits for
            except BaseException as exc:
                self._broken = exc  # before the lock is let go, as in ``_loop``
                if not isinstance(exc, Exception):
                    raise
                break
            finally:
                self._turn_thread = None
                self._core_lock.release()
        else:
            if self._inbox.empty():
                return  # nothing left over for the loop thread
        self._wake.set()

    def _run(self) -> None:
        """The event loop, supervised: an error in a turn, on any thread (a full disk, any bug),
        never leaves a replica up with a frozen view. The node drops its in-memory state, as a crash
        would, and reloads from disk after a backoff; Raft is built to survive exactly that. It
        retries until the fault clears (space returns), then catches up as after a restart. Other
        threads take no turn meanwhile (``_broken``); their inputs wait in the inbox."""
        while True:
            try:
                self._loop()
                return
            except BaseException as exc:  # (what another thread's turn raised, a BaseException too, comes here)
                with self._core_lock:
                    self._broken = exc
                    self._enter_fault(exc)
            while True:
                if self._stopping.wait(self._fault_backoff):
                    return
                self._fault_backoff = min(self._fault_backoff * 2, 1.0)
                try:
                    with self._core_lock:
                        # As a restart would: a connection the fault left broken (SQLite's "disk I/O
                        # error" for good after a full disk, seen once under the nemesis) is not reused.
                        self.store.reopen()
                        self.sm.reopen()
                        self.core = self._load_core()
                        self._caught_up = False
                        self._refresh_view()
                        # A turn another thread takes next must not count the backoff against the
                        # new core (an election at once).
                        self._count_ticks_from_now()
                        self._broken = None
                        self._stuck_since = None  # reloaded: a tier without a leader after it is not stuck
                    break
                except Exception as exc:
                    with self._core_lock:
                        self._enter_fault(exc)
            log.warning("%s: reloaded from disk after a fault; rejoining as a follower", self.name)

    def _enter_fault(self, exc: BaseException) -> None:
        first = self.fault is None
        storage = is_storage_fault(exc)
        if self._stuck_since is None or storage != self._fault_is_storage:  # a streak of one kind (a full disk, then a bug)
            self._stuck_since = time.monotonic()
        self._fault_is_storage = storage
        self.fault = describe(exc) if storage else f"replication loop error: {type(exc).__name__}: {exc}"
        self.loop_faults["storage" if storage else "error"] += 1
        self.last_loop_fault = self.fault
        self._fault_at = time.monotonic()
        if first:
            log.error("%s: %s; stepping down, serving nothing, retrying", self.name, self.fault, exc_info=exc)
        self._lease_until = 0.0
        self._view = {**self._view, "role": "failed", "leader": None}
        for prop in list(self._proposals.values()):
            prop.finish(error=ProposalTimeout(f"{self.name}: {self.fault}; outcome unknown", index=prop.index))
        self._proposals.clear()
        if self._was_leader:
            self._was_leader = False
            # As a step-down in ``_refresh_view``: what it measured as leader is of that leadership
            # (the core reloaded after the fault would be given it, and announce it if it led again).
            self._forget_timing()
            self._notify.put((False, int(self._view.get("term", 0))))

    def _loop(self) -> None:
        """Turns whenever the core's next timer falls due (an idle replica wakes at its heartbeats,
        not every tick) or another thread wakes it; raises the error of a turn taken elsewhere."""
        while not self._stopping.is_set():
            with self._core_lock:
                if self._broken is not None:
                    raise self._broken
                self._wake.clear()  # under the lock: a wake after this is seen below
                try:
                    self._turn()
                except BaseException as exc:
                    # Marked before the lock is let go: a half-handled Ready (entries sent, not
                    # written) must not be built on by another thread's turn, such as an
                    # acknowledgement counting this leader's unwritten entry towards a majority.
                    self._broken = exc
                    raise
                self._loop_sleeps_until = self._wake_at
            if not self._inbox.empty():
                continue  # left by a thread that found the lock taken
            self._wake.wait(max(0.0, self._loop_sleeps_until - time.monotonic()))

    def _turn(self) -> None:
        """With the core lock held: every input queued so far (each after the ticks that fell due
        before it arrived), the ticks due now, then the core's ``Ready``."""
        tick_s = self.config.tick_ms / 1000.0
        if time.monotonic() - self._wake_at > STALLED:
            # This process stood still (SIGSTOP, a long GC, a starved CPU): heartbeats sent before
            # were answered during it, and their round trips measure the stall, not the network.
            self._rtt.forget_pending()
        for _ in range(10_000):
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            # The ticks due before an input arrived come first: a follower that slept through ten
            # ticks and then hears from its leader must count none of them after hearing, or it
            # would vote for a successor while that leader's lease still holds.
            self._tick_until(item[2])
            self._handle_input(item)
        now = time.monotonic()
        self._tick_until(now)
        if now >= self._retune_at:
            self._retune(now)
        self._process_ready(self._next_tick - tick_s)
        self._wake_at = self._next_tick + (self.core.ticks_until_timer() - 1) * tick_s
        if self.fault is not None and self._caught_up and now - self._fault_at >= self.config.election_ticks_max * tick_s:
            # Only once it has caught up with a leader (or leads), which takes writing what it
            # missed, and an election timeout without a new fault: a follower with a full disk
            # that merely had nothing to write for a while is not working again.
            log.warning("%s: working again after %s", self.name, self.fault)
            self.fault = None
            self._fault_backoff = _FAULT_BACKOFF_MIN

    def _retune(self, now: float) -> None:
        """Every ``RETUNE_EVERY``: the timing the measured round trips ask for (``timers``), held
        against lowering too soon, to the core and to the peer connections' connect budgets."""
        self._retune_at = now + RETUNE_EVERY
        rtts = self._rtt.rtts(now)
        # The pace is the voters': the address book also names learners, members it was started
        # with and replicas it heard from, none of which makes a majority.
        voters = self.core.membership.voters
        needed = len(voters) // 2 + 1 - (self.name in voters)
        paced = {p: rtt for p, rtt in rtts.items() if p in voters}
        timing = self._timing_hold.update(now, derive(paced, needed, self.config.tick_ms) if self.config.adapt
                                          else Timing())
        # Told at every retune, changed or not (a leader lowers a window it took over only once
        # told, ``RaftCore._timing_told``, then step by step as the leases it gave allow), but only
        # what was measured: not before this leadership's hold is seeded (``_refresh_view``, after
        # this in a turn that won an election), nor without round trips of a majority (``derive``
        # asks nothing then, and "nothing" would undo a slow link's window).
        measured = not self.config.adapt or len(paced) >= needed
        if measured and self.core.is_leader() == self._was_leader:
            self.core.set_timing(timing)
        if timing != self._timing:
            self._timing = timing
            log.info("%s: round trips %s ask for %s; in force: %s", self.name,
                     {p: (round(m * 1000, 1), round(t * 1000, 1)) for p, (m, t) in rtts.items()}, timing,
                     self.core.timers())
        for peer, (_, tail) in rtts.items():
            sender = self._senders.get(peer)
            if sender is not None:
                sender.client.expect_rtt(tail)
        self._timers = self._timers_view(rtts)

    def _count_ticks_from_now(self) -> None:
        """The first tick falls due one tick from now: at start, and for a core reloaded after a
        fault (before any turn: ``_tick_until`` would count the time before as ticks)."""
        self._next_tick = time.monotonic() + self.config.tick_ms / 1000.0

    def _tick_until(self, until: float) -> None:
        """Advance the core by every tick due by ``until`` (monotonic), in one call. Far behind (a stall
        longer than two election timeouts past the core's next timer), the rest are dropped rather
        than stormed (``timers.ticks_due``): no timer counts them, but the core's clock, and so its
        lease, moves past them (``lost``)."""
        tick_s = self.config.tick_ms / 1000.0
        if until < self._next_tick:
            return
        passed = int((until - self._next_tick) / tick_s) + 1
        due = ticks_due(until - self._next_tick, tick_s, self.core.ticks_until_timer(),
                        2 * self.config.election_ticks_max)
        self.core.tick(due, lost=passed - due)  # one call: the ticks that only count are counted at once
        self._next_tick += passed * tick_s
        if until >= self._next_tick:
            self._next_tick = until + tick_s

    def _handle_input(self, item: tuple[str, Any, float]) -> None:
        kind, value, arrived = item
        if kind == "msgs":
            msgs, url = value
            for m in msgs:
                if m.type == HEARTBEAT_RESP:
                    self._rtt.answered(m.src, m.ctx, arrived)
                self.core.step(m)
                if m.type == SNAPSHOT and isinstance(m.payload, Path):
                    self._stepped_snapshots.append(m.payload)
                if url is not None and m.type in _SAYS_WHERE and m.term == self.core.term and (
                        m.type == VOTE or m.src == self.core.leader):  # taken, not merely read
                    told = (url, self.core.membership.urls.get(m.src))
                    if self._told_urls.get(m.src) != told:
                        self._told_urls = {**self._told_urls, m.src: told}
                        self._told_news = True
        elif kind == "propose":
            prop: _Proposal = value
            if prop.change is not None:
                try:
                    index: int | None = prop.change(self.core)
                except MembershipRefused as exc:
                    prop.finish(error=exc)
                    return
            else:
                index = self.core.propose(prop.command)
            if index is None:
                prop.finish(error=NotLeader(*(self._leader_tuple() or (None, None))))
            else:
                prop.index, prop.term = index, self.core.term
                self._proposals[index] = prop
        elif kind == "hurry":  # a follower about to serve a read at our commit index: (name, commit it knows)
            self.core.hurry_commit(*value)
        elif kind == "call":  # a look at (or a change of) the core, in a turn: (function, proposal)
            fn, prop = value
            with _CALLS:
                if prop.taken is None:
                    return  # its caller gave up (a hand-over nobody waits for must not begin)
                prop.taken = True
            try:
                prop.finish(fn(self.core))
            except Exception as exc:
                prop.finish(error=exc)
        elif kind == "forget":
            prop = value
            if self._proposals.get(prop.index) is prop:
                del self._proposals[prop.index]
            prop.settled.set()

    def _leader_tuple(self) -> tuple[str, str] | None:
        name = self.core.leader
        return None if name is None else (name, self.peers.get(name, ""))

    def _process_ready(self, tick_wall: float) -> None:
        rd = self.core.ready()
        if self._stepped_snapshots:  # received files the core ignored (stale) or superseded
            for path in self._stepped_snapshots:
                if rd.snapshot is None or path is not rd.snapshot.data:
                    self._incoming.discard(path)
            self._stepped_snapshots = []
        if self.core.membership is not self._membership_seen or self._told_news:
            self._sync_members()  # before this turn's messages go out: some may be to a new member
        if self.core.lead_transferee is not None or any(m.type == TIMEOUT_NOW for m in rd.messages):
            # Handing over: from ``timeout_now`` on, the target's voters may elect it at once, so
            # no read, and no cache grant, may count on our lease after this (before it is sent).
            self._lease_until = 0.0
        if not rd.is_empty():
            self._commit_seen = self.core.commit
            # A follower acknowledges only what is on its disk; a leader's appends go out before
            # its own write, and its commit news after its apply (Ready.steps, which the
            # simulator in tests/replication follows too).
            for step in rd.steps():
                if step == PERSIST:
                    self._persist(rd)
                elif step == SEND:
                    self._send(rd.messages)
                else:  # APPLY
                    self._apply(rd.committed_entries)
            self.core.advance(rd)
            self._maybe_compact()
        self._refresh_view(tick_wall)

    def _persist(self, rd: Ready) -> None:
        try:
            self._write(rd)
        finally:  # an install is over once the log store has recorded it (or lost, with what the loop held)
            self._installing = False

    def _write(self, rd: Ready) -> None:
        snap = rd.snapshot
        if snap is not None:
            if snap.data is None:
                raise RuntimeError("snapshot message without payload")
            self._installing = True
            try:
                self.store.begin_install(snap.index, snap.term, snap.membership)
                with self._apply_lock:
                    self.sm.restore(snap.index, snap.data)
                    self.sm.sync()  # before the log below gives up every entry: nothing to replay after
                    self._applied_at = (snap.index, snap.term)
                    self._applied_membership = snap.membership or self.core.snap_membership
            finally:  # installed, or lost with the rest of what the loop held (it reloads from disk)
                self._incoming.discard(snap.data)
            self.snapshots_installed += 1
            log.info("%s: installed a snapshot at index %d (its log was behind the leader's compaction)",
                     self.name, snap.index)
            for index, prop in list(self._proposals.items()):
                if index <= snap.index:
                    prop.finish(error=ProposalTimeout("replaced by a snapshot; outcome unknown"))
                    del self._proposals[index]
            self._set_applied(snap.index)
        hs = rd.hard_state
        if hs is not None and durable(hs) == self._durable_vote and not (
                rd.entries or rd.truncate_from is not None or snap is not None):
            # Only the commit index moved. Raft needs term, vote and floor (with what announced it) durable, not commit (a
            # restarted replica relearns it from the leader), so this costs no synced transaction in
            # the middle of every round; it is written whenever the hard state goes out with entries.
            hs = None
        self.store.save(hs, rd.entries, rd.truncate_from, None if snap is None else (snap.index, snap.term),
                        None if snap is None else snap.membership)
        if hs is not None:
            self._durable_vote = durable(hs)
        if rd.truncate_from is not None:
            # Our uncommitted suffix was replaced by another leader's: lost here, but not surely
            # everywhere. With five voters, two others may hold an entry and, with a third that
            # lacks both, elect a leader that commits it: not NotLeader ("not written"), unknown.
            for index, prop in list(self._proposals.items()):
                if index >= rd.truncate_from:
                    prop.finish(error=ProposalTimeout("replaced here by a newer leader's entry; another replica "
                                                      "may hold it still: outcome unknown", index))
                    del self._proposals[index]

    def _send(self, msgs: list[Message]) -> None:
        now = time.monotonic()
        for m in msgs:
            if m.type == HEARTBEAT:
                pr = self.core.progress(m.dst)
                if pr is not None:
                    self._timed_progress[m.dst] = pr
                self._rtt.sent(m.dst, m.ctx, now, caught_up=pr is not None
                               and pr.match >= self.core.commit - self.config.promote_max_lag)
            sender = self._senders.get(m.dst) or self._sender(m.dst)
            if sender is not None:
                sender.offer(m)

    # -- membership: whom we talk to ---------------------------------------------------------------
    def _address(self, name: str) -> tuple[str, int]:
        """Where ``name`` takes peer connections: given at construction, else its URL's port + 50."""
        return self._addresses.get(name) or raft_address(self.peers[name])

    def _sender(self, name: str) -> _Sender | None:
        """The sender to ``name``, made (and started, if we run) now if we know where it is."""
        if name == self.name or name not in self.peers:
            return None  # a leader we do not know yet: its hello gives its URL (``_on_hello``)
        sender = _Sender(self, name, self._address(name))
        self._senders[name] = sender
        if self._started and not self._stopping.is_set():
            sender.thread.start()
        return sender

    def _sync_members(self) -> None:
        """After a turn changed the configuration, or a request told where its sender serves (and at
        start): the address book from the configuration, a sender to each member, and none any more
        to a replica that left it (unless it is our leader) or whose URL changed (a member removed
        and added again elsewhere).

        A replica that sent us a request at our term (our leader, a candidate) is answered where
        the hello of the connection that brought it says it serves, as long as our configuration
        gives the URL it gave then: one that missed the entries which removed the leader and added
        it again under its name at another address (down, or cut off, meanwhile) would otherwise
        answer to the old address for good, and never get those entries (a leader backs off to
        what a follower lacks only on its answers). A stale process under the same name, at an
        older term, moves nothing."""
        m = self.core.membership
        self._membership_seen = m
        self._told_news = False
        # A word given against a URL our configuration no longer has is over (it must not come
        # back to life should the configuration give that URL again).
        self._told_urls = {n: told for n, told in self._told_urls.items() if m.urls.get(n) == told[1]}
        keep = m.members | set(self.core.replicating_to()) | ({self.core.leader} if self.core.leader else set())
        for name, timed in list(self._timed_progress.items()):
            if self.core.progress(name) is not timed:
                # Gone, or started afresh: another replica under a removed one's name (another host,
                # maybe another link), whose predecessor's round trips are not its own.
                self._rtt.forget(name)
                del self._timed_progress[name]
        with self._peers_lock:  # a replica still sent to (its removal not yet committed) keeps its URL
            kept = {n: u for n, u in self.peers.items() if n in keep}
            peers = {**self._heard_urls, **self._boot_peers, **kept, **m.urls}
            for name, (url, _) in self._told_urls.items():
                if name in peers and name != self.name:
                    peers[name] = url
            self.peers = peers
        for name, sender in list(self._senders.items()):
            if name not in keep or name not in self.peers or (
                    name not in self._addresses and sender.address != self._address(name)):
                del self._senders[name]
                sender.queue.put(None)  # it ends on its own; ``stop`` joins it
                self._retired.append(sender)
        for name in sorted(m.members - self._senders.keys()):
            self._sender(name)

    def _admits(self, name: str, hello: dict[str, Any]) -> bool:
        """Who may open a Raft connection to us: a replica we know of, or one of our tier
        (``catalog-4`` to ``catalog-1``) that says where it serves, as every replica's sender
        does: a leader added after our configuration must reach us to give us the entry that adds
        it, and we must be able to answer it."""
        if name == self.name:
            return False
        return name in self.peers or (name.rpartition("-")[0] == self.name.rpartition("-")[0]
                                      and isinstance(hello.get("url"), str))

    def _on_hello(self, peer: str, hello: dict[str, Any]) -> None:
        """A replica says where it serves: kept for one our configuration does not name (a leader
        added after it), so that our answers can reach it, and for this connection's requests
        (``_sync_members``). On the reader thread that then reads this connection's frames."""
        url = hello.get("url")
        try:
            raft_address(url) if isinstance(url, str) else None
        except ValueError:
            url = None
        self._connection.url = url if isinstance(url, str) else None
        if isinstance(url, str) and peer not in self.peers and peer not in self._heard_urls:
            with self._peers_lock:
                if peer not in self.peers and peer not in self._heard_urls:  # (a turn may have named it)
                    self._heard_urls = {**self._heard_urls, peer: url}
                    self.peers = {**self.peers, peer: url}

    def _apply(self, entries: list[Entry]) -> None:
        todo = [e for e in entries if e.index > self._applied]
        if not todo:
            return
        # A configuration is the log's business, not the state's: the state machine gets a no-op.
        memberships = {e.index: m for e in todo if (m := Membership.of(e.command)) is not None}
        with self._apply_lock:  # a storage fault raises: the loop's supervisor retries the batch
            outcomes = self.sm.apply_many([(e.index, None if e.index in memberships else e.command) for e in todo])
            self._applied_at = (todo[-1].index, todo[-1].term)
            if memberships:
                self._applied_membership = memberships[max(memberships)]
        self._set_applied(todo[-1].index)  # readers see the batch once it is committed, as a whole
        for e, (result, error) in zip(todo, outcomes, strict=True):
            if error is not None:  # a deterministic command failure: the same on every replica
                log.error("%s: applying entry %d failed", self.name, e.index, exc_info=error)
            if e.index in memberships:
                log.info("%s: configuration at index %d committed: %s", self.name, e.index,
                         memberships[e.index].to_dict())
                result = memberships[e.index].to_dict()
            elif e.command is not None and error is None:
                for cb in self._apply_listeners:
                    try:
                        cb(e.index, e.command, result)
                    except Exception:
                        log.exception("%s: apply listener failed", self.name)
            prop = self._proposals.pop(e.index, None)
            if prop is not None:
                if prop.term != e.term:
                    prop.finish(error=NotLeader(*(self._leader_tuple() or (None, None))))
                else:
                    prop.finish(result, error)

    def _set_applied(self, index: int) -> None:
        with self._apply_cond:
            self._applied = index
            self._apply_cond.notify_all()

    def keep_entries(self) -> int:
        """Applied entries worth keeping for lagging followers, from the state's size now (one
        ``PRAGMA`` per call): ``keep_entries`` at most, ``min_keep_entries`` at least."""
        cfg = self.config
        size = self.sm.size_bytes() if cfg.replay_bytes_per_entry > 0 else None
        if size is None:
            return cfg.keep_entries
        return max(min(cfg.min_keep_entries, cfg.keep_entries),
                   min(cfg.keep_entries, size // cfg.replay_bytes_per_entry))

    def _maybe_compact(self) -> None:
        """Compact applied entries by count and by size, whichever asks for more. The count kept
        follows the state's size, read again only when the log has grown past the last count kept
        plus the slack (the state's size changes slowly; a read per turn would not be free)."""
        cfg, core = self.config, self.core
        upto = 0
        if core.applied - core.snap_index > self._keep + cfg.compact_slack:
            self._keep = self.keep_entries()
            if core.applied - core.snap_index > self._keep + cfg.compact_slack:
                upto = core.applied - self._keep
        if self.store.log_bytes > cfg.keep_bytes + cfg.compact_slack_bytes:
            upto = max(upto, self.store.index_keeping(cfg.keep_bytes))
        if min(upto, core.applied) > core.snap_index:
            res = core.compact(upto)
            if res is not None:
                # The state machine commits unsynced (the log is the durable record): once the log
                # drops these entries, a power loss could roll the state back past its new start.
                self.sm.sync()
                self.store.compact(*res, core.snap_membership)

    def _refresh_view(self, tick_wall: float | None = None) -> None:
        core = self.core
        is_leader = core.is_leader()
        if not self._caught_up:
            target = core.first_leader_commit
            if is_leader or (target is not None and self._applied >= target):
                self._caught_up = True
        role = core.public_role
        if role == "follower" and not self._caught_up:
            role = "recovering"
        self._count_transitions(core.role, core.leader, role)
        if is_leader and tick_wall is not None:
            self._lease_until = tick_wall + core.lease_remaining() * self.config.tick_ms / 1000.0
        elif not is_leader:
            self._lease_until = 0.0
        if core.lead_transferee is not None:
            self._lease_until = 0.0  # handing over: no reads or cache grants on our lease (``_process_ready``)
        if role == "follower" and not core.is_voter():
            role = "learner" if self.name in core.membership.members else "removed"
        membership = self._view.get("membership")
        if membership is None or self._view.get("_membership") is not core.membership:
            membership = {**core.membership.to_dict(), "pending": core.membership_pending()}
        elif membership["pending"] != core.membership_pending():
            membership = {**membership, "pending": core.membership_pending()}
        self._view = {
            "role": role,
            "term": core.term,
            "leader": core.leader,
            "commit": core.commit,
            "term_start": core.term_start_index,
            "timers": self._timers,
            "membership": membership,
            "_membership": core.membership,
        }
        if is_leader != self._was_leader:
            self._was_leader = is_leader
            self._forget_timing()
            if is_leader:
                now = time.monotonic()
                self._leader_since = (core.term, now, core.election_gap)
                # Until our own round trips say otherwise (for a hold), keep the window we took
                # over: a new leader that fell back to the configured one before measuring
                # anything would lose a WAN's followers and its leadership with them.
                self._timing_hold.update(now, implied(core.timers()["election"]))
                log.info("%s: leads in term %d (timers in ticks of %g ms: %s)", self.name, core.term,
                         self.config.tick_ms, core.timers())
            else:
                # What we measured as leader is of that leadership: a follower measures nothing, so
                # it would otherwise keep it (and announce it, with its heartbeat and probe, if it
                # led again; a new leader keeps the window it hears anyway).
                core.set_timing(self._timing)
                log.info("%s: no longer leads (term %d, leader %s)", self.name, core.term, core.leader)
            self._notify.put((is_leader, core.term))

    def _forget_timing(self) -> None:
        """Each leadership measures its own round trips and the timing they ask for: those of an
        earlier one are old (and may have been taken across this process's stall), and one a
        follower kept would be announced if it led again."""
        self._rtt, self._timing_hold, self._timing = RttMeter(), Hold(self.config.timing_hold_s), Timing()
        #: The core's progress of each follower timed, as its last heartbeat found it (``_sync_members``
        #: forgets the round trips of one whose progress is gone or new).
        self._timed_progress: dict[str, Progress] = {}

    def _timers_view(self, rtts: dict[str, float]) -> dict[str, Any]:
        """For /status, made at each retune (not every turn: the view is refreshed on every one)."""
        tick = self.config.tick_ms
        out: dict[str, Any] = {f"{k}_ms": v * tick for k, v in self.core.timers().items()}
        out["adapt"] = self.config.adapt
        if self.core.is_leader():
            out["rtt_ms"] = {p: round(median * 1000.0, 1) for p, (median, _) in sorted(rtts.items())}
            out["rtt_tail_ms"] = {p: round(tail * 1000.0, 1) for p, (_, tail) in sorted(rtts.items())}
        return out

    def _count_transitions(self, raw_role: str, leader: str | None, role: str) -> None:
        """Elections started, leader changes seen, time to catch up: counted where they happen."""
        if raw_role == CANDIDATE and self._last_raw_role != CANDIDATE:
            self.elections += 1  # a real election (term + 1), not a pre-vote
        if leader is not None and leader != self._last_leader:
            if self._last_leader is not None:
                self.leader_changes += 1  # the first leader learnt after start is no failover
            self._last_leader = leader
        self._last_raw_role = raw_role
        if self.catch_up_seconds is None and role in ("leader", "follower"):
            self.catch_up_seconds = time.monotonic() - self._created

    def _run_notifier(self) -> None:
        """Supervised: a listener's error is logged and the next change is still delivered."""
        while True:
            item = self._notify.get()
            if item is None:
                return
            for cb in list(self._leader_listeners):
                try:
                    cb(*item)
                except Exception:
                    log.exception("%s: leader listener failed", self.name)
