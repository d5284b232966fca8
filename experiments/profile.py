"""Where the CPU goes: py-spy samples every service of a cluster under a load, or idle.

``python -m pygmy.experiments.profile [--load buy|mix|idle] [--warm] [--seconds 15] [--out DIR]`` starts a cluster
(3+3 replicas, 1 frontend x 2 workers, 1,000 books), runs the load, records every Gunicorn worker
with ``py-spy record --nonblocking --gil`` (only samples holding the GIL: Python CPU, not waits; collapsed stacks and an SVG flame graph per process) and
prints, per service, the share of samples and the functions with the most samples (inclusive and
own): what a change to a hot path is measured with before and after (docs/performance.md).

It also prints, per worker thread (from ``/proc/<pid>/task``, named by ``py-spy dump``), its CPU and
its context switches per operation, voluntary (it blocked: a wait for a frame, a lock, the GIL,
a disk sync) and not (preempted): where an operation's hand-offs between threads and processes
are, which py-spy's samples of the interpreter do not show.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from pygmy.catalog.books import synthetic
from pygmy.cluster.local import LocalCluster
from pygmy.experiments import harness as h
from pygmy.experiments.writepath import BOOKS, STOCK, TOPICS, cache_counters, cluster_cpu_s, warm

LOADS = {"buy": {"buy": 1.0}, "mix": h.MIX_40_40_20, "idle": None}


def workers(c: LocalCluster) -> dict[str, list[int]]:
    """``{service: [pids of its Gunicorn workers]}``: the children of each service's master."""
    out: dict[str, list[int]] = {}
    for name, master in c.process_groups().items():
        kids = Path(f"/proc/{master}/task/{master}/children").read_text().split()
        out[name] = [int(k) for k in kids] or [master]
    return out


#: A thread: its id and its start time (clock ticks after boot), so that an id reused is another.
Tid = tuple[int, int]


