"""``GET /orders?after=N&limit=K`` on an order replica: a page of its orders, for the checkers that
read every order of every replica (``pygmy.verify.chaos.read_orders``).
On the shared cluster."""

from __future__ import annotations

from typing import Any

import requests
from harness import Cluster, wait_for

from pygmy.client.api import PygmyClient
from pygmy.verify.chaos import read_orders


def page(cluster: Cluster, name: str, query: str) -> dict[str, Any]:
    """A page, asked again while the replica cannot serve reads for a moment (503, a slow answer)."""
    def ask() -> dict[str, Any] | None:
        try:
            r = cluster.replica_get(name, f"/orders?{query}", timeout=5)
        except requests.Timeout:
            return None
        assert r.status_code in (200, 503), r.text
        return r.json() if r.status_code == 200 else None
    return wait_for(f"{name}: /orders?{query}", ask, 30)


def test_pages_hold_every_confirmed_order_once_in_number_order(cluster: Cluster) -> None:
    with PygmyClient(cluster.url) as client:
        mine = [client.buy(1 + i % 7, 1)["order_number"] for i in range(5)]
    for name in ("order-1", "order-2", "order-3"):
        # A follower applies the confirms moments after the leader answered.
        def holds_mine(name: str = name) -> dict[str, Any] | None:
            p = page(cluster, name, f"after={mine[0] - 1}&limit=1000")
            return p if set(mine) <= {o["order_number"] for o in p["orders"]} else None

        whole = wait_for(f"{name} has them", holds_mine, 10)
        numbers = [o["order_number"] for o in whole["orders"]]
        assert numbers == sorted(numbers) and whole["pending"] == [] and whole["next"] is None
        one = cluster.replica_get(name, f"/orders/{mine[0]}", timeout=5).json()
        listed = next(o for o in whole["orders"] if o["order_number"] == mine[0])
        assert {k: v for k, v in listed.items() if k != "key"} == one and listed["key"][:2] in ("k:", "g:")
        pages, after = [], mine[0] - 1
        while after is not None:  # a page at a time: the same orders, each once
            p = page(cluster, name, f"after={after}&limit=2")
            assert len(p["orders"]) + len(p["pending"]) <= 2
            pages += [o["order_number"] for o in p["orders"]]
            after = p["next"]
        assert pages == numbers
    auth = {"Authorization": f"Bearer {cluster.secret()}"}
    with requests.Session() as s:
        every = read_orders(s.get, cluster.replica_url("order-2"), auth)
    assert set(mine) <= set(every)


def test_bad_pages_are_refused_clearly(cluster: Cluster) -> None:
    for query in ("after=-1", "after=x", "limit=0", "limit=1001", "limit=1.5", "after=1000000000000000000"):
        r = cluster.replica_get("order-1", f"/orders?{query}", timeout=5)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, (query, r.text)
        assert ("after" if "after" in query else "limit") in r.json()["error"]["message"]
    r = requests.get(cluster.replica_url("order-1") + "/orders", timeout=5, **cluster.cluster_config().tool_tls())
    assert r.status_code in (401, 403) and "error" in r.json()
