"""What an online backup and a restore cost as the store grows (issue #43): a store of 7, 100,000
and 1,000,000 books (``pygmy.catalog.books.synthetic``), the last holding 100,000 orders
(``--quick``: 7 and 100,000 books, then 100,000 books holding 10,000 orders), four client threads
buying one copy at a time under their own keys, and ``pygmy backup`` taken meanwhile; then that
archive restored with ``pygmy restore`` into a fresh data dir, with nothing else running:

- how long the backup takes, and the size of each tier's copy and of the archive;
- the buys' throughput and p50/p99 latency in the seconds before the backup and while it runs;
- how long ``pygmy restore`` takes until it says ready: the archive checked (``--verify``'s checks),
  every replica's state written, every replica's digest recomputed from the rows of its state file
  and found equal to the archive's, then the cluster started.

A store without orders is started with ``pygmy up --books`` and holds only this run's orders. A
store with orders is BUILT OFFLINE first, with the tiers' own state code and nothing else: the seed
as ``pygmy up`` builds it, then the buys as the order and catalog leaders log them (intents, then
the decrements under the same keys, then the confirms, 50 buys to a log entry, each applied by
``OrderState``/``CatalogState.apply_many``), one to three copies each of a book drawn at random,
created over the 12 hours before (within the default 24-hour key window: every key still
remembered). That store is archived by ``pygmy.cluster.backup.write_archive``, checked by ``pygmy
backup --verify`` (stock = initial + added - sold, book by book) and started with ``pygmy restore``;
the backup measured is of the store so started. The backup runs as ``pygmy backup`` in a process
of its own beside the cluster; its progress lines, and the restore's, are kept with the second each
came at. It prints numbers; nothing here asserts a timing.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from pygmy.catalog.books import synthetic
from pygmy.catalog.state import CatalogState, build_seed
from pygmy.cluster import backup as archives
from pygmy.cluster.local import ROOT, LocalCluster, free_port_base, pygmy
from pygmy.experiments import harness as h
from pygmy.kit.config import ClusterConfig
from pygmy.order.state import OrderState

BUYERS = 4
#: Seconds of buys before the backup, after a warm-up second.
BEFORE = 4.0
#: Buys to a log entry in a store built offline (intents, decrements and confirms alike).
BUILD_BATCH = 50
#: Buys applied to both tiers' copies at a time (each tier's part in one transaction).
BUILD_CHUNK = 5_000
#: A built store's orders were created over this many seconds before it was built.
BUILD_SPAN = 12 * 3600.0


def stats(latencies: list[float], seconds: float) -> dict[str, float | int | None]:
    if not latencies:
        return {"buys": 0, "per_s": 0.0, "p50_ms": None, "p99_ms": None}
    ms = np.array(latencies) * 1000
    return {"buys": len(latencies), "per_s": round(len(latencies) / seconds, 1),
            "p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2)}


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds")


def build_store(books_path: Path, books: list[dict[str, Any]], orders: int, dest: Path, seed: int = 43) -> dict[str, Any]:
    """Write ``dest``, the archive of a store of ``books`` (named by ``books_path`` in its settings)
    holding ``orders`` confirmed orders, built with the tiers' own commands (the module's docstring
    says how); its manifest. Checked as every archive is before it is written."""
    started, t0 = time.time(), time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=dest.parent))
    rng = random.Random(seed)
    try:
        build_seed(books, work / "seed.db")
        catalog, ledger = CatalogState(work / "catalog.db"), OrderState(work / "order.db")
        try:
            catalog.restore(0, work / "seed.db")  # as a new catalog replica begins
            ci = oi = 0
            for start in range(0, orders, BUILD_CHUNK):
                buys = [(f"built-{n}", rng.randint(1, len(books)), rng.randint(1, 3),
                         started - BUILD_SPAN + n * BUILD_SPAN / orders) for n in range(start, min(start + BUILD_CHUNK, orders))]
                groups = [buys[g:g + BUILD_BATCH] for g in range(0, len(buys), BUILD_BATCH)]
                intents = [(oi + 1 + j, {"op": "batch", "commands": [
                    {"op": "intent", "key": k, "item": i, "quantity": q, "created_at": _iso(at)} for k, i, q, at in g]})
                    for j, g in enumerate(groups)]
                oi += len(groups)
                decrements = [(ci + 1 + j, {"op": "decrements", "keyed": 1, "items": [
                    {"key": k, "item": i, "quantity": q, "at": at} for k, i, q, at in g]}) for j, g in enumerate(groups)]
                ci += len(groups)
                taken = catalog.apply_many(decrements)
                confirms = []
                for j, (g, (result, exc)) in enumerate(zip(groups, taken, strict=True)):
                    if exc is not None or not all(r["ok"] for r in result["results"]):
                        raise RuntimeError(f"a built decrement failed: {exc or result}")
                    confirms.append((oi + 1 + j, {"op": "batch", "commands": [
                        {"op": "confirm", "key": k, "title": r["book"]["title"], "cost": r["book"]["cost"], "at": at}
                        for (k, _, _, at), r in zip(g, result["results"], strict=True)]}))
                oi += len(groups)
                for _, exc in ledger.apply_many(intents) + ledger.apply_many(confirms):
                    if exc is not None:
                        raise RuntimeError(f"a built order command failed: {exc}")
            cut = {tier: {"replica": "built offline", "index": state.applied_index(), "bytes": state.size_bytes()}
                   for tier, state in (("catalog", catalog), ("order", ledger))}
        finally:
            catalog.close_all()
            ledger.close_all()
        return archives.write_archive(work, ClusterConfig(books=str(books_path)), dest, cut, {}, started, t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _steps(c: LocalCluster, since: float, prefix: str) -> list[tuple[float, str]]:
    """The lines of ``c``'s output that begin with ``prefix``, each with its second after ``since``."""
    return [(round(t - since, 2), line.strip().removeprefix(prefix)[:60]) for t, line in c.stamped
            if line.startswith(prefix)]


