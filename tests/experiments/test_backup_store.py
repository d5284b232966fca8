"""``pygmy.experiments.backup`` builds its store with orders offline: checked here on a small one,
with no cluster (the run itself is ``python -m pygmy.experiments.backup``)."""

from __future__ import annotations

import json
from pathlib import Path

from pygmy.catalog.books import synthetic
from pygmy.catalog.state import CatalogState
from pygmy.cluster import backup
from pygmy.cluster.local import pygmy
from pygmy.experiments.backup import BUILD_BATCH, build_store, table


def test_a_built_store_is_an_archive_verify_accepts(tmp_path: Path) -> None:
    books = synthetic(30, stock=1000)
    path = tmp_path / "books.json"
    path.write_text(json.dumps(books))
    manifest = build_store(path, books, 3 * BUILD_BATCH + 7, tmp_path / "store.tar")
    state = manifest["state"]
    assert (state["books"], state["orders"], state["confirmed"]) == (30, 157, 157)
    assert state["stock_ledger"] and 157 <= state["copies_sold"] <= 3 * 157
    assert (state["catalog"]["index"], state["order"]["index"]) == (4, 8)  # a log entry per 50 buys
    r = pygmy("backup", "--verify", str(tmp_path / "store.tar"))
    assert r.returncode == 0, r.stderr
    facts = backup.verify(tmp_path / "store.tar")
    assert facts["copies_sold"] == state["copies_sold"]
    with backup.opened(tmp_path / "store.tar") as (folder, _):
        assert "books" not in json.loads((folder / "settings.json").read_text())  # the seed holds them
        catalog = CatalogState(folder / "catalog.db")
        stock = sum(s for s, _ in catalog.ledger().values())
        catalog.close_all()
    assert stock == 30 * 1000 - state["copies_sold"]


def test_the_table_shows_both_times_and_the_archive() -> None:
    row = {"books": 7, "orders": 9, "start": "pygmy up --books", "backup_s": 1.5, "restore_s": 4.2,
           "catalog_mib": 0.2, "order_mib": 0.1, "archive_mib": 0.4,
           "steps": [(0.5, "order: asking for a copy (1 of 3)"), (0.9, "order: copied order-1 at index 3")],
           "before": {"per_s": 80.0, "p50_ms": 40.0, "p99_ms": 90.0},
           "during": {"per_s": 60.0, "p50_ms": 45.0, "p99_ms": 120.0}}
    t = table([row])
    shown = dict(zip(t["columns"], t["rows"][0], strict=True))
    assert (shown["backup s"], shown["restore s"], shown["archive MiB"], shown["cut taken after s"]) == (1.5, 4.2, 0.4, 0.4)
