"""OrderState on its own: every command through ``apply`` (the replicated command path), in-process.

A buy is an ``intent`` (pending, numbered in log order, keyed by its idempotency key), then a
``confirm`` or a ``fail``; each is applied at most once per key, whatever the log replays.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pygmy.order.state import CONFIRMED, FAILED, PENDING, OrderState, confirmed, order_dict

AT = "2026-01-02T03:04:05.678+00:00"


class Log:
    """Applies commands at consecutive log indexes, as a replica's applier does."""

    def __init__(self, state: OrderState) -> None:
        self.state = state
        self.index = 0

    def __call__(self, command: dict[str, Any] | None) -> Any:
        self.index += 1
        return self.state.apply(self.index, command)


def intent(key: str, item: int = 3, quantity: int = 1, created_at: str = AT) -> dict[str, Any]:
    return {"op": "intent", "key": key, "item": item, "quantity": quantity, "created_at": created_at}


def confirm(key: str, title: str = "RPCs for Dummies", cost: float = 15.0) -> dict[str, Any]:
    return {"op": "confirm", "key": key, "title": title, "cost": cost}


def fail(key: str, code: int = 409, message: str = "out of stock") -> dict[str, Any]:
    return {"op": "fail", "key": key, "code": code, "message": message}


def pending_order(number: int, key: str, item: int = 3, quantity: int = 1) -> dict[str, Any]:
    return {"order_number": number, "item_number": item, "title": None, "quantity": quantity,
            "cost": None, "total": None, "created_at": AT, "status": "pending", "key": key}


@pytest.fixture
def state(tmp_path: Path) -> Iterator[OrderState]:
    s = OrderState(tmp_path / "order.db")
    yield s
    s.close()


@pytest.fixture
def log(state: OrderState) -> Log:
    return Log(state)


def test_status_names() -> None:
    assert (PENDING, CONFIRMED, FAILED) == ("pending", "confirmed", "failed")


def test_an_intent_is_a_pending_order_numbered_from_one(state: OrderState, log: Log) -> None:
    assert state.order(1) is None and state.pending() == []
    assert log(intent("k1", item=5, quantity=2)) == pending_order(1, "k1", item=5, quantity=2)
    assert state.order(1) == pending_order(1, "k1", item=5, quantity=2)
    assert state.pending() == [pending_order(1, "k1", item=5, quantity=2)]
    assert state.applied_index() == 1


def test_orders_are_numbered_in_log_order(state: OrderState, log: Log) -> None:
    numbers = [log(intent(f"k{i}"))["order_number"] for i in range(5)]
    assert numbers == [1, 2, 3, 4, 5]
    assert [o["key"] for o in state.pending()] == ["k0", "k1", "k2", "k3", "k4"]
    assert state.order(6) is None and state.order(0) is None


def test_a_repeated_intent_returns_the_first_order_unchanged(state: OrderState, log: Log) -> None:
    log(intent("a", item=1, quantity=1))
    log(intent("b", item=2, quantity=2))
    # A client retrying a buy under the same key, even with other fields: still order 1, as first recorded.
    assert log(intent("a", item=7, quantity=9, created_at="later")) == pending_order(1, "a", item=1, quantity=1)
    assert [o["order_number"] for o in state.pending()] == [1, 2]
    assert log(intent("c"))["order_number"] == 3  # the repeat used no number


def test_confirm_records_title_cost_and_total(state: OrderState, log: Log) -> None:
    log(intent("k", quantity=3))
    confirmed = log(confirm("k", title="Cooking for the Impatient Graduate Student", cost=12.5))
    assert confirmed == {
        "order_number": 1, "item_number": 3, "title": "Cooking for the Impatient Graduate Student",
        "quantity": 3, "cost": 12.5, "total": 37.5, "created_at": AT, "status": "confirmed", "key": "k",
    }
    assert state.order(1) == confirmed
    assert state.pending() == []



