"""The replicated state machine contract and its SQLite implementation.

Catalog and order keep their business state in one SQLite file per replica. Every change goes
through ``apply(index, command)``, which runs the service's command inside one transaction that also
records ``applied_index``, so a replica killed at any moment restarts exactly at a log position.
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from replication.storage import transaction

META_SCHEMA = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)"


class StateMachine(ABC):
    """What the replication layer needs from a service's state."""

    @abstractmethod
    def applied_index(self) -> int: ...

    @abstractmethod
    def apply(self, index: int, command: dict[str, Any] | None) -> Any:
        """Apply one committed log entry (``None`` is a no-op entry) and persist ``index`` with it."""

    @abstractmethod
    def snapshot(self) -> bytes:
        """The whole state as of ``applied_index()``, for a follower whose log was compacted away."""

    @abstractmethod
    def restore(self, index: int, data: bytes) -> None:
        """Replace the whole state with a snapshot taken at ``index``."""

    @abstractmethod
    def digest(self) -> str:
        """Hash of the business state; equal applied indexes give equal digests."""


class SQLiteStateMachine(StateMachine):
    """Generic SQLite plumbing; subclasses give the schema, the commands and what the digest covers."""

    #: SQL run once on an empty database (tables of the service).
    schema: tuple[str, ...] = ()
    #: ``(table, order-by columns)`` pairs whose rows make up the business state for the digest.
    digest_tables: tuple[tuple[str, str], ...] = ()

    def __init__(self, path: Path | str) -> None:
        self.path = str(path)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._write_lock = threading.Lock()
        with self._write_lock:
            conn = self._conn()
            conn.execute(META_SCHEMA)
            for stmt in self.schema:
                conn.execute(stmt)
            conn.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('applied_index', 0)")
            conn.commit()

    # -- connections -------------------------------------------------------------------------
    def _conn(self) -> sqlite3.Connection:
        """One connection per thread: readers never block the applier (WAL)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=10, isolation_level=None, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            # The replicated log is the durable record (synced); the state can be re-derived from it
            # after a crash, and a process kill loses no committed transaction even at NORMAL.
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            self._local.conn = conn
        return conn

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
        with self._write_lock, transaction(self._conn()) as conn:
            current = conn.execute("SELECT value FROM meta WHERE key='applied_index'").fetchone()[0]
            if index <= current:
                return None  # already applied before a crash: the log replays it, the state must not
            result = None if command is None else self.execute(conn, index, command)
            conn.execute("UPDATE meta SET value=? WHERE key='applied_index'", (index,))
            return result

    @abstractmethod
    def execute(self, conn: sqlite3.Connection, index: int, command: dict[str, Any]) -> Any:
        """Run one command inside the open transaction; must be deterministic."""

    def snapshot(self) -> bytes:
        with self._write_lock:
            return self._conn().serialize()

    def restore(self, index: int, data: bytes) -> None:
        with self._write_lock:
            # A WAL database serializes with file-format bytes 18-19 = 2, which an in-memory copy
            # cannot write to ("unable to open database file"): mark it rollback-journal (1).
            image = bytearray(data)
            if image[18:20] == b"\x02\x02":
                image[18:20] = b"\x01\x01"
            source = sqlite3.connect(":memory:")
            source.deserialize(bytes(image))
            source.execute("UPDATE meta SET value=? WHERE key='applied_index'", (index,))
            source.commit()
            source.backup(self._conn())
            source.close()

    def digest(self) -> str:
        h = hashlib.sha256()
        with transaction(self._conn(), "DEFERRED") as conn:
            for table, order in self.digest_tables:
                h.update(table.encode())
                for row in conn.execute(f"SELECT * FROM {table} ORDER BY {order}"):  # noqa: S608 (names are ours)
                    h.update(repr(tuple(row)).encode())
        return h.hexdigest()[:16]

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
