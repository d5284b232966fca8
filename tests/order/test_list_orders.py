"""``GET /orders?after=N&limit=K`` on an order replica: a page of its orders, for the operator's
tools and the checks that read every order of every replica (``pygmy.verify.chaos.read_orders``).
On the shared cluster."""

from __future__ import annotations

import requests
from harness import Cluster, wait_for

from pygmy.client.api import PygmyClient
from pygmy.verify.chaos import read_orders


def test_pages_hold_every_confirmed_order_once_in_number_order(cluster: Cluster) -> None:
    with PygmyClient(cluster.url) as client:
        mine = [client.buy(1 + i % 7, 1)["order_number"] for i in range(5)]
    for name in ("order-1", "order-2", "order-3"):
        # A follower applies the confirms moments after the leader answered.
        page = wait_for(f"{name} has them", lambda name=name: (p := cluster.replica_get(
            name, f"/orders?after={mine[0] - 1}&limit=1000").json()) and set(mine) <= {
                o["order_number"] for o in p["orders"]} and p, 10)
        numbers = [o["order_number"] for o in page["orders"]]
        assert numbers == sorted(numbers) and page["pending"] == [] and page["next"] is None
        one = cluster.replica_get(name, f"/orders/{mine[0]}").json()
        assert next(o for o in page["orders"] if o["order_number"] == mine[0]) == one
        pages, after = [], mine[0] - 1
        while after is not None:  # a page at a time: the same orders, each once
            p = cluster.replica_get(name, f"/orders?after={after}&limit=2").json()
            assert len(p["orders"]) + len(p["pending"]) <= 2
            pages += [o["order_number"] for o in p["orders"]]
            after = p["next"]
        assert pages == numbers
    auth = {"Authorization": f"Bearer {cluster.secret()}"}
    with requests.Session() as s:
        every = read_orders(s.get, cluster.replica_url("order-2"), auth)
    assert set(mine) <= set(every)


def test_bad_pages_are_refused_clearly(cluster: Cluster) -> None:
    for query in ("after=-1", "after=x", "limit=0", "limit=1001", "limit=1.5", "after=99999999999999999999"):
        r = cluster.replica_get("order-1", f"/orders?{query}")
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, (query, r.text)
        assert ("after" if "after" in query else "limit") in r.json()["error"]["message"]
    r = requests.get(cluster.replica_url("order-1") + "/orders", timeout=5, **cluster.cluster_config().tool_tls())
    assert r.status_code in (401, 403) and "error" in r.json()