@pytest.mark.parametrize(("quantity", "cost"), [(1, 15.0), (3, 0.29), (4, 19.999), (7, 12.5)])
def test_confirmed_predicts_what_the_confirm_makes_of_the_pending_order(
        log: Log, quantity: int, cost: float) -> None:
    """The order leader answers a buy with ``confirmed(pending, title, cost)`` before its confirm is
    applied (order/app.py): the answer must be the order the confirm then records, rounding included."""
    pending = log(intent("k", quantity=quantity))
    predicted = confirmed(pending, "RPCs for Dummies", cost)
    assert predicted == log(confirm("k", title="RPCs for Dummies", cost=cost))
    assert predicted["status"] == CONFIRMED and predicted["total"] == round(round(cost * 100) * quantity / 100, 2)

def test_cost_is_kept_in_whole_cents(state: OrderState, log: Log) -> None:
    log(intent("k", quantity=3))
    # 0.29 * 100 is 28.999999999999996 in floating point: rounded, not truncated.
    assert log(confirm("k", cost=0.29))["cost"] == 0.29
    assert state.read("SELECT cost_cents FROM orders")[0][0] == 29
    assert state.order(1)["total"] == 0.87
    log(intent("j", quantity=1))
    assert log(confirm("j", cost=19.999))["cost"] == 20.0


def test_confirm_applies_once(state: OrderState, log: Log) -> None:
    log(intent("k"))
    first = log(confirm("k", title="T", cost=10.0))
    assert log(confirm("k", title="Other", cost=99.0)) == first
    assert log(fail("k")) == first  # a late failure cannot undo a confirmed buy
    assert state.order(1) == first


def test_fail_records_the_catalogs_answer(state: OrderState, log: Log) -> None:
    log(intent("k", item=9, quantity=2))
    failed = log(fail("k", code=404, message="no book with item number 9"))
    assert failed == {
        "order_number": 1, "item_number": 9, "title": None, "quantity": 2, "cost": None, "total": None,
        "created_at": AT, "status": "failed", "key": "k",
        "error": {"code": 404, "message": "no book with item number 9"},
    }
    assert state.order(1) == failed
    assert state.pending() == []


def test_fail_applies_once(state: OrderState, log: Log) -> None:
    log(intent("k"))
    first = log(fail("k", code=409, message="out of stock: 0 left"))
    assert log(fail("k", code=404, message="other")) == first
    assert log(confirm("k")) == first  # a late success cannot turn a failed buy into a sale
    assert log(intent("k")) == first
    assert state.order(1) == first


def test_commands_touch_only_their_own_key(state: OrderState, log: Log) -> None:
    log(intent("a"))
    log(intent("b"))
    log(intent("c"))
    log(confirm("b"))
    log(fail("c"))
    assert [o["key"] for o in state.pending()] == ["a"]
    assert [state.order(n)["status"] for n in (1, 2, 3)] == ["pending", "confirmed", "failed"]
    assert "error" not in state.order(1) and "error" not in state.order(2)


def test_pending_lists_only_pending_orders_in_number_order(state: OrderState, log: Log) -> None:
    for key in ("a", "b", "c", "d"):
        log(intent(key))
    log(confirm("a"))
    log(fail("c"))
    assert state.pending() == [pending_order(2, "b"), pending_order(4, "d")]


def test_a_replayed_log_entry_changes_nothing(state: OrderState, log: Log) -> None:
    log(intent("a"))
    log(intent("b"))
    # After a crash the log replays entries the state already holds: nothing is applied twice.
    assert state.apply(2, intent("c")) is None
    assert state.apply(1, confirm("a")) is None
    assert state.applied_index() == 2
    assert state.pending() == [pending_order(1, "a"), pending_order(2, "b")]


