"""Concurrent buyers never oversell: 50 buyers, 20 copies -> exactly 20 orders and 30 answers of 409.

50 buys at once are more than a frontend works on at once (24 per worker, two workers): the excess is refused
with 503 and ``Retry-After``, and the buyers retry with their keys, as clients are told to.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from harness import Cluster

from pygmy.client.api import PygmyClient, PygmyError


def test_fifty_buyers_twenty_copies(fresh_cluster: Cluster) -> None:
    c = fresh_cluster
    with c.client() as admin:
        admin.update(3, stock_delta=20 - admin.lookup(3)["stock"])
        assert admin.lookup(3)["stock"] == 20

    def buyer(i: int) -> int | str:
        with PygmyClient(c.url, timeout=30, retries=10) as client:
            try:
                return client.buy(3, key=f"race-{i}")["order_number"]
            except PygmyError as e:
                return f"{e.status}"

    with ThreadPoolExecutor(max_workers=50) as pool:
        results = list(pool.map(buyer, range(50)))
    orders = [r for r in results if isinstance(r, int)]
    assert len(orders) == 20 and len(set(orders)) == 20
    assert sorted(r for r in results if isinstance(r, str)) == ["409"] * 30
    with c.client() as client:
        assert client.lookup(3)["stock"] == 0
        for n in orders:
            assert client.order(n)["item_number"] == 3
