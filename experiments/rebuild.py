"""A catalog follower rebuilt from nothing (issue #14): its data directory is deleted and it is
started again on a cluster of 1,000,000 books (20,000 with ``--tiny``) whose leader has compacted
its log, so the only way back is a snapshot of the whole state.

Measured, in one run:

- how long from ``pygmy start`` until it has applied the leader's commit index with the leader's
  digest, and whether it installed a snapshot (its log says so);
- its peak resident memory over the rebuild (``VmHWM``, per process) against the resident memory of
  a healthy follower of the same cluster (``VmRSS``), and the leader's peak over the rebuild (its
  ``VmHWM`` is reset just before, through ``/proc/<pid>/clear_refs``).

It prints numbers; nothing here asserts a timing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

from pygmy.catalog.books import synthetic
from pygmy.cluster.launcher import group_members
from pygmy.cluster.local import LocalCluster
from pygmy.experiments import harness as h

#: The leader keeps this few applied entries, so a replica that lost everything needs a snapshot.
KEEP_ENTRIES, SLACK = 50, 20


def _kib(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` figure in KiB (0 once the process is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def memory(c: LocalCluster, name: str, field: str) -> int:
    """The largest ``field`` (``VmRSS`` or ``VmHWM``) over the service's processes, in MiB."""
    group = c.process_groups()[name]
    return max((_kib(p.pid, field) for p in group_members([group])), default=0) // 1024


def reset_peaks(c: LocalCluster, name: str) -> None:
    """From now on, ``VmHWM`` counts the peak from here (Linux 4.0 and later)."""
    for p in group_members([c.process_groups()[name]]):
        with contextlib.suppress(OSError):
            Path(f"/proc/{p.pid}/clear_refs").write_text("5")


def caught_up(c: LocalCluster, leader: str, name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lead, st = h.replica_status(c, leader), h.replica_status(c, name)
        if lead and st and st["applied_index"] >= lead["commit_index"]:
            return
        time.sleep(0.1)
    raise RuntimeError(f"{name} did not catch up with {leader} within {timeout} s")


def run(settings: h.Settings) -> dict[str, Any]:
    books = settings.size(1_000_000, 1_000_000, 20_000)
    writes = 3 * (KEEP_ENTRIES + SLACK)
    env = {"PYGMY_RAFT_KEEP_ENTRIES": str(KEEP_ENTRIES), "PYGMY_RAFT_COMPACT_SLACK": str(SLACK)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with h.cluster(settings, books=synthetic(books, topics=50)) as c:
            leader = h.leader(c, "catalog")
            followers = [r["name"] for r in h.tier_status(c, "catalog")["replicas"] if r["name"] != leader]
            victim, healthy = followers
            c.kill(victim)
            with c.client() as cl:  # past the leader's log: it compacts the entries the victim needs
                for i in range(writes):
                    cl.update(1 + i % 7, stock_delta=1)
            caught_up(c, leader, healthy)  # the other follower: its memory is the steady state
            steady = memory(c, healthy, "VmRSS")
            reset_peaks(c, leader)
            leader_before = memory(c, leader, "VmRSS")
            shutil.rmtree(c.data_dir / victim)
            started = time.monotonic()
            c.restart(victim)
            answered = time.monotonic() - started
            h.wait_caught_up(c, "catalog", timeout=300)
            rebuilt = time.monotonic() - started
            deadline = time.monotonic() + 30  # the state is readable a moment before the install is logged
            while not h.snapshots_installed(c, victim) and time.monotonic() < deadline:
                time.sleep(0.1)
            # Each replica's own status, read now: the frontend's /status may be a view from before
            # the install (it is up to a quarter of a second old, older while a refresh is on its way).
            digests = {(h.replica_status(c, n, timeout=2) or {}).get("state_digest") for n in (leader, *followers)}
            out = {"books": books, "writes_while_down": writes, "answered_s": answered, "rebuilt_s": rebuilt,
                   "snapshots_installed": h.snapshots_installed(c, victim), "digests_equal": len(digests) == 1,
                   "victim_peak_mib": memory(c, victim, "VmHWM"), "victim_rss_mib": memory(c, victim, "VmRSS"),
                   "steady_follower_rss_mib": steady, "leader_rss_before_mib": leader_before,
                   "leader_peak_mib": memory(c, leader, "VmHWM")}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out["victim_peak_over_steady"] = round(out["victim_peak_mib"] / max(1, out["steady_follower_rss_mib"]), 2)
    out["leader_peak_over_before"] = round(out["leader_peak_mib"] / max(1, out["leader_rss_before_mib"]), 2)
    for k, v in out.items():
        print(f"{k:28} {round(v, 2) if isinstance(v, float) else v}")
    h.save(settings, "rebuild", {
        "title": "14. A follower rebuilt from nothing", "description": "A catalog follower whose data directory "
        "was deleted, started again on a store whose leader compacted its log: time until current, and "
        "peak memory against a healthy follower's. See experiments/rebuild.py.", "results": out,
        "table": {"columns": ["measure", "value"], "rows": [[k, v] for k, v in out.items()]}, "plots": []})
    return out


def main(argv: list[str] | None = None) -> None:
    h.cli("rebuild", run, argv)


if __name__ == "__main__":
    main()
