"""5. Scaling as in the related client-scaling study: 1, 2, 4, 8 clients x N operations of each kind.

Each client process runs N operations of one kind back to back (closed loop); we report the
per-client total time (the study's unit), per-request latency percentiles and aggregate ops/s,
for one replica per tier (a central server) against 3 and 5 replicas.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pygmy.experiments import baseline
from pygmy.experiments import harness as h

KINDS = ("search", "lookup", "buy")
#: The study's average per-request ms (register, search, download) and ops/s by client count.
STUDY = {1: (0.128, 0.0901, 0.5637), 2: (0.1423, 0.0999, 0.7036), 4: (0.2478, 0.1121, 1.2401),
         8: (0.6035, 0.1319, 2.9459)}


def run(settings: h.Settings) -> dict[str, Any]:
    # The related study ran 10,000 operations of each kind per client; 1,000 keeps a full run of all
    # experiments within an hour on 2 cores (buys dominate). PYGMY_SCALING_OPS=10000 reproduces it.
    n = int(os.environ.get("PYGMY_SCALING_OPS", 0)) or settings.size(1_000, 100, 5)
    counts = settings.size([1, 2, 4, 8], [1, 2, 4, 8], [1, 2])
    replicas = settings.size([1, 3, 5], [1, 3, 5], [3])
    base = baseline.of_run(settings)
    rtt = base["http_rtt"]["p50"]
    points: list[dict[str, Any]] = []
    for r in replicas:
        args = [] if r == 3 else ["--catalog-replicas", str(r), "--order-replicas", str(r)]
        with h.cluster(settings, *args) as c:
            h.run_load(c.url, 2, {"lookup": 1.0}, count=10)
            for kind in KINDS:
                for k in h.progress(settings, counts, desc=f"{r} replicas, {kind}"):
                    rec = h.run_load(c.url, k, {kind: 1.0}, count=n, seed=k)
                    per_client = [float(rec.latency[rec.select(kind, ok=None)].sum() / k)]
                    points.append({"replicas": r, "kind": kind, "clients": k, "ops_per_s": rec.throughput(),
                                   "errors": rec.errors(), "client_total_ms": per_client[0] * 1000,
                                   **rec.stats(kind)})
    rows = [[p["replicas"], p["kind"], p["clients"], p["client_total_ms"], p["mean"], p["p50"], p["p99"],
             p["ops_per_s"], p["errors"], h.ratio(p["p50"], rtt)] for p in points]

    fig, axes = h.figure(1, len(KINDS), figsize=(14, 4.8), sharey=False)
    for ax, kind in zip(np.atleast_1d(axes), KINDS, strict=True):
        for r in replicas:
            pts = [p for p in points if p["kind"] == kind and p["replicas"] == r]
            ax.plot([p["clients"] for p in pts], [p["ops_per_s"] for p in pts], marker="o",
                    label=f"{r} replica{'s' if r > 1 else ''} ops/s")
        ax.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="aggregate ops / s",
               title=f"{kind}: throughput")
        ax.set_xticks(counts, [str(k) for k in counts])
        ax.legend(fontsize="small")
    p1 = h.save_plot(settings, fig, "scaling_throughput")
    fig, axes = h.figure(1, len(KINDS), figsize=(14, 4.8))
    for ax, kind in zip(np.atleast_1d(axes), KINDS, strict=True):
        for r in replicas:
            pts = [p for p in points if p["kind"] == kind and p["replicas"] == r]
            ax.plot([p["clients"] for p in pts], [p["p50"] for p in pts], marker="o", label=f"{r} rep. p50")
            ax.plot([p["clients"] for p in pts], [p["p99"] for p in pts], marker="x", ls=":", label=f"{r} rep. p99")
        ax.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="latency per request (ms)",
               title=f"{kind}: latency")
        ax.set_xticks(counts, [str(k) for k in counts])
        ax.legend(fontsize="small")
    p2 = h.save_plot(settings, fig, "scaling_latency")

    comp = []
    for k, (reg, srch, dl) in STUDY.items():
        ours = {p["kind"]: p for p in points if p["clients"] == k and p["replicas"] == max(replicas)}
        if ours:
            comp.append([k, reg, ours["buy"]["mean"], srch, ours["search"]["mean"], dl, ours["lookup"]["mean"],
                         round(1000 / srch), ours["search"]["ops_per_s"]])
    return {"path": h.save(settings, "scaling", {
        "title": "5. Scaling with clients and replicas",
        "description": f"{', '.join(map(str, counts))} client processes, each sending {n:,} operations of one kind "
                       f"(search, lookup, buy) back to back; 1 replica per tier (central) against "
                       f"{' and '.join(str(r) for r in replicas if r > 1)}. Cache on.",
        "params": {"n": n, "clients": counts, "replicas": replicas}, "baseline": base, "summary": points,
        "table": {"columns": ["replicas", "operation", "clients", "per-client total ms", "mean ms", "p50 ms",
                              "p99 ms", "aggregate ops/s", "errors", "p50 / bare p50"], "rows": rows},
        "comparison": {"columns": ["clients", "study register ms", "Pygmy buy mean ms", "study search ms",
                                   "Pygmy search mean ms", "study download ms", "Pygmy lookup mean ms",
                                   "study search ops/s (per client)", "Pygmy search ops/s (aggregate)"],
                       "rows": comp,
                       "note": "A different system (a file-sharing index) measured with the same method; shown "
                               "for the method, not as a like-for-like comparison."},
        "plots": [p1, p2]})}


def main(argv: list[str] | None = None) -> None:
    h.cli("scaling", run, argv)


if __name__ == "__main__":
    main()
