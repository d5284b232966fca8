"""3. Invalidation overhead: buy then look up, with 1, 2 and 4 frontend workers holding leases.

The catalog leader pushes each change to every leased frontend worker *before* acknowledging the
decrement, so the push is inside the catalog's ``/books/decrements`` handler time (served as a frame
on its ``decrements`` channel), which the leader's ``/metrics`` histogram
``pygmy_frame_request_seconds`` exposes (sum and count: a mean per write). The push itself is not
timed separately by Pygmy, so we report what can be measured from outside honestly: the handler
mean and the end-to-end buy as the number of subscribed workers grows (``--no-cache`` still
subscribes, so it is shown too), and the marginal cost per extra subscriber (least-squares slope).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pygmy.experiments import baseline
from pygmy.experiments import harness as h

ROUTE, METRIC = "/books/decrements", "pygmy_frame_request_seconds"
#: (label, frontends, workers per frontend, extra args)
CONFIGS = [("1 frontend x 1 worker", 1, 1, []), ("1 frontend x 2 workers", 1, 2, []),
           ("2 frontends x 2 workers", 2, 2, []), ("1 frontend x 2 workers, --no-cache", 1, 2, ["--no-cache"])]


def catalog_handler(c: Any, leader: str) -> tuple[float, float]:
    return h.metric_sum_count(c.replica_get(leader, "/metrics").text, ROUTE, METRIC)


def run(settings: h.Settings) -> dict[str, Any]:
    n = settings.size(1000, 100, 5)
    configs = settings.size(CONFIGS, CONFIGS, [CONFIGS[1]])
    base = baseline.of_run(settings)
    rtt = base["http_rtt"]["p50"]
    results: list[dict[str, Any]] = []
    for label, fes, workers, extra in configs:
        args = [] if (fes, workers, extra) == (1, 2, []) else \
            ["--frontends", str(fes), "--frontend-workers", str(workers), *extra]
        with h.cluster(settings, *args) as c:
            clients = [c.client(k + 1) for k in range(fes)]
            for cl in clients:
                for _ in range(10):
                    cl.lookup(1)
            lead = h.leader(c, "catalog")
            s0, n0 = catalog_handler(c, lead)
            buys, lookups = [], []
            for i in h.progress(settings, range(n), desc=label):
                item = 1 + i % 7
                tb, r = h.timed(lambda: clients[0].buy(item))  # noqa: B023
                if isinstance(r, Exception):
                    raise RuntimeError(f"buy failed: {r}")
                buys.append(tb)
                lookups.append(h.timed(lambda: clients[i % fes].lookup(item))[0])  # noqa: B023
            s1, n1 = catalog_handler(c, lead)
            if h.leader(c, "catalog") != lead:
                raise RuntimeError("catalog leader changed during the measurement; rerun")
            for cl in clients:
                cl.close()
        results.append({"label": label, "subscribers": fes * workers, "cache": not extra, "buy": h.stats(buys),
                        "lookup_after_buy": h.stats(lookups),
                        "decrement_mean_ms": (s1 - s0) / (n1 - n0) * 1000 if n1 > n0 else None,
                        "decrements": n1 - n0})

    cached = [r for r in results if r["cache"] and r["decrement_mean_ms"] is not None]
    slope = None
    if len({r["subscribers"] for r in cached}) > 1:
        slope = float(np.polyfit([r["subscribers"] for r in cached], [r["decrement_mean_ms"] for r in cached], 1)[0])
    rows = [[r["label"], r["subscribers"], r["decrement_mean_ms"], r["buy"]["p50"], r["buy"]["p95"],
             r["lookup_after_buy"]["p50"], h.ratio(r["decrement_mean_ms"], r["buy"]["mean"]),
             h.ratio(r["buy"]["p50"], rtt)] for r in results]

    fig, (a1, a2) = h.figure(1, 2, figsize=(12, 4.8))
    xs = np.arange(len(results))
    a1.bar(xs - 0.2, [r["decrement_mean_ms"] or 0 for r in results], 0.4, label="catalog decrement handler (mean)")
    a1.bar(xs + 0.2, [r["buy"]["mean"] for r in results], 0.4, label="end-to-end buy (mean)")
    a1.set_xticks(xs, [f"{r['subscribers']} sub.{'' if r['cache'] else ' no-cache'}" for r in results])
    a1.set(ylabel="time per write (ms)", xlabel="leased frontend workers",
           title="Decrement (incl. invalidation push) vs end-to-end buy")
    a1.legend()
    for q, marker in (("p50", "o"), ("p95", "s"), ("p99", "^")):
        a2.plot(xs, [r["buy"][q] for r in results], marker=marker, label=f"buy {q}")
        a2.plot(xs, [r["lookup_after_buy"][q] for r in results], marker=marker, ls=":", label=f"lookup after buy {q}")
    a2.set_xticks(xs, [f"{r['subscribers']} sub.{'' if r['cache'] else ' no-cache'}" for r in results])
    a2.set(yscale="log", xlabel="leased frontend workers", ylabel="latency (ms)", title="Buy and lookup percentiles")
    a2.legend(fontsize="small")
    plot = h.save_plot(settings, fig, "invalidation")

    ref = next((r for r in results if r["subscribers"] == 2 and r["cache"]), results[0])
    return {"path": h.save(settings, "invalidation", {
        "title": "3. Invalidation overhead",
        "description": f"One client, {n} times: buy book 1+i%7 through frontend 1, then look it up (through the "
                       "frontends in turn). The catalog leader's decrement handler time (from its /metrics "
                       "histogram sum/count) contains the replicated commit and the invalidation push to every "
                       "leased worker; Pygmy does not time the push alone, so the per-subscriber cost is the slope "
                       "of handler time against the number of leased workers.",
        "params": {"n": n, "configs": [c[0] for c in configs]}, "baseline": base,
        "summary": {"configs": results, "slope_ms_per_subscriber": slope},
        "table": {"columns": ["setup", "leased workers", "catalog decrement mean ms", "buy p50 ms", "buy p95 ms",
                              "lookup after buy p50 ms", "decrement / buy (means)", "buy p50 / bare HTTP p50"],
                  "rows": rows},
        "comparison": {"columns": ["measure", "study", "Pygmy"],
                       "rows": [["invalidation time", "31.13 us", "slope " + h.fmt(slope, 3) + " ms per extra worker"],
                                ["end-to-end buy (mean)", "118.86 us (sic)", h.fmt(ref["buy"]["mean"]) + " ms"],
                                ["invalidation share of buy", "26.19%",
                                 "decrement handler " + h.fmt(100 * (h.ratio(ref["decrement_mean_ms"],
                                                                              ref["buy"]["mean"]) or 0), 1)
                                 + "% of buy (upper bound: includes the catalog commit)"]]},
        "plots": [plot]})}


def main(argv: list[str] | None = None) -> None:
    h.cli("invalidation", run, argv)


if __name__ == "__main__":
    main()
