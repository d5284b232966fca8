"""The orphan scan (``BuyProcessor.scan_orphans``): a buy's decrement goes out while its intent is
being committed, so a leader that dies between the two leaves a decrement with no order. The next
leader reads the catalog's keys back in log order and records such buys; here against a real
CatalogState and OrderState, in-process."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from pygmy.catalog.state import CatalogState
from pygmy.order import app as order_app
from pygmy.order.state import CONFIRMED, OrderState
from pygmy.replication.router import Reply

BOOKS = [{"item_number": n, "title": f"book {n}", "topic": "t", "stock": 10, "cost": 2.5 * n} for n in (1, 2, 3)]


class FakeRuntime:
    """Proposals applied at once, in order, to one real OrderState."""

    name = "order-test"

    def __init__(self, state: OrderState) -> None:
        self.state, self.index = state, 0

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
        applied, found, more = self.catalog.keys_after(params["after"], min(params["limit"], self.page))
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
    catalog.apply(1, {"op": "decrement", "item": 1, "quantity": 1, "key": "has-order", "at": old})
    catalog.apply(2, {"op": "decrement", "item": 2, "quantity": 2, "key": "orphan", "at": old})
    catalog.apply(3, {"op": "decrement", "item": 3, "quantity": 99, "key": "refused", "at": old})  # took nothing
    catalog.apply(4, {"op": "update", "item": 3, "stock_delta": 1, "key": "u:admin", "at": old})  # not a buy's
    keys = Keys(catalog, page=2)
    processor = order_app.BuyProcessor(rt, orders, None, keys)  # type: ignore[arg-type]
    assert processor.scan_orphans() == 1
    adopted = orders.by_key("orphan")
    assert adopted is not None and adopted["status"] == CONFIRMED and adopted["order_number"] == 2
    assert (adopted["item_number"], adopted["quantity"], adopted["title"], adopted["cost"]) == (2, 2, "book 2", 5.0)
    assert orders.by_key("refused") is None and orders.by_key("has-order")["status"] == "pending"
    assert orders.scanned() == 3, "up to the last decrement's index, across pages"
    assert keys.reads == 2
    assert processor.scan_orphans() == 0 and orders.scanned() == 3 and rt.index == 2, "nothing new: nothing proposed"


def test_a_young_key_with_no_order_is_left_for_the_next_scan(tiers: Any) -> None:
    """Its intent may still be on its way; the scan stops before it, so nothing after it is skipped."""
    catalog, orders, rt = tiers
    now = time.time()
    catalog.apply(1, {"op": "decrement", "item": 1, "quantity": 1, "key": "old-orphan", "at": now - 60})
    catalog.apply(2, {"op": "decrement", "item": 1, "quantity": 1, "key": "in-flight", "at": now})
    catalog.apply(3, {"op": "decrement", "item": 2, "quantity": 1, "key": "later-orphan", "at": now - 60})
    processor = order_app.BuyProcessor(rt, orders, None, Keys(catalog, page=10))  # type: ignore[arg-type]
    assert processor.scan_orphans() == 1
    assert orders.scanned() == 1 and orders.by_key("in-flight") is None and orders.by_key("later-orphan") is None
    assert processor.young_orphan, "the next scan comes soon"
    rt.propose({"op": "intent", "key": "in-flight", "item": 1, "quantity": 1, "created_at": "2026-01-01T00:00:00.000+00:00"})
    assert processor.scan_orphans() == 1, "its intent came: settled; the later orphan is recorded"
    assert orders.scanned() == 3 and orders.by_key("later-orphan")["status"] == CONFIRMED
    assert not processor.young_orphan
    assert orders.by_key("in-flight")["status"] == "pending", "the scan leaves an order's own outcome to it"
