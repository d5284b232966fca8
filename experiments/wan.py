"""15. Replica links on a WAN (issue 37): a default cluster whose replicas of one tier talk over slow,
jittery and lossy links, link by link.

Every directed replica link of both tiers goes through a Toxiproxy proxy of its own from the start
(``pygmy.verify.links.ClusterLinks``, ``PYGMY_PEER_ADDRESSES``); frontends and the order tier's
routers keep direct links. For each tier in turn (catalog, then order), and each link shape, the
six links of that tier get the shape (latency each way, ± jitter, loss on the caller's hop with an
RTT-scaled retransmission timeout: see ``pygmy/verify/links.py`` for why and what it gets wrong), and
every connection through them is cut once so that connections have to be made across the new
links (``--keep-connections``: not). Once one leader has held its lease for ``STABLE`` s (the
timers have followed the switch; how long that took is recorded), updates and buys go through the frontend at
a steady open-loop rate, ``LEAD`` s and then a window of ``WINDOW`` s, while every replica's ``/status`` is
polled. Measured in the window: the longest stretch with no acknowledged update, and with no acknowledged
buy (window edges count),
new terms in the window (the tier's highest term at its end less at its start), the share of polls
in which the tier had no leader and in which its leader held its lease. Then, still on the slow
links and under the same load, the tier's leader gets SIGKILL (``pygmy kill``): the time until a
survivor leads in a newer term, and until an update and a buy are acknowledged again. Then the
links are made fast again, the victim restarted and caught up, and the next shape begins.

The whole grid runs once per timer mode (``--modes``), each on a fresh cluster: ``adaptive`` (the
default: timers follow the round trips a leader measures, ``pygmy/replication/timers.py``) and
``fixed`` (the LAN timers of ``ReplicationConfig``, kept as configured: ``PYGMY_RAFT_ADAPT=0`` in
the cluster's environment; it turns off only what the round trips ask for, not the core's election
backoff nor the window of twice a backed-off campaign a new leader keeps). Each point names its mode; the results name what a replica's
``/status`` said of the timers in force (``adapt``), and a cluster whose replicas report another
mode than the one asked for stops the run.

Everything runs in a network namespace of its own (the loss needs iptables rules and a sysctl),
which is deleted afterwards with whatever was left in it: needs root.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import requests

from pygmy.client.api import PygmyClient
from pygmy.cluster.local import LocalCluster, free_port_base
from pygmy.experiments import harness as h
from pygmy.experiments.failover import watch_port
from pygmy.kit.config import ClusterConfig
from pygmy.verify import links as wl
from pygmy.verify.links import LOOPBACK, Shape

NAME = "wan"
TIERS = ("catalog", "order")
WINDOW = 15.0
SETTLE = 2.0
#: After a shape is applied, the window waits (up to SETTLE_MAX s) until one leader has held its
#: lease for STABLE s: the timers fit the link, and the window measures the link, not the switch.
STABLE, SETTLE_MAX = 3.0, 60.0
#: The load runs this long before the window it is measured in: on a slow link a write takes a few
#: round trips, and the window's first acknowledgement must not be counted from its first request.
LEAD = 5.0
#: Updates and buys per second in all (half each), evenly spaced, in a true open loop.
RATE = 8
MIX = {"update": 0.5, "buy": 0.5}
CLIENT_TIMEOUT = 10.0
POLL = 0.2
#: Failover trial: the leader is killed this long after the load starts; the load goes on this long after.
PRE, POST = 2.0, 10.0
#: The issue's "done when": no gap over this between acknowledged updates or buys.
TARGET_GAP = 2.0
#: The timers under test, and what each adds to the cluster's environment.
MODES: dict[str, dict[str, str]] = {"adaptive": {}, "fixed": {"PYGMY_RAFT_ADAPT": "0"}}


def grid(rtts: Sequence[int], losses: Sequence[float]) -> list[Shape]:
    """Round trips (ms) by loss; jitter ±50 ms each way from 150 ms of round trip on (issue 37)."""
    return [Shape(rtt // 2, 50 if rtt >= 150 else 0, loss) for rtt in rtts for loss in losses]


#: The issue's two cases: links of 150 ms ±50 each way with 10% loss, and 300 ms ±50 each way with 5%.
ISSUE = (Shape(150, 50, 0.10), Shape(300, 50, 0.05))


def shapes(settings: h.Settings) -> list[Shape]:
    full = grid((1, 50, 150, 300), (0.0, 0.05, 0.10)) + [ISSUE[1]]
    quick = [LOOPBACK, Shape(75, 50, 0.0), *ISSUE]
    return settings.size(full, quick, [LOOPBACK, Shape(25, 0, 0.05)])


# -- the cluster ----------------------------------------------------------------------------------------
def timers(c: LocalCluster, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The timers in force: ``adaptive`` or ``fixed`` as a replica's ``/status`` says (``adapt``),
    with what it says of them; until it says (its first retune), what the cluster's environment
    ``env`` (over this process's) gives ``ReplicationConfig``, with the configured values."""
    from pygmy.replication.node import ReplicationConfig

    st = h.replica_status(c, "catalog-1", timeout=2) or {}
    given = st.get("timers")
    if isinstance(given, dict) and "adapt" in given:
        return {"mode": "adaptive" if given["adapt"] else "fixed", "status": given}
    cfg = ReplicationConfig.from_env({**os.environ, **(env or {})})
    tick = cfg.tick_ms
    out: dict[str, Any] = {"mode": "adaptive" if cfg.adapt else "fixed", "tick_ms": tick}
    with contextlib.suppress(AttributeError, TypeError):
        out.update({"heartbeat_ms": cfg.heartbeat_ticks * tick,
                    "election_ms": [cfg.election_ticks_min * tick, cfg.election_ticks_max * tick],
                    "lease_ms": cfg.effective_lease_ticks() * tick, "connect_timeout_s": cfg.connect_timeout,
                    "send_timeout_s": cfg.send_timeout})
    return out