def restored(archive: Path, data_dir: Path) -> tuple[LocalCluster, float, list[tuple[float, str]]]:
    """``pygmy restore ARCHIVE`` into ``data_dir``, running; seconds until it said ready, and its lines."""
    c = LocalCluster(data_dir, free_port_base(), [], command=("restore", str(archive)))
    t0 = time.monotonic()
    c.start(timeout=1800)
    return c, time.monotonic() - t0, _steps(c, t0, "pygmy ")


def one_size(books: int, orders: int, tmp: Path) -> dict[str, Any]:
    path = tmp / f"books-{books}.json"
    catalogue = synthetic(books, stock=h.BIG_STOCK)
    path.write_text(json.dumps(catalogue))
    row: dict[str, Any] = {"books": books, "orders_built": orders}
    started = time.monotonic()
    if orders:
        built = tmp / f"built-{books}-{orders}.tar"
        build_store(path, catalogue, orders, built)
        row["build_s"] = round(time.monotonic() - started, 1)
        del catalogue
        t = time.monotonic()
        check = pygmy("backup", "--verify", str(built), timeout=1800)
        if check.returncode != 0:
            raise RuntimeError(f"pygmy backup --verify refused the built store: {check.stderr}")
        row["built_verify_s"] = round(time.monotonic() - t, 1)
        c, ready_s, _ = restored(built, tmp / f"data-{books}")
        built.unlink()
        row["start"] = "built offline, then pygmy restore"
    else:
        del catalogue
        c = LocalCluster(tmp / f"data-{books}", free_port_base(), ["--books", str(path)]).start(reset=True, timeout=1800)
        ready_s = time.monotonic() - started
        row["start"] = "pygmy up --books"
    row["ready_s"] = round(ready_s, 1)
    done: list[tuple[float, float]] = []  # (when it began, seconds), monotonic
    stop = threading.Event()

    def buyer(k: int) -> None:
        with c.client() as client:
            i = 0
            while not stop.is_set():
                t = time.monotonic()
                client.buy(1 + (i + k) % 7, key=f"backup-{uuid.uuid4().hex}")
                done.append((t, time.monotonic() - t))
                i += 1

    threads = [threading.Thread(target=buyer, args=(k,), daemon=True) for k in range(BUYERS)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.0 + BEFORE)
        archive = tmp / f"store-{books}.tar"
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "pygmy.cluster.cli", "backup", str(archive), "--data-dir",
                                 str(c.data_dir)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
        assert proc.stderr is not None
        steps = [(round(time.monotonic() - t0, 2), line.strip().removeprefix("pygmy backup: ")[:60])
                 for line in proc.stderr]
        if proc.wait() != 0:
            raise RuntimeError(f"pygmy backup failed: {steps}")
        t1 = time.monotonic()
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        c.stop()
    shutil.rmtree(c.data_dir, ignore_errors=True)
    with tarfile.open(archive) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))  # type: ignore[arg-type]
    r, restore_s, restore_steps = restored(archive, tmp / f"restored-{books}")
    try:
        with r.client() as client:  # it serves: a buy on the restored store
            client.buy(1, key=f"restored-{uuid.uuid4().hex}")
    finally:
        r.stop()
    shutil.rmtree(r.data_dir, ignore_errors=True)
    before = [s for t, s in done if t0 - BEFORE <= t < t0]
    during = [s for t, s in done if t0 <= t < t1]
    row.update({
        "orders": manifest["state"]["orders"], "backup_s": round(t1 - t0, 2),
        "catalog_mib": round(manifest["cut"]["catalog"]["bytes"] / 2**20, 1),
        "order_mib": round(manifest["cut"]["order"]["bytes"] / 2**20, 1),
        "archive_mib": round(archive.stat().st_size / 2**20, 1), "restore_s": round(restore_s, 1),
        "settled": manifest["settled"], "steps": steps, "restore_steps": restore_steps,
        "before": stats(before, BEFORE), "during": stats(during, max(t1 - t0, 1e-9)),
    })
    archive.unlink()
    return row


