"""The catalog's replicated state: books, and the idempotency keys of the decrements already done.

Every change is a command applied by ``CatalogState.execute`` in log order, so all replicas that
applied the same prefix hold the same books. Money is kept in integer cents so digests never
depend on float formatting.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pygmy.kit.cachekeys import topic_key
from pygmy.replication.statemachine import SQLiteStateMachine

#: Books inserted between two progress reports of a seed.
SEED_STEP = 100_000


def cents(cost: float) -> int:
    return int(round(cost * 100))


def book_dict(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "item_number": row["item_number"], "title": row["title"], "topic": row["topic"],
        "stock": row["stock"], "cost": row["cost_cents"] / 100, "version": row["version"],
    }


def error(code: int, message: str) -> dict[str, Any]:
    return {"ok": False, "error": {"code": code, "message": message}}


class CatalogState(SQLiteStateMachine):
    schema = (
        """CREATE TABLE IF NOT EXISTS books (
               item_number INTEGER PRIMARY KEY, title TEXT NOT NULL, topic TEXT NOT NULL,
               topic_key TEXT NOT NULL, stock INTEGER NOT NULL CHECK (stock >= 0),
               cost_cents INTEGER NOT NULL, version INTEGER NOT NULL DEFAULT 0,
               stock_added INTEGER NOT NULL DEFAULT 0)""",
        "CREATE INDEX IF NOT EXISTS books_topic ON books(topic_key, item_number)",
        # ``at``: the key's time (Unix seconds, in the command, so the same on every replica): for a
        # decrement, when the order leader sent it (the first time: a repeat returns the first row);
        # for an update, when the catalog leader proposed it; 0: kept for good. ``idx``: the log
        # index of the entry that first used the key (0: from before it was kept), the order in which
        # the order leader reads a buy's keys back (``keys_after``). ``item``, ``quantity``: a
        # decrement's (NULL: an update's key), so that the order tier can record a buy whose
        # decrement is all that survived (``BuyProcessor.scan_orphans`` in pygmy/order/app.py). Set
        # only by commands that say so (``keyed``): an entry from before is replayed as it was first
        # applied, with 0 and NULLs, on every replica.
        """CREATE TABLE IF NOT EXISTS idempotency (key TEXT PRIMARY KEY, result TEXT NOT NULL,
               at REAL NOT NULL DEFAULT 0, idx INTEGER NOT NULL DEFAULT 0, item INTEGER, quantity INTEGER)""",
    )
    digest_tables = ("books", "idempotency")

    def migrate(self, conn: sqlite3.Connection) -> None:
        # ``stock_added``: the copies updates and restocks added to a book (net), so that a copy of
        # the state alone says stock = initial + added - sold (``pygmy backup --verify``). A book
        # from before the ledger starts at 0 with its history unknown: ``stock_ledger`` 0 says so.
        if "stock_added" not in {r[1] for r in conn.execute("PRAGMA table_info(books)")}:
            conn.execute("ALTER TABLE books ADD COLUMN stock_added INTEGER NOT NULL DEFAULT 0")
            conn.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('stock_ledger', 0)")
        else:
            conn.execute("INSERT OR IGNORE INTO meta(key, value) VALUES ('stock_ledger', 1)")
        columns = {r[1] for r in conn.execute("PRAGMA table_info(idempotency)")}
        if "at" not in columns:
            conn.execute("ALTER TABLE idempotency ADD COLUMN at REAL NOT NULL DEFAULT 0")
        # Keys from before ``idx`` are all of buys whose intent was committed before their
        # decrement was sent: 0, as if the order leader had read them back already.
        if "idx" not in columns:
            conn.execute("ALTER TABLE idempotency ADD COLUMN idx INTEGER NOT NULL DEFAULT 0")
            conn.execute("ALTER TABLE idempotency ADD COLUMN item INTEGER")
            conn.execute("ALTER TABLE idempotency ADD COLUMN quantity INTEGER")
        conn.execute("CREATE INDEX IF NOT EXISTS idempotency_at ON idempotency(at)")
        conn.execute("CREATE INDEX IF NOT EXISTS idempotency_idx ON idempotency(idx, key)")

    def is_new(self) -> bool:
        """Nothing applied and no books: a replica that never started, or whose data was deleted."""
        return self.applied_index() == 0 and not self.read("SELECT 1 FROM books LIMIT 1")

    def seed(self, books: list[dict[str, Any]], progress: Callable[[int, int], None] | None = None) -> None:
        """Load the initial catalogue into a brand-new replica (identical on every replica), in one
        transaction; ``progress(done, total)`` after every 100,000 books."""
        with self._write_lock, self._writing() as conn:
            if conn.execute("SELECT COUNT(*) FROM books").fetchone()[0] == 0 and self.applied_index() == 0:
                for start in range(0, len(books), SEED_STEP):
                    conn.executemany(
                        "INSERT INTO books(item_number, title, topic, topic_key, stock, cost_cents) VALUES (?,?,?,?,?,?)",
                        [(b["item_number"], b["title"], b["topic"], topic_key(b["topic"]), b["stock"], cents(b["cost"]))
                         for b in books[start:start + SEED_STEP]],
                    )
                    if progress is not None:
                        progress(min(start + SEED_STEP, len(books)), len(books))

    # -- reads ------------------------------------------------------------------------------------
    def book(self, item: int) -> dict[str, Any] | None:
        rows = self.read("SELECT * FROM books WHERE item_number=?", (item,))
        return book_dict(rows[0]) if rows else None

    def book_at(self, item: int) -> tuple[int, dict[str, Any] | None]:
        """The book and the applied index it was read at."""
        applied, rows = self.read_at("SELECT * FROM books WHERE item_number=?", (item,))
        return applied, (book_dict(rows[0]) if rows else None)

    def books(self, items: list[int]) -> dict[int, dict[str, Any]]:
        """The books of ``items`` that exist, by item number (one read)."""
        rows = self.read(f"SELECT * FROM books WHERE item_number IN ({','.join('?' * len(items))})", tuple(items))
        return {r["item_number"]: book_dict(r) for r in rows}

    def existing(self, items: list[int]) -> list[int]:
        """Which of ``items`` are books, in order (no command adds or removes one: a store is seeded,
        or copied whole)."""
        rows = self.read(f"SELECT item_number FROM books WHERE item_number IN ({','.join('?' * len(items))}) "
                         "ORDER BY item_number", tuple(items))
        return [r[0] for r in rows]

    def sold_out(self) -> list[int]:
        return [r[0] for r in self.read("SELECT item_number FROM books WHERE stock = 0 ORDER BY item_number")]

    def search_at(self, topic: str, after: int = 0, limit: int | None = None
                  ) -> tuple[int, list[dict[str, Any]], bool]:
        """Books on a topic with item numbers above ``after``, at most ``limit`` of them (None: all),
        the applied index they were read at, and whether more follow. One index range scan
        (``books_topic``): a page costs its own size, not the topic's."""
        applied, rows = self.read_at(
            "SELECT item_number, title FROM books WHERE topic_key=? AND item_number>? ORDER BY item_number LIMIT ?",
            (topic_key(topic), after, -1 if limit is None else limit + 1),
        )
        more = limit is not None and len(rows) > limit
        return applied, [{"item_number": r["item_number"], "title": r["title"]} for r in rows[:limit]], more

    def key_count(self) -> int:
        return int(self.read("SELECT COUNT(*) FROM idempotency")[0][0])

    def keys_after(self, after: int, limit: int, after_key: str | None = None) -> tuple[int, list[dict[str, Any]], bool]:
        """The decrements' keys first used at log indexes above ``after`` (or at ``after`` itself with
        a key above ``after_key``: one entry may hold many), in (index, key) order, at most ``limit``
        of them; the applied index they were read at, and whether more follow. What the order leader
        reads to find buys whose decrement outlived their intent."""
        where, params = ("idx > ?", (after,)) if after_key is None else (
            "(idx, key) > (?, ?)", (after, after_key))  # a row value: SQLite seeks the (idx, key) index
        applied, rows = self.read_at(
            f"SELECT key, result, at, idx, item, quantity FROM idempotency WHERE {where} AND quantity IS NOT NULL "
            "ORDER BY idx, key LIMIT ?", (*params, limit + 1))
        out = []
        for r in rows[:limit]:
            result = json.loads(r["result"])
            book = result.get("book") if result.get("ok") else None
            out.append({"key": r["key"], "idx": r["idx"], "at": r["at"], "item": r["item"],
                        "quantity": r["quantity"], "ok": book is not None,
                        "title": book["title"] if book else None, "cost": book["cost"] if book else None})
        return applied, out, len(rows) > limit

    # -- a backup's copy (``pygmy.cluster.backup``) --------------------------------------------------
    def remembered(self) -> dict[str, tuple[dict[str, Any], float]]:
        """Every remembered key: its first result and its time."""
        return {r["key"]: (json.loads(r["result"]), r["at"]) for r in self.read("SELECT * FROM idempotency")}

    def decrements(self) -> dict[str, tuple[int, int]]:
        """The book and quantity of each remembered decrement's key (not of keys from before they
        were kept with it)."""
        return {r[0]: (r[1], r[2]) for r in self.read("SELECT key, item, quantity FROM idempotency WHERE quantity IS NOT NULL")}

    def ledger(self) -> dict[int, tuple[int, int]]:
        """Each book's stock and the copies updates and restocks added to it: ``{item: (stock, added)}``."""
        return {r[0]: (r[1], r[2]) for r in self.read("SELECT item_number, stock, stock_added FROM books")}

    def ledger_complete(self) -> bool:
        """Whether ``stock_added`` covers the whole history (not a catalogue from before the ledger)."""
        rows = self.read("SELECT value FROM meta WHERE key='stock_ledger'")
        return bool(rows and rows[0][0])

    def undo_decrement(self, conn: sqlite3.Connection, key: str, item: int, quantity: int) -> None:
        """Forget a decrement whose buy is not in the copy of the orders: its copies go back to
        stock if it took them (its result says), and its key is dropped, so that a retry on the
        restored store is a new buy that takes stock again. Inside ``amend``."""
        row = conn.execute("SELECT result FROM idempotency WHERE key=?", (key,)).fetchone()
        if row is None:
            return
        if json.loads(row[0]).get("ok"):
            conn.execute("UPDATE books SET stock = stock + ? WHERE item_number = ?", (quantity, item))
        conn.execute("DELETE FROM idempotency WHERE key=?", (key,))

    # -- commands ---------------------------------------------------------------------------------
    def execute(self, conn: sqlite3.Connection, index: int, command: dict[str, Any]) -> Any:
        op = command["op"]
        if op == "decrement":
            return self._decrement(conn, index, command, bool(command.get("keyed")))
        if op == "decrements":
            # Concurrent buys in one log entry: each decrement exactly as alone, in order, each
            # under its own key (a repeated key returns its first result, in or out of a batch).
            keyed = bool(command.get("keyed"))
            return {"ok": True, "index": index,
                    "results": [self._decrement(conn, index, item, keyed) for item in command["items"]]}
        if op == "update":
            return self._update(conn, index, command)
        if op == "restock":
            return self._restock(conn, index, command)
        if op == "expire":
            return self._expire(conn, command)
        raise ValueError(f"unknown catalog command {op!r}")

    def _remember(self, conn: sqlite3.Connection, index: int, cmd: dict[str, Any], result: dict[str, Any],
                  decrement: bool = False, keyed: bool = False) -> None:
        """``keyed``: the command says it was written by a version that keeps a key's index and buy."""
        conn.execute("INSERT INTO idempotency(key, result, at, idx, item, quantity) VALUES (?, ?, ?, ?, ?, ?)",
                     (cmd["key"], json.dumps(result), float(cmd.get("at", 0)), index if keyed else 0,
                      cmd["item"] if decrement and keyed else None, cmd["quantity"] if decrement and keyed else None))

    def _expire(self, conn: sqlite3.Connection, cmd: dict[str, Any]) -> dict[str, Any]:
        """Forget the keys whose time is before ``before`` (Unix seconds, chosen by the order leader:
        never after its oldest unfinished buy). Keys without a time (``at`` 0: from before key
        windows, or a caller that gave none) are kept. With ``scanned`` (the log index up to which the
        order tier has read the decrements' keys back, ``keys_after``), keys of later decrements are
        kept too, whatever their time: a buy's decrement the order tier has not seen yet may be all
        that is left of it. ``kept_before``: the oldest time among the keys kept so (None: none),
        below which the order tier must not forget keys either."""
        before = float(cmd["before"])
        scanned = cmd.get("scanned")
        if scanned is None:  # an entry from before the order tier read keys back
            forgotten = conn.execute("DELETE FROM idempotency WHERE at > 0 AND at < ?", (before,)).rowcount
            return {"ok": True, "forgotten": forgotten}
        forgotten = conn.execute("DELETE FROM idempotency WHERE at > 0 AND at < ? AND (idx <= ? OR quantity IS NULL)",
                                 (before, int(scanned))).rowcount
        kept = conn.execute("SELECT MIN(at) FROM idempotency WHERE at > 0 AND at < ? AND idx > ? "
                            "AND quantity IS NOT NULL", (before, int(scanned))).fetchone()[0]
        return {"ok": True, "forgotten": forgotten, "kept_before": kept}

    def _row(self, conn: sqlite3.Connection, item: int) -> sqlite3.Row | None:
        return conn.execute("SELECT * FROM books WHERE item_number=?", (item,)).fetchone()

    def _decrement(self, conn: sqlite3.Connection, index: int, cmd: dict[str, Any], keyed: bool) -> dict[str, Any]:
        key = cmd["key"]
        item, quantity = cmd["item"], cmd["quantity"]
        seen = conn.execute("SELECT result, item, quantity, at FROM idempotency WHERE key=?", (key,)).fetchone()
        if seen:
            first = json.loads(seen[0])
            if seen[2] is not None and (seen[1], seen[2]) != (item, quantity):
                # The key's first decrement was another buy's (one whose intent was lost, or a
                # concurrent request reusing the key): the order tier records that buy under it.
                return {**error(422, "this idempotency key was already used for a different buy"),
                        "buy": {"item": seen[1], "quantity": seen[2], "at": seen[3], "result": first}}
            return first
        # One conditional statement decides: concurrent buyers can never take stock below zero.
        cur = conn.execute(
            "UPDATE books SET stock = stock - ?, version = ? WHERE item_number = ? AND stock >= ?",
            (quantity, index, item, quantity),
        )
        row = self._row(conn, item)
        if cur.rowcount == 1:
            result = {"ok": True, "book": book_dict(row)}
        elif row is None:
            result = error(404, f"no book with item number {item}")
        else:
            result = error(409, f"out of stock: {row['stock']} left of item {item}, {quantity} wanted")
        self._remember(conn, index, cmd, result, decrement=True, keyed=keyed)
        return result

    def _update(self, conn: sqlite3.Connection, index: int, cmd: dict[str, Any]) -> dict[str, Any]:
        """Admin change; with a ``key`` a retried update (after a timeout or failover) applies once."""
        key = cmd.get("key")
        if key:
            seen = conn.execute("SELECT result FROM idempotency WHERE key=?", (key,)).fetchone()
            if seen:
                return json.loads(seen[0])
        item = cmd["item"]
        row = self._row(conn, item)
        delta = cmd.get("stock_delta") or 0
        if row is None:
            result = error(404, f"no book with item number {item}")
        elif row["stock"] + delta < 0:
            result = error(409, f"stock would go negative: {row['stock']} in stock, delta {delta}")
        else:
            cost = cents(cmd["cost"]) if cmd.get("cost") is not None else row["cost_cents"]
            conn.execute(
                "UPDATE books SET stock = stock + ?, stock_added = stock_added + ?, cost_cents = ?, version = ? "
                "WHERE item_number = ?",
                (delta, delta, cost, index, item),
            )
            # The row as just written, without reading it back (one statement fewer per update).
            result = {"ok": True, "book": {**book_dict(row), "stock": row["stock"] + delta, "cost": cost / 100,
                                           "version": index}}
        if key:
            self._remember(conn, index, cmd, result)
        return result

    def _restock(self, conn: sqlite3.Connection, index: int, cmd: dict[str, Any]) -> dict[str, Any]:
        """New stock for the sold-out books the command names (the original store's periodic delivery).

        The leader names them when it proposes, so their cache keys can be held before the command
        can be applied anywhere; one sold again in the meantime is skipped. Old log entries without
        ``items`` restock every sold-out book, as they did when they were written.
        """
        named = cmd.get("items")
        sold_out = [r[0] for r in conn.execute("SELECT item_number FROM books WHERE stock = 0")]
        items = sold_out if named is None else [n for n in sold_out if n in set(named)]
        conn.executemany("UPDATE books SET stock = stock + ?, stock_added = stock_added + ?, version = ? "
                         "WHERE item_number = ?", [(cmd["amount"], cmd["amount"], index, n) for n in items])
        return {"ok": True, "items": items, "index": index}


def build_seed(books: list[dict[str, Any]], dest: Path, progress: Callable[[int, int], None] | None = None) -> None:
    """The initial catalogue as a state file of its own, written once (atomically: to a temporary
    name, then renamed) for every new replica to copy (``restore(0, dest)``): one parse and one
    digest for the whole cluster instead of one per replica, and a starting replica's memory stays
    at a page cache's worth however many books there are."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".building")
    for leftover in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
        leftover.unlink(missing_ok=True)
    state = CatalogState(tmp)
    try:
        state.seed(books, progress)
        state.read("PRAGMA journal_mode=DELETE")  # one self-contained file, nothing beside it
    finally:
        state.close()
    os.replace(tmp, dest)
