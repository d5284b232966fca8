"""8. Cache size: a 100,000-book catalogue, Zipf-distributed lookups, hit ratio and latency per size.

The catalogue is loaded once (``--reset``); each cache size is the same data dir restarted with a
different ``--cache-size``, so every size starts cold. A warm-up phase fills the caches, then the
measured phase's hit ratio comes from the frontend's /status counters (summed over its workers;
each worker has its own cache of that capacity).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from pygmy.catalog.books import synthetic
from pygmy.cluster.local import LocalCluster, free_port_base
from pygmy.experiments import baseline
from pygmy.experiments import harness as h

ZIPF = 1.0


def run(settings: h.Settings) -> dict[str, Any]:
    books = settings.size(100_000, 10_000, 500)
    sizes = settings.size([10, 100, 1000, 10_000, 100_000], [10, 100, 1000, 10_000], [10, 1000])
    clients = settings.size(8, 4, 2)
    warm, measured = settings.size((2500, 5000), (300, 500), (20, 30))  # lookups per client
    base = baseline.of_run(settings)
    rtt = base["http_rtt"]["p50"]
    tmp = Path(tempfile.mkdtemp(prefix="pygmy-cachesize-"))
    books_file = h.write_books(tmp / "books.json", synthetic(books, stock=h.BIG_STOCK))
    port = free_port_base()
    points = []
    try:
        for i, size in enumerate(h.progress(settings, sizes, desc="cache sizes")):
            c = LocalCluster(tmp / "data", port, ["--books", str(books_file), "--cache-size", str(size)])
            try:
                c.start(reset=i == 0, timeout=300)
                h.wait_healthy(c, timeout=120)
                h.run_load(c.url, clients, {"lookup": 1.0}, count=warm, items=books, zipf=ZIPF, seed=1)
                before = c.client().status()["frontend"]["cache"]
                rec = h.run_load(c.url, clients, {"lookup": 1.0}, count=measured, items=books, zipf=ZIPF, seed=2)
                after = c.client().status()["frontend"]["cache"]
            finally:
                c.stop()
            hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
            points.append({"cache_size": size, "hit_ratio": hits / (hits + misses) if hits + misses else None,
                           "hits": hits, "misses": misses, "entries": after["entries"],
                           "evictions": after.get("evictions"), "ops_per_s": rec.throughput(),
                           "errors": rec.errors(), **rec.stats()})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    fig, (a1, a2) = h.figure(1, 2, figsize=(13, 4.8))
    xs = [p["cache_size"] for p in points]
    a1.plot(xs, [p["hit_ratio"] for p in points], marker="o")
    a1.set(xscale="log", ylim=(0, 1), xlabel="cache capacity per worker (entries)", ylabel="hit ratio",
           title=f"Hit ratio, Zipf(s={ZIPF}) lookups over {books:,} books")
    for q, ls in (("p50", "-"), ("p95", "--"), ("p99", ":")):
        a2.plot(xs, [p[q] for p in points], marker="o", ls=ls, label=q)
    a2.axhline(rtt, color="k", lw=0.8, ls="-.", label="bare HTTP p50")
    a2.set(xscale="log", yscale="log", xlabel="cache capacity per worker (entries)", ylabel="lookup latency (ms)",
           title=f"Lookup latency, {clients} closed-loop clients")
    a2.legend()
    plot = h.save_plot(settings, fig, "cache_size")
    rows = [[p["cache_size"], p["hit_ratio"], p["entries"], p["evictions"], p["p50"], p["p95"], p["p99"],
             p["ops_per_s"], h.ratio(p["p50"], rtt)] for p in points]
    return {"path": h.save(settings, "cache_size", {
        "title": "8. Cache size",
        "description": f"{books:,} synthetic books; {clients} client processes look up Zipf(s={ZIPF})-distributed "
                       f"items (popular items scattered over the range): {warm:,} warm-up then {measured:,} measured "
                       "lookups each, per cache capacity. Hit ratio from the frontend's counters over the measured "
                       "phase. 1 frontend x 2 workers, each with its own cache of that capacity.",
        "params": {"books": books, "sizes": sizes, "clients": clients, "warm": warm, "measured": measured,
                   "zipf": ZIPF},
        "baseline": base, "summary": points,
        "table": {"columns": ["capacity", "hit ratio", "entries (all workers)", "evictions", "p50 ms", "p95 ms",
                              "p99 ms", "lookups/s", "p50 / bare p50"], "rows": rows},
        "plots": [plot]})}


def main(argv: list[str] | None = None) -> None:
    h.cli("cache_size", run, argv)


if __name__ == "__main__":
    main()
