"""Costs as the store grows (issues #14 and #12): a cluster started with 7, 100,000 and 1,000,000
books (``pygmy.catalog.books.synthetic``, 50 topics), each measured the same way:

- how long ``pygmy up --books`` takes until the cluster is ready and healthy;
- p50, one request at a time: the frontend's and the catalog leader's ``/status``; a lookup of the
  same seven books (cached: the frontend's path); a random book read from the catalog leader itself
  (the storage path); the first search page (100 books); a durable buy;
- the resident memory of every process of every service;
- the largest store again after 100,000 orders (600 with ``--tiny``), placed through the order
  leader's batch endpoint (``POST /buys``, 256 buys per request: the frontend workers' path through
  both logs, batched harder than clients would).

Each ratio is to a 7-book store running beside the one measured, the two measured alternately,
request by request (both see the same machine; separate runs minutes apart on a shared machine
differ by more than the effects measured here). It prints numbers; nothing here asserts a timing.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from pygmy.catalog.books import synthetic
from pygmy.cluster.launcher import group_members
from pygmy.cluster.local import LocalCluster
from pygmy.experiments import harness as h
from pygmy.order.app import MAX_BUYS

TOPICS = 50
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib(c: LocalCluster) -> dict[str, list[int]]:
    """Each service's processes (Gunicorn master and workers), resident MiB, smallest first."""
    return {name: sorted(p.rss_pages * _PAGE // 2**20 for p in group_members([group]))
            for name, group in c.process_groups().items()}


OPS = ("status", "replica_status", "lookup", "catalog_read", "search", "buy")


@contextlib.contextmanager
def requesters(c: LocalCluster, books: int, rng: random.Random) -> Iterator[dict[str, Callable[[int], Any]]]:
    """One request of each kind on ``c``, as a call taking the request's number."""
    leader = h.leader(c, "catalog")
    with c.client() as cl, requests.Session() as replica:
        replica.headers["Authorization"] = f"Bearer {c.secret()}"
        books_url = c.replica_url(leader) + "/books/"
        status_url = c.replica_url(leader) + "/status"
        yield {
            "status": lambda i: cl.status(),
            "replica_status": lambda i: replica.get(status_url, timeout=5).raise_for_status(),
            # The same seven books at every size: the frontend's path, cached after the first read.
            "lookup": lambda i: cl.lookup(1 + i % 7),
            # A random book from the catalog leader itself: the storage path, never cached.
            "catalog_read": lambda i: replica.get(books_url + str(rng.randint(1, books)), timeout=5).raise_for_status(),
            "search": lambda i: cl.search("topic 1", limit=100),
            # A durable buy of one of the seven first books (each starts with 1,000).
            "buy": lambda i: cl.buy(1 + i % 7, key=f"size-{uuid.uuid4().hex}"),
        }


def measure(base: LocalCluster, c: LocalCluster, books: int, n: int, rng: random.Random) -> dict[str, Any]:
    """p50 of each request kind on ``c`` and on the seven-book ``base``, one request at a time,
    alternating between the two (which goes first alternates too), so that both see the same
    machine: a ratio between runs minutes apart on a shared machine is mostly its noise."""
    out: dict[str, Any] = {}
    with requesters(base, 7, rng) as on_base, requesters(c, books, rng) as on_c:
        for op in OPS:
            for k in range(5):  # warm both (connections, caches)
                on_base[op](k)
                on_c[op](k)
            times: dict[str, list[float]] = {"base": [], "this": []}
            for i in range(n):
                pair = [("base", on_base[op]), ("this", on_c[op])]
                for side, call in pair if i % 2 else pair[::-1]:
                    times[side].append(h.timed(lambda call=call, i=i: call(i))[0])
            mine, theirs = h.stats(times["this"]), h.stats(times["base"])
            out[op] = {**mine, "base_p50": theirs["p50"], "ratio": mine["p50"] / theirs["p50"]}
    return out


def place_orders(c: LocalCluster, books: int, orders: int, rng: random.Random) -> float:
    """``orders`` buys of random books through the order leader's batch endpoint (``POST /buys``, what
    frontend workers send: the same intents, decrements and confirms through both logs), 256 per
    request from 4 threads: the benchmark-only part is the batching, not the path. Returns buys/s."""
    url = c.replica_url(h.leader(c, "order")) + "/buys"
    auth = {"Authorization": f"Bearer {c.secret()}"}
    batches = [[{"item": rng.randint(1, books), "quantity": 1, "key": f"grow-{uuid.uuid4().hex}",
                 "timeout_ms": 30_000} for _ in range(min(MAX_BUYS, orders - i))] for i in range(0, orders, MAX_BUYS)]

    def send(items: list[dict[str, Any]]) -> None:
        with requests.post(url, json={"items": items}, headers=auth, timeout=60) as r:
            r.raise_for_status()
            failed = [x for x in r.json()["results"] if x["status"] != 200]
            if failed:
                raise RuntimeError(f"{len(failed)} of {len(items)} buys failed, e.g. {failed[0]}")

    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(send, batches))
    return orders / (time.monotonic() - started)


