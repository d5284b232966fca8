"""6. Failover under load: SIGKILL the catalog leader, the order leader, a follower (``pygmy kill``).

Client processes run a mixed closed loop; the experiment kills the victim one second in, then polls
the surviving replicas' ``/status`` every few milliseconds. Detection: a survivor has left the old
term or stopped following the victim (it noticed the leader is gone). Switch-over: a survivor is
leader in a newer term. Buy unavailability window: the longest stretch after the kill with no buy
completing successfully (so it includes an ordinary gap between buys, shown as the pre-kill gap).
The kill instant is the first refused TCP connection to the victim's port (probed every ~2 ms while
``pygmy kill`` runs, since the command's own start-up takes a variable fraction of a second).
After each trial the victim is restarted with ``pygmy start`` and the tier waited on until caught up.

With ``pause`` a trial SIGSTOPs the victim's process group instead (a stalled machine, not a dead
one: its sockets stay open and accept connections nobody answers) and SIGCONTs it ``pause`` seconds
later; the pause instant is the signal itself, and the victim rejoins without a restart.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from typing import Any

import numpy as np
import requests

from pygmy.cluster import launcher
from pygmy.experiments import baseline
from pygmy.experiments import harness as h

SCENARIOS = ("catalog-leader", "order-leader", "catalog-follower", "catalog-leader-paused", "order-leader-paused")
#: Seconds a ``-paused`` scenario SIGSTOPs its victim for (issue #10: buys go on within 1 s of it).
PAUSE = 2.0
MIX = {"search": 0.2, "lookup": 0.4, "buy": 0.4}
MAX_RUN = 60.0
SWITCH_TIMEOUT = 10.0
STUDY = {"catalog-leader": (4.98, 535.3), "order-leader": (9.33, 1073.9)}  # switch-over ms, recovery ms


def watch_port(port: int, gone: list[float], until: float) -> None:
    """Append the wall time at which ``port`` first refuses a connection (the victim's sockets closed)."""
    while time.time() < until:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.05):
                pass
        except OSError:
            gone.append(time.time())
            return
        time.sleep(0.002)


def _poll(c: Any, survivors: list[str], victim: str, old_term: int, start_at: float, until: float,
          session: requests.Session) -> dict[str, float | None]:
    headers = {"Authorization": f"Bearer {c.secret()}"}
    detect = switch = None
    new_leader = None
    while time.time() < until and switch is None:
        for name in survivors:
            try:
                s = session.get(c.replica_url(name) + "/status", headers=headers, timeout=0.25).json()
            except (requests.RequestException, ValueError):
                continue
            now = time.time() - start_at
            if detect is None and (s.get("term", 0) > old_term or s.get("role") != "follower"
                                   or s.get("leader") not in (victim,)):
                detect = now
            if s.get("role") == "leader" and s.get("term", 0) > old_term:
                switch, new_leader = now, name
                break
        time.sleep(0.005)
    return {"detect": detect, "switch": switch, "new_leader": new_leader}


