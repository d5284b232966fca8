"""The order service's replicated state: one row per buy, keyed by its idempotency key.

A buy is an intent (``pending``) until the catalog has decremented the stock under the same key,
then ``confirmed``, or ``failed`` with the catalog's answer. Order numbers come from the log
order, so every replica numbers the same buys the same way.
"""

from __future__ import annotations

import sqlite3
import time
from datetime import UTC, datetime
from typing import Any

from pygmy.replication.statemachine import SQLiteStateMachine

PENDING, CONFIRMED, FAILED = "pending", "confirmed", "failed"


def order_dict(row: sqlite3.Row) -> dict[str, Any]:
    out: dict[str, Any] = {
        "order_number": row["order_number"], "item_number": row["item_number"], "title": row["title"],
        "quantity": row["quantity"], "cost": None if row["cost_cents"] is None else row["cost_cents"] / 100,
        "total": None if row["cost_cents"] is None else row["cost_cents"] * row["quantity"] / 100,
        "created_at": row["created_at"], "status": row["status"], "key": row["key"],
    }
    if row["status"] == FAILED:
        out["error"] = {"code": row["error_code"], "message": row["error_message"]}
    return out


def adoption(key: str, item: int, quantity: int, book: dict[str, Any], at: float, created_at: str | None = None
             ) -> dict[str, Any]:
    """The ``adopt`` command that records a buy from its decrement: the key's order becomes this
    buy, confirmed with the decrement's title and cost (what its confirm would have recorded). A
    key's time of 0 (a decrement sent without one) is kept for good on both tiers."""
    return {"op": "adopt", "key": key, "item": item, "quantity": quantity, "title": book["title"],
            "cost": book["cost"], "at": at or None,
            "created_at": created_at or datetime.fromtimestamp(at or time.time(), UTC).isoformat(timespec="milliseconds")}


def failure(key: str, code: int, message: str, at: float | None, item: int | None = None,
            quantity: int | None = None) -> dict[str, Any]:
    """The ``fail`` command: the key's pending order fails with the catalog's answer; with ``item``
    and ``quantity``, as that buy (the one the catalog refused under the key, another request's)."""
    command = {"op": "fail", "key": key, "code": code, "message": message, "at": at}
    if item is not None:
        command.update(item=item, quantity=quantity)
    return command


def confirmed(order: dict[str, Any], title: str, cost: float) -> dict[str, Any]:
    """A pending order as its ``confirm`` with this title and cost makes it (same rounding)."""
    cents = int(round(cost * 100))
    return {**order, "status": CONFIRMED, "title": title, "cost": cents / 100, "total": cents * order["quantity"] / 100}


