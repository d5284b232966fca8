"""``pygmy.experiments.growth`` reads what each replica keeps from its files: checked on files made here
(the ten-minute run itself is ``python -m pygmy.experiments.growth``)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from pygmy.catalog.state import CatalogState
from pygmy.experiments.growth import sample
from pygmy.order.state import OrderState
from pygmy.replication.core import Entry
from pygmy.replication.log_store import LogStore


def test_sample_counts_keys_orders_and_the_log(tmp_path: Path) -> None:
    cat = CatalogState(tmp_path / "catalog-1" / "state.db")
    cat.seed([{"item_number": 1, "title": "t", "topic": "x", "stock": 5, "cost": 1.0}])
    cat.apply(1, {"op": "decrement", "item": 1, "quantity": 1, "key": "a", "at": 5.0})
    cat.apply(2, {"op": "decrement", "item": 1, "quantity": 1, "key": "b", "at": 9.0})
    LogStore(tmp_path / "catalog-1" / "raft.db").save(None, [Entry(1, 1, {"op": "x"}), Entry(2, 1, None)])
    orders = OrderState(tmp_path / "order-1" / "state.db")
    for i, key in enumerate(("a", "b", "c"), start=1):
        orders.apply(i, {"op": "intent", "key": key, "item": 1, "quantity": 1,
                         "created_at": f"2026-01-0{i}T00:00:00.000+00:00"})
    orders.apply(4, {"op": "confirm", "key": "a", "title": "t", "cost": 1.0, "at": 5.0})
    orders.apply(5, {"op": "expire", "before": 6.0})
    assert sample(tmp_path, "catalog-1") == {"log_entries": 2, "log_bytes": len('{"op":"x"}'), "keys": 2}
    assert sample(tmp_path, "order-1") == {"log_entries": -1, "log_bytes": -1, "keys": 2, "orders": 3}
    sqlite3.connect(tmp_path / "order-1" / "raft.db").close()  # an empty file: no table yet
    assert sample(tmp_path, "order-1")["log_entries"] == -1
