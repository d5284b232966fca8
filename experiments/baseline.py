"""The machine baseline the experiments divide by: a bare HTTP round trip and an SQLite synced commit.

The bare endpoint is a Flask app with one static JSON answer, served with the frontend's Gunicorn
options (``pygmy.cluster.serve.gunicorn_options``: the same worker class, timeouts, keep-alive, backlog and
request limits, 2 workers as a frontend has by default) but 16 threads per worker where a frontend
worker has 120 (with the default caps), and measured with the same client library, so a ratio to it shows what Pygmy adds to
a Flask app under the same server.

The threads differ because they are sized for different things. A frontend worker's 120
(``ClusterConfig.threads``) are its share of the frontend's caps on requests in flight, 48 writes
and 64 reads, which its workers share so that one worker may hold all of them, plus 8 for control
traffic and the 503s that shed the excess. The bare endpoint has no caps. gthread takes a thread only
while it works on a request (an idle keep-alive connection waits in the event loop), so the 16 are a
limit only when more than 16 requests are in flight in one worker: never for the sequential round
trips and the 2 to 8 closed-loop clients measured here and in ``bench``; only for ``writepath``'s 32
clients (2 workers x 16 threads for 32 connections), and then only if the kernel gives one worker
more than 16 of them, when the excess waits in that worker's queue for a thread instead of waiting
for its GIL among 120 (not measured apart). What else differs is the point of the comparison: the
bare app has none of Pygmy's middleware (admission control, request ids, metrics, access log), so
``AdmissionWorker`` finds nothing to answer from its event loop and runs as plain gthread; a frontend
answers its cached reads from the event loop without a thread, which is how a cached lookup can beat
the bare endpoint.

The commit is SQLite in WAL mode with ``synchronous=FULL``, in the same temporary directory kind the
clusters use: the floor for a durable write.

``python -m pygmy.experiments.baseline --port P [--workers 2]`` serves the bare endpoint;
``python -m pygmy.experiments.baseline --measure [--quick]`` measures and saves ``baseline.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import requests

from pygmy.experiments import harness as h

BOOK = {"item_number": 1, "title": "How to get a good grade in 677 in 20 minutes a day",
        "topic": "distributed systems", "stock": 1000, "cost": 20.0}


def create_app() -> Any:
    from flask import Flask, jsonify

    app = Flask("baseline")

    @app.get("/lookup/<int:n>")
    def lookup(n: int) -> Any:
        return jsonify({**BOOK, "item_number": n})

    @app.post("/buy/<int:n>")
    def buy(n: int) -> Any:
        """A static order: the bare POST the write-path benchmark divides by."""
        return jsonify({"order_number": 1, "item_number": n, "title": BOOK["title"], "quantity": 1,
                        "cost": BOOK["cost"], "total": BOOK["cost"]})

    @app.get("/health")
    def health() -> Any:
        return jsonify({"ok": True})

    return app


def serve(port: int, workers: int) -> None:
    from pygmy.cluster.serve import gunicorn_options, run_gunicorn

    options = gunicorn_options(f"127.0.0.1:{port}", workers=workers, threads=16, name="baseline")
    options["loglevel"] = "warning"
    run_gunicorn(create_app, options)


@contextlib.contextmanager
def server(workers: int = 2, timeout: float = 30) -> Iterator[str]:
    """The bare endpoint as a subprocess on a free port; its URL. Stopped (whole group) afterwards."""
    from pygmy.cluster.local import ROOT

    port = h.free_port_base(1, 1)  # checked free (with the ports above it that we leave alone)
    proc = subprocess.Popen([sys.executable, "-m", "pygmy.experiments.baseline", "--port", str(port),
                             "--workers", str(workers)], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(requests.RequestException):
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"baseline server did not start: {proc.stderr.read() if proc.stderr else ''}")
            time.sleep(0.1)
        yield url
    finally:
        h.stop_group(proc)


def paired_p50(call: Callable[[int], Any], blocks: int, n: int) -> dict[str, Any]:
    """``call(i)``'s sequential p50 in blocks alternating with the bare lookup's (ABAB, the bare
    endpoint started beside whatever ``call`` talks to): each block's ratio is to the bare block
    next to it, so a shared machine that drifts between the parts of a run (by more than the
    goals' margins, within minutes) does not move it. The median ratio, their spread, and the
    p50s over all blocks."""
    from pygmy.client.api import PygmyClient

    with server() as url, PygmyClient(url) as bare:
        for i in range(20):
            bare.lookup(1)
            if i < 10:
                call(i)
        pairs: list[tuple[list[float], list[float]]] = []
        for b in range(blocks):
            pairs.append(([h.timed(lambda: bare.lookup(1))[0] for _ in range(n)],
                          [h.timed(partial(call, b * n + i))[0] for i in range(n)]))
    ratios = [h.stats(mine)["p50"] / h.stats(base)["p50"] for base, mine in pairs]
    return {"ratio": float(np.median(ratios)), "ratios": ratios,
            "bare_p50": h.stats([x for base, _ in pairs for x in base])["p50"],
            "p50": h.stats([x for _, mine in pairs for x in mine])["p50"]}


def sqlite_commits(n: int) -> list[float]:
    """Seconds per durable one-row commit (WAL, synchronous=FULL)."""
    with tempfile.TemporaryDirectory(prefix="pygmy-sqlite-") as d:
        db = sqlite3.connect(Path(d) / "bench.db", isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT)")
        out = []
        for i in range(n):
            t = time.perf_counter()
            db.execute("BEGIN")
            db.execute("INSERT INTO t (v) VALUES (?)", (f"row {i}",))
            db.execute("COMMIT")
            out.append(time.perf_counter() - t)
        db.close()
    return out


def measure(settings: h.Settings, save: bool = True) -> dict[str, Any]:
    """Sequential round trips, closed-loop throughput with several client processes, synced commits."""
    from pygmy.client.api import PygmyClient

    n = settings.size(2000, 300, 30)
    clients = settings.size(8, 4, 2)
    duration = settings.size(10.0, 3.0, 1.0)
    with server() as url:
        with PygmyClient(url) as c:
            for _ in range(20):  # warm the connection and both workers
                c.lookup(1)
            rtt = [h.timed(lambda: c.lookup(1))[0] for _ in range(n)]
        load = h.run_load(url, clients, {"lookup": 1.0}, duration=duration)
    commits = sqlite_commits(settings.size(500, 100, 20))
    result = {
        "http_rtt": h.stats(rtt),
        "http_closed_loop": {"clients": clients, "duration_s": duration, "ops_per_s": load.throughput(),
                             **load.stats()},
        "sqlite_commit": h.stats(commits),
    }
    if save:
        b = result
        table = {"columns": ["measure", "n", "p50 ms", "p95 ms", "p99 ms", "ops/s"],
                 "rows": [["bare HTTP round trip (sequential)", b["http_rtt"]["n"], b["http_rtt"]["p50"],
                           b["http_rtt"]["p95"], b["http_rtt"]["p99"], 1000 / b["http_rtt"]["mean"]],
                          [f"bare HTTP, {clients} closed-loop clients", b["http_closed_loop"]["n"],
                           b["http_closed_loop"]["p50"], b["http_closed_loop"]["p95"], b["http_closed_loop"]["p99"],
                           b["http_closed_loop"]["ops_per_s"]],
                          ["SQLite commit (WAL, synchronous=FULL)", b["sqlite_commit"]["n"], b["sqlite_commit"]["p50"],
                           b["sqlite_commit"]["p95"], b["sqlite_commit"]["p99"], 1000 / b["sqlite_commit"]["mean"]]]}
        h.save(settings, "baseline", {
            "title": "9. Machine baseline",
            "description": "A bare Flask endpoint returning one static book under the frontend's Gunicorn options "
                           "with 2 workers x 16 gthreads (a frontend worker has 120 threads, its share of the "
                           "frontend's caps on requests in flight; see experiments/baseline.py), called with the same client library; and a one-row SQLite "
                           "commit in WAL mode with synchronous=FULL. Each section of a report divides by the "
                           "baseline measured at the start of its own run.",
            "baseline": result, "table": table, "plots": []})
    return result


def of_run(settings: h.Settings) -> dict[str, Any]:
    """The baseline of this run: measured on first use, then reused by every experiment of the run."""
    if "baseline" not in settings.cache:
        settings.cache["baseline"] = measure(settings)
    return settings.cache["baseline"]


def _main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pygmy.experiments.baseline")
    p.add_argument("--port", type=int, help="serve the bare endpoint on this port (foreground)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--measure", action="store_true", help="measure and save baseline.json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--results-dir", type=Path, default=h.RESULTS)
    a = p.parse_args(argv)
    if a.port:
        serve(a.port, a.workers)
        return
    s = h.Settings(quick=a.quick, results_dir=a.results_dir)
    b = measure(s)
    print(f"bare HTTP p50 {b['http_rtt']['p50']:.2f} ms, {b['http_closed_loop']['ops_per_s']:.0f} ops/s with "
          f"{b['http_closed_loop']['clients']} clients; SQLite synced commit p50 {b['sqlite_commit']['p50']:.2f} ms")


if __name__ == "__main__":
    _main()