def trial(c: Any, scenario: str, clients: int, pre: float, post: float, seed: int,
          pause: float | None = None) -> dict[str, Any]:
    """One kill (or, with ``pause``, one SIGSTOP for that many seconds) of the scenario's victim under load."""
    tier, which = scenario.split("-")[:2]
    st = h.tier_status(c, tier)
    lead = st["leader"]
    names = [r["name"] for r in st["replicas"]]
    if not lead:
        raise RuntimeError(f"{tier} has no leader before the trial: {st}")
    victim = lead if which == "leader" else next(n for n in names if n != lead)
    survivors = [n for n in names if n != victim]
    lead_status = h.replica_status(c, lead) or {}
    old_term = int(lead_status.get("term", 0))
    ev: dict[str, Any] = {"tier": tier, "victim": victim, "old_leader": lead, "old_term": old_term,
                          "fault": f"SIGSTOP {pause:g} s" if pause else "SIGKILL"}
    resumed = threading.Event()
    resumer: list[threading.Thread] = []

    def resume_after(pgid: int, delay: float) -> None:
        resumed.wait(delay)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGCONT)
        resumed.set()

    def inject(start_at: float, stop: Any) -> None:
        time.sleep(max(0.0, start_at + pre - time.time()))
        ev["kill_sent"] = time.time() - start_at
        if pause:
            pgid = c.process_groups()[victim]
            launcher.pause(pgid)  # every thread stopped, not only signalled
            ev["kill"] = ev["kill_returned"] = time.time() - start_at
            resumer.append(threading.Thread(target=resume_after, args=(pgid, pause), daemon=True))
            resumer[0].start()
            stop(ev["kill"] + post)
            if which == "leader":
                with requests.Session() as s:
                    ev.update(_poll(c, survivors, victim, old_term, start_at,
                                    start_at + ev["kill"] + SWITCH_TIMEOUT, s))
            return
        port = int(c.replica_url(victim).rsplit(":", 1)[1])
        gone: list[float] = []
        watcher = threading.Thread(target=watch_port, args=(port, gone, time.time() + 10), daemon=True)
        watcher.start()
        c.kill(victim)
        watcher.join()
        ev["kill_returned"] = time.time() - start_at
        ev["kill"] = (gone[0] if gone else time.time()) - start_at
        stop(ev["kill"] + post)  # the load runs until `post` seconds after the kill, however slow the kill was
        if which == "leader":
            with requests.Session() as s:
                ev.update(_poll(c, survivors, victim, old_term, start_at, start_at + ev["kill"] + SWITCH_TIMEOUT, s))

    # ``pygmy kill`` itself takes a variable time to start: the load is stopped ``post`` s after the kill.
    try:
        rec = h.run_load(c.url, clients, MIX, duration=pre + MAX_RUN + post, seed=seed, on_start=inject)
    finally:
        resumed.set()  # whatever happened, a paused victim is resumed (at once if the trial failed)
        for t in resumer:
            t.join()
    t_kill = ev["kill"]
    buys = rec.select("buy")
    done = np.sort(rec.start[buys] + rec.latency[buys])
    after = np.concatenate([[t_kill], done[done > t_kill], [max(rec.wall, t_kill)]])
    before = done[done <= t_kill]
    ev.update({
        "detection_ms": (ev["detect"] - t_kill) * 1000 if ev.get("detect") is not None else None,
        "switch_ms": (ev["switch"] - t_kill) * 1000 if ev.get("switch") is not None else None,
        "buy_window_ms": float(np.max(np.diff(after))) * 1000,
        "pre_kill_max_gap_ms": float(np.max(np.diff(before))) * 1000 if before.size > 1 else None,
        "errors": {op: int(rec.select(op, ok=False).sum()) for op in MIX},
        "requests": int(rec.op.size),
        "max_latency_ms": {op: (float(rec.latency[rec.select(op)].max()) * 1000 if rec.select(op).any() else None)
                           for op in MIX},
    })
    # Put the cluster back as it was: the victim restarted (or resumed) and caught up.
    if not pause:
        c.restart(victim)
    h.wait_caught_up(c, tier, timeout=90)
    h.leader(c, "catalog")
    h.leader(c, "order")
    return {"event": ev, "records": rec}


def timeline_plot(settings: h.Settings, trials: dict[str, dict[str, Any]]) -> str:
    fig, axes = h.figure(len(trials), 1, figsize=(11, 3.6 * len(trials)), squeeze=False)
    for ax, (scenario, t) in zip(axes[:, 0], trials.items(), strict=True):
        rec, ev = t["records"], t["event"]
        for op, color in (("search", "tab:green"), ("lookup", "tab:blue"), ("buy", "tab:orange")):
            ok = rec.select(op)
            ax.scatter(rec.start[ok], rec.latency[ok] * 1000, s=4, c=color, label=op)
            bad = rec.select(op, ok=False)
            if bad.any():
                ax.scatter(rec.start[bad], rec.latency[bad] * 1000, s=30, marker="x", c="red",
                           label=f"{op} failed")
        ax.axvline(ev["kill"], color="k", lw=1.2, label=f"{ev.get('fault', 'SIGKILL')} {ev['victim']}")
        if ev.get("detect") is not None:
            ax.axvline(ev["detect"], color="tab:purple", ls=":", lw=1.2, label="detected")
        if ev.get("switch") is not None:
            ax.axvline(ev["switch"], color="tab:red", ls="--", lw=1.2, label=f"new leader {ev['new_leader']}")
        ax.set(yscale="log", xlabel="time since load start (s; x = request sent)", ylabel="latency (ms)",
               title=f"{ev.get('fault', 'SIGKILL')} of the {scenario.removesuffix('-paused').replace('-', ' ')} "
                     "under load")
        ax.legend(fontsize="small", ncol=3, loc="upper right")
    return h.save_plot(settings, fig, "failover_timeline")


def distribution_plot(settings: h.Settings, events: list[dict[str, Any]], scenarios: list[str]) -> str:
    fig, axes = h.figure(1, 3, figsize=(14, 4.8))
    for ax, key, title in zip(axes, ("detection_ms", "switch_ms", "buy_window_ms"),
                              ("failure detection", "switch-over (new leader)", "buy unavailability window"),
                              strict=True):
        data = [[e[key] for e in events if e["scenario"] == s and e[key] is not None] for s in scenarios]
        for i, d in enumerate(data):
            ax.scatter(np.full(len(d), i + 1) + np.random.default_rng(i).uniform(-0.08, 0.08, len(d)), d, s=14,
                       alpha=0.7)
        ax.boxplot([d or [np.nan] for d in data], tick_labels=[s.replace("-", "\n") for s in scenarios])
        ax.set(ylabel="ms after the kill", title=f"{title} ({max(len(d) for d in data)} trials)")
    return h.save_plot(settings, fig, "failover_distributions")