def ready(c: LocalCluster, timeout: float = 90) -> float:
    """Until both tiers lead and an update and a buy are acknowledged; the seconds it took."""
    t0 = time.monotonic()
    last: Any = None
    with c.client(timeout=5) as cl:
        while time.monotonic() - t0 < timeout:
            try:
                cl.update(1, stock_delta=1)
                cl.buy(1)
                return time.monotonic() - t0
            except h.PygmyError as exc:
                last = exc
                time.sleep(0.2)
    raise RuntimeError(f"the cluster did not take writes again within {timeout:.0f} s: {last}\n{c.logs_tail()}")


class Poller:
    """Every replica's ``/status`` every ``POLL`` s, on a thread: (round, t after ``start_at``, name,
    term, role, leader lease) per answer."""

    def __init__(self, c: LocalCluster, names: list[str], start_at: float) -> None:
        self.urls = {n: c.replica_url(n) for n in names}
        self.headers = {"Authorization": f"Bearer {c.secret()}"}
        self.start_at = start_at
        self.samples: list[tuple[int, float, str, int, str, bool]] = []
        self.windows: dict[tuple[int, str], float | None] = {}  # (round, name) -> its election window, ms
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with requests.Session() as s:
            k = 0
            while not self._stop.is_set():
                for name, url in self.urls.items():
                    try:
                        st = s.get(url + "/status", headers=self.headers, timeout=0.5).json()
                        self.samples.append((k, time.time() - self.start_at, name, int(st["term"]), str(st["role"]),
                                             bool(st.get("leader_lease"))))
                        self.windows[(k, name)] = (st.get("timers") or {}).get("election_ms")
                    except (requests.RequestException, ValueError, KeyError, TypeError):
                        continue
                k += 1
                self._stop.wait(POLL)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def tier(self, tier: str, start: float = float("-inf"), end: float = float("inf")) -> dict[str, Any]:
        """New terms, and the shares of poll rounds with no leader and with a leader holding its lease."""
        mine = [x for x in self.samples if x[2].startswith(tier + "-") and start <= x[1] <= end]
        if not mine:
            return {"new_terms": None, "no_leader_share": None, "lease_share": None, "polls": 0}
        rounds: dict[int, list[tuple[int, float, str, int, str, bool]]] = {}
        for x in mine:
            rounds.setdefault(x[0], []).append(x)
        ordered = [rounds[k] for k in sorted(rounds)]
        leaders = [[x for x in r if x[4] == "leader"] for r in ordered]
        return {"new_terms": max(x[3] for x in ordered[-1]) - max(x[3] for x in ordered[0]),
                "no_leader_share": sum(not ls for ls in leaders) / len(ordered),
                "lease_share": sum(any(x[5] for x in ls) for ls in leaders) / len(ordered), "polls": len(ordered)}

    def timeline(self) -> list[list[Any]]:
        """Per poll round: seconds after ``start_at``, then each replica's ``name term role window_ms``
        (role L, F or C): how leadership and the election window moved."""
        rounds: dict[int, list[Any]] = {}
        for k, t, name, term, role, _ in self.samples:
            window = self.windows.get((k, name))
            rounds.setdefault(k, [round(t, 2)]).append(
                f"{name} {term} {role[:1].upper()} {'-' if window is None else f'{window:g}'}")
        return [rounds[k] for k in sorted(rounds)]

    def switch(self, tier: str, old_term: int, after: float) -> float | None:
        """When (after ``start_at``) a replica of ``tier`` first led in a term newer than ``old_term``."""
        return next((x[1] for x in self.samples if x[2].startswith(tier + "-") and x[4] == "leader"
                     and x[3] > old_term and x[1] >= after), None)


