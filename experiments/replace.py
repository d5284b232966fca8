"""16. Replicas replaced under load (issue 37): a replica's host lost for good, or a leader retired,
and a new replica put in its place with ``pygmy member``, while clients update and buy.

A default cluster (3 replicas per tier, 1 frontend x 2 workers) on loopback. Clients send updates and
buys at a steady open-loop rate through the frontend (``wan.drive``). In each scenario, ``PRE`` s
into the load, the victim is SIGKILLed for good (``pygmy kill``; never restarted), or, for a
retired leader, left running; then an operator replaces it as ``pygmy.verify.hosts.replace`` does:
``pygmy member add`` (a learner at a new loopback address, standing for a new machine), ``pygmy
start``, wait until the leader's ``/members`` (what ``pygmy member list`` shows) has it caught up, ``promote``, ``remove`` (a leader
removed alive hands leadership over first, then it is stopped). The load goes on ``POST`` s after
the removal. Measured: the longest stretch with no acknowledged update, and with no acknowledged
buy, from the kill (or the first step) to the end, and how long each step took. Correctness under
the same procedure (Porcupine, lost and doubled buys, stock) is tested in
``tests/system/test_membership.py`` and by the nemesis' ``host-lost`` fault.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pygmy.cluster.local import LocalCluster, free_port_base
from pygmy.experiments import harness as h
from pygmy.experiments import wan
from pygmy.kit.config import ClusterConfig
from pygmy.verify import hosts
from pygmy.verify.chaos import leader_of

NAME = "replace"
#: (tier, victim: a follower, or the leader, and whether it is lost for good or retired alive).
SCENARIOS = (("catalog", "follower", True), ("catalog", "leader", True), ("order", "follower", True),
             ("order", "leader", True), ("order", "leader", False))
RATE = 40
PRE, POST = 2.0, 3.0
#: The issue's "done when": no gap over this on a LAN.
TARGET_GAP = 1.0


def victim(c: LocalCluster, tier: str, role: str) -> str:
    lead = leader_of(c.cluster_config(), tier)
    if lead is None:
        raise RuntimeError(f"{tier} has no leader")
    return lead if role == "leader" else sorted(n for n in c.cluster_config().peers(tier) if n != lead)[-1]


def scenario(c: LocalCluster, op: hosts.Operator, tier: str, role: str, lost: bool, new: str, host: str,
             seed: int) -> dict[str, Any]:
    old = victim(c, tier, role)
    steps: list[dict[str, Any]] = []
    marks: dict[str, float] = {}

    def act(start_at: float, stop: Any) -> None:
        try:
            time.sleep(max(0.0, start_at + PRE - time.time()))
            marks["begin"] = time.time() - start_at
            if lost:
                c.kill(old)
            hosts.replace(op, tier, old, new, hosts.free_address(host), c.restart, steps=steps)
            if not lost:
                c.kill(old)  # removed: it serves nothing now; the operator stops it
            marks["done"] = time.time() - start_at
        except Exception as exc:  # recorded; the load stops early
            marks["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            marks.setdefault("done", time.time() - start_at)
        stop(marks["done"] + POST)

    rec = wan.drive(c, 600.0, seed, on_start=act, rate=RATE)
    begin, end = marks.get("begin", PRE), marks["done"] + POST
    t0 = steps[0]["at"] if steps else 0
    return {"tier": tier, "victim": old, "role": role, "lost": lost, "new": new,
            "update": wan.gaps(rec, "update", begin, end), "buy": wan.gaps(rec, "buy", begin, end),
            "replace_s": marks["done"] - begin,
            "steps": [{"action": s["action"], "after_s": (s["at"] - t0) / 1e9} for s in steps],
            **({"error": marks["error"]} if "error" in marks else {})}


def table(points: list[dict[str, Any]]) -> dict[str, Any]:
    rows = [[p["tier"], f"{p['role']} ({'lost' if p['lost'] else 'retired'})", f"{p['victim']} -> {p['new']}",
             round(p["replace_s"], 2), round(p["update"]["longest_gap_s"], 2), round(p["buy"]["longest_gap_s"], 2),
             f"{p['update']['acked']}/{p['update']['sent']}", f"{p['buy']['acked']}/{p['buy']['sent']}",
             p.get("error", "")] for p in points]
    return {"columns": ["tier", "victim", "replaced", "replacement s", "longest update gap s",
                        "longest buy gap s", "updates acked/sent", "buys acked/sent", "error"], "rows": rows}


def run(settings: h.Settings) -> dict[str, Any]:
    started = time.monotonic()
    todo = list(settings.size(SCENARIOS, SCENARIOS, SCENARIOS[:2]))
    tmp = Path(tempfile.mkdtemp(prefix="pygmy-replace-"))
    points: list[dict[str, Any]] = []
    base = free_port_base()
    c = LocalCluster(tmp / "data", base, ["--books", str(h.write_books(tmp / "books.json"))])
    try:
        c.start(reset=True, timeout=180)
        h.wait_healthy(c)
        wan.ready(c)
        op = hosts.Operator(Path(c.data_dir), c.env)
        numbers = {"catalog": 4, "order": 4}
        for k, (tier, role, lost) in enumerate(h.progress(settings, todo, desc="replacements")):
            new = f"{tier}-{numbers[tier]}"
            numbers[tier] += 1
            points.append(scenario(c, op, tier, role, lost, new, f"127.0.0.{10 + k}", seed=100 + k))
            if settings.progress:
                p = points[-1]
                print(f"{tier} {role}: {p['victim']} -> {new} in {p['replace_s']:.1f} s, update gap "
                      f"{p['update']['longest_gap_s']:.2f} s, buy gap {p['buy']['longest_gap_s']:.2f} s"
                      + (f", ERROR {p['error']}" if "error" in p else ""), file=sys.stderr, flush=True)
            h.wait_caught_up(c, tier, timeout=60)
    finally:
        c.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    t = table(points)
    path = h.save(settings, NAME, {
        "title": "16. Replicas replaced under load",
        "description": (
            "Issue 37. A default cluster on loopback; clients send "
            f"{RATE // 2} updates and {RATE // 2} buys a second through the frontend, evenly spaced (an open loop). "
            f"{PRE:g} s in, a replica is SIGKILLed for good (or a leader is retired alive), and replaced by a new "
            "replica at a new loopback address with pygmy member add, pygmy start, promote once caught up, remove "
            f"(pygmy.verify.hosts.replace); the load goes on {POST:g} s after. Gaps: the longest stretch from the "
            "kill (or the first step) to the end with no acknowledged update (buy). Replacement: from the kill to "
            f"the removal. The issue's target: no gap over {TARGET_GAP:g} s on a LAN."),
        "params": {"rate": RATE, "pre_s": PRE, "post_s": POST, "scenarios": [list(s) for s in todo],
                   "config": {"catalog_replicas": ClusterConfig().catalog_replicas,
                              "order_replicas": ClusterConfig().order_replicas}},
        "results": {"points": points, "seconds": time.monotonic() - started},
        "table": t})
    for row in t["rows"]:
        print("  ".join(str(x) for x in row))
    return {"path": path}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pygmy.experiments.replace", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--results-dir", type=Path, default=h.RESULTS)
    p.add_argument("--plots-dir", type=Path, default=h.PLOTS)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    run(h.Settings(quick=a.quick, tiny=a.tiny, results_dir=a.results_dir, plots_dir=a.plots_dir,
                   progress=not a.no_progress))


if __name__ == "__main__":
    main()
