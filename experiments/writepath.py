"""``make bench`` part two: the write path (issue #10), as ratios to a bare endpoint of the same run.

Measures, on a cluster of 3+3 replicas with a 1,000-book catalogue:

- the sequential durable buy's p50 against the bare Flask lookup's p50 (also in blocks alternating
  with it, ``baseline.paired_p50``);
- 32 closed-loop buyers (4 client processes x 8 threads, a random book each time) against a bare
  Flask POST endpoint (``experiments/baseline.py``: the frontend's Gunicorn options, 2 workers, but
  16 threads per worker to the frontend's 120) driven by the same clients; then stock
  is read back and every acknowledged buy must be exactly one decrement (0 lost, 0 doubled);
- the 40/40/20 search/lookup/buy mix with the same 32 clients, twice: with the caches as the buyers
  and the stock count left them (the count's lookups, on one kept-alive connection, fill one
  worker's cache: 2-11% of the mix's reads missed over the runs), then again after every book and
  topic was read a few times (``warm``), as in a store that has been serving a while;
- CPU per buy (every process of the cluster, from /proc), the buys an order log entry carried
  (``pygmy_buy_batch_size``), and the CPU of an idle cluster.

The bare endpoint's loads run before the cluster's and again after them, and the ratios divide by
the mean of the two: this machine's speed drifts within minutes (the same load on the same code
ran 630 and 910 requests/s a few minutes apart), and a ratio to a run minutes earlier took
the drift for Pygmy's own. Both runs are printed.

It prints numbers; nothing here asserts a timing. Results go to ``results/writepath.json``.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from pygmy.catalog.books import synthetic
from pygmy.cluster.launcher import group_members
from pygmy.cluster.local import LocalCluster
from pygmy.experiments import baseline
from pygmy.experiments import harness as h

BOOKS = 1000
TOPICS = 50
STOCK = 1_000_000
_TICKS = os.sysconf("SC_CLK_TCK")


def cluster_cpu_s(c: LocalCluster) -> float:
    """CPU seconds (user + system) used so far by every process of the cluster's services."""
    ticks = sum(p.cpu_ticks for p in group_members(c.process_groups().values()))
    return ticks / _TICKS


def total_stock(c: LocalCluster, books: int) -> int:
    with c.client() as cl:
        return sum(int(cl.lookup(n)["stock"]) for n in range(1, books + 1))


def warm(c: LocalCluster, rounds: int = 4) -> None:
    """Read every book and every topic ``rounds`` times from 8 threads, as a store in steady state has
    them cached. Each read on a new connection: a kept-alive one stays with the worker that accepted
    it, which would then cache every key of its thread and the other worker none; new connections
    land on the workers at random, so each caches all but about 1 in 2^rounds of the keys."""
    keys = [("lookup", n) for n in range(1, BOOKS + 1)] + [("search", f"topic {t}") for t in range(TOPICS)]

    def read(part: int) -> None:
        with c.client() as cl:
            cl.session.headers["Connection"] = "close"
            for _ in range(rounds):
                for op, arg in keys[part::8]:
                    cl.lookup(arg) if op == "lookup" else cl.search(arg)

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(read, range(8)))


def cache_counters(c: LocalCluster) -> dict[str, int]:
    """The frontend's cache counters (every worker), to tell how many reads each load missed."""
    with c.client() as cl:
        cache = cl.status()["frontend"]["cache"]
    return {k: int(cache[k]) for k in ("hits", "misses", "invalidations", "flushes")}


def buy_batches(c: LocalCluster) -> tuple[float, float]:
    """(buys, entries) of the order tier's intents entries so far, over every order replica that
    answers (each leader counts its own): their ratio is the buys an entry carried."""
    buys = entries = 0.0
    for name in c.cluster_config().names():
        if name.startswith("order-"):
            try:
                text = c.replica_get(name, "/metrics").text
            except OSError:
                continue
            b, e = h.metric_sum_count(text, "intents", "pygmy_buy_batch_size", label="what")
            buys, entries = buys + b, entries + e
    return buys, entries


