"""``make bench``: a shorter benchmark that prints medians and ratios to the same-run baseline.

It checks the goals of issue #10 loosely (prints met / not met; nothing here asserts a timing):
cached lookups reach >= 0.8x the bare endpoint's throughput and <= 1.0x its p50; a buy with 3
replicas stays within 8x a bare lookup's p50 (both also measured in blocks alternating with the bare
endpoint, which a drifting machine moves less); buys go on while a leader is killed or
paused for 2 s (no gap between successful buys over 1 s). Results also go to ``results/bench.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from pygmy.catalog.books import synthetic
from pygmy.experiments import baseline, breakdown, failover, invalidation, overload, recovery
from pygmy.experiments import harness as h

#: Issue #10: the longest gap without a successful buy while a leader is SIGKILLed or SIGSTOPped for 2 s.
PAUSE = 2.0


def _sequential(c: Any, op: str, n: int) -> dict[str, Any]:
    with c.client() as cl:
        call = {"lookup": lambda i: cl.lookup(1 + i % 7), "buy": lambda i: cl.buy(1 + i % 7)}[op]
        for i in range(10):
            call(i)
        return h.stats([h.timed(lambda: call(i))[0] for i in range(n)])  # noqa: B023


def _paired_lookups(c: Any, blocks: int, n: int, clients: int, duration: float) -> dict[str, Any]:
    """Cached lookups on the frontend and on the bare endpoint in alternating blocks (ABAB): each
    block's ratio is to the bare block beside it, so a machine that drifts between the start of the
    run and this part of it does not move the ratio. Sequential p50 (``baseline.paired_p50``) and
    closed-loop throughput."""
    with c.client() as front:
        p50 = baseline.paired_p50(lambda i: front.lookup(1 + i % 7), blocks, n)
    pairs: list[dict[str, float]] = []
    with baseline.server() as bare_url:
        for _ in range(blocks):
            rate = {name: h.run_load(url, clients, {"lookup": 1.0}, duration=duration).throughput()
                    for name, url in (("bare", bare_url), ("frontend", c.url))}
            pairs.append({"bare_ops_per_s": rate["bare"], "ops_per_s": rate["frontend"]})
    rate_ratio = [x["ops_per_s"] / x["bare_ops_per_s"] for x in pairs]
    return {"blocks": pairs, "p50_ratio": p50["ratio"], "p50_ratios": p50["ratios"], "bare_p50": p50["bare_p50"],
            "p50": p50["p50"], "ops_ratio": float(np.median(rate_ratio)), "ops_ratios": rate_ratio}


def _invalidation(c: Any, n: int) -> dict[str, Any]:
    lead = h.leader(c, "catalog")
    s0, n0 = invalidation.catalog_handler(c, lead)
    buy = _sequential(c, "buy", n)
    s1, n1 = invalidation.catalog_handler(c, lead)
    return {"decrement_mean_ms": (s1 - s0) / (n1 - n0) * 1000 if n1 > n0 else None, "buy": buy}


def _surge(settings: h.Settings) -> dict[str, Any]:
    """Issue #42's surge, shortened from ``experiments/overload.py`` (whose functions these are): on a
    1,000-book cluster, closed-loop capacity C, then buys offered open-loop at 3x C while two probes
    look books up every 50 ms (a random one: nearly always a cache miss; one of the first seven:
    cached), from before the surge until after it. Its outside checks are the experiment's, not here."""
    z = overload.Sizes.of(settings)
    with h.cluster(settings, books=synthetic(z.books, topics=overload.TOPICS, stock=overload.STOCK)) as c:
        normal, capacity = overload.normal_and_capacity(c, [c.url], z)
        cap = capacity["per_s"]
        fired, _, cpu = overload.surge(c, [c.url], z, cap, None)
    figures = overload.surge_figures(fired, z, cap, normal["buy"]["p50"])
    keep = ("seconds", "multiple", "offered_per_s", "goodput_per_s", "goodput_over_capacity", "shed_per_s", "errors",
            "noanswer", "accepted_p50_ms", "accepted_p99_ms", "shed_p99_ms", "lookups_failed", "lookup_before_p50_ms",
            "lookup_during_p50_ms", "lookup_ratio", "hot_lookup_before_p50_ms", "hot_lookup_during_p50_ms",
            "hot_lookup_ratio")
    return {"capacity_per_s": cap, "cluster_cpu_cores": cpu, **{k: figures[k] for k in keep}}


