"""The orphan scan (``BuyProcessor.scan_orphans``): a buy's decrement goes out while its intent is
being committed, so a leader that dies between the two leaves a decrement with no order. The next
leader reads the catalog's keys back in log order and records such buys; here against a real
CatalogState and OrderState, in-process."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from pygmy.catalog.state import CatalogState
from pygmy.order import app as order_app
from pygmy.order.state import CONFIRMED, OrderState
from pygmy.replication.router import Reply

BOOKS = [{"item_number": n, "title": f"book {n}", "topic": "t", "stock": 10, "cost": 2.5 * n} for n in (1, 2, 3)]


class FakeNode:
    current = 1

    def term(self) -> int:
        return self.current

    def can_serve_reads(self) -> bool:
        return True


class FakeRuntime:
    """Proposals applied at once, in order, to one real OrderState."""

    name = "order-test"

    def __init__(self, state: OrderState) -> None:
        self.state, self.index, self.node = state, 0, FakeNode()

    def propose(self, command: dict[str, Any], timeout: float = 5.0) -> Any:
        self.index += 1
        return self.state.apply(self.index, command)


class Keys:
    """The catalog's ``GET /keys`` over a real CatalogState."""

    def __init__(self, catalog: CatalogState, page: int) -> None:
        self.catalog, self.page, self.reads = catalog, page, 0

    def read(self, path: str, deadline: float, params: dict[str, Any]) -> Reply:
        assert path == "/keys"
        self.reads += 1
        applied, found, more = self.catalog.keys_after(params["after"], min(params["limit"], self.page),
                                                       params.get("after_key"))
        return Reply(200, {"keys": found, "more": more, "applied_index": applied}, "catalog-1")


@pytest.fixture
def tiers(tmp_path: Path) -> Any:
    catalog, orders = CatalogState(tmp_path / "catalog.db"), OrderState(tmp_path / "order.db")
    catalog.seed(BOOKS)
    rt = FakeRuntime(orders)
    yield catalog, orders, rt
    catalog.close()
    orders.close()


def test_a_decrement_with_no_order_is_recorded_and_the_scan_moves_past_what_is_settled(tiers: Any) -> None:
    catalog, orders, rt = tiers
    old = time.time() - 10 * order_app.ORPHAN_AGE
    rt.propose({"op": "intent", "key": "has-order", "item": 1, "quantity": 1, "created_at": "2026-01-01T00:00:00.000+00:00"})
    rt.propose({"op": "confirm", "key": "has-order", "title": "book 1", "cost": 2.5, "at": old})
    catalog.apply(1, {"op": "decrement", "item": 1, "quantity": 1, "key": "has-order", "at": old, "keyed": 1})
    catalog.apply(2, {"op": "decrement", "item": 2, "quantity": 2, "key": "orphan", "at": old, "keyed": 1})
    catalog.apply(3, {"op": "decrement", "item": 3, "quantity": 99, "key": "refused", "at": old, "keyed": 1})  # took nothing
    catalog.apply(4, {"op": "update", "item": 3, "stock_delta": 1, "key": "u:admin", "at": old, "keyed": 1})
    keys = Keys(catalog, page=2)
    processor = order_app.BuyProcessor(rt, orders, None, keys)  # type: ignore[arg-type]
    assert processor.scan_orphans() == 1
    adopted = orders.by_key("orphan")
    assert adopted is not None and adopted["status"] == CONFIRMED and adopted["order_number"] == 2
    assert (adopted["item_number"], adopted["quantity"], adopted["title"], adopted["cost"]) == (2, 2, "book 2", 5.0)
    assert orders.by_key("refused") is None and orders.by_key("has-order")["status"] == CONFIRMED
    assert orders.scanned() == 3, "up to the last decrement's index, across pages"
    assert keys.reads == 2
    assert processor.scan_orphans() == 0 and orders.scanned() == 3 and rt.index == 3, "nothing new: nothing proposed"