def gaps(rec: h.Records, op: str, start: float, end: float) -> dict[str, Any]:
    """The longest stretch of [start, end] with no acknowledged ``op`` (the edges count), and counts."""
    ok = rec.select(op)
    done = np.sort(rec.start[ok] + rec.latency[ok])
    inside = done[(done >= start) & (done <= end)]
    edges = np.concatenate([[start], inside, [end]])
    sent = rec.select(op, ok=None) & (rec.start >= start) & (rec.start < end)
    failed = rec.select(op, ok=False) & sent
    lat = rec.latency[ok & (rec.start >= start) & (rec.start < end)]
    return {"longest_gap_s": float(np.max(np.diff(edges))), "acked": int(inside.size), "sent": int(sent.sum()),
            "failed": int(failed.sum()), "statuses": sorted({int(s) for s in rec.status[failed]}),
            "p50_ms": float(np.median(lat) * 1000) if lat.size else None,
            "max_ms": float(np.max(lat) * 1000) if lat.size else None}


def drive(c: LocalCluster, duration: float, seed: int, on_start: Any = None, rate: int = RATE) -> h.Records:
    """``rate // 2`` updates and as many buys a second, evenly spaced, for ``duration`` s: a true open
    loop (each request on a thread of its own at its scheduled time, whatever the others are doing;
    its start is that time). ``on_start(start_at, stop)`` as ``harness.run_load``'s."""
    start_at = time.time() + 0.2
    end = [duration]
    rows: list[tuple[str, float, float, int]] = []
    lock = threading.Lock()
    local = threading.local()
    token = c.admin_token()
    url = c.cluster_config().frontend_url(1)
    rng = random.Random(seed)

    def one(op: str, scheduled: float, item: int) -> None:
        cl = getattr(local, "client", None)
        if cl is None:
            cl = local.client = PygmyClient(url, timeout=CLIENT_TIMEOUT, token=token)
        status = 200
        try:
            if op == "buy":
                cl.buy(item, key=uuid.uuid4().hex)
            else:
                cl.update(item, stock_delta=1)
        except h.PygmyError as exc:
            status = exc.status
        with lock:
            rows.append((op, scheduled, time.time() - start_at - scheduled, status))

    every = 2 / rate
    schedule = sorted((k * every + (every / 2 if op == "buy" else 0.0), op) for op in MIX
                      for k in range(int(duration / every) + 1))
    with ThreadPoolExecutor(max_workers=int(rate * (CLIENT_TIMEOUT + 2)), thread_name_prefix="wan-load") as pool:
        if on_start is not None:
            threading.Thread(target=on_start, args=(start_at, lambda t: end.__setitem__(0, min(end[0], t))),
                             daemon=True).start()
        for scheduled, op in schedule:
            if scheduled >= end[0]:
                break
            time.sleep(max(0.0, start_at + scheduled - time.time()))
            if scheduled >= end[0]:
                break
            pool.submit(one, op, scheduled, rng.randint(1, 7))
    rows.sort(key=lambda r: r[1])
    if not rows:
        return h.Records(np.array([], str), np.array([]), np.array([]), np.array([], int), start_at, 0.0)
    op, start, lat, status = (np.array(col) for col in zip(*rows, strict=True))
    return h.Records(op, start, lat, status.astype(int), start_at, float(np.max(start + lat)))



