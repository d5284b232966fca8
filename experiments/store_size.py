"""Costs as the store grows (issues #14 and #12): a cluster started with 7, 100,000 and 1,000,000
books (``catalog.books.synthetic``, 50 topics), each measured the same way:

- how long ``pygmy up --books`` takes until the cluster is ready and healthy;
- p50, one request at a time: the frontend's and the catalog leader's ``/status``; a lookup of the
  same seven books (cached: the frontend's path); a random book read from the catalog leader itself
  (the storage path); the first search page (100 books); a durable buy;
- the resident memory of every process of every service;
- the largest store again after 100,000 orders (600 with ``--tiny``), placed through the order
  leader's batch endpoint (``POST /buys``, 256 buys per request: the frontend workers' path through
  both logs, batched harder than clients would).

Ratios are to the 7-book store of the same run. It prints numbers; nothing here asserts a timing.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

from catalog.books import synthetic
from cluster.launcher import group_members
from cluster.local import LocalCluster
from experiments import harness as h
from order.app import MAX_BUYS

TOPICS = 50
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib(c: LocalCluster) -> dict[str, list[int]]:
    """Each service's processes (Gunicorn master and workers), resident MiB, smallest first."""
    return {name: sorted(p.rss_pages * _PAGE // 2**20 for p in group_members([group]))
            for name, group in c.process_groups().items()}


def measure(c: LocalCluster, books: int, n: int, rng: random.Random) -> dict[str, Any]:
    """p50 of each request kind, one request at a time on the quiet cluster."""
    leader = h.leader(c, "catalog")
    with c.client() as cl, requests.Session() as replica:
        cl.status()
        replica.headers["Authorization"] = f"Bearer {c.secret()}"
        books_url = c.replica_url(leader) + "/books/"
        status_url = c.replica_url(leader) + "/status"
        return {
            "status": h.stats([h.timed(cl.status)[0] for _ in range(n)]),
            "replica_status": h.stats([h.timed(lambda: replica.get(status_url, timeout=5).raise_for_status())[0]
                                       for _ in range(n)]),
            # The same seven books at every size: the frontend's path, cached after the first read.
            "lookup": h.stats([h.timed(lambda i=i: cl.lookup(1 + i % 7))[0] for i in range(n)]),
            # A random book from the catalog leader itself: the storage path, never cached.
            "catalog_read": h.stats([h.timed(lambda: replica.get(
                books_url + str(rng.randint(1, books)), timeout=5).raise_for_status())[0] for _ in range(n)]),
            "search": h.stats([h.timed(lambda: cl.search("topic 1", limit=100))[0] for _ in range(n)]),
            # A durable buy of one of the seven first books (each starts with 1,000).
            "buy": h.stats([h.timed(lambda i=i: cl.buy(1 + i % 7, key=f"size-{uuid.uuid4().hex}"))[0]
                            for i in range(n)]),
        }


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


def one(settings: h.Settings, books: int, n: int, orders: int) -> list[dict[str, Any]]:
    """The fresh store; and again after ``orders`` orders, if any."""
    rng = random.Random(books)
    started = time.monotonic()
    with h.cluster(settings, books=synthetic(books, topics=TOPICS)) as c:
        ready = time.monotonic() - started
        out = [{"books": books, "orders": 0, "ready_s": ready, **measure(c, books, n, rng), "rss_mib": rss_mib(c)}]
        if orders:
            rate = place_orders(c, books, orders, rng)
            h.wait_caught_up(c, "order")
            h.wait_caught_up(c, "catalog")
            out.append({"books": books, "orders": orders, "ready_s": None, "orders_per_s": rate,
                        **measure(c, books, n, rng), "rss_mib": rss_mib(c)})
    return out


OPS = ("status", "replica_status", "lookup", "catalog_read", "search", "buy")


def run(settings: h.Settings) -> dict[str, Any]:
    sizes = settings.size([7, 100_000, 1_000_000], [7, 100_000, 1_000_000], [7, 1_000])
    n = settings.size(200, 100, 10)
    orders = settings.size(100_000, 100_000, 600)
    results = [r for b in h.progress(settings, sizes, desc="store sizes")
               for r in one(settings, b, n, orders if b == sizes[-1] else 0)]
    base = results[0]
    rows = []
    for r in results:
        cat = max(max(v) for k, v in r["rss_mib"].items() if k.startswith("catalog"))
        rest = max(max(v) for k, v in r["rss_mib"].items() if not k.startswith("catalog"))
        rows.append([f"{r['books']:,}" + (f" + {r['orders']:,} orders" if r["orders"] else ""),
                     "-" if r["ready_s"] is None else round(r["ready_s"], 1),
                     *(f"{r[op]['p50']:.2f} ms = {r[op]['p50'] / base[op]['p50']:.2f}x" for op in OPS), cat, rest])
    columns = ["books", "ready after (s)", "frontend /status p50", "catalog leader /status p50",
               "lookup p50 (books 1-7)", "catalog read p50 (random)", "first search page p50", "buy p50",
               "catalog RSS max (MiB)", "other RSS max (MiB)"]
    width = [max(len(str(x)) for x in col) for col in zip(columns, *rows, strict=True)]
    for line in [columns, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, width, strict=True)))
    if results[-1]["orders"]:
        print(f"orders placed at {results[-1]['orders_per_s']:.0f}/s through POST /buys (256 per request)")
    h.save(settings, "store_size", {
        "title": "Costs as the store grows", "description": "Start-up, p50 of status (frontend and catalog "
        "leader), lookup, a random catalog read, the first search page and a buy, and memory per process, "
        "at each catalogue size and again after many orders on the largest; ratios to 7 books in the same "
        "run. See experiments/store_size.py.", "results": results,
        "table": {"columns": columns, "rows": rows}, "plots": []})
    return {"results": results}


def main(argv: list[str] | None = None) -> None:
    h.cli("store_size", run, argv)


if __name__ == "__main__":
    main()