def run(settings: h.Settings, scenarios: list[str] | None = None, trials: int | None = None) -> dict[str, Any]:
    scenarios = scenarios or settings.size(list(SCENARIOS), list(SCENARIOS), ["catalog-leader"])
    trials = trials or settings.size(10, 2, 1)
    clients = settings.size(4, 4, 2)
    pre, post = 1.0, settings.size(4.0, 3.0, 2.0)
    base = baseline.of_run(settings)
    events: list[dict[str, Any]] = []
    first: dict[str, dict[str, Any]] = {}
    raw: list[list[Any]] = []
    with h.cluster(settings) as c:
        h.run_load(c.url, 2, MIX, count=10)
        for scenario in scenarios:
            pause = PAUSE if scenario.endswith("-paused") else None
            for k in h.progress(settings, range(trials), desc=scenario):
                t = trial(c, scenario, clients, pre, post + (pause or 0), seed=k, pause=pause)
                events.append({"scenario": scenario, "trial": k, **t["event"]})
                raw += t["records"].rows(scenario=scenario, trial=k)
                first.setdefault(scenario, t)
    h.save_csv(settings, "failover_raw", h.Records.header("scenario", "trial"), raw)
    p1 = timeline_plot(settings, first)
    p2 = distribution_plot(settings, events, scenarios)

    def med(s: str, key: str) -> float | None:
        v = [e[key] for e in events if e["scenario"] == s and e[key] is not None]
        return float(np.median(v)) if v else None

    def pct(s: str, key: str, q: float) -> float | None:
        v = [e[key] for e in events if e["scenario"] == s and e[key] is not None]
        return float(np.percentile(v, q)) if v else None

    summary = {s: {"trials": sum(e["scenario"] == s for e in events),
                   "no_new_leader": sum(e["scenario"] == s and e["switch_ms"] is None for e in events)
                   if "-leader" in s else None,
                   **{f"{key}_{q}": pct(s, key, q) for key in ("detection_ms", "switch_ms", "buy_window_ms")
                      for q in (50, 90, 100)},
                   "failed_buys": sum(e["errors"]["buy"] for e in events if e["scenario"] == s),
                   "failed_reads": sum(e["errors"]["search"] + e["errors"]["lookup"] for e in events
                                       if e["scenario"] == s),
                   "pre_kill_gap_ms_50": med(s, "pre_kill_max_gap_ms")} for s in scenarios}
    rows = [[s, v["trials"], v["detection_ms_50"], v["switch_ms_50"], v["switch_ms_100"], v["buy_window_ms_50"],
             v["buy_window_ms_100"], v["pre_kill_gap_ms_50"], v["failed_buys"], v["failed_reads"]]
            for s, v in summary.items()]
    comp = [[s, STUDY[s][0], summary[s]["detection_ms_50"], summary[s]["switch_ms_50"], summary[s]["buy_window_ms_50"]]
            for s in scenarios if s in STUDY]
    return {"path": h.save(settings, "failover", {
        "title": "6. Failover under load",
        "description": f"{clients} client processes run a closed loop of {MIX}; at {pre:g} s the "
                       f"victim gets SIGKILL via `pygmy kill` (`-paused`: SIGSTOP to its process group, "
                       f"SIGCONT {PAUSE:g} s later, no restart); the load goes on {post:g} s after the kill "
                       f"({post + PAUSE:g} s after a pause). "
                       "Survivors' /status is polled every ~5 ms. Then the "
                       f"victim is restarted (`pygmy start`) and caught up before the next trial. {trials} trial(s) "
                       "per scenario; medians and maxima over trials. 3 replicas per tier.",
        "params": {"scenarios": scenarios, "trials": trials, "clients": clients, "pre_s": pre, "post_s": post,
                   "mix": MIX},
        "baseline": base, "summary": summary, "events": events,
        "table": {"columns": ["scenario", "trials", "detection p50 ms", "switch-over p50 ms", "switch-over max ms",
                              "buy window p50 ms", "buy window max ms", "pre-kill buy gap p50 ms", "failed buys",
                              "failed reads"], "rows": rows},
        "comparison": {"columns": ["scenario", "study detection + switch-over ms", "Pygmy detection p50 ms",
                                   "Pygmy switch-over p50 ms", "Pygmy buy window p50 ms"], "rows": comp,
                       "note": "The study delayed a request by 10 s and measured the client switching to another "
                               "replica; Pygmy elects a new leader (Raft), so its switch-over includes the election "
                               "timeout."},
        "plots": [p1, p2]})}


def main(argv: list[str] | None = None) -> None:
    h.cli("failover", run, argv)


if __name__ == "__main__":
    main()
