"""N = 1 and N = 5 replicas per tier: a complete store, and (for 5) losing two replicas at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import Cluster, free_port_base
from test_faults import leader, wait_converged


def test_one_replica_per_tier_is_a_complete_store(tmp_path: Path) -> None:
    c = Cluster(tmp_path / "d", free_port_base(), ["--catalog-replicas", "1", "--order-replicas", "1"])
    c.start(reset=True)
    try:
        with c.client() as client:
            order = client.buy(2, quantity=3)
            stock = client.lookup(2)["stock"]
        for name in ("catalog-1", "order-1"):
            c.kill(name)
            c.restart(name)
        wait_converged(c)
        with c.client() as client:
            assert client.order(order["order_number"])["quantity"] == 3
            assert client.lookup(2)["stock"] == stock
            assert client.buy(2)["order_number"] > order["order_number"]
    finally:
        c.stop()


def test_five_replicas_survive_losing_two(tmp_path: Path) -> None:
    c = Cluster(tmp_path / "d", free_port_base(), ["--catalog-replicas", "5", "--order-replicas", "5"])
    c.start(reset=True)
    try:
        with c.client() as client:
            first = client.buy(1)
        killed = []
        for tier in ("catalog", "order"):
            lead = leader(c, tier)
            other = next(f"{tier}-{k}" for k in range(1, 6) if f"{tier}-{k}" != lead)
            for name in (lead, other):
                c.kill(name)
                killed.append(name)
        with c.client() as client:
            bought = [client.buy(1 + i % 7) for i in range(10)]
            # Book 1: the first buy and those with i % 7 == 0 (i = 0 and 7).
            assert client.lookup(1)["stock"] == 1000 - 1 - 2
        # Started side by side, as `pygmy up` starts services: each waits for its own health check.
        with ThreadPoolExecutor(len(killed)) as pool:
            for started in [pool.submit(c.restart, name) for name in killed]:
                started.result()
        st = wait_converged(c)
        for tier in ("catalog", "order"):
            assert len({r["state_digest"] for r in st[tier]["replicas"]}) == 1
        with c.client() as client:
            for o in [first, *bought]:
                got = client.order(o["order_number"])
                assert (got["item_number"], got["quantity"], got["total"]) == \
                    (o["item_number"], o["quantity"], o["total"])
    finally:
        c.stop()