def one(settings: h.Settings, base: LocalCluster, books: int, n: int, orders: int) -> list[dict[str, Any]]:
    """The fresh store; and again after ``orders`` orders, if any; each against ``base``."""
    rng = random.Random(books)
    started = time.monotonic()
    with h.cluster(settings, books=synthetic(books, topics=TOPICS)) as c:
        ready = time.monotonic() - started
        out = [{"books": books, "orders": 0, "ready_s": ready, **measure(base, c, books, n, rng),
                "rss_mib": rss_mib(c)}]
        if orders:
            rate = place_orders(c, books, orders, rng)
            h.wait_caught_up(c, "order")
            h.wait_caught_up(c, "catalog")
            out.append({"books": books, "orders": orders, "ready_s": None, "orders_per_s": rate,
                        **measure(base, c, books, n, rng), "rss_mib": rss_mib(c)})
    return out


def run(settings: h.Settings) -> dict[str, Any]:
    sizes = settings.size([7, 100_000, 1_000_000], [7, 100_000, 1_000_000], [7, 1_000])
    n = settings.size(200, 100, 10)
    orders = settings.size(100_000, 100_000, 600)
    # The seven-book store every other is compared with, running beside each of them.
    with h.cluster(settings, books=synthetic(7, topics=TOPICS)) as base:
        results = [r for b in h.progress(settings, sizes, desc="store sizes")
                   for r in one(settings, base, b, n, orders if b == sizes[-1] else 0)]
    rows = []
    for r in results:
        cat = max(max(v) for k, v in r["rss_mib"].items() if k.startswith("catalog"))
        rest = max(max(v) for k, v in r["rss_mib"].items() if not k.startswith("catalog"))
        rows.append([f"{r['books']:,}" + (f" + {r['orders']:,} orders" if r["orders"] else ""),
                     "-" if r["ready_s"] is None else round(r["ready_s"], 1),
                     *(f"{r[op]['p50']:.2f} ms = {r[op]['ratio']:.2f}x" for op in OPS), cat, rest])
    columns = ["books", "ready after (s)", "frontend /status p50", "catalog leader /status p50",
               "lookup p50 (books 1-7)", "catalog read p50 (random)", "first search page p50", "buy p50",
               "catalog RSS max (MiB)", "other RSS max (MiB)"]
    width = [max(len(str(x)) for x in col) for col in zip(columns, *rows, strict=True)]
    print("p50 = its ratio to a seven-book store measured alternately with it, request by request")
    for line in [columns, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, width, strict=True)))
    if results[-1]["orders"]:
        print(f"orders placed at {results[-1]['orders_per_s']:.0f}/s through POST /buys (256 per request)")
    h.save(settings, "store_size", {
        "title": "13. Costs as the store grows", "description": "Start-up, p50 of status (frontend and catalog "
        "leader), lookup, a random catalog read, the first search page and a buy, and memory per process, "
        "at each catalogue size and again after many orders on the largest; each ratio is to a seven-book "
        "store running beside it, measured alternately with it. See experiments/store_size.py.",
        "results": results, "table": {"columns": columns, "rows": rows}, "plots": []})
    return {"results": results}


def main(argv: list[str] | None = None) -> None:
    h.cli("store_size", run, argv)


if __name__ == "__main__":
    main()
