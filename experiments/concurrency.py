"""4. Concurrency: 1 to 100 client processes, mixed workload, cache on and off; closed and open loop.

Closed loop (each client waits for its reply) gives the throughput curve; its latencies hide
overload because slow replies slow the clients down. So an open-loop run follows at fixed offered
rates (fractions of the closed-loop peak), with send times scheduled in advance and latency measured
from the scheduled time: queueing shows up in the percentiles instead of being omitted.
"""

from __future__ import annotations

from typing import Any

from pygmy.experiments import baseline
from pygmy.experiments import harness as h

MIX = h.MIX_40_40_20
#: The study's end-to-end seconds (search + lookup + buy) per client count, cache on (S1) and off (S2).
STUDY = {10: (0.50, 0.50), 20: (0.74, 0.93), 50: (2.03, 2.88), 100: (7.14, 8.54)}
FRACTIONS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5)


def run(settings: h.Settings) -> dict[str, Any]:
    counts = settings.size([1, 2, 4, 8, 16, 32, 64, 100], [1, 4, 16, 64], [1, 2])
    duration = settings.size(15.0, 3.0, 1.0)
    modes = settings.size(["on", "off"], ["on", "off"], ["on"])
    fractions = settings.size(FRACTIONS, (0.5, 1.0, 1.5), (0.5,))
    open_senders = settings.size(32, 16, 2)
    base = baseline.of_run(settings)
    rtt = base["http_rtt"]["p50"]
    closed: list[dict[str, Any]] = []
    open_: list[dict[str, Any]] = []
    raw: list[list[Any]] = []
    for mode in modes:
        with h.cluster(settings, *([] if mode == "on" else ["--no-cache"])) as c:
            h.run_load(c.url, 2, MIX, count=10)  # warm up
            for n in h.progress(settings, counts, desc=f"closed loop, cache {mode}"):
                rec = h.run_load(c.url, n, MIX, duration=duration, seed=n)
                point = {"cache": mode, "clients": n, "ops_per_s": rec.throughput(), "errors": rec.errors(),
                         "all": rec.stats(), **{op: rec.stats(op) for op in MIX}}
                point["e2e_p50_ms"] = sum(point[op]["p50"] or 0 for op in MIX)
                closed.append(point)
                raw += rec.rows(loop="closed", cache=mode, clients=n, rate="")
            peak = max(p["ops_per_s"] for p in closed if p["cache"] == mode)
            for f in h.progress(settings, fractions, desc=f"open loop, cache {mode}"):
                rate = max(1.0, f * peak)
                rec = h.run_load(c.url, open_senders, MIX, duration=duration, rate=rate, seed=int(f * 100))
                open_.append({"cache": mode, "fraction": f, "offered_per_s": rate, "ops_per_s": rec.throughput(),
                              "errors": rec.errors(), "all": rec.stats(), **{op: rec.stats(op) for op in MIX}})
                raw += rec.rows(loop="open", cache=mode, clients=open_senders, rate=round(rate, 2))
    h.save_csv(settings, "concurrency_raw", h.Records.header("loop", "cache", "clients", "rate"), raw)

    fig, (a1, a2) = h.figure(1, 2, figsize=(13, 5))
    for mode in modes:
        pts = [p for p in closed if p["cache"] == mode]
        xs = [p["clients"] for p in pts]
        for q, ls in (("p50", "-"), ("p95", "--"), ("p99", ":")):
            a1.plot(xs, [p["all"][q] for p in pts], ls=ls, marker="o", label=f"cache {mode} {q}")
        a2.plot(xs, [p["ops_per_s"] for p in pts], marker="o", label=f"cache {mode}")
    a1.axhline(rtt, color="k", lw=0.8, ls="-.", label="bare HTTP p50")
    a1.set(xscale="log", yscale="log", xlabel="concurrent client processes", ylabel="latency (ms)",
           title="Closed loop, mixed workload: latency percentiles")
    a1.legend(fontsize="small")
    bl = base["http_closed_loop"]
    a2.axhline(bl["ops_per_s"], color="k", lw=0.8, ls="-.", label=f"bare HTTP ({bl['clients']} clients)")
    a2.set(xscale="log", xlabel="concurrent client processes", ylabel="successful requests / s",
           title="Closed loop: aggregate throughput")
    a2.legend()
    p1 = h.save_plot(settings, fig, "concurrency_closed")

    fig, ax = h.figure()
    for mode in modes:
        pts = [p for p in open_ if p["cache"] == mode]
        for q, ls in (("p50", "-"), ("p99", ":")):
            ax.plot([p["offered_per_s"] for p in pts], [p["all"][q] for p in pts], ls=ls, marker="o",
                    label=f"cache {mode} {q}")
    ax.set(yscale="log", xlabel="offered rate (requests / s, scheduled in advance)",
           ylabel="latency from scheduled send (ms)", title=f"Open loop, {open_senders} sender processes")
    ax.legend()
    p2 = h.save_plot(settings, fig, "concurrency_open")

    rows = [["closed", f"cache {p['cache']}", p["clients"], p["ops_per_s"], p["all"]["p50"], p["all"]["p95"],
             p["all"]["p99"], p["buy"]["p50"], p["errors"], h.ratio(p["all"]["p50"], rtt),
             h.ratio(p["ops_per_s"], bl["ops_per_s"])] for p in closed]
    rows += [["open", f"cache {p['cache']}", f"{p['offered_per_s']:.0f}/s", p["ops_per_s"], p["all"]["p50"],
              p["all"]["p95"], p["all"]["p99"], p["buy"]["p50"], p["errors"], h.ratio(p["all"]["p50"], rtt),
              h.ratio(p["ops_per_s"], bl["ops_per_s"])] for p in open_]
    comp = []
    for n, (s1, s2) in STUDY.items():
        for mode, sv in (("on", s1), ("off", s2)):
            ours = next((p for p in closed if p["clients"] == n and p["cache"] == mode), None)
            comp.append([n, f"cache {mode}", sv * 1000, ours["e2e_p50_ms"] if ours else None])
    return {"path": h.save(settings, "concurrency", {
        "title": "4. Concurrency",
        "description": f"Client processes (a forked pool, one closed loop each) send a mix of {MIX} for "
                       f"{duration:g} s per point; then an open loop of {open_senders} sender processes at fixed "
                       f"offered rates ({', '.join(f'{f:g}' for f in fractions)} x the closed-loop peak), latency "
                       "counted from each request's scheduled send time. Default cluster (3 replicas, 1 frontend x 2 "
                       "workers); cache off is `--no-cache`. On this machine the clients share the cores with the "
                       "cluster.",
        "params": {"clients": counts, "duration_s": duration, "mix": MIX, "fractions": fractions},
        "baseline": base, "summary": {"closed": closed, "open": open_},
        "table": {"columns": ["loop", "cache", "clients / offered", "ok req/s", "p50 ms", "p95 ms", "p99 ms",
                              "buy p50 ms", "errors", "p50 / bare p50", "req/s / bare req/s"], "rows": rows},
        "comparison": {"columns": ["clients", "cache", "study end-to-end ms", "Pygmy search+lookup+buy p50 ms"],
                       "rows": comp},
        "plots": [p1, p2]})}


def main(argv: list[str] | None = None) -> None:
    h.cli("concurrency", run, argv)


if __name__ == "__main__":
    main()
