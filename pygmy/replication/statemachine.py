"""The replicated state machine contract and its SQLite implementation.

Catalog and order keep their business state in one SQLite file per replica. Every change goes
through ``apply(index, command)``, which runs the service's command inside one transaction that also
records ``applied_index``, so a replica killed at any moment restarts exactly at a log position.

The state digest is a multiset hash kept up to date by SQLite triggers: the sum modulo 2**256 of
SHA-256 of every row of the digested tables. An insert adds its row's hash, a delete subtracts it,
an update does both. The triggers add to the open write transaction's running change (a Python
integer, ``_DigestChange``), which is folded into the digest row once, just before that transaction
commits: in the same transaction as the commands, at one write of the digest row per transaction
instead of two per changed row (a replica catching up applies thousands of commands in one). Reading
it is O(1), maintaining it O(1) per changed row, and it travels inside snapshots. ``full_digest()``
recomputes it from the rows, as verification (``pygmy verify``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pygmy.replication.storage import is_storage_fault, transaction

META_SCHEMA = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)"
DIGEST_SCHEMA = "CREATE TABLE IF NOT EXISTS digest (id INTEGER PRIMARY KEY CHECK (id = 0), value TEXT NOT NULL)"
_MODULUS = 1 << 256
_ZERO = "0" * 64


def row_hash(table: str, values: tuple[Any, ...]) -> int:
    """A row's contribution to the digest: SHA-256 of its table and values (``repr`` of SQLite's
    int, float, str, bytes and None is the same in every process)."""
    return int.from_bytes(hashlib.sha256(repr((table, values)).encode()).digest(), "big")


def _mix(current: str, sign: int, table: str, *values: Any) -> str:
    """SQL ``pygmy_digest_mix(digest, +1|-1, table, col...)``: add or remove one row's hash. What the
    triggers of databases written before ``_DigestChange`` call (until opened here: replaced)."""
    return format((int(current, 16) + sign * row_hash(table, values)) % _MODULUS, "064x")


class _CommandFailed(Exception):
    """A command of a batch applied without savepoints failed: the batch is taken again with them."""


class _DigestChange:
    """The digest change of the write transaction open on one connection, which the triggers add
    to (SQL ``pygmy_digest_note(table, k, values...)``: the first ``k`` values are a row removed,
    the rest a row added). A digested table written outside ``SQLiteStateMachine._writing`` fails
    the statement rather than leave the digest behind the rows."""

    def __init__(self) -> None:
        self.total = 0
        self.open = False

    def note(self, table: str, removed: int, *values: Any) -> None:
        if not self.open:
            raise RuntimeError(f"{table} written outside a digest-keeping transaction")
        if removed:
            self.total -= row_hash(table, values[:removed])
        if len(values) > removed:
            self.total += row_hash(table, values[removed:])


def _show(value: str) -> str:
    """What status shows: the first 16 hex digits of the 256-bit sum."""
    return value[:16]


class Pin:
    """A state held still for copying: an open read transaction on a connection of its own (WAL:
    the applier goes on writing meanwhile, and the copy is of the state at ``index``, whole)."""

    def __init__(self, index: int, conn: sqlite3.Connection) -> None:
        self.index, self._conn = index, conn

    def write(self, path: Path) -> None:
        """Copy the pinned state to a new SQLite file at ``path`` (page by page: bounded memory)."""
        path.unlink(missing_ok=True)
        dest = sqlite3.connect(str(path))
        try:
            self._conn.backup(dest)  # within our open read transaction: its snapshot, not the latest
        finally:
            dest.close()

    def close(self) -> None:
        self._conn.close()  # ends the read transaction; the WAL may be checkpointed past it


class StateMachine(ABC):
    """What the replication layer needs from a service's state."""

    @abstractmethod
    def applied_index(self) -> int: ...

    @abstractmethod
    def apply(self, index: int, command: dict[str, Any] | None) -> Any:
        """Apply one committed log entry (``None`` is a no-op entry) and persist ``index`` with it."""

    def apply_many(self, entries: list[tuple[int, dict[str, Any] | None]]) -> list[tuple[Any, Exception | None]]:
        """Apply consecutive committed entries; ``(result, error)`` for each, where ``error`` is a
        command's own deterministic failure (storage faults raise). One by one unless overridden."""
        out: list[tuple[Any, Exception | None]] = []
        for index, command in entries:
            try:
                out.append((self.apply(index, command), None))
            except Exception as exc:
                if is_storage_fault(exc):
                    raise
                out.append((None, exc))
        return out

    @abstractmethod
    def pin(self) -> Pin:
        """The state as of now, held still (a read snapshot, taken in microseconds) so that it can be
        copied to a file at leisure while commands go on being applied: what a follower whose log was
        compacted away is sent."""

    def snapshot_to(self, path: Path) -> int:
        """Write the whole state to ``path``; the applied index it is at."""
        pin = self.pin()
        try:
            pin.write(path)
            return pin.index
        finally:
            pin.close()

    @abstractmethod
    def restore(self, index: int, source: Path) -> None:
        """Replace the whole state with the snapshot in file ``source``, taken at ``index``."""

    @abstractmethod
    def sync(self) -> None:
        """Make every transaction committed so far durable against a power loss. The node asks it
        before its log gives up entries the state stands for (a compaction, a snapshot install):
        until then, a state rolled back by a power loss is rebuilt by replaying them."""

    def size_bytes(self) -> int | None:
        """What a snapshot of the state costs to send, in bytes (None: not known). The log keeps
        no more entries than replaying costs less than that (``ReplicationConfig.replay_bytes_per_entry``)."""
        return None

    @abstractmethod
    def digest(self) -> str:
        """Hash of the business state; equal applied indexes give equal digests."""

    def applied_and_digest(self) -> tuple[int, str]:
        """Both, of the same state (status shows them side by side)."""
        return self.applied_index(), self.digest()

    @abstractmethod
    def full_digest(self) -> tuple[int, str, str]:
        """``(applied index, digest, digest recomputed from the whole state)``: verification."""

    def close_all(self) -> None:
        """Release what the state holds open, once nothing uses it (a stopping service)."""
        return  # nothing by default

    def reopen(self) -> None:
        """Trust no connection opened before now (a node reloading after a storage fault, as a
        restart would): each thread opens a new one at its next use."""
        return  # nothing by default


