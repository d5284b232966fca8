"""Costs as the store grows (issues #14 and #12): a cluster started with 7, 100,000 and 1,000,000
books (``catalog.books.synthetic``, 50 topics), each measured the same way:

- how long ``pygmy up --books`` takes until the cluster is ready and healthy;
- ``/status`` p50; lookup p50 of the same seven books (cached: the frontend's path); a random book
  read from the catalog leader itself (the storage path); the first search page (100 books) p50;
- the resident memory of every process of every service.

Ratios are to the 7-book store of the same run. It prints numbers; nothing here asserts a timing.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import requests

from catalog.books import synthetic
from cluster.launcher import group_members
from cluster.local import LocalCluster
from experiments import harness as h

TOPICS = 50
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib(c: LocalCluster) -> dict[str, list[int]]:
    """Each service's processes (Gunicorn master and workers), resident MiB, smallest first."""
    return {name: sorted(p.rss_pages * _PAGE // 2**20 for p in group_members([group]))
            for name, group in c.process_groups().items()}


def one(settings: h.Settings, books: int, n: int) -> dict[str, Any]:
    rng = random.Random(books)
    started = time.monotonic()
    with h.cluster(settings, books=synthetic(books, topics=TOPICS)) as c:
        ready = time.monotonic() - started
        leader = h.leader(c, "catalog")
        with c.client() as cl, requests.Session() as replica:
            cl.status()
            replica.headers["Authorization"] = f"Bearer {c.secret()}"
            books_url = c.replica_url(leader) + "/books/"
            out = {"books": books, "ready_s": ready,
                   "status": h.stats([h.timed(cl.status)[0] for _ in range(n)]),
                   # The same seven books at every size: the frontend's path, cached after the first read.
                   "lookup": h.stats([h.timed(lambda i=i: cl.lookup(1 + i % 7))[0] for i in range(n)]),
                   # A random book from the catalog leader itself: the storage path, never cached.
                   "catalog_read": h.stats([h.timed(lambda: replica.get(
                       books_url + str(rng.randint(1, books)), timeout=5).raise_for_status())[0] for _ in range(n)]),
                   "search": h.stats([h.timed(lambda: cl.search("topic 1", limit=100))[0] for _ in range(n)]),
                   "rss_mib": rss_mib(c)}
    return out


def run(settings: h.Settings) -> dict[str, Any]:
    sizes = settings.size([7, 100_000, 1_000_000], [7, 100_000, 1_000_000], [7, 1_000])
    n = settings.size(200, 100, 10)
    results = [one(settings, b, n) for b in h.progress(settings, sizes, desc="store sizes")]
    base = results[0]
    rows = []
    for r in results:
        cat = max(max(v) for k, v in r["rss_mib"].items() if k.startswith("catalog"))
        rest = max(max(v) for k, v in r["rss_mib"].items() if not k.startswith("catalog"))
        rows.append([r["books"], round(r["ready_s"], 1),
                     *(f"{r[op]['p50']:.2f} ms = {r[op]['p50'] / base[op]['p50']:.2f}x"
                       for op in ("status", "lookup", "catalog_read", "search")), cat, rest])
    columns = ["books", "ready after (s)", "/status p50", "lookup p50 (books 1-7)", "catalog read p50 (random)",
               "first search page p50",
               "catalog RSS max (MiB)", "other RSS max (MiB)"]
    width = [max(len(str(x)) for x in col) for col in zip(columns, *rows, strict=True)]
    for line in [columns, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, width, strict=True)))
    h.save(settings, "store_size", {
        "title": "Costs as the store grows", "description": "Start-up, p50 of status, lookup and the first "
        "search page, and memory per process, at each catalogue size; ratios to 7 books in the same run. "
        "See experiments/store_size.py.", "results": results,
        "table": {"columns": columns, "rows": rows}, "plots": []})
    return {"results": results}


def main(argv: list[str] | None = None) -> None:
    h.cli("store_size", run, argv)


if __name__ == "__main__":
    main()
