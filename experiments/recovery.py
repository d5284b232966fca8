"""7. Recovery: a follower is down while K commands commit; how long until it has caught up?

Catalog tier: K stock updates (one command each) through the frontend while a catalog follower is
killed (``pygmy kill``). Then ``pygmy start``; we time from issuing the start until the replica's own
``/status`` reports ``applied_index`` at the leader's commit index taken just before the restart.
Also reported: when it first answered ``/status`` (process start-up) and the catch-up rate.
"""

from __future__ import annotations

import math
import time
from typing import Any

from pygmy.experiments import baseline
from pygmy.experiments import harness as h

STUDY_MS = {"catalog": 535.3, "order": 1073.9}


def catch_up(c: Any, k: int, clients: int, timeout: float) -> dict[str, Any]:
    st = h.tier_status(c, "catalog")
    lead = st["leader"]
    victim = next(r["name"] for r in st["replicas"] if r["name"] != lead)
    h.wait_caught_up(c, "catalog")
    at_kill = (h.replica_status(c, victim) or {}).get("applied_index", 0)
    snapshots = h.snapshots_installed(c, victim)
    c.kill(victim)
    per = math.ceil(k / clients)
    rec = h.run_load(c.url, clients, {"update": 1.0}, count=per, token=c.admin_token(), seed=k)
    target = (h.replica_status(c, h.leader(c, "catalog"), timeout=2) or {}).get("commit_index")
    if target is None:
        raise RuntimeError("cannot read the catalog leader's commit index")
    t0 = time.perf_counter()
    c.restart(victim)
    started = time.perf_counter() - t0
    up = caught = None
    last: dict[str, Any] | None = None
    while time.perf_counter() - t0 < timeout:
        s = h.replica_status(c, victim, timeout=1)
        if s is not None:
            last = s
            if up is None:
                up = time.perf_counter() - t0
            if s.get("applied_index", -1) >= target:
                caught = time.perf_counter() - t0
                break
        time.sleep(0.005)
    # The log line follows the install by microseconds; a status may show the state a moment before.
    settle = time.perf_counter() + 0.5
    while caught is not None and h.snapshots_installed(c, victim) == snapshots and time.perf_counter() < settle:
        time.sleep(0.02)
    if caught is None:
        raise RuntimeError(f"{victim} did not catch up to {target} within {timeout} s; last status {last}\n"
                           f"{c.logs_tail(victim)}")
    return {"k": k, "victim": victim, "updates_ok": int(rec.select("update").sum()), "update_errors": rec.errors(),
            "missed": target - at_kill, "start_cmd_s": started, "first_status_s": up, "caught_up_s": caught,
            "catch_up_after_start_s": caught - (up or 0), "load_ops_per_s": rec.throughput(),
            # The leader kept fewer entries than it missed (a small state costs less to copy than the
            # entries cost to replay: ReplicationConfig.replay_bytes_per_entry), so it got the state.
            "by_snapshot": h.snapshots_installed(c, victim) > snapshots}


def run(settings: h.Settings, ks: list[int] | None = None) -> dict[str, Any]:
    ks = ks or settings.size([100, 1000, 10_000, 100_000], [100, 1000], [20])
    clients = settings.size(8, 4, 2)
    base = baseline.of_run(settings)
    points = []
    with h.cluster(settings) as c:
        for k in h.progress(settings, ks, desc="recovery"):
            points.append(catch_up(c, k, clients, timeout=120 + k / 100))
    rows = [[p["k"], p["missed"], p["start_cmd_s"] * 1000, p["first_status_s"] * 1000, p["caught_up_s"] * 1000,
             "snapshot" if p["by_snapshot"] else "log",
             p["missed"] / p["caught_up_s"], h.ratio(p["caught_up_s"] * 1000, base["sqlite_commit"]["p50"] * p["missed"])]
            for p in points]

    fig, ax = h.figure()
    ax.plot([p["missed"] for p in points], [p["caught_up_s"] for p in points], marker="o",
            label="restart issued -> applied_index = leader commit")
    ax.plot([p["missed"] for p in points], [p["first_status_s"] for p in points], marker="s", ls=":",
            label="restart issued -> first /status answer")
    ax.set(xscale="log", yscale="log", xlabel="commands missed while down (log)", ylabel="time (s)",
           title="Catalog follower catch-up time against missed commands")
    ax.legend()
    plot = h.save_plot(settings, fig, "recovery")
    return {"path": h.save(settings, "recovery", {
        "title": "7. Recovery and catch-up",
        "description": f"A catalog follower is SIGKILLed (`pygmy kill`); {clients} client processes then commit K "
                       "stock updates through the frontend; the follower is restarted (`pygmy start`) and its "
                       "/status polled every 5 ms until its applied_index reaches the leader's commit index read "
                       "just before the restart. 'missed' counts every command committed meanwhile (leader "
                       "no-ops included). A follower that missed more entries than the leader keeps (no more than cost less "
                       "to replay than the state costs to copy, ReplicationConfig.replay_bytes_per_entry) is sent "
                       "the state instead: 'caught up from' says which.",
        "params": {"k": ks, "clients": clients}, "baseline": base, "summary": points,
        "table": {"columns": ["K updates", "commands missed", "pygmy start ms", "first /status ms",
                              "caught up ms", "caught up from", "commands/s (overall)",
                              "caught up / (missed x SQLite commit p50)"], "rows": rows},
        "comparison": {"columns": ["measure", "study ms", "Pygmy ms"],
                       "rows": [["catalog recover + resync (study: ~100 requests missed)", STUDY_MS["catalog"],
                                 min(points, key=lambda p: abs(p["k"] - 100))["caught_up_s"] * 1000],
                                ["order recover + resync", STUDY_MS["order"], None]]},
        "plots": [plot]})}


def main(argv: list[str] | None = None) -> None:
    h.cli("recovery", run, argv)


if __name__ == "__main__":
    main()
