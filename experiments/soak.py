"""Soak: many concurrent clients, a mixed workload, one replica per tier killed and restarted meanwhile.

    .venv/bin/python -m pygmy.experiments.soak [--clients 100] [--duration 60]

Reports what the clients saw (answers by status, errors other than a clear 409 out-of-stock) and the
resident memory of every service's process group (from /proc) after warm-up and at the end, so a
leak shows as growth. It prints numbers and asserts nothing about timing.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import tempfile
import threading
import time
from pathlib import Path

import requests

from pygmy.cluster.launcher import group_members
from pygmy.cluster.local import LocalCluster, free_port_base

MIX = (("lookup", 0.55), ("search", 0.2), ("buy", 0.2), ("order", 0.05))
TOPICS = ("distributed systems", "graduate-school", "Distributed%20Systems", "nothing here")


def group_rss_kib(pgid: int) -> int:
    """Resident memory of every process in one process group (Gunicorn master and workers)."""
    return sum(p.rss_pages for p in group_members([pgid])) * os.sysconf("SC_PAGE_SIZE") // 1024


def memory(c: LocalCluster) -> dict[str, tuple[int, int]]:
    """``{service: (pgid, RSS KiB)}`` for every service with a pid file."""
    return {name: (pgid, group_rss_kib(pgid)) for name, pgid in c.process_groups().items()}


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.answers: collections.Counter[tuple[str, str]] = collections.Counter()
        self.samples: dict[str, list[str]] = {}
        self.orders: list[int] = []

    def add(self, op: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.answers[(op, outcome)] += 1
            if detail and outcome not in ("200", "409"):
                self.samples.setdefault(f"{op} {outcome}", []).append(detail[:160])


def client_loop(url: str, stop: threading.Event, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    ops, weights = zip(*MIX, strict=True)
    session = requests.Session()
    n = 0
    while not stop.is_set():
        op = rng.choices(ops, weights)[0]
        n += 1
        try:
            if op == "lookup":
                r = session.get(f"{url}/lookup/{rng.randint(1, 7)}", timeout=(2, 10))
            elif op == "search":
                r = session.get(f"{url}/search/{rng.choice(TOPICS)}", timeout=(2, 10))
            elif op == "order":
                with tally.lock:
                    known = rng.choice(tally.orders) if tally.orders else 1
                r = session.get(f"{url}/orders/{known}", timeout=(2, 10))
                if r.status_code == 404 and not tally.orders:
                    r.status_code = 200  # nothing bought yet: 404 is the right answer
            else:
                key = f"soak-{seed}-{n}"
                for _ in range(3):  # a 503 during a failover: retry with the same key (exactly once)
                    r = session.post(f"{url}/buy/{rng.randint(1, 7)}", json={"quantity": rng.randint(1, 3)},
                                     headers={"Idempotency-Key": key}, timeout=(2, 15))
                    if r.status_code != 503:
                        break
                if r.status_code == 200:
                    with tally.lock:
                        tally.orders.append(r.json()["order_number"])
            tally.add(op, str(r.status_code), r.text)
        except requests.RequestException as exc:
            tally.add(op, type(exc).__name__, str(exc))


def leader(c: LocalCluster, tier: str) -> str:
    for _ in range(50):
        try:
            name = requests.get(c.url + "/status", timeout=5).json()[tier]["leader"]
            if name:
                return str(name)
        except (requests.RequestException, ValueError, KeyError):
            pass
        time.sleep(0.2)
    return f"{tier}-1"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--warmup", type=float, default=5.0, help="seconds before the first memory sample")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="pygmy-soak-") as tmp:
        c = LocalCluster(Path(tmp) / "data", free_port_base(),
                         ["--restock-every", "2", "--restock-amount", "200"]).start(reset=True)
        try:
            run(c, args)
        finally:
            c.stop()
    return 0


def run(c: LocalCluster, args: argparse.Namespace) -> None:
    tally, stop = Tally(), threading.Event()
    threads = [threading.Thread(target=client_loop, args=(c.url, stop, tally, args.seed * 1000 + i), daemon=True)
               for i in range(args.clients)]
    started = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(args.warmup)
    mem_start = memory(c)
    # One replica per tier, the leader (the harder case): killed a quarter in, restarted ten seconds later.
    plan = [(0.25, "catalog"), (0.5, "order")]
    events = []
    for frac, tier in plan:
        at = started + args.duration * frac
        time.sleep(max(0.0, at - time.monotonic()))
        victim = leader(c, tier)
        c.kill(victim)
        events.append(f"{time.monotonic() - started:6.1f} s  killed {victim}")
        time.sleep(min(10.0, args.duration * 0.15))
        c.restart(victim)
        events.append(f"{time.monotonic() - started:6.1f} s  restarted {victim}")
    time.sleep(max(0.0, started + args.duration - time.monotonic()))
    mem_end = memory(c)
    stop.set()
    for t in threads:
        t.join(timeout=20)
    elapsed = time.monotonic() - started

    total = sum(tally.answers.values())
    print(f"soak: {args.clients} clients, {elapsed:.0f} s, {total} requests ({total / elapsed:.0f}/s)")
    for e in events:
        print("  " + e)
    print("answers (operation, outcome): count")
    for (op, outcome), n in sorted(tally.answers.items()):
        print(f"  {op:7} {outcome:22} {n}")
    bad = {k: n for k, n in tally.answers.items() if k[1] not in ("200", "409")}
    print(f"client errors other than 409: {sum(bad.values())}")
    for what, samples in sorted(tally.samples.items()):
        print(f"  {what}: e.g. {samples[0]!r}")
    print("memory (RSS of each process group, MiB): after warm-up -> end")
    for name in sorted(set(mem_start) | set(mem_end)):
        a, b = mem_start.get(name), mem_end.get(name)
        note = " (restarted: new process)" if a and b and a[0] != b[0] else ""
        fa = f"{a[1] / 1024:7.1f}" if a else "      -"
        fb = f"{b[1] / 1024:7.1f}" if b else "      -"
        print(f"  {name:12} {fa} -> {fb}{note}")


if __name__ == "__main__":
    raise SystemExit(main())