def _cut_after(row: dict[str, Any]) -> float | None:
    """From the first copy asked for to the third copy in: what the replicas themselves spend."""
    asked = [t for t, line in row["steps"] if "asking for a copy" in line]
    copied = [t for t, line in row["steps"] if "copied" in line]
    return round(copied[-1] - asked[0], 2) if asked and copied else None


def table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    columns = ["books", "orders", "started by", "backup s", "cut taken after s", "catalog copy MiB",
               "order copy MiB", "archive MiB", "restore s", "buys/s before, during", "buy p50 ms before, during",
               "buy p99 ms before, during"]
    return {"columns": columns, "rows": [
        [r["books"], r["orders"], r["start"], r["backup_s"], _cut_after(r), r["catalog_mib"], r["order_mib"],
         r["archive_mib"], r["restore_s"], f"{r['before']['per_s']}, {r['during']['per_s']}",
         f"{r['before']['p50_ms']}, {r['during']['p50_ms']}", f"{r['before']['p99_ms']}, {r['during']['p99_ms']}"]
        for r in rows]}


def built_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stores built offline: how long building, checking and starting each took."""
    built = [r for r in rows if r.get("orders_built")]
    return [{"caption": "The stores built offline before their run: built (seed and buys, archived), checked by "
                        "pygmy backup --verify, started by pygmy restore (until ready)",
             "columns": ["books", "orders built", "build s", "verify s", "restore s"],
             "rows": [[r["books"], r["orders_built"], r["build_s"], r["built_verify_s"], r["ready_s"]] for r in built]
             }] if built else []


def run(settings: h.Settings) -> dict[str, Any]:
    sizes = settings.size(((7, 0), (100_000, 0), (1_000_000, 100_000)), ((7, 0), (100_000, 0), (100_000, 10_000)),
                          ((7, 0), (7, 200)))
    rows = []
    with tempfile.TemporaryDirectory(prefix="pygmy-backup-") as tmp:
        for books, orders in sizes:
            row = one_size(books, orders, Path(tmp))
            rows.append(row)
            print(f"{books:>9,} books, {row['orders']:>7,} orders ({row['start']}): backup {row['backup_s']:6.2f} s, "
                  f"archive {row['archive_mib']:6.1f} MiB, restore {row['restore_s']:6.1f} s; buys before "
                  f"{row['before']['per_s']}/s p50 {row['before']['p50_ms']} ms p99 {row['before']['p99_ms']} ms; "
                  f"during {row['during']['per_s']}/s p50 {row['during']['p50_ms']} ms p99 {row['during']['p99_ms']} ms "
                  f"({row['during']['buys']} buys)", flush=True)
    out = {"title": "17. Online backup and restore", "description": (__doc__ or "").strip().replace("\n", " "),
           "buyers": BUYERS, "rows": rows, "table": table(rows),
           "tables": built_table(rows), "plots": []}
    h.save(settings, "backup", out)
    return out


if __name__ == "__main__":
    h.cli("backup", run)
