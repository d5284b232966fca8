"""Three threaded ``ReplicaNode``s in one process talking over real sockets: their peer transport on
free ports, and HTTP (werkzeug servers) for what clients and peers ask over HTTP."""

from __future__ import annotations

import logging
import socket
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from flask import Flask
from werkzeug.serving import make_server

from pygmy.cluster.local import free_port
from pygmy.replication.core import Entry, HardState, Membership
from pygmy.replication.log_store import LogStore
from pygmy.replication.node import NotLeader, ReadIndexUnavailable, ReplicaNode, ReplicationConfig
from pygmy.replication.statemachine import SQLiteStateMachine
from pygmy.replication.transport import encode, read_frame

logging.getLogger("werkzeug").setLevel(logging.ERROR)
SECRET = "test-secret"
CONFIG = ReplicationConfig(keep_entries=50, compact_slack=20)


class KV(SQLiteStateMachine):
    schema = ("CREATE TABLE IF NOT EXISTS kv (k TEXT PRIMARY KEY, v INTEGER NOT NULL)",)
    digest_tables = ("kv",)

    def execute(self, conn: sqlite3.Connection, index: int, command: dict[str, Any]) -> Any:
        row = conn.execute("SELECT v FROM kv WHERE k=?", (command["k"],)).fetchone()
        value = (row[0] if row else 0) + command.get("add", 0)
        conn.execute("INSERT OR REPLACE INTO kv(k, v) VALUES (?, ?)", (command["k"], value))
        return value



class Switch:
    """A WSGI app whose target can be swapped, so a 'restarted' replica keeps its port."""

    def __init__(self) -> None:
        self.app: Any = None

    def __call__(self, environ, start_response):
        app = self.app
        if app is None:
            start_response("503 Service Unavailable", [("Content-Type", "application/json")])
            return [b'{"error": {"code": 503, "message": "down"}}']
        return app(environ, start_response)


class Harness:
    def __init__(self, tmp: Path, n: int = 3, config: ReplicationConfig = CONFIG) -> None:
        self.tmp, self.config = tmp, config
        self.switches: dict[str, Switch] = {}
        self.servers = []
        self.peers: dict[str, str] = {}
        self.addresses: dict[str, tuple[str, int]] = {}
        for i in range(1, n + 1):
            name = f"kv-{i}"
            sw = Switch()
            server = make_server("127.0.0.1", 0, sw, threaded=True)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self.switches[name] = sw
            self.servers.append(server)
            self.peers[name] = f"http://127.0.0.1:{server.server_port}"
            self.addresses[name] = ("127.0.0.1", free_port())
        self.nodes: dict[str, ReplicaNode] = {}
        self.sms: dict[str, KV] = {}
        for name in self.peers:
            self.start(name)

    def start(self, name: str) -> ReplicaNode:
        sm = KV(self.tmp / name / "state.db")
        node = ReplicaNode(name, self.peers, sm, self.tmp / name, SECRET, self.config, addresses=self.addresses)
        app = Flask(name)
        app.register_blueprint(node.blueprint)
        node.start()
        self.nodes[name], self.sms[name] = node, sm
        self.switches[name].app = app
        return node

    def stop(self, name: str) -> None:
        self.switches[name].app = None
        node = self.nodes.pop(name)
        node.stop()
        self.sms.pop(name).close()

    def close(self) -> None:
        for name in list(self.nodes):
            self.stop(name)
        for server in self.servers:
            server.shutdown()
            server.server_close()

    def leader(self, timeout: float = 5.0) -> ReplicaNode:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            leaders = [n for n in self.nodes.values() if n.is_leader()]
            if len(leaders) == 1 and leaders[0].can_serve_reads():
                return leaders[0]
            time.sleep(0.01)
        raise AssertionError("no leader")

    def until(self, predicate, timeout: float = 10.0) -> None:
        """``wait_for(predicate)``, failing with every node's status."""
        try:
            wait_for(predicate, timeout, "the condition")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {[n.status() for n in self.nodes.values()]}") from None

    def converge(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = [n.status() for n in self.nodes.values()]
            if len({(s["applied_index"], s["state_digest"]) for s in st}) == 1 and st[0]["applied_index"] > 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"replicas did not converge: {[n.status() for n in self.nodes.values()]}")


@pytest.fixture
def cluster(tmp_path):
    h = Harness(tmp_path)
    try:
        yield h
    finally:
        h.close()


def miss_commands(h: Harness, n: int, **extra: Any) -> str:
    """Stop a follower, then commit ``n`` commands without it; its name."""
    leader = h.leader()
    away = next(name for name in h.nodes if name != leader.name)
    h.stop(away)
    for i in range(n):
        leader.propose({"k": f"k{i % 5}", "add": 1, **extra}, timeout=2)
    return away


def installed_snapshots(node: ReplicaNode, expect_one: bool = True) -> int:
    """``node.snapshots_installed``, waited for (up to 5 s) when one is expected. Status reads the
    state machine, restored a few statements before the count goes up: replicas can agree a moment
    before the count says so (one make test saw 0)."""
    deadline = time.monotonic() + 5
    while expect_one and node.snapshots_installed == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    return node.snapshots_installed


def test_the_log_is_compacted_by_size_as_well_as_by_count(tmp_path: Path) -> None:
    """Big commands, a count budget never reached: the size budget alone keeps the log small, on disk
    and in memory, on every replica; a follower that missed more than it keeps gets a snapshot."""
    big = "x" * 1000
    config = ReplicationConfig(keep_entries=10_000, compact_slack=2_000, keep_bytes=20_000, compact_slack_bytes=10_000)
    h = Harness(tmp_path, config=config)
    try:
        away = miss_commands(h, 120, pad=big)
        for node in h.nodes.values():
            store = node.store
            on_disk = store._conn.execute("SELECT COALESCE(SUM(LENGTH(command)), 0) FROM raft_log").fetchone()[0]
            assert store.log_bytes == on_disk, "the running total is what the file holds"
            assert on_disk <= config.keep_bytes + config.compact_slack_bytes + 1100
            assert node.core.snap_index > 60, "compacted by size, far below the count budget"
            assert len(node.core._log) == node.core.last_index - node.core.snap_index
        back = h.start(away)
        h.converge(timeout=10)
        assert installed_snapshots(back) == 1
    finally:
        h.close()


