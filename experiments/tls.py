"""What TLS costs (#38): the same cluster plain and with ``--tls``, both up at once, in alternating blocks.

``python -m pygmy.experiments.tls [--pairs 4] [--seconds 8] [--buys 150]`` starts two default clusters
from this tree (3+3 replicas, 1,000 books, as ``ab`` and ``writepath``), one of them ``--tls``, warms
both caches, then runs per pair, the order swapped every pair: one buyer's sequential buys (p50) and
the 32 buyers of ``writepath`` (4 processes x 8 threads, throughput) on each. It prints the medians
over pairs of tls/plain: the goal is p50 at most 1.2x and throughput at least 1/1.2 of plain text.
Blocks seconds apart see the same machine (whose speed drifts by 10-30% within minutes), so their
ratio is worth more than two runs minutes apart (docs/performance.md).

The load's clients trust the TLS cluster's CA through ``REQUESTS_CA_BUNDLE`` (the load generator's
processes inherit it; the plain cluster needs none).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from typing import Any

from pygmy.catalog.books import synthetic
from pygmy.experiments import harness as h
from pygmy.experiments.ab import block
from pygmy.experiments.writepath import BOOKS, STOCK, TOPICS, warm


def run(pairs: int, seconds: float, buys: int) -> dict[str, Any]:
    settings = h.Settings(quick=True, progress=False)
    books = synthetic(BOOKS, topics=TOPICS, stock=STOCK)
    out: dict[str, dict[str, list[dict[str, float]]]] = {"plain": {"sequential": [], "buy": []},
                                                         "tls": {"sequential": [], "buy": []}}
    with contextlib.ExitStack() as stack:
        clusters = {"plain": stack.enter_context(h.cluster(settings, books=books)),
                    "tls": stack.enter_context(h.cluster(settings, "--tls", books=books))}
        os.environ["REQUESTS_CA_BUNDLE"] = str(clusters["tls"].data_dir / "certs" / "ca.pem")
        time.sleep(2)  # let start-up settle
        for c in clusters.values():
            warm(c)
        for k in range(pairs):
            for name in ("plain", "tls") if k % 2 == 0 else ("tls", "plain"):
                seq = block(clusters[name], "sequential", seconds, buys)
                load = block(clusters[name], "buy", seconds, buys)
                out[name]["sequential"].append(seq)
                out[name]["buy"].append(load)
                print(f"pair {k + 1} {name}: buy p50 {seq['p50_ms']:.2f} ms, 32 buyers {load['ops_per_s']:.0f} "
                      f"buys/s, {seq['errors'] + load['errors']:.0f} errors", flush=True)
    p50 = [t["p50_ms"] / p["p50_ms"] for p, t in zip(out["plain"]["sequential"], out["tls"]["sequential"], strict=True)]
    rate = [t["ops_per_s"] / p["ops_per_s"] for p, t in zip(out["plain"]["buy"], out["tls"]["buy"], strict=True)]
    result = {"blocks": out, "p50_ratio": statistics.median(p50), "p50_ratios": p50,
              "throughput_ratio": statistics.median(rate), "throughput_ratios": rate}
    print(f"tls/plain buy p50: median {result['p50_ratio']:.3f} over {len(p50)} pairs ({min(p50):.3f}-{max(p50):.3f}); "
          f"goal <= 1.2: {'met' if result['p50_ratio'] <= 1.2 else 'NOT met'}")
    print(f"tls/plain 32-buyer throughput: median {result['throughput_ratio']:.3f} ({min(rate):.3f}-{max(rate):.3f}); "
          f"goal >= {1 / 1.2:.3f}: {'met' if result['throughput_ratio'] >= 1 / 1.2 else 'NOT met'}")
    h.save(settings, "tls", result)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pygmy.experiments.tls", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--seconds", type=float, default=8.0, help="length of one block of 32 buyers")
    p.add_argument("--buys", type=int, default=150, help="sequential buys in one block")
    a = p.parse_args(argv)
    run(a.pairs, a.seconds, a.buys)


if __name__ == "__main__":
    main()