def measured_load(c: LocalCluster, mix: dict[str, float], duration: float, procs: int = 4,
                  threads: int = 8) -> dict[str, Any]:
    """One closed-loop load on ``c``: throughput, errors, latencies, the cache's counters and the
    cluster's CPU per buy and per operation over it."""
    cache0 = cache_counters(c)
    batches0 = buy_batches(c)
    cpu0 = cluster_cpu_s(c)
    rec = h.run_load(c.url, procs, mix, duration=duration, items=BOOKS, threads=threads,
                     topics=tuple(f"topic {t}" for t in range(TOPICS)))
    cpu = cluster_cpu_s(c) - cpu0
    batched, entries = (after - before for after, before in zip(buy_batches(c), batches0, strict=True))
    cache = {k: v - cache0[k] for k, v in cache_counters(c).items()}
    buys = int(rec.select("buy").sum())
    return {"ops_per_s": rec.throughput(), "buys_per_s": rec.throughput("buy"), "buys": buys,
            "errors": rec.errors(), "buy": rec.stats("buy"), "all": rec.stats(),
            "error_statuses": {str(k): int(v) for k, v in zip(*np.unique(rec.status[rec.status != 200],
                                                                          return_counts=True), strict=True)},
            "cache": cache, "buys_per_entry": batched / entries if entries else None,
            "cpu_s": cpu, "cpu_ms_per_buy": cpu / buys * 1000 if buys else None,
            "cpu_ms_per_op": cpu / len(rec.op) * 1000 if len(rec.op) else None}


def _bracket(bare: dict[str, Any]) -> str:
    return (f"{bare['ops_per_s']:.0f} req/s (mean of {bare['before']['ops_per_s']:.0f} before the cluster's "
            f"loads and {bare['after']['ops_per_s']:.0f} after)")


def _missed(load: dict[str, Any]) -> str:
    c = load["cache"]
    return f"{c['misses'] / max(1, c['hits'] + c['misses']) * 100:.0f}% of reads missed the cache"


def _bare_loads(url: str, duration: float, procs: int, threads: int) -> dict[str, dict[str, Any]]:
    """The bare endpoint under the buyers' load (POSTs) and under a lookup/POST mix, same clients."""
    bare = h.run_load(url, procs, {"buy": 1.0}, duration=duration, items=BOOKS, threads=threads)
    bare_mix = h.run_load(url, procs, {"lookup": 0.5, "buy": 0.5}, duration=duration, items=BOOKS, threads=threads)
    return {"bare_post": {"ops_per_s": bare.throughput(), **bare.stats()},
            "bare_mix": {"ops_per_s": bare_mix.throughput()}}


