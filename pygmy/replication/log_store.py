"""Durable Raft state in its own SQLite file: hard state, log entries and snapshot metadata.

WAL with ``synchronous=FULL`` so a save returns only once it is on disk: Raft's safety rests on a
node never forgetting a vote or an acknowledged entry. One transaction per ``Ready`` batches appends.

Configurations are log entries like any other; the one in force at the snapshot's index (which the
log no longer holds once compacted) is kept beside it, ``snapshot_membership`` in ``raft_meta``
(``Membership.to_dict`` as JSON), written in the transaction that moves the snapshot.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pygmy.kit import codec
from pygmy.replication.core import Entry, HardState, Membership
from pygmy.replication.storage import transaction

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS raft_meta (key TEXT PRIMARY KEY, value TEXT)",
    "CREATE TABLE IF NOT EXISTS raft_log (idx INTEGER PRIMARY KEY, term INTEGER NOT NULL, command TEXT)",
)


@dataclass
class PersistedState:
    hard_state: HardState = field(default_factory=HardState)
    snapshot: tuple[int, int] = (0, 0)
    entries: list[Entry] = field(default_factory=list)
    #: A snapshot install that was started (state machine restore) but maybe not finished.
    installing: tuple[int, int] | None = None
    #: The configuration in force at ``snapshot`` (None: none recorded, e.g. a log from before them).
    snapshot_membership: Membership | None = None
    #: The configuration in force at the snapshot ``installing`` names (``begin_install``).
    installing_membership: Membership | None = None


class LogStore:
    """Not thread-safe: owned by the node's event-loop thread (and its constructor)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = self._open()

    def _open(self) -> sqlite3.Connection:
        conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=10)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            for stmt in SCHEMA:
                conn.execute(stmt)
            #: Each entry's size as stored (its JSON command), oldest first, and their sum: what the
            #: node compacts by besides the count (``ReplicationConfig.keep_bytes``).
            self._sizes: dict[int, int] = {idx: n for idx, n in conn.execute(
                "SELECT idx, COALESCE(LENGTH(command), 0) FROM raft_log ORDER BY idx")}
            self.log_bytes = sum(self._sizes.values())
            return conn
        except BaseException:
            conn.close()
            raise

    def reopen(self) -> None:
        """A new connection for the one a fault may have left broken, as after a restart (a node
        reloading after a storage fault): nothing of the old one's state is trusted."""
        new = self._open()  # if this fails too, the old one stays and the node's next reload tries again
        old, self._conn = self._conn, new
        with contextlib.suppress(sqlite3.Error):
            old.close()  # a broken connection may fail to close; it is dropped either way

    def close(self) -> None:
        self._conn.close()

    # -- reading ---------------------------------------------------------------------------------
    def _meta(self) -> dict[str, str | None]:
        return dict(self._conn.execute("SELECT key, value FROM raft_meta").fetchall())

    def load(self) -> PersistedState:
        meta = self._meta()
        vote = meta.get("vote")
        hs = HardState(int(meta.get("term") or 0), vote or None, int(meta.get("commit") or 0),
                       int(meta.get("floor") or 0), int(meta.get("floor_term") or 0), int(meta.get("floor_ctx") or 0))
        snap = (int(meta.get("snapshot_index") or 0), int(meta.get("snapshot_term") or 0))
        installing = None
        if meta.get("installing_index"):
            installing = (int(meta["installing_index"] or 0), int(meta.get("installing_term") or 0))
        entries: list[Entry] = []
        expected = snap[0] + 1
        rows = self._conn.execute(
            "SELECT idx, term, command FROM raft_log WHERE idx > ? ORDER BY idx", (snap[0],)
        )
        for idx, term, command in rows:
            if idx != expected:
                break  # a gap can only follow a crash mid-way; keep the contiguous prefix
            entries.append(Entry(idx, term, None if command is None else codec.loads(command)))
            expected += 1
        raw = meta.get("snapshot_membership")
        membership = Membership.from_dict(codec.loads(raw)) if raw else None
        raw = meta.get("installing_membership")
        installing_membership = Membership.from_dict(codec.loads(raw)) if raw and installing else None
        return PersistedState(hs, snap, entries, installing, membership, installing_membership)

    def last_index(self) -> int:
        row = self._conn.execute("SELECT MAX(idx) FROM raft_log").fetchone()
        return int(row[0] or 0)

    # -- writing ---------------------------------------------------------------------------------
    def save(
        self,
        hard_state: HardState | None = None,
        entries: Iterable[Entry] = (),
        truncate_from: int | None = None,
        snapshot: tuple[int, int] | None = None,
        membership: Membership | None = None,
    ) -> None:
        """Persist one Ready in a single durable transaction.

        ``snapshot`` (index, term) replaces the whole log (the state machine was restored first),
        with ``membership``, the configuration in force at it; ``truncate_from`` drops a
        conflicting suffix before ``entries`` are written."""
        entries = list(entries)
        if hard_state is None and not entries and truncate_from is None and snapshot is None:
            return  # a Ready with only messages (heartbeats): no transaction, no sync
        c = self._conn
        rows = [(e.index, e.term, None if e.command is None else codec.dumps_text(e.command))
                for e in entries]
        with transaction(c):
            if snapshot is not None:
                c.execute("DELETE FROM raft_log")
                self._set(snapshot_index=snapshot[0], snapshot_term=snapshot[1])
                self._set_membership(membership)
                self._clear_install()
            if truncate_from is not None:
                c.execute("DELETE FROM raft_log WHERE idx >= ?", (truncate_from,))
            c.executemany("INSERT OR REPLACE INTO raft_log(idx, term, command) VALUES (?, ?, ?)", rows)
            if hard_state is not None:
                self._set(term=hard_state.term, vote=hard_state.vote or "", commit=hard_state.commit,
                          floor=hard_state.floor, floor_term=hard_state.floor_term, floor_ctx=hard_state.floor_ctx)
        # Sizes only once the transaction is in: a failed save leaves them as the disk is.
        if snapshot is not None:
            self._sizes.clear()
            self.log_bytes = 0
        if truncate_from is not None:
            for idx in [i for i in self._sizes if i >= truncate_from]:
                self.log_bytes -= self._sizes.pop(idx)
        for idx, _, command in rows:
            self.log_bytes -= self._sizes.pop(idx, 0)  # a rewritten index goes to the end, where it belongs
            self._sizes[idx] = len(command or "")
            self.log_bytes += self._sizes[idx]

    def begin_install(self, index: int, term: int, membership: Membership | None = None) -> None:
        """Record the intent to install a snapshot before the state machine is overwritten, so a
        crash in between is detected on restart (``PersistedState.installing``), with the
        configuration in force at it: an install finished after that crash writes it as the
        snapshot's, or the replica would fall back to the members it was started with."""
        with transaction(self._conn):
            self._clear_install()
            self._set(installing_index=index, installing_term=term)
            if membership is not None:
                self._set(installing_membership=codec.dumps_text(membership.to_dict()))

    def abort_install(self) -> None:
        self._clear_install()

    def _clear_install(self) -> None:
        """Forget an install's intent, its configuration with it."""
        self._conn.execute("DELETE FROM raft_meta WHERE key IN ('installing_index', 'installing_term', "
                           "'installing_membership')")

    def compact(self, index: int, term: int, membership: Membership | None = None) -> None:
        """Drop entries up to ``index`` (already applied by the state machine); ``membership`` is
        the configuration in force at it."""
        with transaction(self._conn) as c:
            c.execute("DELETE FROM raft_log WHERE idx <= ?", (index,))
            self._set(snapshot_index=index, snapshot_term=term)
            self._set_membership(membership)
        for idx in list(self._sizes):
            if idx > index:
                break
            self.log_bytes -= self._sizes.pop(idx)

    def index_keeping(self, budget: int) -> int:
        """The highest index whose compaction leaves at most ``budget`` bytes of entries after it
        (0 if the log is within budget already)."""
        total, last = self.log_bytes, 0
        for idx, size in self._sizes.items():
            if total <= budget:
                break
            total -= size
            last = idx
        return last

    def _set_membership(self, membership: Membership | None) -> None:
        if membership is None:
            self._conn.execute("DELETE FROM raft_meta WHERE key='snapshot_membership'")
        else:
            self._set(snapshot_membership=codec.dumps_text(membership.to_dict()))

    def _set(self, **values: object) -> None:
        self._conn.executemany(
            "INSERT INTO raft_meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            [(k, str(v)) for k, v in values.items()],
        )