class SQLiteStateMachine(StateMachine):
    """Generic SQLite plumbing; subclasses give the schema, the commands and what the digest covers."""

    #: SQL run once on an empty database (tables of the service).
    schema: tuple[str, ...] = ()
    #: The tables whose rows make up the replicated state, all of it (idempotency keys included).
    digest_tables: tuple[str, ...] = ()

    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._write_lock = threading.Lock()
        #: Every live thread's connection, for ``close_all``; a dead thread's is closed when the next opens.
        self._opened: dict[threading.Thread, sqlite3.Connection] = {}
        self._opened_lock = threading.Lock()
        #: Bumped by ``reopen``: a thread whose connection is older opens a new one.
        self._generation = 0
        self._prepare()

    def _prepare(self) -> None:
        """What a start does before the state is used, and a reload after a fault (``reopen``) again:
        the tables, the applied index's row, an older version's rows migrated, the digest's
        triggers (a restore that failed part way may have left a snapshot's)."""
        with self._write_lock:
            conn = self._conn()
            conn.execute(META_SCHEMA)
            for stmt in self.schema:
                conn.execute(stmt)
            conn.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('applied_index', 0)")
            conn.commit()
            with self._writing() as conn:
                self.migrate(conn)
            self._install_digest(conn)

    def migrate(self, conn: sqlite3.Connection) -> None:
        """Bring a database written by an older version up to this schema (in one transaction, before
        the digest's triggers are checked: a changed table gets them anew). Deterministic: every
        replica migrates its own copy to the same rows."""

    def _install_digest(self, conn: sqlite3.Connection) -> None:
        """Create the digest row and its triggers once; a database from before them (or whose
        triggers changed) gets its digest computed from the rows, once, here."""
        with transaction(conn):
            conn.execute(DIGEST_SCHEMA)
            fresh = conn.execute("INSERT OR IGNORE INTO digest(id, value) VALUES (0, ?)", (_ZERO,)).rowcount
            existing = {r[0]: r[1] for r in conn.execute("SELECT name, sql FROM sqlite_master WHERE type='trigger'")}
            wanted = dict(self._triggers(conn))
            if fresh or wanted != existing:
                for name in existing:
                    conn.execute(f"DROP TRIGGER {name}")
                for sql in wanted.values():
                    conn.execute(sql)
                conn.execute("UPDATE digest SET value=? WHERE id=0", (self._sum_rows(conn),))

    def _triggers(self, conn: sqlite3.Connection) -> list[tuple[str, str]]:
        out = []
        for table in self.digest_tables:
            cols = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
            new = ", ".join(f"NEW.{c}" for c in cols)
            old = ", ".join(f"OLD.{c}" for c in cols)
            note = "SELECT pygmy_digest_note('" + table + "', {}, {});"
            out += [
                (f"digest_{table}_insert", f"CREATE TRIGGER digest_{table}_insert AFTER INSERT ON {table} "
                                           f"BEGIN {note.format(0, new)} END"),
                (f"digest_{table}_delete", f"CREATE TRIGGER digest_{table}_delete AFTER DELETE ON {table} "
                                           f"BEGIN {note.format(len(cols), old)} END"),
                (f"digest_{table}_update", f"CREATE TRIGGER digest_{table}_update AFTER UPDATE ON {table} "
                                           f"BEGIN {note.format(len(cols), old + ', ' + new)} END"),
            ]
        return out

    def _sum_rows(self, conn: sqlite3.Connection) -> str:
        total = 0
        for table in self.digest_tables:
            for row in conn.execute(f"SELECT * FROM {table}"):  # noqa: S608 (names are ours)
                total += row_hash(table, tuple(row))
        return format(total % _MODULUS, "064x")

    # -- connections -------------------------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        """One connection per thread: readers never block the applier (WAL)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.generation != self._generation:
            self.close()  # opened before a ``reopen``: not trusted
            conn = None
        if conn is None:
            generation = self._generation  # read first: a reopen meanwhile makes this one old too
            conn = sqlite3.connect(self.path, timeout=10, isolation_level=None, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            # The replicated log is the durable record (synced); the state can be re-derived from it
            # after a crash, and a process kill loses no committed transaction even at NORMAL.
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            # INSERT OR REPLACE deletes the row it replaces: the delete trigger must see that too.
            conn.execute("PRAGMA recursive_triggers=ON")
            conn.create_function("pygmy_digest_mix", -1, _mix, deterministic=True)
            change = _DigestChange()
            conn.create_function("pygmy_digest_note", -1, change.note)  # not deterministic: it adds up
            self._local.conn, self._local.change, self._local.generation = conn, change, generation
            with self._opened_lock:
                # Threads come and go with connections (a frame connection has one): those that ended
                # are closed here, not kept open until stop, nor left to a later garbage collection.
                for thread in [t for t in self._opened if not t.is_alive()]:
                    self._opened.pop(thread).close()
                self._opened[threading.current_thread()] = conn
        return conn

    @contextmanager
    def _writing(self) -> Iterator[sqlite3.Connection]:
        """A write transaction on this thread's connection (under the write lock, taken by the
        caller) whose rows' digest change is folded into the digest row just before it commits."""
        conn = self._conn()
        change: _DigestChange = self._local.change
        if change.open:
            raise RuntimeError("a digest-keeping transaction is already open on this thread")
        try:
            with transaction(conn):
                change.total, change.open = 0, True
                try:
                    yield conn
                    if change.total % _MODULUS:  # (no trigger has fired before the digest row exists)
                        kept = conn.execute("SELECT value FROM digest WHERE id=0").fetchone()[0]
                        value = format((int(kept, 16) + change.total) % _MODULUS, "064x")
                        conn.execute("UPDATE digest SET value=? WHERE id=0", (value,))
                finally:
                    change.total, change.open = 0, False
        except BaseException as exc:
            if conn.in_transaction or is_storage_fault(exc):
                # Closed now, on its own thread: a rollback that failed too would leave it holding the
                # write lock until this thread's next use (``reopen`` is lazy), and every other
                # thread's write would wait for it; its next use opens a new one.
                self.close()
            raise

    @contextmanager
    def amend(self) -> Iterator[sqlite3.Connection]:
        """A change made outside the log, digest kept: only for a copy that no replica runs (a
        backup settling the buys its cut split, ``pygmy.cluster.backup``), never a live state."""
        with self._write_lock, self._writing() as conn:
            yield conn

    def read(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        return self._conn().execute(sql, params).fetchall()

    def read_at(self, sql: str, params: tuple[Any, ...] = ()) -> tuple[int, list[sqlite3.Row]]:
        """Rows and the ``applied_index`` they reflect, from one consistent read transaction.

        Caches need the pair: a value is as fresh as the log position it was read at, which is
        newer than the index of the value's own last change.
        """
        with transaction(self._conn(), "DEFERRED") as conn:
            applied = conn.execute("SELECT value FROM meta WHERE key='applied_index'").fetchone()[0]
            return int(applied), conn.execute(sql, params).fetchall()

    # -- StateMachine -------------------------------------------------------------------------
    def applied_index(self) -> int:
        row = self._conn().execute("SELECT value FROM meta WHERE key='applied_index'").fetchone()
        return int(row[0])

    def apply(self, index: int, command: dict[str, Any] | None) -> Any:
        with self._write_lock, self._writing() as conn:
            current = conn.execute("SELECT value FROM meta WHERE key='applied_index'").fetchone()[0]
            if index <= current:
                return None  # already applied before a crash: the log replays it, the state must not
            result = None if command is None else self._run(conn, index, command)
            conn.execute("UPDATE meta SET value=? WHERE key='applied_index'", (index,))
            return result

    def _run(self, conn: sqlite3.Connection, index: int, command: dict[str, Any]) -> Any:
        """``execute`` one command, or each of a ``{"op": "batch", "commands": [...]}`` in order (the
        commands of concurrent requests in one log entry), with their results as a list."""
        if command.get("op") == "batch":
            return [self.execute(conn, index, c) for c in command["commands"]]
        return self.execute(conn, index, command)

    def apply_many(self, entries: list[tuple[int, dict[str, Any] | None]]) -> list[tuple[Any, Exception | None]]:
        """Every entry in ONE transaction (one commit for a whole batch: a replica catching up on
        10,000 commands, or a round under load, pays the commit once). A command that fails is
        undone alone, as it would be applied alone: the batch is then taken again from the start
        with a savepoint around each command. Commands are deterministic, so the second pass gives
        the others the same results; failures are rare (a malformed command), and two statements
        per command for savepoints nobody needs are not."""
        with self._write_lock:  # both passes: nothing may be applied in between
            try:
                return self._apply_batch(entries, undo_each=False)
            except _CommandFailed:
                return self._apply_batch(entries, undo_each=True)

    def _apply_batch(self, entries: list[tuple[int, dict[str, Any] | None]],
                     undo_each: bool) -> list[tuple[Any, Exception | None]]:
        out: list[tuple[Any, Exception | None]] = []
        with self._writing() as conn:
            change: _DigestChange = self._local.change
            current = last = conn.execute("SELECT value FROM meta WHERE key='applied_index'").fetchone()[0]
            for index, command in entries:
                if index <= current or command is None:
                    out.append((None, None))  # replayed after a crash, or a no-op
                    last = max(last, index)
                    continue
                if undo_each:
                    conn.execute("SAVEPOINT command")
                before = change.total
                try:
                    out.append((self._run(conn, index, command), None))
                except Exception as exc:
                    if is_storage_fault(exc):
                        raise
                    if not undo_each:
                        raise _CommandFailed from exc  # the whole transaction rolls back
                    conn.execute("ROLLBACK TO command")
                    change.total = before  # the rows undone, their hashes with them
                    out.append((None, exc))
                if undo_each:
                    conn.execute("RELEASE command")
                last = index
            if last > current:
                conn.execute("UPDATE meta SET value=? WHERE key='applied_index'", (last,))
        return out

    @abstractmethod
    def execute(self, conn: sqlite3.Connection, index: int, command: dict[str, Any]) -> Any:
        """Run one command inside the open transaction; must be deterministic. It must not catch a
        failed statement and go on: SQLite undoes that statement's rows, but not the hashes its
        triggers already added to the transaction's digest change (let it raise: the command is
        then undone whole, its part of the change with it)."""

    def size_bytes(self) -> int:
        """The database's pages, free ones included: what SQLite's backup copies into a snapshot."""
        conn = self._conn()
        return int(conn.execute("PRAGMA page_count").fetchone()[0]) * int(conn.execute("PRAGMA page_size").fetchone()[0])

    def pin(self) -> Pin:
        conn = sqlite3.connect(self.path, timeout=10, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("BEGIN DEFERRED")  # the read snapshot starts at the first read, here:
            index = int(conn.execute("SELECT value FROM meta WHERE key='applied_index'").fetchone()[0])
        except BaseException:
            conn.close()
            raise
        return Pin(index, conn)

    def sync(self) -> None:
        """fsync the database file and its WAL: at ``synchronous=NORMAL`` a commit is in the WAL,
        written but not synced until a checkpoint (a checkpoint may not sync at all while a reader
        holds an older snapshot, such as a pin being copied). Recovery replays the WAL's committed
        frames over the database file, so both synced hold every commit made so far."""
        for path in (self.path, self.path + "-wal"):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # no WAL: every commit is in the database file
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def restore(self, index: int, source: Path) -> None:
        """Page by page from the file into the live database (SQLite's backup): memory stays at a
        page cache's worth however large the state, and readers on other connections (WAL) see the
        old state until the copy commits, then the new one."""
        with self._write_lock:
            # Read-only: several replicas may copy one file, and a missing file is an error rather
            # than a new empty database installed as the state at ``index``.
            src = sqlite3.connect(f"{Path(source).resolve().as_uri()}?mode=ro", uri=True, isolation_level=None)
            try:
                src.backup(self._conn())
            finally:
                src.close()
            with self._writing() as conn:  # a snapshot from an older version: brought up to this schema
                conn.execute("UPDATE meta SET value=? WHERE key='applied_index'", (index,))
                self.migrate(conn)
            self._install_digest(conn)

    def digest(self) -> str:
        """O(1): the maintained sum, not a scan."""
        return _show(self._conn().execute("SELECT value FROM digest WHERE id=0").fetchone()[0])

    def applied_and_digest(self) -> tuple[int, str]:
        with transaction(self._conn(), "DEFERRED") as conn:
            applied = conn.execute("SELECT value FROM meta WHERE key='applied_index'").fetchone()[0]
            return int(applied), _show(conn.execute("SELECT value FROM digest WHERE id=0").fetchone()[0])

    def full_digest(self) -> tuple[int, str, str]:
        """``(applied index, maintained digest, digest recomputed from every row)`` of one read
        snapshot, taken without the write lock (WAL: the applier goes on meanwhile)."""
        with transaction(self._conn(), "DEFERRED") as conn:
            applied = conn.execute("SELECT value FROM meta WHERE key='applied_index'").fetchone()[0]
            kept = conn.execute("SELECT value FROM digest WHERE id=0").fetchone()[0]
            return int(applied), _show(kept), _show(self._sum_rows(conn))

    def close(self) -> None:
        """This thread's connection (a broken one may fail to close: it is dropped all the same)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            self._local.conn = None
            with self._opened_lock:
                self._opened.pop(threading.current_thread(), None)
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    def reopen(self) -> None:
        self._generation += 1  # each thread closes its own: another's may be in use right now
        self._prepare()  # as at a start: a fault (not a crash) never passed through ``__init__``

    def close_all(self) -> None:
        """Close every thread's connection, once no thread uses them (a stopping service). A
        connection is in a reference cycle with its statement cache (CPython's sqlite3), so one left
        by a thread that ended closes only in a garbage collection; and the last one to close is
        what checkpoints the WAL into the database and removes it."""
        with self._opened_lock:
            opened, self._opened = self._opened, {}
        for conn in opened.values():
            conn.close()
        self._local = threading.local()
