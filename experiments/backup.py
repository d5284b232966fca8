"""What an online backup costs as the store grows (issue #43): a cluster started with 7, 100,000
and 1,000,000 books (``pygmy.catalog.books.synthetic``; ``--quick``: 7 and 100,000), four client
threads buying one copy at a time under their own keys, and ``pygmy backup`` taken meanwhile:

- how long the backup takes, and the size of each tier's copy and of the archive;
- the buys' throughput and p50/p99 latency in the seconds before the backup and while it runs.

The catalogue's size is what grows; the order tier holds only this run's orders. The backup runs
as ``pygmy backup`` in a process of its own beside the cluster; its progress lines are kept with
the second each came at.
It prints numbers; nothing here asserts a timing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from pygmy.catalog.books import synthetic
from pygmy.cluster.local import ROOT, LocalCluster, free_port_base
from pygmy.experiments import harness as h

BUYERS = 4
#: Seconds of buys before the backup, after a warm-up second.
BEFORE = 4.0


def stats(latencies: list[float], seconds: float) -> dict[str, float | int | None]:
    if not latencies:
        return {"buys": 0, "per_s": 0.0, "p50_ms": None, "p99_ms": None}
    ms = np.array(latencies) * 1000
    return {"buys": len(latencies), "per_s": round(len(latencies) / seconds, 1),
            "p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2)}


def one_size(books: int, tmp: Path) -> dict[str, Any]:
    path = tmp / f"books-{books}.json"
    path.write_text(json.dumps(synthetic(books, stock=h.BIG_STOCK)))
    started = time.monotonic()
    c = LocalCluster(tmp / f"data-{books}", free_port_base(), ["--books", str(path)]).start(reset=True, timeout=1800)
    ready_s = time.monotonic() - started
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
    with tarfile.open(archive) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))  # type: ignore[arg-type]
    before = [s for t, s in done if t0 - BEFORE <= t < t0]
    during = [s for t, s in done if t0 <= t < t1]
    return {
        "books": books, "ready_s": round(ready_s, 1), "backup_s": round(t1 - t0, 2),
        "catalog_mib": round(manifest["cut"]["catalog"]["bytes"] / 2**20, 1),
        "order_mib": round(manifest["cut"]["order"]["bytes"] / 2**20, 2),
        "archive_mib": round(archive.stat().st_size / 2**20, 1),
        "settled": manifest["settled"], "steps": steps,
        "before": stats(before, BEFORE), "during": stats(during, max(t1 - t0, 1e-9)),
    }


def run(settings: h.Settings) -> dict[str, Any]:
    sizes = settings.size((7, 100_000, 1_000_000), (7, 100_000), (7,))
    rows = []
    with tempfile.TemporaryDirectory(prefix="pygmy-backup-") as tmp:
        for books in sizes:
            row = one_size(books, Path(tmp))
            rows.append(row)
            print(f"{books:>9,} books: backup {row['backup_s']:6.2f} s, catalog copy {row['catalog_mib']:6.1f} MiB, "
                  f"archive {row['archive_mib']:6.1f} MiB; buys before {row['before']['per_s']}/s p50 "
                  f"{row['before']['p50_ms']} ms p99 {row['before']['p99_ms']} ms; during {row['during']['per_s']}/s "
                  f"p50 {row['during']['p50_ms']} ms p99 {row['during']['p99_ms']} ms ({row['during']['buys']} buys)",
                  flush=True)
    out = {"buyers": BUYERS, "rows": rows}
    h.save(settings, "backup", out)
    return out


if __name__ == "__main__":
    h.cli("backup", run)