def run(settings: h.Settings) -> dict[str, Any]:
    duration = settings.size(30.0, 15.0, 3.0)
    idle_s = settings.size(60.0, 20.0, 3.0)
    n = settings.size(300, 150, 20)
    procs, threads = 4, 8
    out: dict[str, Any] = {"books": BOOKS, "clients": f"{procs} processes x {threads} threads",
                           "duration_s": duration}
    with baseline.server() as url:
        from pygmy.client.api import PygmyClient

        with PygmyClient(url) as cl:
            for _ in range(20):
                cl.lookup(1)
            out["bare_lookup"] = h.stats([h.timed(lambda: cl.lookup(1))[0] for _ in range(n)])
        bare_before = _bare_loads(url, duration, procs, threads)
    books = synthetic(BOOKS, topics=TOPICS, stock=STOCK)
    with h.cluster(settings, books=books) as c:
        time.sleep(2)  # let start-up settle
        cpu0 = cluster_cpu_s(c)
        time.sleep(idle_s)
        out["idle"] = {"seconds": idle_s, "cpu_share_of_one_core": (cluster_cpu_s(c) - cpu0) / idle_s}
        with c.client() as cl:
            for i in range(10):
                cl.buy(1 + i)
            out["sequential_buy"] = h.stats([h.timed(lambda i=i: cl.buy(1 + i % BOOKS))[0] for i in range(n)])
            out["sequential_buy"]["paired"] = baseline.paired_p50(lambda i: cl.buy(1 + i % BOOKS),
                                                                  settings.size(5, 5, 1), max(10, n // 5))
        before = total_stock(c, BOOKS)
        out["buyers"] = measured_load(c, {"buy": 1.0}, duration, procs, threads)
        sold = before - total_stock(c, BOOKS)
        out["buyers"]["stock_sold"] = sold
        out["buyers"]["lost_or_doubled"] = sold - out["buyers"]["buys"] if out["buyers"]["errors"] == 0 else None
        mix = h.MIX_40_40_20
        out["mix"] = measured_load(c, mix, duration, procs, threads)  # caches as the buyers and the stock count left them
        warm(c)
        out["mix_warm"] = measured_load(c, mix, duration, procs, threads)
    with baseline.server() as url:
        bare_after = _bare_loads(url, duration, procs, threads)
    for k in ("bare_post", "bare_mix"):
        # The ratios divide by the mean of the runs before and after the cluster's: this shared
        # machine's speed drifts by more than the goals' margins within minutes.
        out[k] = {"ops_per_s": (bare_before[k]["ops_per_s"] + bare_after[k]["ops_per_s"]) / 2,
                  "before": bare_before[k], "after": bare_after[k]}
    rtt = out["bare_lookup"]["p50"]
    b, m, mw, seq = out["buyers"], out["mix"], out["mix_warm"], out["sequential_buy"]["paired"]
    lines = [
        ("bare lookup p50 (sequential)", f"{rtt:.2f} ms"),
        ("bare POST, 32 closed-loop clients", _bracket(out["bare_post"])),
        ("bare lookup/POST mix, same clients", _bracket(out["bare_mix"])),
        ("sequential buy p50", f"{out['sequential_buy']['p50']:.2f} ms = {out['sequential_buy']['p50'] / rtt:.1f}x "
                               "bare lookup p50 (goal <= 8x)"),
        ("  alternating with the bare lookup", f"median {seq['ratio']:.1f}x over {len(seq['ratios'])} pairs of blocks "
                                              f"({min(seq['ratios']):.1f}-{max(seq['ratios']):.1f}x)"),
        ("32 buyers", f"{b['buys_per_s']:.0f} buys/s = {b['buys_per_s'] / out['bare_post']['ops_per_s']:.3f}x bare POST; "
                      f"p50 {b['buy']['p50']:.0f} ms; {b['errors']} errors; stock sold {b['stock_sold']} for "
                      f"{b['buys']} acknowledged buys" + (f"; errors by status {b['error_statuses']}" if b["errors"] else "")),
        ("CPU per buy (all processes)", f"{h.fmt(b['cpu_ms_per_buy'])} ms; {h.fmt(b['buys_per_entry'])} buys per "
                                        f"intents entry (the mix: {h.fmt(m['buys_per_entry'])})"),
        ("40/40/20 mix, 32 clients", f"{m['ops_per_s']:.0f} req/s = {m['ops_per_s'] / out['bare_mix']['ops_per_s']:.3f}x "
                                     f"bare lookup/POST mix; {m['errors']} errors; {_missed(m)} (caches as the buyers and "
                                     "the stock count left them)"),
        ("40/40/20 mix, caches warmed", f"{mw['ops_per_s']:.0f} req/s = "
                                        f"{mw['ops_per_s'] / out['bare_mix']['ops_per_s']:.3f}x; {mw['errors']} errors; "
                                        f"{_missed(mw)}; CPU per operation {h.fmt(mw['cpu_ms_per_op'])} ms"),
        ("idle cluster CPU", f"{out['idle']['cpu_share_of_one_core'] * 100:.1f}% of one core over {idle_s:.0f} s "
                             "(goal <= 5%)"),
    ]
    width = max(len(k) for k, _ in lines)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in lines))
    h.save(settings, "writepath", {"title": "Write path (make bench)", "description": "Issue #10's measures as "
           "ratios to a bare endpoint of the same run; see experiments/writepath.py.", "results": out,
           "table": {"columns": ["measure", "value"], "rows": [list(x) for x in lines]}, "plots": []})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pygmy.experiments.writepath")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--results-dir", type=Path, default=h.RESULTS)
    a = p.parse_args(argv)
    run(h.Settings(quick=a.quick, results_dir=a.results_dir, progress=False))


if __name__ == "__main__":
    main()
