"""Bounded growth (#14): steady buying for ten minutes with a short key window, and what each replica
keeps over time: idempotency keys (catalog table, order keys), orders, and Raft log entries and bytes;
and the p50 of status, a cached lookup and a buy, one at a time, fresh and again after the orders.

    python -m pygmy.experiments.growth [--quick] [--minutes 10] [--window 120]

Past the key window the key counts stop growing (a key is forgotten once older than the window) and
the log stops growing once compaction keeps pace; the orders themselves are kept, and grow. Counts
are read from each replica's SQLite files, beside the running replica (WAL readers), every few
seconds. It prints the table and plots the series; it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from pygmy.client.api import PygmyClient, PygmyError
from pygmy.experiments import harness as h

REPLICAS = [f"{t}-{k}" for t in ("catalog", "order") for k in (1, 2, 3)]


def _count(path: Path, sql: str) -> int:
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5) as db:
            return int(db.execute(sql).fetchone()[0] or 0)
    except sqlite3.Error:
        return -1  # a replica being restarted, or its file being swapped by a snapshot


def sample(data_dir: Path, name: str) -> dict[str, int]:
    state, raft = data_dir / name / "state.db", data_dir / name / "raft.db"
    out = {"log_entries": _count(raft, "SELECT COUNT(*) FROM raft_log"),
           "log_bytes": _count(raft, "SELECT SUM(LENGTH(command)) FROM raft_log")}
    if name.startswith("catalog"):
        out["keys"] = _count(state, "SELECT COUNT(*) FROM idempotency")
    else:
        out["keys"] = _count(state, "SELECT COUNT(*) FROM orders WHERE key IS NOT NULL")
        out["orders"] = _count(state, "SELECT COUNT(*) FROM orders")
    return out


def _buyer(url: str, token: str, stop: threading.Event, seed: int, bought: list[int]) -> None:
    with PygmyClient(url, timeout=10, token=token) as client:
        n = 0
        while not stop.is_set():
            n += 1
            item = (seed + n) % 7 + 1
            try:
                client.buy(item, key=f"growth-{seed}-{n}")
                bought[seed] += 1
            except PygmyError as exc:
                if exc.status == 409:  # sold out: deliver more and go on
                    with contextlib.suppress(PygmyError):
                        client.update(item, stock_delta=10_000)


def quiet_p50s(c: Any, n: int) -> dict[str, dict[str, Any]]:
    """One client, one request at a time, on a quiet cluster: the costs that must not grow with the
    orders kept (``/status`` of the frontend and of the catalog leader, a cached lookup, a buy)."""
    leader = h.leader(c, "catalog")
    with c.client() as client:
        out = {"frontend_status": h.stats([h.timed(client.status)[0] for _ in range(n)]),
               "replica_status": h.stats([h.timed(lambda: c.replica_get(leader, "/status"))[0] for _ in range(n)]),
               "lookup": h.stats([h.timed(lambda i=i: client.lookup(1 + i % 7))[0] for i in range(n)])}
        client.update(4, stock_delta=n)  # enough stock for the buys below, whatever was sold
        out["buy"] = h.stats([h.timed(lambda: client.buy(4))[0] for _ in range(n)])
    return out


def run(settings: h.Settings, minutes: float | None = None, window: float | None = None,
        clients: int = 8) -> dict[str, Any]:
    minutes = minutes if minutes is not None else settings.size(10.0, 2.0, 0.4)
    window = window if window is not None else settings.size(120.0, 30.0, 10.0)
    every = settings.size(10.0, 5.0, 2.0)
    series: list[dict[str, Any]] = []
    n = settings.size(200, 100, 10)
    with h.cluster(settings, "--key-window", str(window)) as c:
        quiet_p50s(c, max(5, n // 4))  # warm-up (connections, caches, a cluster just started): not kept
        fresh = quiet_p50s(c, n)
        stop = threading.Event()
        bought = [0] * clients
        threads = [threading.Thread(target=_buyer, args=(c.url, c.admin_token(), stop, i, bought), daemon=True)
                   for i in range(clients)]
        started = time.monotonic()
        for t in threads:
            t.start()
        try:
            while (elapsed := time.monotonic() - started) < minutes * 60:
                series.append({"t": round(elapsed, 1), "buys": sum(bought),
                               **{name: sample(c.data_dir, name) for name in REPLICAS}})
                time.sleep(every)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=15)
        series.append({"t": round(time.monotonic() - started, 1), "buys": sum(bought),
                       **{name: sample(c.data_dir, name) for name in REPLICAS}})
        time.sleep(every)  # let the last batches, confirms and compactions finish: a quiet cluster again
        quiet_p50s(c, max(5, n // 4))
        grown = quiet_p50s(c, n)
    last = series[-1]
    # "Stopped growing": the largest value in the last third of the run against the largest before.
    cut = [s for s in series if s["t"] >= window * 1.5] or series[-1:]

    def peak(name: str, what: str, rows: list[dict[str, Any]]) -> int:
        return max(r[name][what] for r in rows)

    rows = []
    for name in REPLICAS:
        rows.append([name, peak(name, "keys", series), last[name]["keys"], peak(name, "keys", cut),
                     last[name].get("orders", "-"), peak(name, "log_entries", series),
                     round(peak(name, "log_bytes", series) / 2**20, 1)])
    columns = ["replica", "keys max", "keys at end", f"keys max after {window * 1.5:.0f} s", "orders at end",
               "log entries max", "log MiB max"]
    print(f"growth: {sum(bought)} buys in {last['t']:.0f} s by {clients} clients, key window {window:.0f} s")
    width = [max(len(str(x)) for x in col) for col in zip(columns, *rows, strict=True)]
    for line in [columns, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, width, strict=True)))
    orders = last["order-1"].get("orders", 0)
    costs = [[op, f"{fresh[op]['p50']:.2f}", f"{grown[op]['p50']:.2f}", f"{grown[op]['p50'] / fresh[op]['p50']:.2f}x"]
             for op in fresh]
    print(f"p50 (ms), one request at a time on the quiet cluster: fresh, then after {orders} orders")
    for row in [["operation", "fresh", f"after {orders} orders", "ratio"], *costs]:
        print("  ".join(f"{x:<18}" for x in row))
    plots = [_plot(settings, series, window)]
    data = {"title": "12. Bounded growth under steady buying",
            "description": f"{clients} clients buying for {minutes:g} min with a {window:g} s key window; what each "
                           "replica keeps, sampled from its files. See experiments/growth.py.",
            "window_s": window, "buys": sum(bought), "series": series, "fresh": fresh, "grown": grown,
            "costs": {"columns": ["operation", "fresh p50 ms", f"after {orders} orders p50 ms", "ratio"],
                      "rows": costs},
            "table": {"columns": columns, "rows": rows}, "plots": plots}
    h.save(settings, "growth", data)
    return data


def _plot(settings: h.Settings, series: list[dict[str, Any]], window: float) -> str:
    fig, axes = h.figure(1, 3, figsize=(15, 4))
    t = [s["t"] for s in series]
    for name in ("catalog-1", "order-1"):
        axes[0].plot(t, [s[name]["keys"] for s in series], label=f"{name} keys")
        axes[1].plot(t, [s[name]["log_entries"] for s in series], label=f"{name} log entries")
    axes[0].plot(t, [s["order-1"]["orders"] for s in series], label="order-1 orders (kept)", linestyle="--")
    axes[0].plot(t, [s["buys"] for s in series], label="buys answered", linestyle=":")
    rate = [(b["buys"] - a["buys"]) / max(b["t"] - a["t"], 1e-9) for a, b in zip(series, series[1:], strict=False)]
    axes[2].plot(t[1:], rate, label="buys/s")
    for ax in axes[:2]:
        ax.axvline(window, color="grey", linestyle=":", label="key window")
    axes[0].set_title("idempotency keys and orders")
    axes[1].set_title("Raft log entries")
    axes[2].set_title("buying rate")
    for ax in axes:
        ax.set_xlabel("seconds")
        ax.legend(fontsize=8)
    return h.save_plot(settings, fig, "growth")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pygmy.experiments.growth")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--minutes", type=float)
    p.add_argument("--window", type=float, help="key window in seconds")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--results-dir", type=Path, default=h.RESULTS)
    p.add_argument("--plots-dir", type=Path, default=h.PLOTS)
    a = p.parse_args(argv)
    s = h.Settings(quick=a.quick, results_dir=a.results_dir, plots_dir=a.plots_dir)
    run(s, a.minutes, a.window, a.clients)


if __name__ == "__main__":
    main()