def window(c: LocalCluster, tier: str, seed: int, seconds: float, lead: float = LEAD) -> dict[str, Any]:
    """The steady load for ``seconds``: gaps, terms, leadership."""
    names = list(c.cluster_config().peers(tier))
    polls: list[Poller] = []
    rec = drive(c, lead + seconds, seed, on_start=lambda start_at, stop: polls.append(Poller(c, names, start_at)))
    polls[0].stop()
    end = lead + seconds
    leadership = polls[0].tier(tier, lead, end)
    quiet = not leadership["new_terms"] and not leadership["no_leader_share"]
    return {"seconds": seconds, "update": gaps(rec, "update", lead, end), "buy": gaps(rec, "buy", lead, end),
            **leadership, "tail_s": max(0.0, rec.wall - end),
            # Kept where leadership moved: what moved, when, and with which windows.
            **({} if quiet else {"timeline": polls[0].timeline()})}


def failover(c: LocalCluster, tier: str, seed: int) -> dict[str, Any]:
    """SIGKILL of the tier's leader under the same load; the victim is left down (``restore`` restarts it)."""
    names = list(c.cluster_config().peers(tier))
    try:
        lead = h.leader(c, tier, timeout=5)
    except RuntimeError:
        return {"victim": None, "skipped": f"no {tier} leader to kill"}
    old_term = int((h.replica_status(c, lead, timeout=2) or {}).get("term", 0))
    ev: dict[str, Any] = {"victim": lead, "old_term": old_term}
    polls: list[Poller] = []

    def inject(start_at: float, stop: Any) -> None:
        polls.append(Poller(c, [n for n in names if n != lead], start_at))
        time.sleep(max(0.0, start_at + PRE - time.time()))
        gone: list[float] = []
        port = int(c.replica_url(lead).rsplit(":", 1)[1])
        watcher = threading.Thread(target=watch_port, args=(port, gone, time.time() + 10), daemon=True)
        watcher.start()
        c.kill(lead)
        watcher.join()
        ev["kill"] = (gone[0] if gone else time.time()) - start_at
        stop(ev["kill"] + POST)

    rec = drive(c, PRE + POST + 10, seed, on_start=inject)
    time.sleep(POLL)
    polls[0].stop()
    t_kill = ev["kill"]
    switch = polls[0].switch(tier, old_term, t_kill)
    ev["new_leader_s"] = None if switch is None else switch - t_kill
    for op in MIX:
        ok = rec.select(op)
        done = np.sort(rec.start[ok] + rec.latency[ok])
        after = done[done > t_kill]
        ev[f"{op}_back_s"] = float(after[0] - t_kill) if after.size else None
        ev[f"{op}_gap_s"] = gaps(rec, op, t_kill, t_kill + POST)["longest_gap_s"]
    ev["horizon_s"] = POST
    return ev


def restore(c: LocalCluster, net: wl.ClusterLinks, tier: str, victim: str | None) -> dict[str, Any]:
    """Fast links again; the victim restarted and caught up; both tiers taking writes."""
    t0 = time.monotonic()
    net.shape(LOOPBACK, tier)
    if victim is not None:
        c.restart(victim)
    waited = ready(c)
    with contextlib.suppress(RuntimeError):
        h.wait_caught_up(c, tier, timeout=60)
    return {"ready_s": waited, "restore_s": time.monotonic() - t0}


def settle(c: LocalCluster, tier: str, stable: float = STABLE) -> float | None:
    """Seconds (from now, just after the switch) until one leader of ``tier`` has held its lease in
    every poll for ``stable`` s, at least ``SETTLE``; None if not within ``SETTLE_MAX``."""
    t0 = time.monotonic()
    urls = [c.replica_url(n) for n in c.cluster_config().peers(tier)]
    held: tuple[str, int] | None = None
    since = t0
    with requests.Session() as session:
        session.headers["Authorization"] = f"Bearer {c.secret()}"
        while (now := time.monotonic()) - t0 < SETTLE_MAX:
            leaders = set()
            for url in urls:
                with contextlib.suppress(requests.RequestException, ValueError, KeyError, TypeError):
                    st = session.get(url + "/status", timeout=1).json()
                    if st["role"] == "leader" and st.get("leader_lease"):
                        leaders.add((url, int(st["term"])))
            current = next(iter(leaders)) if len(leaders) == 1 else None
            if current != held:
                held, since = current, now
            elif held is not None and now - since >= stable and now - t0 >= SETTLE:
                return now - t0
            time.sleep(POLL)
    return None