def thread_counters(pid: int) -> dict[Tid, tuple[int, int, int]]:
    """``{thread: (CPU clock ticks, voluntary, involuntary context switches)}`` of a process so far."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        switches = dict(re.findall(r"^(voluntary|nonvoluntary)_ctxt_switches:\s+(\d+)", status, re.M))
        out[(int(task.name), int(stat[19]))] = (int(stat[11]) + int(stat[12]), int(switches["voluntary"]),
                                                int(switches["nonvoluntary"]))
    return out


def thread_names(spy: str, pid: int) -> dict[int, str]:
    """``{thread id: Python thread name}`` of a process, from ``py-spy dump --json`` (empty if it
    gives none in time)."""
    try:
        dump = subprocess.run([spy, "dump", "--json", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=60).stdout
        return {int(t["os_thread_id"]): str(t["thread_name"]) for t in json.loads(dump)
                if t.get("os_thread_id") is not None}
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError, TypeError):
        return {}


def thread_table(before: dict[int, dict[Tid, tuple[int, int, int]]],
                 after: dict[int, dict[Tid, tuple[int, int, int]]], names: dict[int, dict[int, str]],
                 services: dict[int, str], ops: int) -> list[str]:
    """Lines: each busy thread's CPU (ms) and context switches per operation between the two
    counts, then their sum. A thread that began meanwhile counts from zero; one that ended is
    missing from both the lines and the sum."""
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    rows, total = [], 0.0
    for pid, service in services.items():
        for (tid, started), (ticks, vol, invol) in after.get(pid, {}).items():
            t0, v0, i0 = before.get(pid, {}).get((tid, started), (0, 0, 0))
            cpu, v, i = (ticks - t0) * tick_ms / ops, (vol - v0) / ops, (invol - i0) / ops
            total += cpu
            if cpu >= 0.01 or v + i >= 0.1:
                rows.append((service, -cpu, names.get(pid, {}).get(tid, "?"), tid, cpu, v, i))
    rows.sort()
    width = max((len(r[2]) for r in rows), default=0)
    return [f"  {s:<12} {name:<{width}} {tid:>8}  CPU {cpu:6.3f} ms  switches {v:5.2f} + {i:5.2f}"
            for s, _, name, tid, cpu, v, i in rows] + [f"  every thread: CPU {total:.3f} ms"]


def sync_blocks(where: Path, commits: int = 200) -> float:
    """Voluntary context switches of one synced SQLite commit alone (WAL, ``synchronous=FULL``, as
    a replica's log), in ``where``: how often a thread blocks for the disk in a commit, so that a
    replica thread's switches per operation can be read as syncs and frames."""
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        conn = sqlite3.connect(Path(tmp) / "sync.db", isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("CREATE TABLE t (i INTEGER, v BLOB)")
            me = threading.get_native_id()

            def switches() -> int:
                return next(v for (tid, _), (_, v, _) in thread_counters(os.getpid()).items() if tid == me)

            first = switches()
            for i in range(commits):
                conn.execute("BEGIN")
                conn.execute("INSERT INTO t VALUES (?, ?)", (i, bytes(200)))
                conn.execute("COMMIT")
            return (switches() - first) / commits
        finally:
            conn.close()


def summarize(raw: Path, top: int) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    """(samples, top functions inclusive, top functions by own samples) of a collapsed-stack file."""
    total, incl, own = 0, collections.Counter(), collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        count = int(n)
        frames = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] + ")"
                  if " (" in f else f for f in stack.split(";")[1:]]  # drop the thread name
        total += count
        for f in set(frames):
            incl[f] += count
        if frames:
            own[frames[-1]] += count
    return total, incl.most_common(top), own.most_common(top)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pygmy.experiments.profile")
    p.add_argument("--load", choices=sorted(LOADS), default="buy")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--clients", default="4x8", help="processes x threads (closed loop)")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--warm", action="store_true", help="read every book and topic first, as make bench's warm mix")
    p.add_argument("--out", type=Path, default=h.RESULTS / "profile",
                   help="where py-spy's raw profiles go (not kept in git)")
    a = p.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    procs, threads = (int(x) for x in a.clients.split("x"))
    a.out.mkdir(parents=True, exist_ok=True)
    settings = h.Settings(quick=True, progress=False)
    with h.cluster(settings, books=synthetic(BOOKS, topics=TOPICS, stock=STOCK)) as c:
        time.sleep(2)
        if a.warm:
            warm(c)
        recorders = []
        for name, pids in workers(c).items():
            for pid in pids:
                base = a.out / f"{a.load}-{name}-{pid}"
                recorders.append((name, base, subprocess.Popen(
                    [spy, "record", "--nonblocking", "--gil", "--pid", str(pid), "--rate", str(a.rate), "--duration",
                     str(int(a.seconds)), "--format", "raw", "--output", f"{base}.txt"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        cache0 = cache_counters(c)  # the load's own hits and misses, not warm()'s nor the start's flushes
        services = {pid: name for name, ps in workers(c).items() for pid in ps}
        threads0 = {pid: thread_counters(pid) for pid in services}
        cpu0, t0 = cluster_cpu_s(c), time.monotonic()
        load = LOADS[a.load]
        done = {}
        if load is not None:
            def drive() -> None:
                done["rec"] = h.run_load(c.url, procs, load, duration=a.seconds, items=BOOKS, threads=threads,
                                         topics=tuple(f"topic {t}" for t in range(TOPICS)))
            t = threading.Thread(target=drive)
            t.start()
            t.join()
        else:
            time.sleep(a.seconds)
        cpu = cluster_cpu_s(c) - cpu0
        wall = time.monotonic() - t0
        threads1 = {}
        for pid in services:  # read at once, as the load ends: the names take a py-spy run each
            with contextlib.suppress(OSError):  # (the worker is gone)
                threads1[pid] = thread_counters(pid)
        names = {pid: thread_names(spy, pid) for pid in threads1}
        per_sync = sync_blocks(c.data_dir)
        ops = len(done["rec"].op) if done else 0
        per_thread = thread_table(threads0, threads1, names, services, ops) if ops else []
        for _, _, proc in recorders:
            proc.wait(timeout=a.seconds + 60)
        cache = {k: v - cache0[k] for k, v in cache_counters(c).items()}
    print(f"load {a.load}: {ops} operations in {wall:.1f} s; cluster CPU {cpu:.2f} s "
          f"({cpu / wall * 100:.0f}% of one core){f', {cpu / ops * 1000:.2f} ms per operation' if ops else ''}")
    looked = cache["hits"] + cache["misses"]
    print(f"frontend cache: {cache['hits']} hits, {cache['misses']} misses"
          f" ({cache['misses'] / max(looked, 1) * 100:.0f}% of reads), {cache['invalidations']} invalidations,"
          f" {cache['flushes']} flushes")
    if per_thread:
        print("\nper operation, each worker thread busy in it (switches: voluntary + involuntary):")
        print("\n".join(per_thread))
        print(f"a synced SQLite commit alone, beside the cluster's data (WAL, synchronous=FULL): "
              f"{per_sync:.2f} voluntary switches")
    per_service: dict[str, list[Path]] = collections.defaultdict(list)
    for name, base, _ in recorders:
        if Path(f"{base}.txt").exists():
            per_service[name].append(Path(f"{base}.txt"))
    grand = 0
    summaries = {}
    for name, files in per_service.items():
        merged = a.out / f"{a.load}-{name}.txt"
        merged.write_text("".join(f.read_text() for f in files))
        summaries[name] = summarize(merged, a.top)
        grand += summaries[name][0]
    for name, (total, incl, own) in sorted(summaries.items(), key=lambda kv: -kv[1][0]):
        print(f"\n## {name}: {total} samples ({total / max(grand, 1) * 100:.0f}% of all)")
        print("  inclusive: " + "; ".join(f"{f} {n / total * 100:.0f}%" for f, n in incl))
        print("  own:       " + "; ".join(f"{f} {n / total * 100:.0f}%" for f, n in own))
    os.sync()


if __name__ == "__main__":
    main()
