"""1. Sequential search, lookup and buy, cache on and off (the original study's sections 2.1 and 2.2).

Phase A repeats the study's loop: search a topic, look up a book, buy that same book (so each buy
invalidates the entry the lookup just cached). Phase B is lookups only, where the cache can show.
One client, one request at a time; every latency is kept.
"""

from __future__ import annotations

from typing import Any

from pygmy.experiments import baseline
from pygmy.experiments import harness as h

OPS = ("search", "lookup", "buy", "e2e")
#: The original study (seconds in its tables, here in ms).
STUDY = {("on", "search"): 19, ("on", "lookup"): 18, ("on", "buy"): 103, ("on", "e2e"): 141,
         ("off", "search"): 19, ("off", "lookup"): 20, ("off", "buy"): 187, ("off", "e2e"): 200,
         ("on", "lookup only"): 4.94, ("off", "lookup only"): 18.7}


def measure(c: Any, n: int, settings: h.Settings, desc: str) -> dict[str, list[float]]:
    series: dict[str, list[float]] = {op: [] for op in (*OPS, "lookup only")}
    topics = h.DEFAULT_TOPICS
    with c.client() as cl:
        for _ in range(10):  # warm connections and both frontend workers, not measured
            cl.lookup(1)
        for i in h.progress(settings, range(n), desc=f"{desc} A"):
            item = 1 + i % 7
            ts = h.timed(lambda: cl.search(topics[i % 2]))[0]  # noqa: B023
            tl = h.timed(lambda: cl.lookup(item))[0]  # noqa: B023
            tb, r = h.timed(lambda: cl.buy(item))  # noqa: B023
            if isinstance(r, Exception):
                raise RuntimeError(f"buy failed: {r}")
            for op, t in zip(OPS, (ts, tl, tb, ts + tl + tb), strict=True):
                series[op].append(t)
        for i in h.progress(settings, range(n), desc=f"{desc} B"):
            series["lookup only"].append(h.timed(lambda: cl.lookup(1 + i % 7))[0])  # noqa: B023
    return series


def run(settings: h.Settings) -> dict[str, Any]:
    n = settings.size(1000, 100, 5)
    modes = settings.size(["on", "off"], ["on", "off"], ["on"])
    base = baseline.of_run(settings)
    rtt = base["http_rtt"]["p50"]
    series: dict[str, dict[str, list[float]]] = {}
    for mode in modes:
        with h.cluster(settings, *([] if mode == "on" else ["--no-cache"])) as c:
            series[mode] = measure(c, n, settings, f"cache {mode}")

    summary = {m: {op: h.stats(v) for op, v in s.items()} for m, s in series.items()}
    rows, comp = [], []
    for m in modes:
        for op in (*OPS, "lookup only"):
            st = summary[m][op]
            rows.append([f"cache {m}", op, st["n"], st["mean"], st["p50"], st["p95"], st["p99"], st["max"],
                         h.ratio(st["p50"], rtt)])
            comp.append([f"cache {m}", op, STUDY[(m, op)], st["mean"], st["p50"]])
    h.save_csv(settings, "sequential_raw", ["cache", "op", "i", "latency_ms"],
               [[m, op, i, round(t * 1000, 3)] for m, s in series.items() for op, v in s.items()
                for i, t in enumerate(v)])

    fig, axes = h.figure(len(OPS), 1, sharex=True, figsize=(9, 10))
    for ax, op in zip(axes, OPS, strict=True):
        for m in modes:
            ax.plot([t * 1000 for t in series[m][op]], lw=0.7, label=f"cache {m}")
        ax.set_yscale("log")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"{op}" + (" (search + lookup + buy)" if op == "e2e" else ""))
        ax.legend(loc="upper right")
    axes[-1].set_xlabel("request number")
    fig.suptitle(f"Sequential requests, one client: {n} iterations of search, lookup, buy the same book")
    p1 = h.save_plot(settings, fig, "sequential_series")

    fig, ax = h.figure()
    for m in modes:
        ax.plot([t * 1000 for t in series[m]["lookup only"]], lw=0.7, label=f"cache {m}")
    ax.axhline(rtt, color="k", ls="--", lw=1, label=f"bare HTTP p50 ({rtt:.2f} ms)")
    ax.set(yscale="log", xlabel="request number", ylabel="latency (ms)",
           title=f"{n} sequential lookups (no buys), cache on and off")
    ax.legend()
    p2 = h.save_plot(settings, fig, "sequential_lookup")

    return {"path": h.save(settings, "sequential", {
        "title": "1. Sequential search, lookup and buy",
        "description": f"One client, {n} iterations of search (alternating topics), lookup of book 1+i%7 and a buy "
                       f"of that book (phase A, as in the study), then {n} lookups alone (phase B). Cache on: default "
                       "cluster; cache off: `--no-cache`. 3 replicas per tier, 1 frontend x 2 workers.",
        "params": {"n": n, "modes": modes}, "baseline": base, "summary": summary,
        "table": {"columns": ["cache", "operation", "n", "mean ms", "p50 ms", "p95 ms", "p99 ms", "max ms",
                              "p50 / bare HTTP p50"], "rows": rows},
        "comparison": {"columns": ["cache", "operation", "study mean ms", "Pygmy mean ms", "Pygmy p50 ms"],
                       "rows": comp},
        "plots": [p1, p2]}), "summary": summary}


def main(argv: list[str] | None = None) -> None:
    h.cli("sequential", run, argv)


if __name__ == "__main__":
    main()