@pytest.mark.parametrize("replay_bytes_per_entry", [10**9, 0])
def test_a_small_state_keeps_few_entries_and_a_follower_far_behind_gets_a_snapshot(
        tmp_path: Path, replay_bytes_per_entry: int) -> None:
    """A state that costs less to copy than its log costs to replay: the log keeps only
    ``min_keep_entries`` (a replay cost huge against the state's size), and a follower that missed
    more gets the state, not the entries. With the rule off (0) the count budget alone decides,
    which 120 commands do not reach: the follower catches up from the log."""
    config = ReplicationConfig(keep_entries=10_000, compact_slack=20, min_keep_entries=30,
                               replay_bytes_per_entry=replay_bytes_per_entry)
    h = Harness(tmp_path, config=config)
    try:
        away = miss_commands(h, 120)
        for node in h.nodes.values():
            kept = node.core.last_index - node.core.snap_index
            assert (kept <= 30 + 20) if replay_bytes_per_entry else (kept >= 120), kept
        back = h.start(away)
        h.converge(timeout=10)
        assert installed_snapshots(back, expect_one=bool(replay_bytes_per_entry)) == (1 if replay_bytes_per_entry else 0)
        assert back.sm.read("SELECT SUM(v) FROM kv")[0][0] == 120
    finally:
        h.close()


def test_the_state_is_synced_before_the_log_gives_up_what_it_stands_for(tmp_path: Path, monkeypatch) -> None:
    """The state machine commits unsynced (``synchronous=NORMAL``): after a power loss it is rebuilt
    by replaying the log. So before the log drops entries (a compaction, a snapshot install), the
    state is synced: every compaction and install on every replica comes after a sync of its state."""
    events: list[tuple[str, Path]] = []
    sync, compact, save = SQLiteStateMachine.sync, LogStore.compact, LogStore.save

    def syncing(self: SQLiteStateMachine) -> None:
        sync(self)
        events.append(("sync", Path(self.path).parent))

    def compacting(self: LogStore, *args: Any, **kw: Any) -> None:
        events.append(("compact", self.path.parent))
        compact(self, *args, **kw)

    def saving(self: LogStore, *args: Any, **kw: Any) -> None:
        snapshot = kw.get("snapshot", args[3] if len(args) > 3 else None)
        if snapshot is not None:
            events.append(("install", self.path.parent))
        save(self, *args, **kw)

    monkeypatch.setattr(SQLiteStateMachine, "sync", syncing)
    monkeypatch.setattr(LogStore, "compact", compacting)
    monkeypatch.setattr(LogStore, "save", saving)
    cluster = Harness(tmp_path)
    try:
        leader = cluster.leader()
        away = next(n for n in cluster.nodes if n != leader.name)
        cluster.stop(away)
        for _ in range(150):  # past keep_entries + slack: compacted beyond what ``away`` holds
            leader.propose({"k": "a", "add": 1}, timeout=5)
        cluster.start(away)
        cluster.until(lambda: cluster.nodes[away].snapshots_installed == 1)
    finally:
        cluster.close()
    kinds = {kind for kind, _ in events}
    assert {"compact", "install"} <= kinds, events
    for i, (kind, where) in enumerate(events):
        if kind != "sync":
            assert ("sync", where) in events[:i] and [e for e in events[:i] if e[1] == where][-1] == ("sync", where), \
                (kind, where, events[:i])


def test_a_state_behind_the_start_of_its_log_is_refused(tmp_path: Path) -> None:
    """Entries between the state's index and the log's start are in neither (a state rolled back
    under a compacted log): the node refuses to start on it rather than apply on with a gap."""
    store = LogStore(tmp_path / "kv-1" / "raft.db")
    store.save(HardState(2, None, 100), [Entry(101, 2, {"k": "a", "add": 1})], None, (100, 2))
    store.close()
    sm = KV(tmp_path / "kv-1" / "state.db")  # at index 0
    try:
        with pytest.raises(RuntimeError, match="behind the log's start"):
            ReplicaNode("kv-1", {"kv-1": "http://127.0.0.1:9"}, sm, tmp_path / "kv-1", SECRET, CONFIG)
    finally:
        sm.close()


def test_a_proposal_truncated_away_here_has_an_unknown_outcome(tmp_path: Path) -> None:
    """A newer leader's entry replaced ours in this replica's log. Other replicas may still hold
    ours (with five voters, two of them, and a third lacking both, can elect a leader that commits
    it), so its proposer hears "outcome unknown", never NotLeader ("not written")."""
    from pygmy.replication.core import Ready
    from pygmy.replication.node import ProposalTimeout, _Proposal

    sm = KV(tmp_path / "kv-1" / "state.db")
    node = ReplicaNode("kv-1", {"kv-1": "http://127.0.0.1:9"}, sm, tmp_path / "kv-1", SECRET, CONFIG)
    try:
        prop = _Proposal({"k": "a", "add": 1})
        prop.index, prop.term = 3, 1
        node._proposals[3] = prop
        node.core.ready = lambda: Ready(truncate_from=2)  # type: ignore[method-assign]
        with node._core_lock:
            node._process_ready(time.time())
        assert isinstance(prop.error, ProposalTimeout) and prop.error.index == 3, prop.error
        assert 3 not in node._proposals
    finally:
        node.store.close()
        sm.close()


def test_replicate_failover_catch_up_and_snapshot(cluster: Harness) -> None:
    leader = cluster.leader()
    for i in range(30):
        assert leader.propose({"k": "a", "add": 1}, timeout=2) == i + 1
    cluster.converge()
    st = leader.status()
    assert st["role"] == "leader" and st["leader"] == leader.name and st["term"] >= 1

    # A follower refuses writes and names the leader.
    follower = next(n for n in cluster.nodes.values() if n is not leader)
    with pytest.raises(NotLeader) as info:
        follower.propose({"k": "a", "add": 1}, timeout=1)
    assert info.value.leader_name == leader.name
    assert info.value.leader_url == cluster.peers[leader.name]

    # Failover: stop the leader; a new one takes writes (how fast is a benchmark's business:
    # experiments/failover.py; here only a generous bound on the wait).
    old = leader.name
    cluster.stop(old)
    new = cluster.leader(timeout=10)
    assert new.propose({"k": "a", "add": 1}, timeout=5) == 31
    for _ in range(100):  # enough for the log to be compacted past what the old leader has
        new.propose({"k": "b", "add": 2}, timeout=2)
    assert new.core.snap_index > 31

    # The old leader restarts, receives a snapshot (its next entries were compacted) and catches up.
    back = cluster.start(old)
    cluster.converge(timeout=10)
    deadline = time.monotonic() + 2  # status reads the restored state a moment before the install is counted
    while (back.status()["role"] != "follower" or not back.snapshots_installed) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert back.status()["role"] == "follower"
    assert back.core.snap_index > 31 and back.snapshots_installed == 1
    assert cluster.sms[old].read("SELECT v FROM kv WHERE k='b'")[0][0] == 200

    # Catch-up from the log (no snapshot) after a short absence.
    follower = next(n for n in cluster.nodes.values() if not n.is_leader())
    name = follower.name
    cluster.stop(name)
    leader = cluster.leader()
    for _ in range(10):
        leader.propose({"k": "c", "add": 1}, timeout=2)
    back = cluster.start(name)
    cluster.converge(timeout=10)
    assert back.snapshots_installed == 0, "a short absence must be caught up from the log, not a snapshot"
    deadline = time.monotonic() + 2
    while not back.can_serve_reads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert back.can_serve_reads()


