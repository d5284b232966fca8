"""Where one sequential buy's time goes, from timestamps taken in every process on its path.

``python -m pygmy.experiments.breakdown [--buys 300]`` starts a default cluster (3+3 replicas, 1,000
books, as ``writepath``) whose every service process loads ``experiments/trace_hooks`` (it wraps the
functions a buy passes through and records when each call starts and ends; Pygmy's own code carries
no timestamps), then one client buys one copy at a time. CLOCK_MONOTONIC is one clock for every
process of the machine, so the events of all of them fall on one line: for each buy, every event
between the client's send and its answer is placed at its offset from the send, and the table gives,
for each step, the median over buys of its start and its length. The recording costs a few
microseconds per event (dozens per buy), so the buy is a little slower here than untraced
(``python -m pygmy.experiments.ab --load sequential`` times it untraced). The floor beside it is
measured on the spot: a frame's round trip between two processes and one synced SQLite commit.

It prints numbers; nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pygmy.catalog.books import synthetic
from pygmy.cluster.local import ROOT
from pygmy.experiments import baseline
from pygmy.experiments import harness as h
from pygmy.experiments.writepath import BOOKS, STOCK, TOPICS
from pygmy.replication.transport import FrameClient

HOOKS = ROOT / "experiments" / "trace_hooks"


def read_events(folder: Path) -> list[tuple[int, int, str]]:
    """(time ns, pid, label) of every event the services recorded, in time order."""
    out = []
    for f in folder.glob("*.txt"):
        pid = int(f.stem)
        for line in f.read_text().splitlines():
            t, label = line.split(" ", 1)
            out.append((int(t), pid, label))
    out.sort()
    return out


#: The buy's path as checkpoints, each the first event matching after the one before it ({O}: the
#: order leader, {C}: the catalog leader, {F}: either follower of that tier), with what the step
#: between a checkpoint and the one before it is. A sequential buy arrives with no other in flight,
#: so the order leader sends its decrement while its intent is being committed: the intent's commit
#: runs beside the path (``BESIDE``), and the path waits for it only if it is not done by the
#: time the catalog answers.
PATH: list[tuple[str, str]] = [
    (r"fe\.submit \.", "client -> frontend worker's event loop takes the buy (HTTP, the client's own cost)"),
    (r"call\.buys \+", "hand-off: the combiner's helper thread picks the batch up"),
    (r"{O}\.frame/buys \+", "frame to the order leader, read by its reader thread"),
    (r"call\.decrements \+", "order: parse, intents handed to their combiner's helper, decrements combiner"),
    (r"{C}\.frame/books/decrements \+", "frame to the catalog leader, read by its reader thread"),
    (r"catalog\.hold \+", "catalog: parse, check"),
    (r"catalog\.hold -", "catalog: hold round (written to both frontend workers, then their acks read, on one thread)"),
    (r"{C}\.propose \+", "catalog: propose"),
    (r"{C}\.in\[append_resp\] \.", "catalog decrements: append, follower write + fsync, ack back"),
    (r"{C}\.apply \+", "catalog: the leader's own write ends, ack stepped, commit"),
    (r"{C}\.apply -", "catalog: apply"),
    (r"{C}\.propose -", "catalog: proposer woken"),
    (r"{C}\.frame/books/decrements -", "catalog: release (written once the answer is), answer built"),
    (r"call\.decrements -", "answer frame back to the order leader"),
    (r"{O}\.frame/buys -", "order: the intents' commit awaited if not done, outcome, confirm queued, answer built"),
    (r"call\.buys -", "answer frame back to the frontend worker"),
    (r"fe\.answer \.", "frontend: results to the callback"),
    (r"$END", "frontend answers; the client reads it"),
]
#: Steps beside the path (from, to), each the first match after the path's checkpoint ``after``.
BESIDE: list[tuple[str, str, str, str]] = [
    ("order intents: proposed -> committed and applied (beside the decrement)", r"{O}\.propose \+",
     r"{O}\.propose -", r"{O}\.frame/buys \+"),
    ("order intents: append sent -> a follower's ack back", r"{O}\.send\[append\] \.", r"{O}\.in\[append_resp\] \.",
     r"{O}\.frame/buys \+"),
    ("order intents: apply (one SQLite transaction)", r"{O}\.apply \+", r"{O}\.apply -", r"{O}\.frame/buys \+"),
    ("order leader's own write (persist)", r"{O}\.persist \+", r"{O}\.persist -", r"{O}\.frame/buys \+"),
    ("order append frame: leader sends -> a follower's reader has it", r"{O}\.send\[append\] \.", r"{F}\.in\[append\] \.", r"{O}\.frame/buys \+"),
    ("order follower: append in -> ack out", r"{F}\.in\[append\] \.", r"{F}\.send\[append_resp\] \.", r"{O}\.frame/buys \+"),
    ("order follower's write (persist)", r"{F}\.persist \+", r"{F}\.persist -", r"{O}\.frame/buys \+"),
    ("catalog leader's own write (persist)", r"{C}\.persist \+", r"{C}\.persist -", r"{C}\.propose \+"),
    ("catalog append frame: leader sends -> a follower's reader has it", r"{C}\.send\[append\] \.", r"{G}\.in\[append\] \.", r"{C}\.propose \+"),
    ("catalog follower: append in -> ack out", r"{G}\.in\[append\] \.", r"{G}\.send\[append_resp\] \.", r"{C}\.propose \+"),
    ("catalog follower's write (persist)", r"{G}\.persist \+", r"{G}\.persist -", r"{C}\.propose \+"),
    ("a frontend worker's hold (push in -> ack)", r"fe\.push\[hold\] \+", r"fe\.push\[hold\] -", r"catalog\.hold \+"),
]


def _leaders(window: list[tuple[int, int, str]]) -> tuple[str, str] | None:
    order = next((lb.split(".")[0] for _, _, lb in window if lb.startswith("order-") and ".propose +" in lb), None)
    catalog = next((lb.split(".")[0] for _, _, lb in window if lb.startswith("catalog-") and ".propose +" in lb), None)
    return (order, catalog) if order and catalog else None


def _pattern(p: str, leaders: tuple[str, str]) -> re.Pattern[str]:
    o, c = leaders
    return re.compile(p.replace("{O}", re.escape(o)).replace("{C}", re.escape(c))
                      .replace("{F}", rf"order-(?!{re.escape(o.split('-')[1])}\b)\d+")
                      .replace("{G}", rf"catalog-(?!{re.escape(c.split('-')[1])}\b)\d+"))


def _first(window: list[tuple[int, int, str]], pattern: re.Pattern[str], after: int) -> int | None:
    return next((t for t, _, lb in window if t >= after and pattern.fullmatch(lb)), None)


def timeline(buys: list[tuple[int, int]], events: list[tuple[int, int, str]]) -> dict[str, Any]:
    """Per step of ``PATH`` and ``BESIDE``: the median over buys of its length (ms), over the buys
    where every checkpoint was found in order."""
    steps: list[list[float]] = [[] for _ in PATH]
    beside: list[list[float]] = [[] for _ in BESIDE]
    j, complete = 0, 0
    for t0, t1 in buys:
        while j < len(events) and events[j][0] < t0:
            j += 1
        k = j
        while k < len(events) and events[k][0] <= t1:
            k += 1
        window = events[j:k]
        leaders = _leaders(window)
        if leaders is None:
            continue
        marks, at = [t0], t0
        for p, _ in PATH[:-1]:
            t = _first(window, _pattern(p, leaders), at)
            if t is None:
                break
            marks.append(t)
            at = t
        else:
            marks.append(t1)
            complete += 1
            for i in range(len(PATH)):
                steps[i].append((marks[i + 1] - marks[i]) / 1e6)
            anchors = {p: marks[i + 1] for i, (p, _) in enumerate(PATH)}
            for i, (_, a, b, after) in enumerate(BESIDE):
                ta = _first(window, _pattern(a, leaders), anchors[after])
                tb = None if ta is None else _first(window, _pattern(b, leaders), ta)
                if tb is not None:
                    beside[i].append((tb - ta) / 1e6)
    med = [(statistics.median(v), statistics.fmean(v)) if v else (float("nan"), float("nan")) for v in steps]
    return {"p50_ms": statistics.median((t1 - t0) / 1e6 for t0, t1 in buys),
            "mean_ms": statistics.fmean((t1 - t0) / 1e6 for t0, t1 in buys), "complete": complete,
            "path": [(what, m, mean) for (_, what), (m, mean) in zip(PATH, med, strict=True)],
            "beside": [(what, statistics.median(v) if v else float("nan"), len(v))
                       for (what, *_), v in zip(BESIDE, beside, strict=True)]}


_ECHO = """
import sys, time
from pygmy.replication.transport import Channel, FrameServer
FrameServer("127.0.0.1", int(sys.argv[1]), "s", {"echo": Channel(lambda peer, frame: frame)}, name="echo").start()
time.sleep(3600)
"""


def floor_parts(n: int = 300, commit_ms: float | None = None) -> dict[str, float]:
    """Medians (ms) of what the floor is made of, on this machine now: a frame's round trip between
    two sleeping processes (``FrameClient.call`` to an echoing ``FrameServer`` in another process,
    with a pause between calls as between buys), and one synced SQLite commit of a small row
    (``baseline.sqlite_commits``: WAL, ``synchronous=FULL``, as the log store's), unless the run
    measured it already (``commit_ms``)."""
    port = h.free_port_base()
    server = subprocess.Popen([sys.executable, "-c", _ECHO, str(port)], cwd=ROOT)
    try:
        client = FrameClient(("127.0.0.1", port), "s", "probe", "echo", connect_timeout=2.0)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.call({"x": 1}, 1.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        rtts = []
        for _ in range(n):
            time.sleep(0.005)  # the peer's threads go back to sleep, as between a buy's frames
            t0 = time.perf_counter()
            client.call({"messages": [{"type": "append", "n": 1}]}, 1.0)
            rtts.append(time.perf_counter() - t0)
        client.close()
    finally:
        server.kill()
        server.wait()
    if commit_ms is None:
        commit_ms = statistics.median(baseline.sqlite_commits(n)) * 1000
    return {"frame_rtt_ms": statistics.median(rtts) * 1000, "synced_commit_ms": commit_ms}


def floor_ms(request_ms: float, parts: dict[str, float]) -> float:
    """A buy's floor: one frontend request and two majority commits, each a frame round trip and
    one synced commit (``floor_parts``)."""
    return request_ms + 2 * (parts["frame_rtt_ms"] + parts["synced_commit_ms"])


def timed_buys(c: Any, n: int) -> list[tuple[int, int]]:
    out = []
    with c.client() as cl:
        for i in range(n):
            t0 = time.perf_counter_ns()
            cl.buy(1 + i % BOOKS)
            out.append((t0, time.perf_counter_ns()))
    return out


def run(n: int) -> dict[str, Any]:
    settings = h.Settings(quick=True, progress=False)
    books = synthetic(BOOKS, topics=TOPICS, stock=STOCK)
    with tempfile.TemporaryDirectory(prefix="pygmy-trace-") as tmp:
        env = {"PYGMY_TRACE_DIR": tmp,
               "PYTHONPATH": os.pathsep.join([str(HOOKS), str(ROOT), os.environ.get("PYTHONPATH", "")])}
        with h.cluster(settings, books=books, env=env) as c:
            time.sleep(2)
            timed_buys(c, 20)  # warm connections, caches, the first entries
            buys = timed_buys(c, n)
            time.sleep(0.5)  # the services' flushers write every 0.1 s
            events = read_events(Path(tmp))
    out = timeline(buys, events)
    out["floor_parts"] = parts = floor_parts()
    print(f"{n} sequential buys traced: p50 {out['p50_ms']:.2f} ms, mean {out['mean_ms']:.2f} ms; "
          f"{out['complete']} with every step found. Each step's median and mean (ms):")
    for what, m, mean in out["path"]:
        print(f"  {m:6.3f}  {mean:6.3f}  {what}")
    print(f"  {sum(m for _, m, _ in out['path']):6.3f}  {sum(x for *_, x in out['path']):6.3f}  sums")
    print("Beside the path (ms, buys):")
    for what, m, count in out["beside"]:
        print(f"  {m:6.3f}  {what} ({count})")
    path = {what: m for what, m, _ in out["path"]}
    http = path[PATH[0][1]] + path[PATH[-1][1]]
    out["floor_ms"] = floor_ms(http, parts)
    print(f"Floor: the frontend request as measured here ({http:.3f} ms: the first and last steps) + 2 majority "
          f"commits, each a frame round trip ({parts['frame_rtt_ms']:.3f} ms, median between two processes) + "
          f"one synced SQLite commit ({parts['synced_commit_ms']:.3f} ms, median) = {out['floor_ms']:.2f} ms; "
          f"the buy's p50 is {out['p50_ms'] / out['floor_ms']:.2f}x that")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pygmy.experiments.breakdown", description=__doc__.split("\n\n")[0])
    p.add_argument("--buys", type=int, default=300)
    a = p.parse_args(argv)
    run(a.buys)


if __name__ == "__main__":
    main()
