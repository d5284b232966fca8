"""The same load on two versions of Pygmy, both up at once, in alternating blocks: what a change did.

``python -m pygmy.experiments.ab --old REV [--new REV] [--load mix|buy|sequential|idle] [--pairs 6] [--seconds 10]``
checks each REV out into a temporary git worktree (``--new`` defaults to this working tree, uncommitted
changes included), starts a default cluster from each (3+3 replicas, 1,000 books, as ``writepath``),
warms both caches, then runs the load on one and then the other, the order swapped every pair. Per
block: requests per second and the cluster's CPU per request (every process of its services, from
``/proc``); at the end the medians over pairs of new/old. This machine's speed drifts by 10-30% within
minutes, more than most changes move a figure: blocks seconds apart see the same machine, so their
ratio is worth more than two runs minutes apart (docs/performance.md).

``mix`` is the 40/40/20 search/lookup/buy mix and ``buy`` the 32 buyers of ``writepath`` (4 processes x
8 threads); ``sequential`` times one buyer's buys (p50), its cluster's CPU per buy and the entries the
order tier's log gained per buy (its commit index: an orphan scan's entry or an election's counts
too, a few thousandths per buy in a block of 200); ``idle`` serves
nothing and takes the cluster's CPU per second (both clusters sit idle through each other's blocks, so
only the block's own cluster is counted); ``catch-up`` is ``recovery.catch_up`` (a catalog follower
killed, ``--updates`` committed without it, restarted): the time from its first status answer until it
has applied them (no CPU figure: the cluster's processes are read from ``/proc`` and the victim is
not the same process before and after).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pygmy.catalog.books import synthetic
from pygmy.cluster.local import ROOT, LocalCluster
from pygmy.experiments import harness as h
from pygmy.experiments import recovery
from pygmy.experiments.writepath import BOOKS, STOCK, TOPICS, cluster_cpu_s, measured_load, warm

LOADS = {"mix": h.MIX_40_40_20, "buy": {"buy": 1.0}}


@contextlib.contextmanager
def checkout(rev: str | None) -> Iterator[Path]:
    """``rev`` in a temporary worktree (removed afterwards), or this working tree for None."""
    if rev is None:
        yield ROOT
        return
    with tempfile.TemporaryDirectory(prefix="pygmy-ab-") as tmp:
        path = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                       capture_output=True, timeout=60)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                           capture_output=True, timeout=60)
            # Whatever happened above, git forgets a worktree whose directory is gone.
            subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], capture_output=True, timeout=60)


def order_entries(cl: Any) -> int:
    """The order tier's commit index (the greatest any replica shows): its log entries so far."""
    return max(int(r.get("commit_index") or 0) for r in cl.status()["order"]["replicas"])


def block(c: LocalCluster, load: str, seconds: float, n: int) -> dict[str, float]:
    """One block of ``load``: throughput (or p50 for ``sequential``) and cluster CPU per operation."""
    if load == "catch-up":  # no CPU figure (module docstring)
        p = recovery.catch_up(c, n, clients=4, timeout=120 + n / 100)
        return {"catch_up_ms": p["catch_up_after_start_s"] * 1000, "errors": p["update_errors"]}
    if load == "sequential":
        with c.client() as cl:
            entries0 = order_entries(cl)
            cpu0 = cluster_cpu_s(c)  # the buys' own: not the status calls' nor the sleep's
            timed = [h.timed(lambda i=i: cl.buy(1 + i % BOOKS)) for i in range(n)]
            cpu = cluster_cpu_s(c) - cpu0
            time.sleep(0.1)  # a confirm's linger (20 ms) is over: it is in the log or taken by a buy
            entries = order_entries(cl) - entries0
        return {"p50_ms": statistics.median(t for t, _ in timed) * 1000,
                "cpu_ms": cpu / n * 1000, "order_entries": entries / n,
                "errors": sum(1 for _, r in timed if isinstance(r, Exception))}
    cpu0 = cluster_cpu_s(c)
    if load == "idle":
        time.sleep(seconds)
        return {"cpu_ms": (cluster_cpu_s(c) - cpu0) / seconds * 1000, "errors": 0}
    b = measured_load(c, LOADS[load], seconds)
    return {"ops_per_s": b["ops_per_s"], "cpu_ms": b["cpu_ms_per_op"] or 0.0, "errors": b["errors"]}


def run(old: str, new: str | None, load: str, pairs: int, seconds: float, n: int) -> dict[str, Any]:
    settings = h.Settings(quick=True, progress=False)
    books = synthetic(BOOKS, topics=TOPICS, stock=STOCK)
    out: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    with contextlib.ExitStack() as stack:
        roots = {"old": stack.enter_context(checkout(old)), "new": stack.enter_context(checkout(new))}
        clusters = {k: stack.enter_context(h.cluster(settings, books=books, root=r)) for k, r in roots.items()}
        time.sleep(2)  # let start-up settle
        for c in clusters.values():
            warm(c)
        for k in range(pairs):
            for name in ("old", "new") if k % 2 == 0 else ("new", "old"):
                b = block(clusters[name], load, seconds, n)
                out[name].append(b)
                figure = {"sequential": f"{b.get('p50_ms', 0):.2f} ms p50, {b.get('order_entries', 0):.3f} order "
                                        "entries per buy, ", "idle": "",
                          "catch-up": f"caught up {b.get('catch_up_ms', 0):.0f} ms after answering, "}.get(
                    load, f"{b.get('ops_per_s', 0):.0f} req/s, ")
                per = "per second" if load == "idle" else "per operation"
                cpu = f"{b['cpu_ms']:.3f} ms of CPU {per}, " if "cpu_ms" in b else ""
                print(f"pair {k + 1} {name}: {figure}{cpu}{b['errors']:.0f} errors", flush=True)
    key = {"sequential": "p50_ms", "idle": None, "catch-up": "catch_up_ms"}.get(load, "ops_per_s")
    label = {"sequential": "p50", "catch-up": "catch-up time"}.get(load, "throughput")
    measures = [(key, label)] if key else []
    if load != "catch-up":
        measures.append(("cpu_ms", "CPU per second" if load == "idle" else "CPU per operation"))
    if load == "sequential":
        measures.append(("order_entries", "order entries per buy"))
    ratios = {m: [nb[m] / ob[m] if ob[m] else float("nan") for ob, nb in zip(out["old"], out["new"], strict=True)]
              for m, _ in measures}
    for m, label in measures:
        r = ratios[m]
        print(f"new/old {label}: median {statistics.median(r):.3f} over {len(r)} pairs "
              f"({min(r):.3f}-{max(r):.3f})")
    return {"blocks": out, "ratios": ratios}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pygmy.experiments.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="the revision to compare against (e.g. HEAD~1)")
    p.add_argument("--new", help="the revision measured (default: this working tree)")
    p.add_argument("--load", choices=[*LOADS, "sequential", "idle", "catch-up"], default="mix")
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--seconds", type=float, default=10.0, help="length of one block of mix, buy or idle")
    p.add_argument("--buys", type=int, default=200, help="buys in one block of sequential")
    p.add_argument("--updates", type=int, default=10_000, help="commands a follower misses in one block of catch-up")
    a = p.parse_args(argv)
    run(a.old, a.new, a.load, a.pairs, a.seconds, a.updates if a.load == "catch-up" else a.buys)


if __name__ == "__main__":
    main()