def point(c: LocalCluster, net: wl.ClusterLinks, tier: str, shape: Shape, seed: int, kill: bool,
          seconds: float = WINDOW, reset: bool = True, lead: float = LEAD, stable: float = STABLE,
          mode: str = "adaptive") -> dict[str, Any]:
    out: dict[str, Any] = {"tier": tier, "timers": mode, "shape": asdict(shape), "rtt_ms": max(1, shape.rtt_ms),
                           "label": shape.label()}
    victim = None
    try:
        net.shape(shape, tier, reset=reset)
        out["settle_s"] = settle(c, tier, stable)
        out["window"] = window(c, tier, seed, seconds, lead)
        if kill:
            out["failover"] = failover(c, tier, seed + 1)
            victim = out["failover"]["victim"]
    except Exception as exc:  # one point's failure is recorded; the cluster is put back for the next
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    out["restore"] = restore(c, net, tier, victim)
    return out


# -- results ----------------------------------------------------------------------------------------------
def _s(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


def table(points: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    rows = []
    for p in points:
        w, f = p.get("window", {}), p.get("failover", {})
        sh = p["shape"]
        jitter = f" ±{sh['jitter_ms']}" if sh["jitter_ms"] else ""
        rows.append([p["tier"], p.get("timers", "adaptive"), f"{sh['one_way_ms']}{jitter}", p["rtt_ms"], f"{sh['loss']:.0%}",
                     _s(p.get("settle_s")), _s(w.get("update", {}).get("longest_gap_s")), _s(w.get("buy", {}).get("longest_gap_s")),
                     f"{w['update']['acked']}/{w['update']['sent']}" if w else "-",
                     f"{w['buy']['acked']}/{w['buy']['sent']}" if w else "-",
                     w.get("new_terms"), _s(w.get("no_leader_share")), _s(w.get("lease_share")),
                     _s(f.get("new_leader_s")), _s(f.get("update_back_s")), _s(f.get("buy_back_s")),
                     p.get("error") or f.get("skipped", "")])
    return {"columns": ["tier", "timers", "each way ms", "RTT ms", "loss", "settled after s", "longest update gap s", "longest buy gap s",
                        "updates acked/sent", "buys acked/sent", f"new terms ({seconds:g} s)", "no-leader share",
                        "lease share", "failover: new leader s", "failover: update back s",
                        "failover: buy back s", "error"], "rows": rows}


#: How each timer mode is drawn.
STYLES = {"adaptive": "-", "fixed": "--"}
LEGEND = {"adaptive": "adaptive timers (solid)", "fixed": "fixed LAN timers (dashed, hollow)"}


def plot(settings: h.Settings, points: list[dict[str, Any]], seconds: float) -> str:
    """Per tier, against the links' round trip, one line per loss (a colour each) and timer mode
    (adaptive solid, fixed dashed): the gaps, new terms, the shares of the window without a leader
    and with a leader holding its lease, and the failover (a kill with no buy after it within ``POST`` s, or no leader to kill, is drawn
    as an x at ``POST``)."""
    from matplotlib.lines import Line2D

    def failover_s(p: dict[str, Any]) -> float | None:
        f = p.get("failover") or {}
        return f.get("buy_back_s") if f.get("buy_back_s") is not None else (POST if f else None)

    measures = (("update gap", lambda p: p["window"]["update"]["longest_gap_s"], "longest gap (s)"),
                ("buy gap", lambda p: p["window"]["buy"]["longest_gap_s"], "longest gap (s)"),
                ("new terms", lambda p: p["window"]["new_terms"], f"new terms per {seconds:g} s"),
                ("no leader", lambda p: p["window"]["no_leader_share"], "share of the window"),
                ("lease held", lambda p: p["window"]["lease_share"], "share of the window"),
                ("failover", failover_s, "leader killed → buy acked (s)"))
    tiers = [t for t in TIERS if any(p["tier"] == t for p in points)]
    fig, axes = h.figure(len(tiers), len(measures), figsize=(21, 3.8 * len(tiers)), squeeze=False)
    losses = sorted({p["shape"]["loss"] for p in points})
    rtts = sorted({p["rtt_ms"] for p in points})
    modes = [m for m in STYLES if any(p.get("timers", "adaptive") == m for p in points)]
    for row, tier in zip(axes, tiers, strict=True):
        for ax, (title, get, ylabel) in zip(row, measures, strict=True):
            for j, mode in enumerate(modes):
                for i, loss in enumerate(losses):
                    mine = sorted((p for p in points if p["tier"] == tier and p["shape"]["loss"] == loss
                                   and p.get("timers", "adaptive") == mode and "window" in p), key=lambda p: p["rtt_ms"])
                    # side by side where they meet: by loss, and the modes a little apart
                    xs = [rtts.index(p["rtt_ms"]) + 0.06 * (i - 1) + 0.02 * j for p in mine]
                    ys = [get(p) for p in mine]
                    ax.plot(xs, [np.nan if y is None else y for y in ys], marker="o", ls=STYLES[mode],
                            color=f"C{i}", mfc="none" if mode == "fixed" else None)
                    if title == "failover":
                        lost = [(x, POST) for x, p in zip(xs, mine, strict=True)
                                if p.get("failover") and (p["failover"].get("buy_back_s") is None)]
                        if lost:
                            ax.scatter(*zip(*lost, strict=True), marker="x", s=80, color=f"C{i}")
            handles = [Line2D([], [], color=f"C{i}", marker="o", label=f"{loss:.0%} loss") for i, loss in enumerate(losses)]
            handles += [Line2D([], [], color="k", ls=STYLES[m], label=LEGEND[m]) for m in modes]
            if "gap" in title:
                handles.append(ax.axhline(TARGET_GAP, color="k", ls=":", lw=1, label=f"issue 37: {TARGET_GAP:g} s"))
                handles.append(ax.axhline(seconds, color="tab:red", ls="-.", lw=1, label="the whole window"))
            ax.set(xlabel="link round trip (ms)", ylabel=ylabel, title=f"{tier} links: {title}")
            ax.set_xticks(range(len(rtts)))
            ax.set_xticklabels([str(x) for x in rtts])
            ax.legend(handles=handles, fontsize="x-small")
    named = {"adaptive": "adaptive timers solid", "fixed": "fixed LAN timers (PYGMY_RAFT_ADAPT=0) dashed"}
    fig.suptitle(f"One tier's replica links on a WAN: {', '.join(named[m] for m in modes)} (jitter ±50 ms each way "
                 f"from 150 ms of round trip; x: no buy within {POST:g} s of the kill, or no leader to kill)")
    return h.save_plot(settings, fig, NAME)


def print_table(t: dict[str, Any]) -> None:
    cols = t["columns"][:-1]
    widths = [max(len(str(c)), *(len(h.fmt(r[i])) for r in t["rows"])) for i, c in enumerate(cols)]
    print("  ".join(str(c).rjust(w) for c, w in zip(cols, widths, strict=True)))
    for r in t["rows"]:
        print("  ".join(h.fmt(v).rjust(w) for v, w in zip(r, widths, strict=False)) + (f"  {r[-1]}" if r[-1] else ""))


# -- running it -------------------------------------------------------------------------------------------
def run(settings: h.Settings, tiers: Sequence[str] | None = None, kill: bool | None = None,
        reset: bool = True, only: Sequence[Shape] = (), keep: bool = False,
        modes: Sequence[str] | None = None) -> dict[str, Any]:
    """In a network namespace of its own (this process re-run in one, unless it is in one already)."""
    tiers = list(tiers or settings.size(TIERS, TIERS, ("catalog",)))
    kill = settings.size(True, True, False) if kill is None else kill
    modes = list(modes or settings.size(tuple(MODES), tuple(MODES), ("adaptive",)))
    if not wl.own_namespace():
        argv = [sys.executable, "-m", "pygmy.experiments.wan", "--results-dir", str(settings.results_dir),
                "--plots-dir", str(settings.plots_dir), "--tiers", *tiers, "--modes", *modes, *(["--quick"] if settings.quick else []),
                *(["--tiny"] if settings.tiny else []), *([] if settings.progress else ["--no-progress"]),
                *([] if kill else ["--no-kill"]), *([] if reset else ["--keep-connections"]),
                *[f"--shape={x.one_way_ms},{x.jitter_ms},{x.loss:g}" for x in only], *(["--keep"] if keep else [])]
        proc = wl.isolated(argv, timeout=7200)
        if proc.returncode != 0:
            raise RuntimeError(f"the WAN experiment failed in its namespace (exit {proc.returncode})")
        return {"path": settings.results_dir / f"{NAME}.json"}
    return _run(settings, tiers, kill, reset, only, keep, modes)


def _grid(settings: h.Settings, tiers: Sequence[str], kill: bool, reset: bool, todo: Sequence[Shape],
          keep: bool, mode: str, seconds: float, lead: float, stable: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every shape of ``todo`` for each tier, on a fresh cluster with ``mode``'s timers: what its
    replicas say of their timers, and the points."""
    tmp = Path(tempfile.mkdtemp(prefix=f"pygmy-wan-{mode}-"))
    base = free_port_base()
    points: list[dict[str, Any]] = []
    with wl.ClusterLinks(ClusterConfig(port_base=base), log=tmp / "toxiproxy.log") as net:
        env = {**net.env(), **MODES[mode]}
        c = LocalCluster(tmp / "data", base, ["--books", str(h.write_books(tmp / "books.json"))], env=env)
        try:
            c.start(reset=True, timeout=180)
            h.wait_healthy(c)
            ready(c)
            said = timers(c, env)
            if said["mode"] != mode:
                raise RuntimeError(f"asked for {mode} timers, the replicas report {said['mode']}: {said}")
            broken = False
            for tier in tiers:
                for k, shape in enumerate(h.progress(settings, todo, desc=f"{tier}, {mode}")):
                    if broken:
                        break
                    try:
                        points.append(point(c, net, tier, shape, seed=100 * len(points) + k, kill=kill,
                                            seconds=seconds, reset=reset, lead=lead, stable=stable, mode=mode))
                    except Exception as exc:  # the cluster would not take writes again: keep what was measured
                        points.append({"tier": tier, "timers": mode, "shape": asdict(shape),
                                       "rtt_ms": max(1, shape.rtt_ms), "label": shape.label(),
                                       "error": f"not restored: {exc}"[:300]})
                        broken = True
                    if settings.progress:
                        p = points[-1]
                        w = p.get("window", {})
                        f = p.get("failover", {})
                        print(f"{tier} {mode} {shape.label()}: update gap {w.get('update', {}).get('longest_gap_s')}, "
                              f"buy gap {w.get('buy', {}).get('longest_gap_s')}, new terms {w.get('new_terms')}, "
                              f"failover buy back {f.get('buy_back_s')}"
                              + (f", ERROR {p['error']}" if "error" in p else ""), file=sys.stderr, flush=True)
        finally:
            c.stop()
            if keep:
                print(f"wan: the cluster's data and logs are kept in {tmp}", file=sys.stderr)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
    return said, points


def _run(settings: h.Settings, tiers: Sequence[str], kill: bool, reset: bool,
         only: Sequence[Shape] = (), keep: bool = False, modes: Sequence[str] = ("adaptive",)) -> dict[str, Any]:
    started = time.monotonic()
    points: list[dict[str, Any]] = []
    todo = list(only) or shapes(settings)
    seconds = settings.size(WINDOW, WINDOW, 4.0)
    lead, stable = settings.size(LEAD, LEAD, 1.0), settings.size(STABLE, STABLE, 1.0)
    said: dict[str, Any] = {}
    took: dict[str, float] = {}
    for mode in modes:
        t0 = time.monotonic()
        try:
            said[mode], mine = _grid(settings, tiers, kill, reset, todo, keep, mode, seconds, lead, stable)
        except Exception as exc:  # its cluster never took writes (or ran other timers): the other modes still run
            said[mode], mine = {"mode": mode, "error": f"{type(exc).__name__}: {exc}"[:300]}, []
            print(f"wan: {mode} timers: {said[mode]['error']}", file=sys.stderr, flush=True)
        points += mine
        took[mode] = time.monotonic() - t0
    t = table(points, seconds)
    plots = [plot(settings, points, seconds)]
    path = h.save(settings, NAME, {
        "title": "15. Replica links on a WAN",
        "description": (
            f"Issue 37. A default cluster (3 replicas per tier, 1 frontend x 2 workers, the seven books) whose every "
            "replica link goes through a Toxiproxy proxy of its own (`pygmy.verify.links`, `PYGMY_PEER_ADDRESSES`); "
            "frontends and the order tier's routers keep direct links. For one tier at a time, its six links get the "
            "shape: latency each way (RTT/2; ±50 ms of jitter each way from 150 ms of RTT on; the last point is the "
            "issue's 300 ±50 ms each way), and loss on the calling replica's hop with the retransmission timeout of "
            "a link of that RTT (see the module's docstring); connections are cut once so that they are made again "
            f"across it. Once one leader has held its lease for {stable:g} s in every poll (at least {SETTLE:g} s "
            f"after the switch; settled after: how long that took, - if not within {SETTLE_MAX:g} s), clients send {RATE // 2} updates and {RATE // 2} buys a second, evenly "
            f"spaced (a true open loop: each request on a thread of its own, {CLIENT_TIMEOUT:g} s client timeout) for {seconds:g} s. Gaps "
            f"are the longest stretch of the window with no acknowledged update (buy), edges included (the load starts "
            f"{lead:g} s before the window, so the first acknowledgement is not counted from the first request), so a "
            "window with none shows "
            f"{seconds:g} s. New terms: the tier's highest term at the window's end less at its start (every "
            f"replica's /status every {POLL:g} s); no-leader and lease shares: of those poll rounds. Failover: "
            f"the tier's leader SIGKILLed {PRE:g} s into the same load on the same links; time until a survivor "
            f"leads in a newer term and until an update and a buy are acknowledged again (none within {POST:g} s: "
            "-). Timers (column timers): the whole grid runs once per mode, each on a fresh cluster: "
            + " and ".join(_MODE_TEXT[m] for m in modes) + "."),
        "timers": {"mode": " and ".join(modes), "modes": said, "env": {m: MODES[m] for m in modes}},
        "params": {"window_s": seconds, "lead_s": lead, "settle_min_s": SETTLE, "stable_s": stable,
                   "settle_max_s": SETTLE_MAX, "rate": RATE, "mix": MIX, "poll_s": POLL,
                   "failover": kill, "pre_s": PRE, "post_s": POST, "tiers": list(tiers),
                   "shapes": [asdict(s) for s in todo], "reset_connections": reset, "modes": list(modes),
                   "loss_model": "iptables statistic on the caller-side loopback hop, both ways; "
                                 "net.ipv4.tcp_rto_min_us = RTT + 200 ms, tcp_early_retrans = 0"},
        "results": {"points": points, "seconds": time.monotonic() - started, "seconds_by_mode": took},
        "table": t, "plots": plots})
    print_table(t)
    return {"path": path}


_MODE_TEXT = {"adaptive": "adaptive (the default: heartbeat, election window and lease follow the round trips a "
                         "leader measures)",
              "fixed": ("fixed (the LAN timers as configured, `PYGMY_RAFT_ADAPT=0` in the cluster's environment: nothing "
                      "follows the measured round trips; the core's election backoff, and the window of twice a "
                      "backed-off campaign a new leader keeps, stay in both modes)")}


def _shape(text: str) -> Shape:
    try:
        ms, jitter, loss = text.split(",")
        return Shape(int(ms), int(jitter), float(loss))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected MS,JITTER,LOSS such as 150,50,0.1, not {text!r}") from exc


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pygmy.experiments.wan", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the issue's two cases and two more (a few minutes)")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tiers", nargs="+", choices=TIERS)
    p.add_argument("--modes", nargs="+", choices=tuple(MODES),
                   help="the timers, each on a fresh cluster: adaptive (the default) and fixed (the LAN timers, "
                        "PYGMY_RAFT_ADAPT=0); default both")
    p.add_argument("--no-kill", action="store_true", help="no failover trials")
    p.add_argument("--keep-connections", action="store_true",
                   help="do not cut the connections when a shape is applied (they keep the LAN's retransmission "
                        "timeout: loss is cheaper than on the link it stands for)")
    p.add_argument("--shape", action="append", type=_shape, default=[], metavar="MS,JITTER,LOSS",
                   help="only this shape (one-way ms, ± jitter ms, loss fraction), e.g. 150,50,0.1; repeatable")
    p.add_argument("--keep", action="store_true", help="keep the cluster's data directories and logs")
    p.add_argument("--results-dir", type=Path, default=h.RESULTS)
    p.add_argument("--plots-dir", type=Path, default=h.PLOTS)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    s = h.Settings(quick=a.quick, tiny=a.tiny, results_dir=a.results_dir, plots_dir=a.plots_dir,
                   progress=not a.no_progress)
    run(s, a.tiers, kill=False if a.no_kill else None, reset=not a.keep_connections, only=a.shape, keep=a.keep,
        modes=a.modes)


if __name__ == "__main__":
    main()
