"""Key windows (``pygmy.order.app.KeyExpirer``): which time the order leader picks, and that the order tier
forgets only after the catalog has; then the whole path on a cluster with a short window."""

from __future__ import annotations

import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import requests
from harness import Cluster, start_cluster

from pygmy.cluster.launcher import running
from pygmy.order.app import KeyExpirer, unix
from pygmy.order.state import OrderState
from pygmy.replication.router import Reply

WINDOW = 3600.0


class FakeNode:
    def is_leader(self) -> bool:
        return True


class FakeRuntime:
    """Proposals applied at once, in order, to one real OrderState."""

    def __init__(self, state: OrderState) -> None:
        self.state, self.index, self.node, self.proposed = state, 0, FakeNode(), []

    def propose(self, command: dict[str, Any], timeout: float = 5.0) -> Any:
        self.index += 1
        self.proposed.append(command)
        return self.state.apply(self.index, command)


class FakeCatalog:
    def __init__(self, status: int = 200) -> None:
        self.status, self.asked = status, []
        self.kept: float | None = None  # the oldest time of a key it kept for the orphan scan

    def write(self, path: str, body: dict[str, Any], deadline: float) -> Reply:
        self.asked.append((path, body))
        if self.status != 200:
            return Reply(self.status, {"error": {"code": self.status, "message": "no leader"}}, "catalog-1")
        return Reply(200, {"ok": True, "forgotten": 4, "kept_before": self.kept}, "catalog-1")


@pytest.fixture
def rt(tmp_path: Path) -> FakeRuntime:
    return FakeRuntime(OrderState(tmp_path / "order.db"))


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")


def order(rt: FakeRuntime, key: str, created: float, finish: bool = True) -> None:
    """An order created at ``created`` whose decrement was sent a second later."""
    rt.propose({"op": "intent", "key": key, "item": 1, "quantity": 1, "created_at": iso(created)})
    if finish:
        rt.propose({"op": "confirm", "key": key, "title": "t", "cost": 1.0, "at": created + 1})


def test_the_window_start_when_every_buy_is_finished(rt: FakeRuntime) -> None:
    now = time.time()
    order(rt, "old", now - 2 * WINDOW)
    order(rt, "young", now - WINDOW / 2)
    catalog = FakeCatalog()
    assert KeyExpirer(rt, rt.state, catalog, WINDOW).expire() == {"catalog": 4, "order": 1}  # type: ignore[arg-type]
    (path, body), = catalog.asked
    assert path == "/keys/expire" and now - WINDOW - 1 < body["before"] <= time.time() - WINDOW
    assert rt.proposed[-1] == {"op": "expire", "before": body["before"]}, "both tiers use the same time"
    assert rt.state.order(1)["key"] is None and rt.state.order(2)["key"] == "young"


def test_an_unfinished_buy_holds_the_time_back_so_both_tiers_keep_its_keys(rt: FakeRuntime) -> None:
    now = time.time()
    order(rt, "older", now - 3 * WINDOW)
    order(rt, "stuck", now - 2 * WINDOW, finish=False)
    order(rt, "done", now - 1.5 * WINDOW)
    catalog = FakeCatalog()
    assert KeyExpirer(rt, rt.state, catalog, WINDOW).expire()["order"] == 1  # type: ignore[arg-type]
    stuck = rt.state.order(2)
    assert catalog.asked[0][1]["before"] == unix(stuck["created_at"]), "the catalog keeps the stuck buy's decrement key"
    assert stuck["key"] == "stuck" and rt.state.order(3)["key"] == "done"
    assert rt.state.order(1)["key"] is None


def test_nothing_is_forgotten_here_unless_the_catalog_forgot_first(rt: FakeRuntime) -> None:
    """Otherwise a retry would make a new order whose decrement gets the old decrement's answer."""
    order(rt, "old", time.time() - 2 * WINDOW)
    proposed = len(rt.proposed)
    with pytest.raises(RuntimeError, match="catalog did not forget"):
        KeyExpirer(rt, rt.state, FakeCatalog(503), WINDOW).expire()  # type: ignore[arg-type]
    assert len(rt.proposed) == proposed and rt.state.key_count() == 1


def keys(c: Cluster, name: str) -> int:
    """Remembered keys, read from a replica's database file (WAL: a reader beside the replica)."""
    table = "idempotency" if name.startswith("catalog") else "orders WHERE key IS NOT NULL"
    with sqlite3.connect(f"file:{c.data_dir / name / 'state.db'}?mode=ro", uri=True) as db:
        return int(db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])


def test_a_key_is_forgotten_after_its_window_on_every_replica(tmp_path: Path) -> None:
    window = 10.0
    c = start_cluster(tmp_path, "--key-window", str(window))
    try:
        with c.client() as client:
            stock = client.lookup(2)["stock"]
            first = client.buy(2, key="remember-me")
            assert client.buy(2, key="remember-me") == first, "within the window: the first answer"
            client.buy(3)
            names = [f"{t}-{k}" for t in ("catalog", "order") for k in (1, 2, 3)]
            deadline = time.monotonic() + 3 * window
            while any(keys(c, n) for n in names) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert {n: keys(c, n) for n in names} == dict.fromkeys(names, 0), "every replica forgot them"
            again = client.buy(2, key="remember-me")
            assert again["order_number"] > first["order_number"], "after the window: a new buy"
            assert client.lookup(2)["stock"] == stock - 2, "and it took stock again, once"
            assert client.order(first["order_number"])["quantity"] == 1, "the old order stays"
        assert all(running(c.cluster_config(), n) for n in names)
        lead = c.client().status()["catalog"]["leader"]
        for bad in ({}, {"before": "yesterday"}, {"before": True}, {"before": time.time() + 60}):
            r = requests.post(c.replica_url(lead) + "/keys/expire", json=bad, timeout=5,
                              headers={"Authorization": f"Bearer {c.secret()}"})
            assert r.status_code == 400 and r.json()["error"]["code"] == 400, (bad, r.text)
        verify = c.replica_get("order-1", "/verify").json()
        assert verify["ok"], verify
    finally:
        c.stop()


def test_keys_the_catalog_kept_for_the_orphan_scan_hold_this_tiers_time_back(rt: FakeRuntime) -> None:
    """The catalog keeps the keys of decrements the orphan scan has not read (``scanned`` in the
    request) and says the oldest time it kept: this tier forgets nothing from that time on."""
    now = time.time()
    order(rt, "older", now - 3 * WINDOW)
    order(rt, "unread", now - 2 * WINDOW)  # its decrement was sent at now - 2 * WINDOW + 1
    rt.propose({"op": "scanned", "upto": 17})
    catalog = FakeCatalog()
    catalog.kept = now - 2 * WINDOW + 1
    KeyExpirer(rt, rt.state, catalog, WINDOW).expire()  # type: ignore[arg-type]
    assert catalog.asked[0][1]["scanned"] == 17
    assert rt.proposed[-1] == {"op": "expire", "before": now - 2 * WINDOW + 1}
    assert rt.state.order(1)["key"] is None and rt.state.order(2)["key"] == "unread"