def test_peer_transport_requires_the_secret_and_a_member(cluster: Harness) -> None:
    """Without the cluster secret a connection is refused before any message is read; with it, a
    message from a non-member, or naming another sender than the connection's, changes nothing."""
    leader = cluster.leader()
    target = next(n for n in cluster.nodes.values() if n is not leader)
    term = target.term()
    bogus = {"type": "vote", "src": "intruder", "dst": target.name, "term": term + 50, "index": 10**6,
             "log_term": term + 50}
    with socket.create_connection(cluster.addresses[target.name], timeout=2) as s:
        s.sendall(encode({"hello": "kv-9", "secret": "wrong", "channel": "raft"}))
        s.sendall(encode({"messages": [{**bogus, "src": "kv-9"}]}))
        reply = read_frame(s.makefile("rb"))
        assert reply == {"error": {"code": 403, "message": "wrong internal secret"}}
        assert s.recv(1) == b""  # closed
    other = next(n for n in cluster.nodes if n not in (leader.name, target.name))
    delivered: list = []
    real_put = target._inbox.put
    target._inbox.put = lambda item, *a, **k: (delivered.append(item), real_put(item, *a, **k))  # type: ignore[method-assign]
    stale = {"type": "heartbeat", "src": other, "dst": target.name, "term": 0}  # harmless: an old term
    with socket.create_connection(cluster.addresses[target.name], timeout=2) as s:
        s.sendall(encode({"hello": other, "secret": SECRET, "channel": "raft"}))
        s.sendall(encode({"messages": [bogus, {**bogus, "src": leader.name}, stale]}))  # not who said hello
        # Our frame's message, not merely the leader's next heartbeat (which may come first).
        wait_for(lambda: any(kind == "msgs" and any(m.src == other and m.term == 0 for m in value[0])
                             for kind, value, _ in delivered), 5, "the frame was read")
    msgs = [m for kind, value, _ in delivered if kind == "msgs" for m in value[0]]
    # Only our frame's messages carry term 0 or term + 50: the cluster's own traffic (a pre-vote
    # answer from ``other`` when a loaded machine delays a heartbeat) is neither.
    assert [(m.src, m.type, m.term) for m in msgs if m.term in (0, term + 50)] == [(other, "heartbeat", 0)]
    assert target.term() < term + 50


def test_a_follower_counts_no_tick_that_fell_due_before_it_heard_its_leader(cluster: Harness) -> None:
    """An idle follower sleeps between heartbeats (200 ms apart) and catches up on the ticks it slept
    through when one arrives. Counted after the heartbeat, those ticks would make it think it had
    heard nothing for 90 ms more than it had: it would vote that much sooner, while the leader's
    lease still holds, and tell a successor its old lease ended sooner than it did (``vote_quiet_s``).
    So its count never runs ahead of the time since it heard (by more than the tick that may fall
    due at once, and one for the queue)."""
    leader = cluster.leader()
    follower = next(n for n in cluster.nodes.values() if n is not leader)
    core, tick_s = follower.core, follower.config.tick_ms / 1000.0
    # Measured from the first message heard after the patch: before it, the core's count started at
    # a hearing the test did not see (on a busy machine a heartbeat may come late).
    heard: list[float | None] = [None]
    ahead, turns = [0.0], [0]
    real_step, real_tick = core.step, core.tick

    def step(m: Any) -> None:
        real_step(m)
        if m.src == leader.name and m.type in ("heartbeat", "append"):
            heard[0] = time.monotonic()

    def tick(n: int = 1, lost: int = 0) -> None:
        real_tick(n, lost)
        turns[0] += 1
        if heard[0] is not None:
            ahead[0] = max(ahead[0], core._quiet * tick_s - (time.monotonic() - heard[0]))

    core.step, core.tick = step, tick  # type: ignore[method-assign]
    try:
        time.sleep(1.0)
    finally:
        core.step, core.tick = real_step, real_tick  # type: ignore[method-assign]
    # The patched core is the one that ran (a failed turn would have reloaded another): at least a
    # turn per heartbeat heard.
    assert follower.core is core and follower.faults == 0 and turns[0] >= 4 and heard[0] is not None
    assert core.role == "follower"
    assert ahead[0] <= 2 * tick_s, f"counted {ahead[0] * 1000:.0f} ms that had not passed since it heard"


def test_leader_listener_and_apply_listener(cluster: Harness) -> None:
    applied: list[tuple[int, Any, Any]] = []
    leader = cluster.leader()
    leader.add_apply_listener(lambda i, c, r: applied.append((i, c, r)))
    followers = [n for n in cluster.nodes.values() if n is not leader]
    events: dict[str, list[tuple[bool, int]]] = {n.name: [] for n in followers}
    for n in followers:  # whichever of them wins the election must be told
        n.add_leader_listener(lambda is_leader, term, name=n.name: events[name].append((is_leader, term)))
    follower = followers[0]
    leader.propose({"k": "x", "add": 5}, timeout=2)
    assert applied and applied[-1][1] == {"k": "x", "add": 5} and applied[-1][2] == 5
    assert leader.wait_applied(applied[-1][0], 1)
    assert follower.wait_applied(applied[-1][0], 2)
    cluster.stop(leader.name)
    new = cluster.leader()
    deadline = time.monotonic() + 5
    while not events[new.name] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events[new.name] and events[new.name][-1] == (True, new.term())


def test_whole_cluster_restart_keeps_committed_state(cluster: Harness) -> None:
    leader = cluster.leader()
    for _ in range(20):
        leader.propose({"k": "d", "add": 3}, timeout=2)
    names = list(cluster.nodes)
    for name in names:
        cluster.stop(name)
    for name in names:
        cluster.start(name)
    leader = cluster.leader(timeout=5)
    assert leader.propose({"k": "d", "add": 1}, timeout=2) == 61
    cluster.converge()
    for name in names:
        assert cluster.sms[name].read("SELECT v FROM kv WHERE k='d'")[0][0] == 61


def test_config_from_env() -> None:
    cfg = ReplicationConfig.from_env(
        {"PYGMY_RAFT_TICK_MS": "5", "PYGMY_RAFT_KEEP_ENTRIES": "7", "PYGMY_RAFT_PRE_VOTE": "0"}
    )
    assert cfg.tick_ms == 5.0 and cfg.keep_entries == 7 and cfg.pre_vote is False
    assert cfg.lease_ticks is None and cfg.effective_lease_ticks() == 20


def wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s: {what}")


