"""The restocker (``--restock-every``): the catalog leader delivers copies of sold-out books through
the log, cached lookups see the delivery, books still in stock get nothing, and delivery goes on
after the leader that ran it is killed."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
from harness import Cluster, start_cluster

from pygmy.catalog.books import DEFAULT_BOOKS

AMOUNT = 4


@pytest.fixture
def restocking(tmp_path: Path) -> Iterator[Cluster]:
    books = [{**b, "stock": 2 if b["item_number"] == 1 else 50} for b in DEFAULT_BOOKS]
    path = tmp_path / "books.json"
    path.write_text(json.dumps(books))
    c = start_cluster(tmp_path, "--books", str(path), "--restock-every", "0.3", "--restock-amount", str(AMOUNT))
    yield c
    c.stop()


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)


def sell_out(c: Cluster, item: int) -> int:
    """Buy one copy at a time until the answer is 409; the number bought."""
    sold = 0
    with requests.Session() as s:
        while True:
            r = s.post(f"{c.url}/buy/{item}", json={"quantity": 1}, timeout=10)
            if r.status_code == 409:
                return sold
            assert r.status_code == 200, r.text
            sold += 1
            assert sold < 100, "the book never sold out"


def stock(c: Cluster, item: int) -> int:
    return requests.get(f"{c.url}/lookup/{item}", timeout=5).json()["stock"]


def leader(c: Cluster) -> str:
    name = requests.get(c.url + "/status", timeout=5).json()["catalog"]["leader"]
    assert name
    return name


def test_sold_out_books_are_restocked_through_the_log(restocking: Cluster) -> None:
    c = restocking
    assert stock(c, 1) == 2 and stock(c, 2) == 50  # both cached now
    assert sell_out(c, 1) >= 2
    wait_for(lambda: stock(c, 1) == AMOUNT, "book 1 restocked (and its cached lookup replaced)")
    assert stock(c, 2) == 50, "a book in stock gets no delivery"
    # Every replica agrees on the delivery.
    secret = {"Authorization": f"Bearer {c.secret()}"}
    names = [f"catalog-{k}" for k in (1, 2, 3)]
    wait_for(lambda: len({c.replica_get(n, "/status").json()["state_digest"] for n in names}) == 1, "replicas agree")
    assert {requests.get(c.replica_url(n) + "/books/1", headers=secret, timeout=5).json()["stock"]
            for n in names} == {AMOUNT}

    # The leader that ran the restocker dies: the new leader's restocker takes over.
    old = leader(c)
    c.kill(old)
    wait_for(lambda: requests.get(c.url + "/status", timeout=5).json()["catalog"]["leader"] not in (None, old),
             "a new catalog leader")
    assert sell_out(c, 1) >= AMOUNT  # more if a delivery lands while we buy
    wait_for(lambda: stock(c, 1) == AMOUNT, "book 1 restocked by the new leader")