def test_a_young_key_with_no_order_is_left_for_the_next_scan(tiers: Any) -> None:
    """Its intent may still be on its way; the scan stops before it, so nothing after it is skipped."""
    catalog, orders, rt = tiers
    now = time.time()
    catalog.apply(1, {"op": "decrement", "item": 1, "quantity": 1, "key": "old-orphan", "at": now - 60, "keyed": 1})
    catalog.apply(2, {"op": "decrement", "item": 1, "quantity": 1, "key": "in-flight", "at": now, "keyed": 1})
    catalog.apply(3, {"op": "decrement", "item": 2, "quantity": 1, "key": "later-orphan", "at": now - 60, "keyed": 1})
    processor = order_app.BuyProcessor(rt, orders, None, Keys(catalog, page=10))  # type: ignore[arg-type]
    assert processor.scan_orphans() == 1
    assert orders.scanned() == 1 and orders.by_key("in-flight") is None and orders.by_key("later-orphan") is None
    assert processor.scan_soon, "the next scan comes soon"
    rt.propose({"op": "intent", "key": "in-flight", "item": 1, "quantity": 1, "created_at": "2026-01-01T00:00:00.000+00:00"})
    assert processor.scan_orphans() == 1, "its intent came; the later orphan is recorded"
    assert orders.by_key("later-orphan")["status"] == CONFIRMED
    assert orders.by_key("in-flight")["status"] == "pending", "the scan leaves an order's own outcome to it"
    assert orders.scanned() == 1, "held below a key whose order is pending"
    assert not processor.scan_soon, "the catalog keeps the key: the next scan in its time is soon enough"
    rt.propose({"op": "confirm", "key": "in-flight", "title": "book 1", "cost": 2.5, "at": now})
    assert processor.scan_orphans() == 0 and orders.scanned() == 3 and not processor.scan_soon


def test_a_retried_orphan_keeps_its_catalog_key_while_its_order_is_pending(tiers: Any) -> None:
    """A buy whose intent was lost with its leader, its decrement committed, is retried under its key
    before any scan adopts it: the retry's intent is newer than the decrement, and stays pending (its
    own decrement held up). Were the key settled, key expiry would let the catalog forget it a window
    after the decrement, and the pending order's decrement would then take the stock again."""
    catalog, orders, rt = tiers
    now = time.time()
    first = now - 20  # the first attempt's decrement
    catalog.apply(1, {"op": "decrement", "item": 1, "quantity": 1, "key": "K", "at": first, "keyed": 1})
    created = datetime.fromtimestamp(first + 5, UTC).isoformat(timespec="milliseconds")
    rt.propose({"op": "intent", "key": "K", "item": 1, "quantity": 1, "created_at": created})
    processor = order_app.BuyProcessor(rt, orders, None, Keys(catalog, page=10))  # type: ignore[arg-type]
    assert processor.scan_orphans() == 0 and orders.scanned() == 0

    class Catalog:
        def write(self, path: str, body: dict[str, Any], deadline: float) -> Reply:
            return Reply(200, catalog.apply(2, {"op": "expire", **body}), "catalog-1")

    order_app.KeyExpirer(rt, orders, Catalog(), 10.0).expire()  # type: ignore[arg-type]
    again = catalog.apply(3, {"op": "decrement", "item": 1, "quantity": 1, "key": "K", "at": now, "keyed": 1})
    assert again["ok"] and catalog.books([1])[1]["stock"] == 9, "the key's first answer, the stock taken once"


def decrements(*items: tuple[str, int, float]) -> dict[str, Any]:
    """One catalog entry of several buys' decrements, as the order leader sends them."""
    return {"op": "decrements", "keyed": 1,
            "items": [{"item": item, "quantity": 1, "key": key, "at": at} for key, item, at in items]}


def test_keys_of_one_entry_are_each_read_across_pages(tiers: Any) -> None:
    """An entry carries many keys under one index: a page may end inside it, and the next begins
    after the last key seen, not after the entry."""
    catalog, orders, rt = tiers
    old = time.time() - 60
    catalog.apply(1, decrements(("a", 1, old), ("b", 1, old), ("c", 2, old)))
    catalog.apply(2, decrements(("d", 3, old)))
    keys = Keys(catalog, page=2)
    processor = order_app.BuyProcessor(rt, orders, None, keys)  # type: ignore[arg-type]
    assert processor.scan_orphans() == 4
    assert [orders.by_key(k)["item_number"] for k in "abcd"] == [1, 1, 2, 3]
    assert orders.scanned() == 2 and keys.reads == 2