class OrderState(SQLiteStateMachine):
    schema = (
        # ``key`` is NULL once forgotten: the order stays, a retry with its key is a new buy.
        # ``key_time``: when its decrement was sent (Unix seconds, from the confirm or fail), the
        # time the catalog keeps for the same key at most; NULL (unfinished, or finished before key
        # windows existed): the key is kept.
        """CREATE TABLE IF NOT EXISTS orders (
               order_number INTEGER PRIMARY KEY, key TEXT UNIQUE,
               item_number INTEGER NOT NULL, quantity INTEGER NOT NULL,
               title TEXT, cost_cents INTEGER, status TEXT NOT NULL,
               error_code INTEGER, error_message TEXT, created_at TEXT NOT NULL,
               key_time REAL)""",
        "CREATE INDEX IF NOT EXISTS orders_status ON orders(status)",
    )
    digest_tables = ("orders",)

    def migrate(self, conn: sqlite3.Connection) -> None:
        """Orders from before key windows had ``key NOT NULL`` and no ``key_time``: the table is
        rebuilt with the same rows, their keys kept for good."""
        notnull = {r[1]: r[3] for r in conn.execute("PRAGMA table_info(orders)")}
        if notnull.get("key"):
            conn.execute("ALTER TABLE orders RENAME TO orders_before_windows")
            conn.execute(self.schema[0])
            cols = ("order_number, key, item_number, quantity, title, cost_cents, status, error_code, "
                    "error_message, created_at")
            conn.execute(f"INSERT INTO orders({cols}) SELECT {cols} FROM orders_before_windows")
            conn.execute("DROP TABLE orders_before_windows")
            conn.execute(self.schema[1])
        # The keys still remembered, oldest first: what an expiry walks.
        conn.execute("CREATE INDEX IF NOT EXISTS orders_keys_by_age ON orders(key_time) WHERE key IS NOT NULL")

    # -- reads ------------------------------------------------------------------------------------
    def order(self, number: int) -> dict[str, Any] | None:
        rows = self.read("SELECT * FROM orders WHERE order_number=?", (number,))
        return order_dict(rows[0]) if rows else None

    def orders_after(self, after: int, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` orders numbered above ``after``, in number order, from one read."""
        return [order_dict(r) for r in self.read(
            "SELECT * FROM orders WHERE order_number>? ORDER BY order_number LIMIT ?", (after, limit))]

    def pending(self) -> list[dict[str, Any]]:
        return [order_dict(r) for r in self.read("SELECT * FROM orders WHERE status=? ORDER BY order_number", (PENDING,))]

    def oldest_pending(self) -> str | None:
        """``created_at`` of the oldest unfinished buy, if any (its keys must be kept)."""
        return self.read("SELECT MIN(created_at) FROM orders WHERE status=?", (PENDING,))[0][0]

    def key_count(self) -> int:
        return int(self.read("SELECT COUNT(*) FROM orders WHERE key IS NOT NULL")[0][0])

    def all_orders(self) -> list[dict[str, Any]]:
        return [order_dict(r) for r in self.read("SELECT * FROM orders ORDER BY order_number")]

    def scanned(self) -> int:
        """The catalog's log index up to which the decrements' keys were read back and every buy
        among them has its order here (``BuyProcessor.scan_orphans`` in pygmy/order/app.py)."""
        rows = self.read("SELECT value FROM meta WHERE key='catalog_scanned'")
        return int(rows[0][0]) if rows else 0

    def has_keys(self, keys: list[str]) -> set[str]:
        """Which of ``keys`` an order here still holds."""
        return set(self.statuses(keys))

    def statuses(self, keys: list[str]) -> dict[str, str]:
        """The status of the order each of ``keys`` has here (keys with none are left out)."""
        if not keys:
            return {}
        rows = self.read(f"SELECT key, status FROM orders WHERE key IN ({','.join('?' * len(keys))})", tuple(keys))
        return {r[0]: r[1] for r in rows}

    def by_key(self, key: str) -> dict[str, Any] | None:
        rows = self.read("SELECT * FROM orders WHERE key=?", (key,))
        return order_dict(rows[0]) if rows else None

    # -- commands ---------------------------------------------------------------------------------
    def _intent(self, conn: sqlite3.Connection, command: dict[str, Any]) -> None:
        """A pending order under the command's key, numbered next, unless the key has one already."""
        if conn.execute("SELECT 1 FROM orders WHERE key=?", (command["key"],)).fetchone() is None:
            conn.execute(
                "INSERT INTO orders(order_number, key, item_number, quantity, status, created_at) "
                "VALUES ((SELECT COALESCE(MAX(order_number), 0) + 1 FROM orders), ?, ?, ?, ?, ?)",
                (command["key"], command["item"], command["quantity"], PENDING, command["created_at"]),
            )

    def _confirm(self, conn: sqlite3.Connection, command: dict[str, Any]) -> None:
        """The pending order under the command's key confirmed with its title, cost and key time."""
        key = command["key"]
        row = conn.execute("SELECT * FROM orders WHERE key=? AND status=?", (key, PENDING)).fetchone()
        if row is not None:
            done = confirmed(order_dict(row), command["title"], command["cost"])
            conn.execute("UPDATE orders SET status=?, title=?, cost_cents=?, key_time=? WHERE key=? AND status=?",
                         (CONFIRMED, done["title"], int(round(done["cost"] * 100)), command.get("at"), key, PENDING))

    def _rebuy(self, conn: sqlite3.Connection, command: dict[str, Any]) -> None:
        """A pending order under the command's key becomes the command's buy (its book and quantity)."""
        conn.execute("UPDATE orders SET item_number=?, quantity=? WHERE key=? AND status=?",
                     (command["item"], command["quantity"], command["key"], PENDING))

    def execute(self, conn: sqlite3.Connection, index: int, command: dict[str, Any]) -> Any:
        op = command["op"]
        if op == "expire":
            # Finished orders whose key's time is before ``before`` forget it; unfinished ones keep it.
            forgotten = conn.execute(
                "UPDATE orders SET key = NULL WHERE key IS NOT NULL AND key_time < ? AND status != ?",
                (float(command["before"]), PENDING)).rowcount
            return {"forgotten": forgotten}
        if op == "scanned":
            # Never backwards: two leaders' scans may commit out of order.
            conn.execute("INSERT INTO meta(key, value) VALUES ('catalog_scanned', ?) ON CONFLICT(key) "
                         "DO UPDATE SET value = MAX(value, excluded.value)", (int(command["upto"]),))
            return {"scanned": conn.execute("SELECT value FROM meta WHERE key='catalog_scanned'").fetchone()[0]}
        key = command["key"]
        if op == "intent":
            self._intent(conn, command)
        elif op == "adopt":
            # A buy whose decrement was committed while its intent was lost (its leader died first):
            # recorded from the decrement, as its intent and confirm would have recorded it. A key
            # pending here already (its intent arrived after all, or a request reusing the key for
            # another buy made one) becomes the decrement's buy, confirmed; a finished one stays.
            self._intent(conn, command)
            self._rebuy(conn, command)
            self._confirm(conn, command)
        elif op == "confirm":
            self._confirm(conn, command)
        elif op == "fail":
            if "item" in command:  # the buy the catalog refused under the key (another request's)
                self._rebuy(conn, command)
            conn.execute(
                "UPDATE orders SET status=?, error_code=?, error_message=?, key_time=? WHERE key=? AND status=?",
                (FAILED, command["code"], command["message"], command.get("at"), key, PENDING),
            )
        else:
            raise ValueError(f"unknown order command {op!r}")
        row = conn.execute("SELECT * FROM orders WHERE key=?", (key,)).fetchone()
        # A confirm or fail always follows its intent in the log; were one ever alone, it would be a
        # no-op with no result, never an exception that stops every replica's apply loop at it.
        return None if row is None else order_dict(row)
