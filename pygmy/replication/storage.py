"""SQLite transactions for the log store and the state machines, and what counts as a storage fault.

One wrapper for every write transaction, because a failed ``COMMIT`` (disk full, I/O error) may
leave SQLite having already rolled back: an unconditional ``ROLLBACK`` then raises "cannot
rollback - no transaction is active" and hides the real error.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager, suppress


@contextmanager
def transaction(conn: sqlite3.Connection, mode: str = "IMMEDIATE") -> Iterator[sqlite3.Connection]:
    """``BEGIN <mode>`` ... ``COMMIT``; on any error roll back if SQLite has not already, and re-raise."""
    conn.execute(f"BEGIN {mode}")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            with suppress(sqlite3.Error):  # the original error is the one worth raising
                conn.execute("ROLLBACK")
        raise


def is_storage_fault(exc: BaseException) -> bool:
    """An error of the disk or the database file, not of the command: the same command would
    succeed on another replica, so it must never be recorded as the command's outcome."""
    if isinstance(exc, sqlite3.IntegrityError | sqlite3.ProgrammingError | sqlite3.InterfaceError):
        return False
    return isinstance(exc, sqlite3.DatabaseError | OSError | MemoryError)


def describe(exc: BaseException) -> str:
    """A short, operator-facing name for a storage fault (shown in ``/status``)."""
    text = str(exc)
    if "disk is full" in text or "No space left" in text:
        return f"disk full: {text}"
    return f"storage error: {type(exc).__name__}: {text}"