def test_a_young_key_inside_an_entry_holds_the_scan_below_that_entry(tiers: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Had ``scanned`` moved to the entry's index, its young key would never be read again."""
    catalog, orders, rt = tiers
    now = time.time()
    catalog.apply(1, decrements(("a", 1, now - 60)))
    catalog.apply(2, decrements(("b", 1, now - 60), ("c", 2, now), ("d", 2, now - 60)))
    processor = order_app.BuyProcessor(rt, orders, None, Keys(catalog, page=10))  # type: ignore[arg-type]
    assert processor.scan_orphans() == 2  # a and b; c stops it
    assert orders.scanned() == 1 and processor.scan_soon
    assert orders.by_key("c") is None and orders.by_key("d") is None
    catalog_keys_later = time.time() + 10 * order_app.ORPHAN_AGE
    monkeypatch.setattr(order_app.time, "time", lambda: catalog_keys_later)
    assert processor.scan_orphans() == 2  # c and d; b found recorded
    monkeypatch.undo()
    assert orders.scanned() == 2 and not processor.scan_soon
    assert orders.by_key("c")["status"] == CONFIRMED


def test_a_decrement_refused_as_another_buys_key_records_that_buy(tiers: Any) -> None:
    """The catalog holds the key for another buy (its intent was lost, and a request reusing the key
    for another book came first): the pending order becomes that buy, confirmed, and the buyer of
    the other book hears 422 (``answer``)."""
    catalog, orders, rt = tiers
    catalog.apply(1, decrements(("k", 2, 100.0)))
    rt.propose({"op": "intent", "key": "k", "item": 1, "quantity": 1, "created_at": "2026-01-01T00:00:00.000+00:00"})
    refused = catalog.apply(2, decrements(("k", 1, 200.0)))["results"][0]
    reply = Reply(422, {"error": refused["error"], "buy": refused["buy"]}, "catalog-1")
    processor = order_app.BuyProcessor(rt, orders, None)  # type: ignore[arg-type]
    out: list[Any] = [None]
    processor._outcomes(out, [(0, orders.by_key("k"), (1, 1), reply)], 200.0)
    assert (out[0]["status"], out[0]["item_number"], out[0]["title"]) == (CONFIRMED, 2, "book 2")
    buy = order_app.Buy(1, 1, "k", time.monotonic() + 5)
    assert order_app.answer(buy, out[0])[0] == 422


def test_a_decrement_taken_for_a_buy_whose_intent_found_another_requests_order_records_this_buy(tiers: Any) -> None:
    """A request reusing a key for another book got there first with its intent, which this buy's
    intent found; this buy's decrement took stock for its own book: the key's order becomes this
    buy (stock and orders agree), and its buyer hears 200."""
    catalog, orders, rt = tiers
    rt.propose({"op": "intent", "key": "k", "item": 2, "quantity": 3, "created_at": "2026-01-01T00:00:00.000+00:00"})
    taken = catalog.apply(1, decrements(("k", 1, 100.0)))["results"][0]
    processor = order_app.BuyProcessor(rt, orders, None)  # type: ignore[arg-type]
    out: list[Any] = [None]
    processor._outcomes(out, [(0, orders.by_key("k"), (1, 1), Reply(200, taken["book"], "catalog-1"))],
                        100.0)
    assert (out[0]["status"], out[0]["item_number"], out[0]["quantity"]) == (CONFIRMED, 1, 1)
    assert order_app.answer(order_app.Buy(1, 1, "k", time.monotonic() + 5), out[0])[0] == 200


def test_a_key_whose_first_decrement_was_refused_fails_as_that_buy(tiers: Any) -> None:
    """The catalog refused the key's first buy (out of stock), and a request reusing the key for
    another book comes: the key's order is the first buy, failed with its own 409; the reusing
    request hears 422 and the first buyer's retry its 409."""
    catalog, orders, rt = tiers
    catalog.apply(1, decrements(("k", 2, 100.0)))  # one copy: fine
    first = catalog.apply(2, {"op": "decrements", "keyed": 1, "items": [
        {"item": 3, "quantity": 99, "key": "k2", "at": 100.0}]})["results"][0]
    assert first["error"]["code"] == 409
    rt.propose({"op": "intent", "key": "k2", "item": 1, "quantity": 1, "created_at": "2026-01-01T00:00:00.000+00:00"})
    refused = catalog.apply(3, decrements(("k2", 1, 200.0)))["results"][0]
    processor = order_app.BuyProcessor(rt, orders, None)  # type: ignore[arg-type]
    out: list[Any] = [None]
    processor._outcomes(out, [(0, orders.by_key("k2"), (1, 1), Reply(422, {"error": refused["error"], "buy": refused["buy"]},
                                                                   "catalog-1"))], 200.0)
    assert (out[0]["status"], out[0]["item_number"], out[0]["quantity"]) == ("failed", 3, 99)
    assert order_app.answer(order_app.Buy(1, 1, "k2", time.monotonic() + 5), out[0])[0] == 422
    assert order_app.answer(order_app.Buy(3, 99, "k2", time.monotonic() + 5), out[0])[0] == 409


def test_decrements_go_with_their_intents_only_after_a_scan_in_the_leaders_term(tiers: Any) -> None:
    """Until an orphan scan has finished in this term, the catalog may not yet keep the keys a scan
    needs: buys go intent first. A scan of an earlier term does not count."""
    catalog, orders, rt = tiers
    processor = order_app.BuyProcessor(rt, orders, None, Keys(catalog, page=10))  # type: ignore[arg-type]
    assert not processor.together_ok()
    processor.scan_orphans()
    assert processor.together_ok()
    rt.node.current = 2  # a new term: this replica led again, or another led meanwhile
    assert not processor.together_ok()
    processor.scan_orphans()
    assert processor.together_ok()