def test_a_no_op_entry_only_advances_the_applied_index(state: OrderState, log: Log) -> None:
    log(intent("a"))
    before = state.digest()
    assert log(None) is None
    assert state.applied_index() == 2
    assert state.digest() == before
    assert log(intent("b"))["order_number"] == 2


def test_an_outcome_without_an_intent_is_a_no_op_with_no_result(state: OrderState, log: Log) -> None:
    log(intent("a"))
    # Never proposed by the order service, but were one in the log it must not stop every replica's
    # apply loop: it is applied as nothing.
    assert log(confirm("nobody")) is None
    assert log(fail("nobody")) is None
    assert state.applied_index() == 3
    assert state.pending() == [pending_order(1, "a")] and state.order(2) is None


def test_an_unknown_command_is_refused_and_applies_nothing(state: OrderState, log: Log) -> None:
    log(intent("a"))
    with pytest.raises(ValueError, match=r"^unknown order command 'refund'$"):
        state.apply(2, {"op": "refund", "key": "a"})
    assert state.applied_index() == 1
    assert state.order(1) == pending_order(1, "a")


def test_replicas_applying_the_same_log_have_the_same_digest(tmp_path: Path) -> None:
    replicas = [OrderState(tmp_path / f"r{i}.db") for i in range(3)]
    logs = [Log(r) for r in replicas]
    commands = [intent("a"), intent("b", quantity=2), confirm("a", cost=15.0), fail("b")]
    for lg in logs[:2]:
        for cmd in commands:
            lg(cmd)
    for cmd in commands[:3]:
        logs[2](cmd)
    digests = [r.digest() for r in replicas]
    assert digests[0] == digests[1]
    assert digests[2] != digests[0]  # "b" is still pending there
    assert len(digests[0]) == 16 and int(digests[0], 16) >= 0
    for r in replicas:
        r.close()


def test_order_dict_of_a_confirmed_row_has_no_error() -> None:
    row = {"order_number": 4, "item_number": 2, "title": "T", "quantity": 2, "cost_cents": 1999,
           "created_at": AT, "status": "confirmed", "key": "k", "error_code": None, "error_message": None}
    assert order_dict(row) == {"order_number": 4, "item_number": 2, "title": "T", "quantity": 2, "cost": 19.99,
                               "total": 39.98, "created_at": AT, "status": "confirmed", "key": "k"}


def test_a_batch_applies_each_command_as_alone_in_order(tmp_path: Path) -> None:
    """``{"op": "batch"}``: the intents (or confirms) of concurrent buys in one log entry number and
    settle exactly as one entry each would, a repeated key included."""
    batched, alone = OrderState(tmp_path / "a.db"), OrderState(tmp_path / "b.db")
    commands = [{"op": "intent", "key": k, "item": i, "quantity": 1, "created_at": "t"}
                for k, i in (("a", 1), ("b", 2), ("a", 1), ("c", 3))]
    results = batched.apply(1, {"op": "batch", "commands": commands})
    singles = [alone.apply(n, c) for n, c in enumerate(commands, start=1)]
    assert [r["order_number"] for r in results] == [r["order_number"] for r in singles] == [1, 2, 1, 3]
    confirms = [{"op": "confirm", "key": k, "title": "T", "cost": 2.5} for k in ("a", "c")]
    assert [r["status"] for r in batched.apply(2, {"op": "batch", "commands": confirms})] == ["confirmed"] * 2
    for n, c in enumerate(confirms, start=5):
        alone.apply(n, c)
    assert batched.full_digest()[1:] == alone.full_digest()[1:] and batched.digest() == alone.digest()
    batched.close()
    alone.close()