def write_somewhere(cluster: Harness, k: str) -> None:
    """One write through whichever replica leads now (retried across the failover)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for n in list(cluster.nodes.values()):
            try:
                n.propose({"k": k, "add": 1}, timeout=1)
                return
            except Exception:  # NotLeader or ProposalTimeout: try the next
                continue
        time.sleep(0.05)
    raise AssertionError("no write got through")


def fill_log_store(node: ReplicaNode, monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Make ``node``'s log store full (no page beyond those it has, on every connection it opens:
    a reload opens new ones); the function returned makes room again."""
    full, real_open = [True], node.store._open

    def opened() -> sqlite3.Connection:
        conn = real_open()
        if full[0]:
            conn.execute(f"PRAGMA max_page_count={conn.execute('PRAGMA page_count').fetchone()[0]}")
        return conn

    def room() -> None:
        full[0] = False
        node.store._conn.execute("PRAGMA max_page_count=1073741823")

    monkeypatch.setattr(node.store, "_open", opened)
    conn = node.store._conn
    conn.execute(f"PRAGMA max_page_count={conn.execute('PRAGMA page_count').fetchone()[0]}")
    return room


@pytest.mark.allow_faults("storage")
def test_a_full_disk_on_the_leader_is_a_state_it_recovers_from(cluster: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader's log store fills: it steps down, reports it, serves nothing, and rejoins on its
    own once there is room again; no write acknowledged meanwhile is lost (#16)."""
    from pygmy.replication.core import Timing

    old = cluster.leader()
    for _ in range(5):
        old.propose({"k": "a", "add": 1}, timeout=2)
    measured = Timing(heartbeat_ticks=9, election_ticks=60)  # as if its round trips had asked for it
    old.in_turn(lambda core: (core.set_timing(measured), old._timing_hold.update(time.monotonic(), measured)))
    old._timing = measured
    room = fill_log_store(old, monkeypatch)
    with pytest.raises(Exception):  # noqa: B017 (NotLeader or ProposalTimeout: not acknowledged)
        old.propose({"k": "big", "add": 1, "pad": "x" * 50_000}, timeout=2)
    wait_for(lambda: (old.fault or "").startswith("disk full"), 5, "the full replica reports it")
    st = old.status()
    assert st["role"] == "failed" and st["error"].startswith("disk full") and not old.is_leader()
    assert not old.can_serve_reads()
    for i in range(10):  # writes go on (on another leader, or on this one if small writes still fit)
        write_somewhere(cluster, f"during-{i}")
    room()
    wait_for(lambda: old.fault is None, 10, "the replica works again")
    # Stepped down by the fault, it forgot what it measured as leader (the reloaded core was given
    # it, and would have announced it if it led again).
    assert old._timing == Timing() and (old.is_leader() or old.in_turn(lambda core: core._timing) == Timing())
    cluster.converge(timeout=10)
    assert cluster.sms[old.name].read("SELECT v FROM kv WHERE k='a'")[0][0] == 5
    assert old.faults > 0 and old.store._conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


class BrokenConnection:
    """A SQLite connection a fault left broken for good: every statement fails with SQLite's
    "disk I/O error", space or not (one replica's log store after a full tmpfs, under the nemesis)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._real = conn

    def __getattr__(self, name: str) -> Any:
        if name in ("execute", "executemany", "commit", "rollback", "backup"):
            def fail(*args: Any, **kw: Any) -> Any:
                raise sqlite3.OperationalError("disk I/O error")
            return fail
        return getattr(self._real, name)


@pytest.mark.allow_faults("storage")
@pytest.mark.parametrize("broken", ["log store", "state"])
def test_a_connection_a_fault_broke_is_not_reused_by_the_reload(cluster: Harness, monkeypatch: pytest.MonkeyPatch,
                                                               broken: str) -> None:
    """The node reloads after a storage fault as a restart would, on new connections: before, it
    reused the broken one, failed every reload the same way and never served again."""
    leader = cluster.leader()
    follower = next(n for n in cluster.nodes.values() if n is not leader)
    if broken == "log store":
        follower.store._conn = BrokenConnection(follower.store._conn)  # type: ignore[assignment]
    else:
        sm = cluster.sms[follower.name]
        opened, before = sm._conn, sm._generation
        monkeypatch.setattr(sm, "_conn", lambda: BrokenConnection(opened()) if sm._generation == before else opened())
    for _ in range(5):
        leader.propose({"k": "c", "add": 1}, timeout=2)
    wait_for(lambda: follower.faults > 0, 5, "the broken connection hit the loop")
    wait_for(lambda: follower.fault is None, 10, "the replica reloaded and works again")
    cluster.converge(timeout=10)
    assert cluster.sms[follower.name].read("SELECT v FROM kv WHERE k='c'")[0][0] == 5


def test_a_write_that_failed_on_storage_lets_the_database_go_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A state write that failed with a storage fault, whose rollback failed too, closes its
    connection there and then: before, it kept the write lock until its thread used the state
    again, and the next apply, on another thread, waited 10 s and failed "database is locked"."""
    from contextlib import contextmanager

    from pygmy.replication import statemachine

    @contextmanager
    def rollback_fails(conn: sqlite3.Connection, mode: str = "IMMEDIATE") -> Iterator[sqlite3.Connection]:
        conn.execute(f"BEGIN {mode}")
        yield conn  # the error goes up with the transaction still open, as after a failed ROLLBACK
        conn.execute("COMMIT")

    sm = KV(tmp_path / "s.db")
    monkeypatch.setattr(statemachine, "transaction", rollback_fails)
    with pytest.raises(sqlite3.OperationalError, match="disk I/O error"), sm._write_lock, sm._writing() as conn:
        conn.execute("INSERT INTO kv(k, v) VALUES ('x', 1)")
        raise sqlite3.OperationalError("disk I/O error")
    monkeypatch.undo()
    other = sqlite3.connect(sm.path, timeout=0.5, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # the write lock is free: "database is locked" otherwise
    other.execute("ROLLBACK")
    other.close()
    assert sm.apply_many([(1, {"k": "y", "add": 2})]) == [(2, None)]  # on a new connection
    sm.close_all()


def test_a_reopened_state_keeps_its_digest_as_a_started_one_does(tmp_path: Path) -> None:
    """A restore that failed after its copy and before its digest's triggers were put back (a full
    disk) left the snapshot's triggers (here: none, as from a version before them); the node's reload
    (``reopen``) puts them back as a restart would, so the digest follows the rows again."""
    sm = KV(tmp_path / "s.db")
    sm.apply_many([(1, {"k": "a", "add": 1})])
    with sm._write_lock:
        for (name,) in sm.read("SELECT name FROM sqlite_master WHERE type='trigger'"):
            sm._conn().execute(f"DROP TRIGGER {name}")
    sm.reopen()
    sm.apply_many([(2, {"k": "b", "add": 2})])
    applied, kept, recomputed = sm.full_digest()
    assert applied == 2 and kept == recomputed
    sm.close_all()


def test_a_reopened_state_is_migrated_as_a_started_one_is(tmp_path: Path) -> None:
    """A restore that failed after its copy and before its migration (a snapshot of an older
    version) left the old schema; the reload's ``reopen`` migrates as a start does."""
    class Migrating(KV):
        def migrate(self, conn: sqlite3.Connection) -> None:
            if "note" not in {r[1] for r in conn.execute("PRAGMA table_info(kv)")}:
                conn.execute("ALTER TABLE kv ADD COLUMN note TEXT")

    def columns() -> set[str]:
        return {r[1] for r in sm.read("PRAGMA table_info(kv)")}

    older = KV(tmp_path / "older.db")
    older.apply_many([(1, {"k": "a", "add": 1})])
    older.close_all()
    sm = Migrating(tmp_path / "s.db")
    with sm._write_lock:  # what ``restore`` copies first, its migration not reached
        src = sqlite3.connect(older.path)
        src.backup(sm._conn())
        src.close()
    assert "note" not in columns()
    sm.reopen()
    assert "note" in columns()
    sm.apply_many([(2, {"k": "b", "add": 2})])
    applied, kept, recomputed = sm.full_digest()
    assert applied == 2 and kept == recomputed
    sm.close_all()


def test_a_state_reopened_gives_each_thread_a_new_connection_at_its_next_use(tmp_path: Path) -> None:
    """``reopen`` does not close another thread's connection under it (it may be reading): each
    thread drops its own, at its next use, and the old one is closed."""
    sm = KV(tmp_path / "s.db")
    mine = sm._conn()
    other: list[sqlite3.Connection] = []
    in_use, go_on = threading.Event(), threading.Event()

    def reader() -> None:
        other.append(sm._conn())
        in_use.set()
        go_on.wait(5)
        other[0].execute("SELECT 1").fetchone()  # still open: reopen closed nothing of ours
        other.append(sm._conn())

    t = threading.Thread(target=reader)
    t.start()
    in_use.wait(5)
    sm.reopen()
    go_on.set()
    t.join(5)
    assert other[1] is not other[0]
    with pytest.raises(sqlite3.ProgrammingError):
        other[0].execute("SELECT 1")  # closed by its own thread, at its next use
    assert sm._conn() is not mine and sm.read("SELECT 1")[0][0] == 1
    with pytest.raises(sqlite3.ProgrammingError):
        mine.execute("SELECT 1")
    sm.close_all()


class _NotAnException(BaseException):
    """What no ``except Exception`` takes (a thread's SystemExit, a GeneratorExit out of place)."""


@pytest.mark.allow_faults("error")
@pytest.mark.parametrize("error", [RuntimeError, pytest.param(_NotAnException, marks=pytest.mark.filterwarnings(
    # The thread whose turn raised it lets it go on up (``_drive``) and ends: its connection is
    # opened again. What matters is the loop thread, which must take it as a fault.
    "ignore::pytest.PytestUnhandledThreadExceptionWarning"))])
def test_an_unexpected_error_in_the_loop_does_not_freeze_the_replica(cluster: Harness, monkeypatch,
                                                                     error: type[BaseException]) -> None:
    """Any exception in a turn (here: injected), on whichever thread takes it, leads to an
    in-process restart, never a replica that answers with a frozen view or a loop thread gone."""
    leader = cluster.leader()
    follower = next(n for n in cluster.nodes.values() if n is not leader)
    real = follower._process_ready
    calls = {"n": 0}

    def flaky(tick_wall: float) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise error("injected")
        real(tick_wall)

    monkeypatch.setattr(follower, "_process_ready", flaky)
    wait_for(lambda: follower.faults > 0, 5, "the injected error hit the loop")
    for _ in range(10):
        leader.propose({"k": "b", "add": 1}, timeout=2)
    wait_for(lambda: follower.fault is None, 10, "the loop recovered")
    cluster.converge(timeout=10)


@pytest.mark.allow_faults("sender")
def test_a_sender_survives_an_error(cluster: Harness) -> None:
    """A per-peer sender that hits an unexpected error drops that batch, not its thread (Raft resends)."""
    leader = cluster.leader()
    follower = next(n for n in cluster.nodes.values() if n is not leader)
    sender = leader._senders[follower.name]
    real, calls = sender._send, {"n": 0}

    def flaky(msgs: list, timeout: float) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        real(msgs, timeout)

    sender._send = flaky  # type: ignore[method-assign]
    sender.client.send_nowait = lambda obj: False  # type: ignore[method-assign]  # all through the thread
    for _ in range(10):
        leader.propose({"k": "c", "add": 1}, timeout=2)
    cluster.converge(timeout=10)
    assert calls["n"] > 1 and sender.thread.is_alive()


def test_a_leader_waits_for_its_lease_instead_of_refusing_a_read(cluster: Harness) -> None:
    """A lease that lapsed for a moment (a busy machine, a new term) makes a read wait a few ticks for
    the next heartbeat round; a node that does not lead refuses at once (the caller asks the leader)."""
    leader = cluster.leader()
    leader.propose({"k": "r", "add": 1}, timeout=2)
    leader._lease_until = 0.0  # as if the last heartbeat round had been late
    assert leader.wait_read_index(5.0) >= leader.applied_index() - 1
    follower = next(n for n in cluster.nodes.values() if n is not leader)
    with pytest.raises(ReadIndexUnavailable):
        follower.wait_read_index(5.0)


def test_a_commit_is_carried_by_the_threads_that_bring_its_inputs(cluster: Harness, monkeypatch) -> None:
    """Sequential proposals are handed to no replication thread: the leader writes a proposal on
    the proposing thread (or on the thread whose turn it arrived during: a reader that applied the
    previous one and is still sending), a follower writes the append and answers on the thread
    that read its frame, and the leader commits and applies on the thread that read the answer.
    The loop threads keep the timers, and an input that arrives while one of them takes a turn.
    Before, every input was queued for the loop thread and woken there: three hand-offs per
    commit, and none of these turns was taken anywhere else."""
    leader = cluster.leader()
    for _ in range(5):  # past the election's first rounds, which the loop threads take
        leader.propose({"k": "inline", "add": 1}, timeout=2)
    turns: list[tuple[str, str, str]] = []  # (node, what, thread)
    for node in cluster.nodes.values():
        real_persist, real_apply = node._persist, node._apply

        def persist(rd: Any, node: ReplicaNode = node, real: Any = real_persist) -> None:
            if rd.entries:
                turns.append((node.name, "wrote", threading.current_thread().name))
            real(rd)

        def apply(entries: list, node: ReplicaNode = node, real: Any = real_apply) -> None:
            if entries and node is leader:
                turns.append((node.name, "applied", threading.current_thread().name))
            real(entries)

        monkeypatch.setattr(node, "_persist", persist)
        monkeypatch.setattr(node, "_apply", apply)
    for _ in range(20):
        leader.propose({"k": "inline", "add": 1}, timeout=2)

    def off_loop(who: str, what: str) -> float:
        mine = [t for n, w, t in turns if w == what and (n == leader.name) == (who == "leader")]
        assert mine, f"no {what} turn on the {who}"
        assert all(t.startswith(("raft-loop-", "frames-conn-", "MainThread")) for t in mine), mine
        return sum(not t.startswith("raft-loop-") for t in mine) / len(mine)

    # Most, not all: an input that arrives while a loop thread takes a turn for a timer is its.
    assert off_loop("leader", "wrote") >= 0.5, turns
    assert off_loop("follower", "wrote") >= 0.5, turns
    assert off_loop("leader", "applied") >= 0.5, turns


@pytest.mark.allow_faults("error")
def test_a_turn_that_fails_on_the_loop_thread_is_marked_before_the_core_is_let_go(cluster: Harness,
                                                                                  monkeypatch) -> None:
    """A turn can fail halfway through a Ready: a leader's appends sent, its own write not done. No
    other thread may take a turn on that core before the loop thread has reloaded it from disk, or
    an acknowledgement could count the unwritten entry towards a majority and answer a proposer.
    So the loop thread marks the failure while it still holds the core, as other threads do."""
    leader = cluster.leader()
    real_lock, marked = leader._core_lock, []
    injected = RuntimeError("injected")
    inside = threading.local()  # a turn taken through Watched (not one that took the real lock before the swap)

    class Watched:
        """The core lock, noting what other threads would see as a failing turn lets it go."""

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            return real_lock.acquire(blocking, timeout)

        def release(self) -> None:
            real_lock.release()

        def __enter__(self) -> Watched:
            real_lock.acquire()
            inside.held = True
            return self

        def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
            inside.held = False
            if exc is injected:
                marked.append(leader._broken)
            real_lock.release()

    real_ready, calls = leader._process_ready, {"n": 0}

    def flaky(tick_wall: float) -> None:
        if threading.current_thread() is leader._loop_thread and getattr(inside, "held", False) and calls["n"] == 0:
            calls["n"] += 1
            raise injected
        real_ready(tick_wall)

    monkeypatch.setattr(leader, "_core_lock", Watched())
    monkeypatch.setattr(leader, "_process_ready", flaky)
    wait_for(lambda: marked, 5, "a turn of the loop thread failed")
    assert marked == [injected], "the core was let go unmarked: another thread could take a turn on it"
    wait_for(lambda: leader.faults > 0 and leader.fault is None, 10, "the replica reloaded and works again")
    cluster.converge(timeout=10)


@pytest.mark.allow_faults("error")
def test_a_fault_in_a_turn_is_counted_and_named(cluster: Harness) -> None:
    """A node counts a fault of its loop in ``loop_faults`` and ``/status``: tests/conftest.py fails
    any test whose nodes counted one it did not declare (this one declares it, and checks the count)."""
    leader = cluster.leader()
    process = ReplicaNode._process_ready
    failed = threading.Event()

    def failing(tick_wall: float) -> None:
        if not failed.is_set():
            failed.set()
            raise RuntimeError("test fault: one turn")
        process(leader, tick_wall)

    leader._process_ready = failing  # type: ignore[method-assign]
    deadline = time.monotonic() + 10
    while not (leader.loop_faults["error"] == 1 and leader.fault is None) and time.monotonic() < deadline:
        time.sleep(0.02)
    status = leader.status()
    assert status["loop_faults"] == {"storage": 0, "error": 1, "sender": 0}
    assert "RuntimeError: test fault: one turn" in status["last_loop_fault"] and leader.fault is None


def test_a_new_leader_keeps_the_window_it_took_over_until_it_has_measured_for_a_while(
        cluster: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """A leader on a slow network announces a long window; after a hand-over, its successor (on
    loopback here, so its own round trips ask for the configured window) must not fall back to the
    configured one at its first retune: on the slow network that would lose its followers."""
    from pygmy.replication import node as node_module
    from pygmy.replication.core import Timing

    slow = Timing(heartbeat_ticks=10, election_ticks=100, probe_ticks=30)
    real = node_module.derive
    monkeypatch.setattr(node_module, "derive", lambda *a, **k: slow)
    old = cluster.leader()
    deadline = time.monotonic() + 5
    while any(n.core.floor != 100 for n in cluster.nodes.values()):
        assert time.monotonic() < deadline, {n.name: n.core.floor for n in cluster.nodes.values()}
        time.sleep(0.05)
    monkeypatch.setattr(node_module, "derive", real)
    for _ in range(20):  # on a busy machine an election may come first: hand over from whoever leads
        try:
            new = old.transfer_leadership(None, timeout=5)
            break
        except NotLeader:
            old = cluster.leader()
    assert new is not None and new != old.name
    time.sleep(2.5 * node_module.RETUNE_EVERY)  # two retunes and more: time enough to have lowered it
    # Whoever leads now (on a busy machine another election may have followed the hand-over) took
    # over the window since the hand-over and has measured only loopback since.
    successor = cluster.leader()
    assert successor.core.timers()["election"] == 100
    assert all(n.core.floor == 100 for n in cluster.nodes.values())


def test_a_follower_told_of_commits_late_is_told_at_once_when_it_serves_a_read(tmp_path: Path) -> None:
    """Followers learn a new commit with the next entry (``commit_delay_ticks``, here never within
    the test) or a heartbeat (seconds apart here). A follower about to serve a read asks the leader
    for its read index, and the leader tells it the commit there and then: the read sees the
    write at once, well inside its wait."""
    config = ReplicationConfig(keep_entries=50, compact_slack=20, heartbeat_ticks=5, election_ticks_min=300,
                               election_ticks_max=400, idle_heartbeat_ticks=250, commit_delay_ticks=100_000,
                               adapt=False)
    h = Harness(tmp_path, config=config)
    try:
        leader = h.leader(timeout=15)
        follower = next(n for n in h.nodes.values() if n is not leader)
        # It knows the leader (a heartbeat or an append reached it): on a loaded machine a read
        # asked right after the election found it knowing none ("kv-2 knows no leader").
        deadline = time.monotonic() + 15
        while follower.leader() is None:
            assert time.monotonic() < deadline, "the follower never heard of the leader"
            time.sleep(0.01)
        untold = 0
        for i in range(3):
            leader.propose({"k": "late", "add": 1}, timeout=2)
            index = leader.applied_index()
            untold += follower._view["commit"] < index  # a heartbeat may have told it, rarely
            read = follower.linearizable_index(0.5)
            assert read >= index
            assert follower.wait_applied(read, 0.5), (follower.status(), index)
            assert follower.sm.read("SELECT v FROM kv WHERE k='late'")[0][0] == i + 1
        assert untold, "the test needs a follower that was not yet told the commit"
    finally:
        h.close()


#: What a read-index question may carry: (from, commit), None for a parameter left out.
QUESTIONS = [
    ("kv-9", "0"),  # no such follower
    ("LEADER", "0"),  # the leader itself
    ("FOLLOWER", "9" * 40),  # past 18 digits: not read
    ("FOLLOWER", "²"),
    ("FOLLOWER", "-1"),
    ("", "1"),
    (None, None),  # a follower of a version before the names
]


def test_the_read_index_question_takes_any_name_and_commit(cluster: Harness) -> None:
    """Who asks and what commit it knows only decide whether the leader hurries the commit to it:
    whatever they say, the question is answered with the read index and nothing breaks."""
    leader = cluster.leader()
    follower = next(n for n in cluster.nodes if n != leader.name)
    for n, (asker, commit) in enumerate(QUESTIONS, start=1):
        assert leader.propose({"k": "q", "add": 1}, timeout=2) == n
        sent = {} if asker is None else {"from": asker.replace("LEADER", leader.name).replace("FOLLOWER", follower),
                                         "commit": commit}
        r = urllib3.request("GET", cluster.peers[leader.name] + "/raft/read_index", fields=sent,
                            headers={"Authorization": f"Bearer {SECRET}"}, timeout=5)
        assert r.status == 200, (sent, r.data)
        assert r.json()["index"] >= leader.applied_index() - 1
    assert leader.status()["loop_faults"].get("error", 0) == 0
    assert leader.propose({"k": "q", "add": 1}, timeout=2) == len(QUESTIONS) + 1  # the tier goes on


def test_a_leader_back_from_a_stall_counts_its_lease_as_run_out(cluster: Harness,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """On a slow network the lease stretches to seconds (here 300 ticks: about 2.9 s). A leader
    that stood still 5 s counts back only the ticks up to its next heartbeat and two election
    timeouts (``timers.ticks_due``); the rest must still pass on its clock, or it would come back
    holding most of a lease its followers stopped honouring long ago (a successor may lead)."""
    from pygmy.replication import node as node_module
    from pygmy.replication.core import Timing

    monkeypatch.setattr(node_module, "derive", lambda *a, **k: Timing(heartbeat_ticks=10, election_ticks=300,
                                                                       probe_ticks=30))
    cluster.until(lambda: all(n.core.floor == 300 for n in cluster.nodes.values()))
    leader = cluster.leader()  # (on a busy machine an election may have come meanwhile)
    cluster.until(lambda: leader.core.lease_remaining() > 200)
    with leader._core_lock:
        leader._tick_until(time.monotonic() + 5.0)
        assert leader.core.lease_remaining() == 0


def test_a_call_whose_caller_gave_up_waiting_never_runs(cluster: Harness) -> None:
    """``in_turn`` answered ProposalTimeout: what it asked must not happen later anyway (a hand-over
    begun after ``remove`` told its caller the outcome was unknown, with writes refused meanwhile)."""
    from pygmy.replication.node import ProposalTimeout

    node = cluster.leader()
    ran: list[int] = []
    with node._core_lock, pytest.raises(ProposalTimeout):  # a slow turn (a long write) holds the core
        node.in_turn(lambda core: ran.append(1), timeout=0.2)
    assert node.in_turn(lambda core: core.term) > 0  # turns go on, and the queued call has come up
    assert ran == []


def test_a_sender_made_by_a_turn_as_the_listener_starts_is_started_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame can arrive as soon as the listener runs, and its turn can make a sender (a leader
    heard in a hello): ``start`` must not then start that sender a second time."""
    from pygmy.replication import node as node_module

    peers = {"kv-1": "http://127.0.0.1:1", "kv-2": "http://127.0.0.1:2"}
    addresses = {n: ("127.0.0.1", free_port()) for n in peers}
    sm = KV(tmp_path / "state.db")
    node = ReplicaNode("kv-1", peers, sm, tmp_path / "kv-1", SECRET, CONFIG, addresses=addresses)
    assert not node._senders.pop("kv-2").thread.is_alive()  # no sender to kv-2 yet (never started)

    class Listener(node_module.FrameServer):
        def start(self) -> None:
            super().start()
            with node._core_lock:  # a turn, as a frame's would be, making the sender to kv-2
                node._sender("kv-2")

    monkeypatch.setattr(node_module, "FrameServer", Listener)
    try:
        node.start()  # raised RuntimeError (a thread started twice) when the listener came first
        assert "kv-2" in node._senders and all(s.thread.is_alive() for s in node._senders.values())
    finally:
        node.stop()
        sm.close()


def test_an_install_finished_after_a_crash_keeps_the_snapshots_configuration(tmp_path: Path) -> None:
    """A crash (or a full disk) between restoring the state from a snapshot and recording it in the
    log store: the next start finishes the install with the snapshot's configuration, not with the
    members the replica was started with. (It had fallen back to them: a replica that had missed a
    replacement would count a majority of the tier's old members, and elect or commit with them.)"""
    peers = {f"kv-{i}": f"http://127.0.0.1:{free_port()}" for i in (1, 2, 3)}
    replaced = Membership(frozenset({"kv-1", "kv-2", "kv-4"}),
                          urls={"kv-1": peers["kv-1"], "kv-2": peers["kv-2"], "kv-4": f"http://127.0.0.1:{free_port()}"})
    d = tmp_path / "kv-2"
    sm = KV(d / "state.db")
    for i in range(1, 11):  # the snapshot's state, restored: applied up to its index
        sm.apply(i, {"k": "a", "add": 1})
    store = LogStore(d / "raft.db")
    store.save(HardState(2, None, 3, 0), [Entry(i, 1, {"k": "a", "add": 1}) for i in range(1, 4)])
    store.begin_install(10, 2, replaced)  # ... and the log store never told: the crash
    store.close()
    node = ReplicaNode("kv-2", peers, sm, d, SECRET, CONFIG, addresses={n: ("127.0.0.1", free_port()) for n in peers})
    try:
        assert node.core.membership == replaced
        assert node.core.snap_index == 10
    finally:
        node.stop()
        sm.close()
    again = LogStore(d / "raft.db")
    try:
        persisted = again.load()
        assert persisted.installing is None and persisted.snapshot == (10, 2)
        assert persisted.snapshot_membership == replaced
    finally:
        again.close()


def test_the_timers_follow_the_round_trips_of_the_voters_a_majority_needs(tmp_path: Path, monkeypatch) -> None:
    """After a replacement the address book still names the members a replica was started with (and
    learners, and replicas it heard from): the pace is set by the voters, as many of them as make a
    majority with this one, not by a count of that book nor by round trips to non-voters."""
    from pygmy.replication import node as node_module
    from pygmy.replication.core import Timing

    peers = {f"kv-{i}": f"http://127.0.0.1:{free_port()}" for i in range(1, 6)}
    voters = Membership(frozenset({"kv-1", "kv-2", "kv-3"}), urls={n: peers[n] for n in ("kv-1", "kv-2", "kv-3")})
    d = tmp_path / "kv-1"
    sm = KV(d / "state.db")
    for i in range(1, 6):
        sm.apply(i, {"k": "a", "add": 1})
    store = LogStore(d / "raft.db")
    store.save(HardState(1, None, 5, 0), snapshot=(5, 1), membership=voters)
    store.close()
    node = ReplicaNode("kv-1", peers, sm, d, SECRET, CONFIG, addresses={n: ("127.0.0.1", free_port()) for n in peers})
    asked: list[tuple[dict, int]] = []
    monkeypatch.setattr(node_module, "derive", lambda rtts, needed, tick_ms: asked.append((rtts, needed)) or Timing())
    rtts = {"kv-2": (0.001, 0.002), "kv-3": (0.3, 0.4), "kv-4": (0.0001, 0.0002), "kv-5": (0.0001, 0.0002)}
    monkeypatch.setattr(node._rtt, "rtts", lambda now: rtts)
    try:
        assert node.core.membership == voters
        node._retune(time.monotonic())
        assert asked == [({"kv-2": (0.001, 0.002), "kv-3": (0.3, 0.4)}, 1)]
    finally:
        node.stop()
        sm.close()


def test_a_leader_past_its_lease_does_not_give_its_view_of_the_members_as_current(
        cluster: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """``GET /members`` (``members(leased=True)``), which ``pygmy member`` records, is refused by a
    leader whose lease has lapsed: cut off, it may have been replaced without knowing it."""
    from pygmy.replication.node import ReadIndexUnavailable

    leader = cluster.leader()
    cluster.until(lambda: leader.core.lease_remaining() > 0)
    assert leader.members(leased=True)["leader"] == leader.name
    monkeypatch.setattr(leader.core, "lease_remaining", lambda: 0)
    with pytest.raises(ReadIndexUnavailable):
        leader.members(leased=True)
    assert leader.members()["leader"] == leader.name  # the node's own callers may still look


def test_two_senders_to_one_peer_stream_from_files_of_their_own(tmp_path: Path) -> None:
    """A peer removed and added again gets a new sender while the old one may still be copying or
    deleting its snapshot file: each stream's copy is a file of its own, never the other's (one
    shared name let one sender's copy be written over, or deleted, under the other's stream)."""
    from types import SimpleNamespace

    from pygmy.replication.core import Message
    from pygmy.replication.node import _Sender

    written: list[Path] = []
    seen_during: list[list[str]] = []

    class Pin:
        index = 5

        def write(self, path: Path) -> None:
            path.write_bytes(b"state at 5")
            written.append(path)

        def close(self) -> None:
            pass

    out = tmp_path / "out"
    out.mkdir()
    node = SimpleNamespace(secret="s", name="kv-1", url="http://x", config=ReplicationConfig(),
                           _stopping=threading.Event(), snapshot_out=out,
                           _pin_state=lambda: (Pin(), 1, Membership(frozenset({"kv-1", "kv-2"}))))
    senders = [_Sender(node, "kv-2", ("127.0.0.1", 9)) for _ in range(2)]  # type: ignore[arg-type]
    for s in senders:
        s.client.send = lambda frame, timeout: seen_during.append(sorted(p.name for p in out.iterdir()))  # type: ignore[method-assign]
        s._stream_snapshot(Message("snapshot", "kv-1", "kv-2", 1))
    assert len(written) == 2 and written[0] != written[1] and all(p.name.startswith("kv-2") for p in written)
    assert seen_during and not list(out.iterdir())  # each deleted its own once streamed


def test_a_replica_installing_a_long_snapshot_stays_live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot install runs in the loop's turn, as long as the state takes to copy and sync:
    ``/livez`` (``liveness``) says live meanwhile, or a liveness probe restarted the replica in
    the middle, and it needed the same snapshot again, and again."""
    restore = SQLiteStateMachine.restore
    copying, go_on = threading.Event(), threading.Event()

    def slow_restore(self: SQLiteStateMachine, index: int, source: Path) -> None:
        copying.set()
        go_on.wait(10)
        restore(self, index, source)

    cluster = Harness(tmp_path)
    try:
        away = miss_commands(cluster, 150)  # past keep_entries + slack: compacted beyond what it holds
        monkeypatch.setattr(SQLiteStateMachine, "restore", slow_restore)
        back = cluster.start(away)
        assert copying.wait(10)
        assert back.liveness(turn_within=0.3) is None
        go_on.set()
        cluster.until(lambda: back.snapshots_installed == 1)
        assert back.liveness(turn_within=2.0) is None
    finally:
        go_on.set()
        cluster.close()


@pytest.mark.parametrize(("leads", "was_leader", "samples", "told"), [
    (True, True, 2, True),    # a leader measuring its voters: told, changed or not
    (True, False, 2, False),  # the turn that won the election: the hold is not seeded yet
    (True, True, 0, False),   # no round trips of a majority: nothing to tell
])
def test_the_core_is_told_only_measured_timings_of_the_leadership_in_force(
        leads: bool, was_leader: bool, samples: int, told: bool) -> None:
    """``_retune`` tells the core the held timing at every retune, so that a leader lowers a window
    it took over; but not in the turn an election was won (before ``_refresh_view`` seeds the hold
    with the window taken over: the old hold and an empty meter said "the default", and the new
    leader dropped a slow link's window at once), nor what no measurement asked for."""
    from types import SimpleNamespace

    from pygmy.replication.core import Membership
    from pygmy.replication.timers import Hold, RttMeter

    calls: list[object] = []
    core = SimpleNamespace(membership=Membership(frozenset({"kv-1", "kv-2", "kv-3"})), is_leader=lambda: leads,
                           set_timing=calls.append, timers=lambda: {})
    meter = RttMeter()
    now = time.monotonic()
    for peer in ["kv-2", "kv-3"][:samples]:
        meter.samples[peer] = deque([(now, 0.001)] * 5)
    node = SimpleNamespace(name="kv-1", core=core, _rtt=meter, _timing_hold=Hold(), config=ReplicationConfig(),
                           _timing=None, _senders={}, _was_leader=was_leader, _retune_at=0.0,
                           _timers_view=lambda rtts: {})
    ReplicaNode._retune(node, now)  # type: ignore[arg-type]
    assert bool(calls) == told, calls


def test_a_replica_that_no_longer_leads_forgets_the_timing_it_measured_as_leader(cluster: Harness) -> None:
    """A follower measures no round trips, so the timing it was told as leader would stay, and be
    announced (window, heartbeat, probe) if it led again; it goes back to the configured one."""
    from pygmy.replication.core import Timing

    leader = cluster.leader()
    leader.in_turn(lambda core: core.set_timing(Timing(heartbeat_ticks=9, election_ticks=60)))
    target = next(n for n in cluster.nodes if n != leader.name)
    assert leader.transfer_leadership(target, 5.0) == target
    cluster.until(lambda: leader.in_turn(lambda core: core._timing) == Timing())
