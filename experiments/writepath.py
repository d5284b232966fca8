"""``make bench`` part two: the write path (issue #10), as ratios to a bare endpoint of the same run.

Measures, on a cluster of 3+3 replicas with a 1,000-book catalogue:

- the sequential durable buy's p50 against the bare Flask lookup's p50;
- 32 closed-loop buyers (4 client processes x 8 threads, a random book each time) against a bare
  Flask POST endpoint under the frontend's Gunicorn settings driven by the same clients; then stock
  is read back and every acknowledged buy must be exactly one decrement (0 lost, 0 doubled);
- the 40/40/20 search/lookup/buy mix with the same 32 clients;
- CPU per buy (every process of the cluster, from /proc) and the CPU of an idle cluster.

It prints numbers; nothing here asserts a timing. Results go to ``results/writepath.json``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from catalog.books import synthetic
from cluster.local import LocalCluster, group_processes
from experiments import baseline
from experiments import harness as h

BOOKS = 1000
TOPICS = 50
STOCK = 1_000_000
_TICKS = os.sysconf("SC_CLK_TCK")


def cluster_cpu_s(c: LocalCluster) -> float:
    """CPU seconds (user + system) used so far by every process of the cluster's services."""
    ticks = sum(int(f[11]) + int(f[12]) for _, f in group_processes(set(c.process_groups().values())))
    return ticks / _TICKS


def total_stock(c: LocalCluster, books: int) -> int:
    with c.client() as cl:
        return sum(int(cl.lookup(n)["stock"]) for n in range(1, books + 1))


def _load(c: LocalCluster, mix: dict[str, float], duration: float, procs: int, threads: int) -> dict[str, Any]:
    cpu0 = cluster_cpu_s(c)
    rec = h.run_load(c.url, procs, mix, duration=duration, items=BOOKS, threads=threads,
                     topics=tuple(f"topic {t}" for t in range(TOPICS)))
    cpu = cluster_cpu_s(c) - cpu0
    buys = int(rec.select("buy").sum())
    return {"ops_per_s": rec.throughput(), "buys_per_s": rec.throughput("buy"), "buys": buys,
            "errors": rec.errors(), "buy": rec.stats("buy"), "all": rec.stats(),
            "cpu_s": cpu, "cpu_ms_per_buy": cpu / buys * 1000 if buys else None,
            "cpu_ms_per_op": cpu / len(rec.op) * 1000 if len(rec.op) else None}


def run(settings: h.Settings) -> dict[str, Any]:
    duration = settings.size(30.0, 15.0, 3.0)
    idle_s = settings.size(60.0, 20.0, 3.0)
    n = settings.size(300, 150, 20)
    procs, threads = 4, 8
    out: dict[str, Any] = {"books": BOOKS, "clients": f"{procs} processes x {threads} threads",
                           "duration_s": duration}
    with baseline.server() as url:
        from client.api import PygmyClient

        with PygmyClient(url) as cl:
            for _ in range(20):
                cl.lookup(1)
            out["bare_lookup"] = h.stats([h.timed(lambda: cl.lookup(1))[0] for _ in range(n)])
        bare = h.run_load(url, procs, {"buy": 1.0}, duration=duration, items=BOOKS, threads=threads)
        out["bare_post"] = {"ops_per_s": bare.throughput(), **bare.stats()}
        bare_mix = h.run_load(url, procs, {"lookup": 0.5, "buy": 0.5}, duration=duration, items=BOOKS,
                              threads=threads)
        out["bare_mix"] = {"ops_per_s": bare_mix.throughput()}
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
        before = total_stock(c, BOOKS)
        out["buyers"] = _load(c, {"buy": 1.0}, duration, procs, threads)
        sold = before - total_stock(c, BOOKS)
        out["buyers"]["stock_sold"] = sold
        out["buyers"]["lost_or_doubled"] = sold - out["buyers"]["buys"] if out["buyers"]["errors"] == 0 else None
        out["mix"] = _load(c, {"search": 0.4, "lookup": 0.4, "buy": 0.2}, duration, procs, threads)
    rtt = out["bare_lookup"]["p50"]
    b, m = out["buyers"], out["mix"]
    lines = [
        ("bare lookup p50 (sequential)", f"{rtt:.2f} ms"),
        ("bare POST, 32 closed-loop clients", f"{out['bare_post']['ops_per_s']:.0f} req/s"),
        ("sequential buy p50", f"{out['sequential_buy']['p50']:.2f} ms = {out['sequential_buy']['p50'] / rtt:.1f}x "
                               "bare lookup p50 (goal <= 8x)"),
        ("32 buyers", f"{b['buys_per_s']:.0f} buys/s = {b['buys_per_s'] / out['bare_post']['ops_per_s']:.3f}x bare POST; "
                      f"p50 {b['buy']['p50']:.0f} ms; {b['errors']} errors; stock sold {b['stock_sold']} for "
                      f"{b['buys']} acknowledged buys"),
        ("CPU per buy (all processes)", f"{h.fmt(b['cpu_ms_per_buy'])} ms"),
        ("40/40/20 mix, 32 clients", f"{m['ops_per_s']:.0f} req/s = {m['ops_per_s'] / out['bare_mix']['ops_per_s']:.3f}x "
                                     f"bare lookup/POST mix; {m['errors']} errors"),
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
    p = argparse.ArgumentParser(prog="python -m experiments.writepath")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--results-dir", type=Path, default=h.RESULTS)
    a = p.parse_args(argv)
    run(h.Settings(quick=a.quick, results_dir=a.results_dir, progress=False))


if __name__ == "__main__":
    main()