def run(settings: h.Settings) -> dict[str, Any]:
    n = settings.size(300, 100, 10)
    trials = settings.size(10, 10, 1)
    ks = settings.size([1000, 10_000], [1000, 10_000], [20])
    variants = not settings.tiny
    base = baseline.of_run(settings)
    bl, rtt = base["http_closed_loop"], base["http_rtt"]["p50"]
    out: dict[str, Any] = {"baseline": base}
    with h.cluster(settings) as c:
        _sequential(c, "lookup", 20)
        load = h.run_load(c.url, bl["clients"], {"lookup": 1.0}, duration=bl["duration_s"])
        out["cached_lookup"] = {"sequential": _sequential(c, "lookup", n), "ops_per_s": load.throughput(),
                                "loaded": load.stats(),
                                "paired": _paired_lookups(c, settings.size(5, 3, 1), max(30, n // 3), bl["clients"],
                                                          bl["duration_s"])}
        out["buy_3"] = _sequential(c, "buy", n)
        with c.client() as buyer:
            out["buy_3"]["paired"] = baseline.paired_p50(lambda i: buyer.buy(1 + i % 7), settings.size(5, 5, 1),
                                                         max(10, n // 5))
        # The buy's floor (docs/performance.md): one frontend request (the bare lookup beside it) and
        # two majority commits, each a frame round trip and one synced SQLite commit, measured now.
        parts = breakdown.floor_parts(settings.size(300, 200, 20), commit_ms=base["sqlite_commit"]["p50"])
        bare = out["buy_3"]["paired"]["bare_p50"]
        out["buy_3"]["floor"] = {**parts, "bare_lookup_ms": bare,
                                 "floor_ms": breakdown.floor_ms(bare, parts)}
        out["invalidation_1fe"] = _invalidation(c, n)
        windows: dict[str, list[float]] = {}
        for tier in ("catalog", "order"):
            for fault, pause in (("SIGKILL", None), (f"SIGSTOP {PAUSE:g} s", PAUSE)):
                for k in h.progress(settings, range(trials), desc=f"{fault} {tier} leader"):
                    ev = failover.trial(c, f"{tier}-leader", settings.size(4, 4, 2), 1.0, (pause or 0) + 2.0,
                                        seed=k, pause=pause)["event"]
                    windows.setdefault(f"{tier} leader {fault}", []).append(ev["buy_window_ms"])
        out["buy_window_ms"] = windows
        out["catch_up"] = [recovery.catch_up(c, k, settings.size(8, 4, 2), timeout=120 + k / 100) for k in ks]
    out["surge"] = _surge(settings)
    if variants:
        with h.cluster(settings, "--no-cache") as c:
            out["uncached_lookup"] = _sequential(c, "lookup", n)
        with h.cluster(settings, "--frontends", "2") as c:
            out["invalidation_2fe"] = _invalidation(c, n)
        for r in (1, 5):
            with h.cluster(settings, "--catalog-replicas", str(r), "--order-replicas", str(r)) as c:
                out[f"buy_{r}"] = _sequential(c, "buy", n)

    cl = out["cached_lookup"]
    pr = cl["paired"]

    def spread(values: list[float]) -> str:
        return f"{min(values):.2f}-{max(values):.2f}x over {len(values)} pairs"

    lines = [
        ("bare endpoint", f"p50 {rtt:.2f} ms sequential; {bl['ops_per_s']:.0f} req/s with {bl['clients']} clients"),
        ("SQLite synced commit", f"p50 {base['sqlite_commit']['p50']:.2f} ms"),
        ("cached lookup throughput", f"{cl['ops_per_s']:.0f} req/s = {cl['ops_per_s'] / bl['ops_per_s']:.2f}x bare"),
        ("cached lookup p50", f"{cl['sequential']['p50']:.2f} ms = {cl['sequential']['p50'] / rtt:.2f}x bare"),
        ("  alternating with the bare endpoint", f"throughput median {pr['ops_ratio']:.2f}x ({spread(pr['ops_ratios'])}; "
                                                 f"goal >= 0.8x: {'met' if pr['ops_ratio'] >= 0.8 else 'NOT met'})"),
        ("", f"p50 median {pr['p50_ratio']:.2f}x ({spread(pr['p50_ratios'])}; "
             f"goal <= 1.0x: {'met' if pr['p50_ratio'] <= 1.0 else 'NOT met'})"),
    ]
    if "uncached_lookup" in out:
        lines.append(("lookup, cache off, p50", f"{out['uncached_lookup']['p50']:.2f} ms = "
                                                f"{out['uncached_lookup']['p50'] / rtt:.2f}x bare"))
    for fe in (1, 2):
        inv = out.get(f"invalidation_{fe}fe")
        if inv:
            lines.append((f"catalog decrement incl. invalidation, {fe} frontend(s)",
                          f"mean {h.fmt(inv['decrement_mean_ms'])} ms per write; buy p50 {inv['buy']['p50']:.2f} ms"))
    for r in (1, 3, 5):
        b = out.get(f"buy_{r}")
        if b:
            goal = f" (goal <= 8x: {'met' if b['p50'] <= 8 * rtt else 'NOT met'})" if r == 3 else ""
            lines.append((f"buy p50, {r} replica(s)", f"{b['p50']:.2f} ms = {b['p50'] / rtt:.2f}x bare lookup{goal}"))
            if "paired" in b:
                bp = b["paired"]
                lines.append(("  alternating with the bare endpoint", f"median {bp['ratio']:.2f}x ({spread(bp['ratios'])}; "
                                                                      f"goal <= 8x: {'met' if bp['ratio'] <= 8 else 'NOT met'}; "
                                                                      f"#42: <= 3x: {'met' if bp['ratio'] <= 3 else 'NOT met'})"))
            if "floor" in b:
                fl = b["floor"]
                lines.append(("  against its floor", f"{b['p50'] / fl['floor_ms']:.2f}x the floor of {fl['floor_ms']:.2f} ms "
                                                     f"(bare lookup {fl['bare_lookup_ms']:.2f} + 2 x (frame round trip "
                                                     f"{fl['frame_rtt_ms']:.2f} + synced commit {fl['synced_commit_ms']:.2f}))"))
    sg = out["surge"]
    lines += [
        (f"{sg['multiple']:g}x C buy surge, {sg['seconds']:g} s", f"C = {sg['capacity_per_s']:.0f} buys/s closed-loop; goodput "
         f"{sg['goodput_over_capacity']:.2f} C (#42: >= 0.9), shed p99 {h.fmt(sg['shed_p99_ms'])} ms (<= 50), accepted "
         f"p50/p99 {h.fmt(sg['accepted_p50_ms'])}/{h.fmt(sg['accepted_p99_ms'])} ms, {sg['errors']} errors"),
        ("  cached lookups p50 during / before", f"{h.fmt(sg['hot_lookup_during_p50_ms'])} / {h.fmt(sg['hot_lookup_before_p50_ms'])} ms "
         f"= {h.fmt(sg['hot_lookup_ratio'])}x (#42: <= 2x: "
         f"{'met' if sg['hot_lookup_ratio'] is not None and sg['hot_lookup_ratio'] <= 2 else 'NOT met'}); "
         f"{sg['lookups_failed']} lookups failed"),
        ("  uncached lookups p50 during / before", f"{h.fmt(sg['lookup_during_p50_ms'])} / {h.fmt(sg['lookup_before_p50_ms'])} ms "
         f"= {h.fmt(sg['lookup_ratio'])}x"),
    ]
    for what, w in windows.items():
        lines.append((f"{what}: buy window", f"median {np.median(w):.0f} ms, max {max(w):.0f} ms over {len(w)} "
                                             f"trials (goal max <= 1000 ms: {'met' if max(w) <= 1000 else 'NOT met'})"))
    for p in out["catch_up"]:
        lines.append((f"catch-up, {p['k']:,} missed updates",
                      f"{p['caught_up_s'] * 1000:.0f} ms from `pygmy start`, "
                      f"{(p['caught_up_s'] - p['start_cmd_s']) * 1000:.0f} ms after it returned "
                      f"({p['missed']:,} commands, {'by a snapshot' if p['by_snapshot'] else 'from the log'}; "
                      f"goal for 10,000: < 1 s after it returned)"))
    width = max(len(k) for k, _ in lines)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in lines))
    h.save(settings, "bench", {"title": "Benchmark (make bench)", "description": "Medians and ratios to the same-run "
           "baseline; see experiments/bench.py.", "results": out,
           "table": {"columns": ["measure", "value"], "rows": [list(x) for x in lines]}, "plots": []})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pygmy.experiments.bench")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--results-dir", type=Path, default=h.RESULTS)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    run(h.Settings(quick=a.quick, results_dir=a.results_dir, progress=not a.no_progress))


if __name__ == "__main__":
    main()
