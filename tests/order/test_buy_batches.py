"""``POST /buys`` on the order leader: a frontend worker's buys in one request, each answered as if
alone, each exactly once, and a malformed batch refused whole with nothing changed."""

from __future__ import annotations

import time
from typing import Any

import requests
from harness import Cluster


def leader(c: Cluster, tier: str) -> str:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with c.client() as client:
            name = client.status()[tier]["leader"]
        if name:
            return str(name)
        time.sleep(0.1)
    raise AssertionError(f"no {tier} leader")


def post(c: Cluster, replica: str, body: Any) -> requests.Response:
    return requests.post(c.replica_url(replica) + "/buys", json=body, timeout=10,
                         headers={"Authorization": f"Bearer {c.secret()}"})


def stocks(c: Cluster) -> list[int]:
    with c.client() as client:
        return [client.lookup(n)["stock"] for n in range(1, 8)]


def test_a_batch_is_answered_item_by_item_and_each_buy_happens_once(fresh_cluster: Cluster) -> None:
    c = fresh_cluster
    with c.client() as admin:
        admin.update(5, stock_delta=1 - admin.lookup(5)["stock"])
    before = stocks(c)
    order = leader(c, "order")
    batch = {"items": [
        {"item": 1, "quantity": 2, "key": "a"},
        {"item": 99_999, "quantity": 1, "key": "b"},       # no such book
        {"item": 3, "quantity": 5, "key": "c", "timeout_ms": 5000},
        {"item": 1, "quantity": 2, "key": "a"},            # the same buy twice in one batch: one order
        {"item": 1, "quantity": 3, "key": "a"},            # the same key for another buy
        {"item": 5, "quantity": 2, "key": "d"},            # one copy left
        {"item": 2, "quantity": 1, "key": "e", "timeout_ms": 0},  # its time ran out on the way: nothing done
    ]}
    r = post(c, order, batch)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["status"] for x in results] == [200, 404, 200, 200, 422, 409, 504]
    first = results[0]["body"]
    assert first["item_number"] == 1 and first["quantity"] == 2 and first["total"] == first["cost"] * 2
    assert results[3]["body"]["order_number"] == first["order_number"]
    assert results[2]["body"]["item_number"] == 3
    assert all("message" in x["body"]["error"] for x in results if x["status"] != 200)
    after = stocks(c)
    assert after[0] == before[0] - 2 and after[2] == before[2] - 5 and after[4] == 1 and after[1] == before[1]
    # The whole batch again (a retry after a lost answer): the same answers, no stock taken twice.
    again = post(c, order, batch).json()["results"]
    assert [x["status"] for x in again] == [200, 404, 200, 200, 422, 409, 504]
    assert again[0]["body"]["order_number"] == first["order_number"]
    assert again[2]["body"]["order_number"] == results[2]["body"]["order_number"]
    assert stocks(c) == after
    with c.client() as client:
        assert client.order(first["order_number"])["quantity"] == 2


def test_a_malformed_batch_is_refused_whole_and_changes_nothing(fresh_cluster: Cluster) -> None:
    c = fresh_cluster
    before = stocks(c)
    order = leader(c, "order")
    good = {"item": 1, "quantity": 1, "key": "fine"}
    for body in ({}, {"items": []}, {"items": "x"}, {"items": [good] * 257}, {"items": [good, 7]},
                 {"items": [good, {"item": 2, "quantity": 0, "key": "k"}]},
                 {"items": [good, {"item": 2, "quantity": 1}]},
                 {"items": [good, {"item": 2, "quantity": 1, "key": "k", "timeout_ms": -5}]}):
        r = post(c, order, body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["code"] == 400
    assert stocks(c) == before
    with c.client() as client:
        assert client.status()["order"]["replicas"]  # still answering
    follower = next(n for n in c.cluster_config().peers("order") if n != order)
    r = post(c, follower, {"items": [good]})
    assert r.status_code == 421 and r.json()["error"]["leader"] == order
    assert stocks(c) == before