# -- key windows --------------------------------------------------------------------------------------
def test_expire_forgets_keys_of_finished_orders_by_their_time_only(state: OrderState, log: Log) -> None:
    for key in ("done", "refused", "open", "old-style", "recent"):
        log(intent(key))
    log({**confirm("done"), "at": 100.0})
    log({**fail("refused"), "at": 150.0})
    log(confirm("old-style"))  # decided before key windows: no time, kept for good
    log({**confirm("recent"), "at": 300.0})
    assert log({"op": "expire", "before": 200.0}) == {"forgotten": 2}
    assert state.key_count() == 3
    assert [o["key"] for o in state.pending()] == ["open"], "an unfinished buy keeps its key"
    assert state.oldest_pending() == AT
    # The order stays; its key is free again: a retry with it is a new buy.
    assert state.order(1)["status"] == CONFIRMED and state.order(1)["key"] is None
    again = log(intent("done", created_at=LATE))
    assert again["order_number"] == 6 and again["status"] == PENDING
    assert log(confirm("recent"))["order_number"] == 5, "a remembered key still finds its order"
    applied, kept, recomputed = state.full_digest()
    assert kept == recomputed


LATE = "2026-01-03T00:00:00.000+00:00"


def test_a_database_from_before_key_windows_is_migrated_with_its_orders(tmp_path: Path) -> None:
    """``key NOT NULL`` and no ``key_time``: rebuilt with the same rows, their keys kept for good."""
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.execute("""CREATE TABLE orders (
               order_number INTEGER PRIMARY KEY, key TEXT NOT NULL UNIQUE,
               item_number INTEGER NOT NULL, quantity INTEGER NOT NULL,
               title TEXT, cost_cents INTEGER, status TEXT NOT NULL,
               error_code INTEGER, error_message TEXT, created_at TEXT NOT NULL)""")
    conn.execute("INSERT INTO orders VALUES (1, 'k1', 2, 1, 'RPCs for Dummies', 1500, 'confirmed', NULL, NULL, ?)",
                 (AT,))
    conn.execute("INSERT INTO orders VALUES (2, 'k2', 3, 1, NULL, NULL, 'pending', NULL, NULL, ?)", (AT,))
    conn.commit()
    conn.close()
    s = OrderState(path)
    assert s.order(1)["key"] == "k1" and s.order(1)["total"] == 15.0 and s.pending()[0]["key"] == "k2"
    s.apply(1, {"op": "expire", "before": 10**10})
    assert s.key_count() == 2, "keys from before windows are kept"
    s.apply(2, {**confirm("k2"), "at": 50.0})  # finished now, with a time: forgettable
    s.apply(3, {"op": "expire", "before": 10**10})
    assert s.order(2)["key"] is None and s.order(1)["key"] == "k1" and s.key_count() == 1
    applied, kept, recomputed = s.full_digest()
    assert kept == recomputed
    fresh = OrderState(tmp_path / "fresh.db")
    s.snapshot_to(tmp_path / "snap.db")
    fresh.restore(3, tmp_path / "snap.db")
    assert fresh.applied_and_digest() == s.applied_and_digest()


def adopt(key: str, item: int = 3, quantity: int = 1, title: str = "RPCs for Dummies", cost: float = 15.0
          ) -> dict[str, Any]:
    return {"op": "adopt", "key": key, "item": item, "quantity": quantity, "title": title, "cost": cost,
            "at": 100.0, "created_at": AT}


def test_adopt_records_a_buy_from_its_decrement_alone(state: OrderState, log: Log) -> None:
    """A decrement that outlived its intent: the order is made confirmed, numbered next."""
    log(intent("first"))
    got = log(adopt("orphan", item=2, quantity=3))
    assert got == {**confirmed(pending_order(2, "orphan", item=2, quantity=3), "RPCs for Dummies", 15.0),
                   "created_at": AT}
    assert state.by_key("orphan")["status"] == CONFIRMED
    # Its intent arriving after all (or a retry's) finds the order: one order per key.
    assert log(intent("orphan", item=2, quantity=3)) == got
    assert log(adopt("orphan", item=2, quantity=3)) == got


