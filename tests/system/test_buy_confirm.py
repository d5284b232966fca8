"""A buy is answered once the catalog's decrement is committed; its confirm follows. The crash instant
in between, held open on purpose: the order leader answers buys and records no confirm, then dies.

Checked from outside: every answered order is found, with what its buyer was told, through the
frontend before and after the kill; stock fell by exactly the copies bought; every replica of each tier
ends with the same applied index and digest, and each digest matches a recount of the rows.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import requests
from harness import Cluster, cluster_env, pygmy, start_cluster

from pygmy.client.api import PygmyClient, PygmyError

ORDERS = [f"order-{k}" for k in (1, 2, 3)]


def order_leader(c: Cluster, timeout: float = 15) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in ORDERS:
            try:
                if c.replica_get(name, "/status", timeout=1).json()["role"] == "leader":
                    return name
            except (requests.RequestException, ValueError):
                continue
        time.sleep(0.05)
    raise AssertionError("no order leader")


def replica_order(c: Cluster, name: str, n: int) -> int:
    """What one order replica itself answers for order ``n`` (421: pending there, sent to the leader)."""
    return c.replica_get(name, f"/orders/{n}", timeout=2).status_code


def test_an_answered_buy_survives_its_leader_dying_before_the_confirm(tmp_path: Path) -> None:
    flag = tmp_path / "drop-confirms"
    flag.touch()
    c = start_cluster(tmp_path, env=cluster_env(PYGMY_TEST_DROP_CONFIRMS=str(flag)))
    try:
        with PygmyClient(c.url, timeout=10) as client:
            stock = {i: client.lookup(i)["stock"] for i in (1, 2, 3)}
            dying = order_leader(c)
            answered = {}
            for k in range(6):
                item, qty = 1 + k % 3, 1 + k % 2
                order = client.buy(item, quantity=qty, key=f"confirm-{k}-{uuid.uuid4().hex[:6]}")
                answered[order["order_number"]] = order
            assert len(answered) == 6
            # The confirms really are missing: on the leader the orders are pending, so a follower
            # (which sees the same) sends a reader to the leader, and the leader finishes each on read.
            followers = [n for n in ORDERS if n != dying]
            for n in answered:
                assert {replica_order(c, f, n) for f in followers} == {421}, n
                assert client.order(n) | {"created_at": None} == answered[n] | {"created_at": None}
            c.kill(dying)  # the leader dies with every confirm unrecorded
            flag.unlink()
            for n, order in answered.items():
                deadline = time.monotonic() + 20
                while True:
                    try:
                        got = client.order(n)
                        break
                    except PygmyError as exc:  # 503 while the new leader is elected
                        assert exc.status == 503 and time.monotonic() < deadline, exc
                        time.sleep(0.1)
                assert {k: got[k] for k in order} == order, (got, order)
            for i, before in stock.items():
                sold = sum(o["quantity"] for o in answered.values() if o["item_number"] == i)
                assert client.lookup(i)["stock"] == before - sold
            # The new leader records the confirms itself: followers answer the orders directly.
            deadline = time.monotonic() + 20
            while any(replica_order(c, f, n) != 200 for f in followers for n in answered):
                assert time.monotonic() < deadline, "the confirms were never recorded"
                time.sleep(0.1)
        c.restart(dying)
        deadline = time.monotonic() + 30
        while True:
            st = requests.get(c.url + "/status", timeout=5).json()["order"]["replicas"]
            if len({(r.get("applied_index"), r.get("state_digest")) for r in st}) == 1 and all(
                    r.get("role") in ("leader", "follower") for r in st):
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.2)
        verify = pygmy("verify", "--data-dir", str(c.data_dir))
        assert verify.returncode == 0, verify.stdout + verify.stderr
    finally:
        c.stop()
