"""2. Cache-miss latency: the first pass over the books misses, later passes hit (study section 3.1).

Each request is classified by the frontend's own counters: ``/status`` sums hits and misses over
all worker processes, so reading it before and after a lookup says exactly whether it missed (the
status call is not part of the timed lookup). With 2 workers each book can miss once per worker.
"""

from __future__ import annotations

from typing import Any

from pygmy.catalog.books import synthetic
from pygmy.experiments import baseline
from pygmy.experiments import harness as h

STUDY_MISS_MS = 5.9136


def run(settings: h.Settings) -> dict[str, Any]:
    books = settings.size(100, 30, 7)
    passes = settings.size(5, 3, 2)
    base = baseline.of_run(settings)
    rtt = base["http_rtt"]["p50"]
    catalogue = synthetic(books, topics=10, stock=h.BIG_STOCK)
    lat: list[float] = []
    miss: list[bool] = []
    with h.cluster(settings, books=None if settings.tiny else catalogue) as c, c.client() as cl:
        misses = cl.status()["frontend"]["cache"]["misses"]
        order = [1 + i % books for i in range(books * passes)]
        for item in h.progress(settings, order, desc="cache miss"):
            t, r = h.timed(lambda: cl.lookup(item))  # noqa: B023
            if isinstance(r, Exception):
                raise RuntimeError(f"lookup {item} failed: {r}")
            now = cl.status()["frontend"]["cache"]["misses"]
            lat.append(t)
            miss.append(now > misses)
            misses = now
    miss_lat = [t for t, m in zip(lat, miss, strict=True) if m]
    hit_lat = [t for t, m in zip(lat, miss, strict=True) if not m]
    sm, sh = h.stats(miss_lat), h.stats(hit_lat)
    penalty = None if sm["p50"] is None or sh["p50"] is None else sm["p50"] - sh["p50"]
    h.save_csv(settings, "cache_miss_raw", ["i", "item", "latency_ms", "miss"],
               [[i, it, round(t * 1000, 3), int(m)] for i, (it, t, m) in enumerate(zip(order, lat, miss, strict=True))])

    fig, (a1, a2) = h.figure(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 1]})
    xs = range(len(lat))
    a1.plot(list(xs), [t * 1000 for t in lat], color="0.7", lw=0.6, zorder=1)
    a1.scatter([i for i in xs if miss[i]], [lat[i] * 1000 for i in xs if miss[i]], s=14, c="tab:red",
               label=f"miss ({len(miss_lat)})", zorder=2)
    a1.scatter([i for i in xs if not miss[i]], [lat[i] * 1000 for i in xs if not miss[i]], s=6, c="tab:blue",
               label=f"hit ({len(hit_lat)})", zorder=2)
    for p in range(1, passes):
        a1.axvline(p * books - 0.5, color="k", lw=0.6, ls=":")
    a1.axhline(rtt, color="k", ls="--", lw=1, label=f"bare HTTP p50 ({rtt:.2f} ms)")
    a1.set(yscale="log", xlabel="request number (dotted lines: start of the next pass)", ylabel="latency (ms)",
           title=f"Lookups over {books} books, {passes} passes: misses marked")
    a1.legend()
    a2.boxplot([[t * 1000 for t in miss_lat] or [0], [t * 1000 for t in hit_lat] or [0]], tick_labels=["miss", "hit"])
    a2.set(yscale="log", ylabel="latency (ms)", title="miss vs hit")
    plot = h.save_plot(settings, fig, "cache_miss")

    rows = [[k, s["n"], s["mean"], s["p50"], s["p95"], s["p99"], h.ratio(s["p50"], rtt)]
            for k, s in (("miss", sm), ("hit", sh))]
    return {"path": h.save(settings, "cache_miss", {
        "title": "2. Cache-miss latency",
        "description": f"One client looks up {books} books in order, {passes} times. A lookup is a miss if the "
                       "frontend's miss counter (summed over its 2 workers) rose during it. Each worker has its own "
                       "cache, so a book can miss once per worker.",
        "params": {"books": books, "passes": passes}, "baseline": base,
        "summary": {"miss": sm, "hit": sh, "penalty_p50_ms": penalty},
        "table": {"columns": ["lookup", "n", "mean ms", "p50 ms", "p95 ms", "p99 ms", "p50 / bare HTTP p50"],
                  "rows": rows},
        "comparison": {"columns": ["measure", "study ms", "Pygmy ms"],
                       "rows": [["cache miss (mean)", STUDY_MISS_MS, sm["mean"]],
                                ["miss penalty (p50 miss - p50 hit)", None, penalty]]},
        "plots": [plot]})}


def main(argv: list[str] | None = None) -> None:
    h.cli("cache_miss", run, argv)


if __name__ == "__main__":
    main()