def test_adopt_confirms_a_pending_order_as_the_decrements_buy_and_leaves_a_finished_one(
        state: OrderState, log: Log) -> None:
    """A pending order under the key becomes the buy the catalog took stock for (a request reusing
    the key for another book made the intent): stock and orders agree book by book."""
    log(intent("pending", item=3, quantity=1))
    log(intent("failed"))
    log(fail("failed"))
    got = log(adopt("pending", item=5, quantity=2))
    assert (got["status"], got["item_number"], got["quantity"]) == (CONFIRMED, 5, 2)
    assert log(adopt("failed"))["status"] == FAILED
    assert [o["order_number"] for o in state.all_orders()] == [1, 2]


def test_scanned_only_moves_forward(state: OrderState, log: Log) -> None:
    assert state.scanned() == 0
    assert log({"op": "scanned", "upto": 7}) == {"scanned": 7}
    assert log({"op": "scanned", "upto": 3}) == {"scanned": 7}, "an older scan's entry committed late"
    assert state.scanned() == 7
    assert state.has_keys(["a", "b"]) == set()
    log(intent("a"))
    assert state.has_keys(["a", "b"]) == {"a"} and state.has_keys([]) == set()
    assert state.statuses(["a", "b"]) == {"a": "pending"} and state.statuses([]) == {}


def test_the_commands_the_leader_builds_for_adoptions_and_failures_record_what_they_say(
        state: OrderState, log: Log) -> None:
    """``adoption`` and ``failure`` are how the order leader writes these commands (the orphan scan,
    a refused decrement): what their orders end up holding, key times included."""
    from pygmy.order.state import adoption, failure

    def key_time(key: str) -> Any:
        return state.read("SELECT key_time FROM orders WHERE key=?", (key,))[0][0]

    book = {"title": "Xen and the Art of Surviving Undergraduate School", "cost": 12.5}
    got = log(adoption("orphan", 2, 3, book, 1_700_000_000.25))
    assert (got["status"], got["item_number"], got["quantity"], got["title"], got["cost"], got["total"]) == (
        CONFIRMED, 2, 3, book["title"], 12.5, 37.5)
    assert got["created_at"] == "2023-11-14T22:13:20.250+00:00" and key_time("orphan") == 1_700_000_000.25
    kept = log(adoption("timeless", 4, 1, book, 0.0, created_at=AT))
    assert kept["created_at"] == AT and key_time("timeless") is None, "a key sent without a time is kept for good"
    assert log(adoption("now", 4, 1, book, 0.0))["created_at"].endswith("+00:00")

    log(intent("refused", item=3, quantity=1))
    got = log(failure("refused", 409, "out of stock", 55.0))
    assert (got["status"], got["error"], key_time("refused")) == (FAILED, {"code": 409, "message": "out of stock"}, 55.0)
    log(intent("reused", item=3, quantity=1))
    got = log(failure("reused", 409, "out of stock", None, item=6, quantity=2))
    assert (got["status"], got["item_number"], got["quantity"]) == (FAILED, 6, 2), "recorded as the refused buy"
    assert key_time("reused") is None


def test_orders_after_pages_in_number_order_from_the_one_after(state: OrderState, log: Log) -> None:
    """What ``GET /orders`` pages through: every status, numbers above ``after``, at most ``limit``."""
    for k in range(1, 6):
        log(intent(f"k{k}"))
    log(confirm("k1"))
    log(fail("k2"))
    log(confirm("k4"))
    page = state.orders_after(0, 10)
    assert [(o["order_number"], o["status"]) for o in page] == [
        (1, CONFIRMED), (2, FAILED), (3, PENDING), (4, CONFIRMED), (5, PENDING)]
    assert [o["order_number"] for o in state.orders_after(2, 2)] == [3, 4]
    assert [o["order_number"] for o in state.orders_after(4, 10)] == [5]
    assert state.orders_after(5, 10) == []
    assert page[0]["title"] == "RPCs for Dummies" and page[0]["cost"] == 15.0 and page[1]["key"] == "k2"
