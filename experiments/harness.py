"""What every experiment shares: sizes, clusters, load generators, statistics, result files, plots.

Load comes from separate client *processes* (a forked pool, each a closed or open loop), so the
Python client is not the bottleneck and the GIL of one client never serialises the others.
Percentiles are always computed from the complete list of latencies, never from averages.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pygmy.catalog.books import DEFAULT_BOOKS  # noqa: E402
from pygmy.client.api import PygmyClient, PygmyError  # noqa: E402
from pygmy.cluster.local import LocalCluster, free_port_base  # noqa: E402

PACKAGE = Path(__file__).resolve().parent
RESULTS = PACKAGE / "results"
PLOTS = PACKAGE.parent / "plots"
#: Stock so large that no experiment ever sees "out of stock" (409) by accident.
BIG_STOCK = 10**9
DEFAULT_TOPICS = ("distributed systems", "graduate school")


@dataclass
class Settings:
    """Run size and where output goes; tests pass ``tiny=True`` and tmp dirs."""

    quick: bool = False
    tiny: bool = False
    results_dir: Path = RESULTS
    plots_dir: Path = PLOTS
    progress: bool = True
    #: A running default cluster (7 books, big stock, 3 replicas) experiments may reuse (tests do).
    shared: LocalCluster | None = None
    cache: dict[str, Any] = field(default_factory=dict)

    def size(self, full: Any, quick: Any, tiny: Any = None) -> Any:
        if self.tiny:
            return quick if tiny is None else tiny
        return quick if self.quick else full

    @property
    def label(self) -> str:
        return "tiny" if self.tiny else "quick" if self.quick else "full"


def cli(name: str, run: Callable[[Settings], dict[str, Any]], argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The command line every experiment module shares: ``python -m pygmy.experiments.<name> [--quick]``."""
    p = argparse.ArgumentParser(prog=f"python -m pygmy.experiments.{name}")
    p.add_argument("--quick", action="store_true", help="small sizes: a few seconds to a minute")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--plots-dir", type=Path, default=PLOTS)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    s = Settings(quick=a.quick, results_dir=a.results_dir, plots_dir=a.plots_dir, progress=not a.no_progress)
    return run(s)


def progress(settings: Settings, it: Any, **kw: Any) -> Any:
    if not settings.progress:
        return it
    from tqdm import tqdm

    return tqdm(it, leave=False, dynamic_ncols=True, **kw)


# -- machine and result files ------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    mem = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cores": os.cpu_count(), "memory_gib": round(mem / 2**30, 1), "cpu": cpu,
            "python": platform.python_version(), "platform": platform.platform(),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "load_1min": load}


def save(settings: Settings, name: str, data: dict[str, Any]) -> Path:
    settings.results_dir.mkdir(parents=True, exist_ok=True)
    data = {"experiment": name, "size": settings.label, "machine": machine(), **data}
    path = settings.results_dir / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=_jsonable))
    return path


def _jsonable(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(type(o).__name__)


def save_csv(settings: Settings, name: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> Path:
    settings.results_dir.mkdir(parents=True, exist_ok=True)
    path = settings.results_dir / f"{name}.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def figure(rows: int = 1, cols: int = 1, **kw: Any) -> tuple[Any, Any]:
    kw.setdefault("figsize", (9, 4.8 if rows == 1 else 3.2 * rows))
    return plt.subplots(rows, cols, **kw)


def save_plot(settings: Settings, fig: Any, name: str) -> str:
    settings.plots_dir.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(settings.plots_dir / f"{name}.png", dpi=110)
    plt.close(fig)
    return f"{name}.png"


# -- statistics --------------------------------------------------------------------------------------
def stats(latencies_s: Sequence[float]) -> dict[str, Any]:
    """Summary in milliseconds from the complete record of latencies (seconds)."""
    if not len(latencies_s):
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p95": None, "p99": None, "max": None, "min": None}
    a = np.asarray(latencies_s, dtype=float) * 1000
    p50, p90, p95, p99 = np.percentile(a, [50, 90, 95, 99])
    return {"n": int(a.size), "mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p95": float(p95),
            "p99": float(p99), "max": float(a.max()), "min": float(a.min())}


def ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{digits}f}"
    return str(v)


# -- clusters ----------------------------------------------------------------------------------------
def write_books(path: Path, books: list[dict[str, Any]] | None = None) -> Path:
    """The seven Pygmy books with a stock no experiment can exhaust (or ``books`` as given)."""
    books = books if books is not None else [{**b, "stock": BIG_STOCK} for b in DEFAULT_BOOKS]
    path.write_text(json.dumps(books))
    return path


@contextlib.contextmanager
def cluster(settings: Settings, *args: str, books: list[dict[str, Any]] | None = None,
            keep: bool = False, root: Path | None = None, env: dict[str, str] | None = None) -> Iterator[LocalCluster]:
    """A fresh local cluster (stopped and removed afterwards, even on failure), running the code of
    the checkout ``root`` (default: this one).

    With no extra arguments, the default books and no ``env`` (added to every service's environment),
    the shared cluster in ``settings`` is reused.
    """
    if settings.shared is not None and not args and books is None and root is None and env is None:
        yield settings.shared
        return
    tmp = Path(tempfile.mkdtemp(prefix="pygmy-exp-"))
    books_file = write_books(tmp / "books.json", books)
    c = LocalCluster(tmp / "data", free_port_base(), ["--books", str(books_file), *args], env,
                     **({"root": root} if root is not None else {}))
    try:
        c.start(reset=True, timeout=180)
        wait_healthy(c)
        yield c
    finally:
        c.stop()
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def tier_status(c: LocalCluster, tier: str) -> dict[str, Any]:
    return c.client().status()[tier]


def leader(c: LocalCluster, tier: str, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(PygmyError):
            name = tier_status(c, tier).get("leader")
            if name:
                return name
        time.sleep(0.1)
    raise RuntimeError(f"no {tier} leader within {timeout} s\n{c.logs_tail()}")


def replica_status(c: LocalCluster, name: str, timeout: float = 0.5) -> dict[str, Any] | None:
    try:
        r = c.replica_get(name, "/status", timeout=timeout)
        return r.json() if r.status_code == 200 else None
    except Exception:  # down, starting, or answering garbage: all mean "not there yet"
        return None


def snapshots_installed(c: LocalCluster, name: str) -> int:
    """Snapshots the replica ``name`` has installed over all its runs (its log says so each time)."""
    log = c.data_dir / "logs" / f"{name}.log"
    return log.read_text(errors="replace").count("installed a snapshot") if log.exists() else 0


def wait_caught_up(c: LocalCluster, tier: str, timeout: float = 60) -> None:
    """Until every replica of ``tier`` answers and has applied the leader's commit index (the
    replicas the frontend names, asked again each round: it learns a membership change in seconds)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    names: list[str] = []
    while time.monotonic() < deadline:
        with contextlib.suppress(PygmyError, KeyError, TypeError):
            names = [r["name"] for r in tier_status(c, tier)["replicas"]]
        sts = [replica_status(c, n) for n in names]
        lead = [s for s in sts if s and s.get("role") == "leader"]
        if lead and all(s and s.get("applied_index", -1) >= lead[0]["commit_index"] for s in sts):
            return
        last = sts
        time.sleep(0.1)
    raise RuntimeError(f"{tier} replicas not caught up within {timeout} s: {last}")


def wait_healthy(c: LocalCluster, timeout: float = 60) -> None:
    for tier in ("catalog", "order"):
        leader(c, tier, timeout)
    c.client().lookup(1)


# -- load generation ---------------------------------------------------------------------------------
@dataclass
class Job:
    url: str
    mix: dict[str, float]
    start_at: float  # wall clock (time.time), shared by all processes of one run
    count: int | None = None  # operations per process (closed loop), or
    duration: float | None = None  # seconds
    rate: float | None = None  # open loop: requests per second from this process
    phase: float = 0.0  # open loop: offset of this process's schedule
    items: int = 7
    topics: tuple[str, ...] = DEFAULT_TOPICS
    zipf: float | None = None
    token: str | None = None
    seed: int = 0
    timeout: float = 10.0
    threads: int = 1  # closed-loop clients in this process, each with its own connection


#: The 40/40/20 search/lookup/buy mix of the original study and of issue #10, one definition for every
#: experiment that runs it.
MIX_40_40_20 = {"search": 0.4, "lookup": 0.4, "buy": 0.2}
OPS = ("search", "lookup", "buy", "update")
#: End of the current run in seconds after start_at, settable while it runs (forked children inherit it).
_STOP: Any = None
#: Start barrier: children count themselves ready, then wait for the parent to publish start_at.
_READY: Any = None
_START: Any = None


def _chooser(job: Job, rng: random.Random) -> Callable[[], int]:
    if job.zipf is None:
        return lambda: rng.randint(1, job.items)
    weights = 1.0 / np.arange(1, job.items + 1) ** job.zipf
    cdf = np.cumsum(weights) / weights.sum()
    perm = np.random.default_rng(12345).permutation(job.items) + 1  # popular items spread over the range
    return lambda: int(perm[min(int(np.searchsorted(cdf, rng.random())), job.items - 1)])


def _worker(job: Job) -> list[tuple[str, float, float, int]]:
    """One client process: returns (op, start s after start_at, latency s, HTTP status or 0) per request,
    from ``job.threads`` closed-loop threads (one, the process itself, by default)."""
    start_at = job.start_at
    if _READY is not None and _START is not None:
        with _READY.get_lock():
            _READY.value += 1
        while _START.value == 0:
            time.sleep(0.002)
        start_at = _START.value
    if job.threads <= 1:
        return _client_loop(job, start_at, job.seed)
    results: list[list[tuple[str, float, float, int]]] = [[] for _ in range(job.threads)]

    def run(k: int) -> None:
        results[k] = _client_loop(job, start_at, job.seed * 100 + k)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(job.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for rs in results for r in rs]


def _client_loop(job: Job, start_at: float, seed: int) -> list[tuple[str, float, float, int]]:
    """One client's loop. Open loop: a request's start is its *scheduled* time, so waiting behind a
    slow reply counts against the system (no coordinated omission)."""
    rng = random.Random(seed)
    item = _chooser(job, rng)
    ops, weights = zip(*job.mix.items(), strict=True)
    out: list[tuple[str, float, float, int]] = []
    with PygmyClient(job.url, timeout=job.timeout, token=job.token, pool=2) as c:
        calls: dict[str, Callable[[], Any]] = {
            "search": lambda: c.search(rng.choice(job.topics)),
            "lookup": lambda: c.lookup(item()),
            "buy": lambda: c.buy(item(), key=uuid.uuid4().hex),
            "update": lambda: c.update(item(), stock_delta=1),
        }
        time.sleep(max(0.0, start_at - time.time()))
        t0, offset = time.perf_counter(), time.time() - start_at  # monotonic clock, start_at timebase
        i = 0
        while True:
            if job.count is not None and i >= job.count:
                break
            if job.rate:
                scheduled = job.phase + i / job.rate
                if job.duration is not None and scheduled >= job.duration:
                    break
                delay = scheduled - (time.perf_counter() - t0 + offset)
                if delay > 0:
                    time.sleep(delay)
                start = scheduled
            else:
                start = time.perf_counter() - t0 + offset
                if job.duration is not None and start >= job.duration:
                    break
            if _STOP is not None and start >= _STOP.value:
                break
            op = rng.choices(ops, weights)[0]
            status = 200
            try:
                calls[op]()
            except PygmyError as exc:
                status = exc.status
            out.append((op, start, time.perf_counter() - t0 + offset - start, status))
            i += 1
    return out


@dataclass
class Records:
    """Every request of one load run: columns as numpy arrays, times in seconds after ``start_at``."""

    op: np.ndarray
    start: np.ndarray
    latency: np.ndarray
    status: np.ndarray
    start_at: float
    wall: float  # seconds from start_at until the last reply

    def select(self, op: str | None = None, ok: bool | None = True) -> np.ndarray:
        m = np.ones(self.op.shape, bool)
        if op is not None:
            m &= self.op == op
        if ok is True:
            m &= self.status == 200
        elif ok is False:
            m &= self.status != 200
        return m

    def stats(self, op: str | None = None) -> dict[str, Any]:
        return stats(self.latency[self.select(op)])

    def throughput(self, op: str | None = None) -> float:
        return float(self.select(op).sum() / self.wall) if self.wall > 0 else 0.0

    def errors(self, op: str | None = None) -> int:
        return int(self.select(op, ok=False).sum())

    def rows(self, **extra: Any) -> list[list[Any]]:
        ex = list(extra.values())
        return [[*ex, o, round(s, 6), round(lat * 1000, 3), st]
                for o, s, lat, st in zip(self.op, self.start, self.latency, self.status, strict=True)]

    @staticmethod
    def header(*extra: str) -> list[str]:
        return [*extra, "op", "start_s", "latency_ms", "status"]


def run_load(url: str | Sequence[str], clients: int, mix: dict[str, float], *, count: int | None = None,
             duration: float | None = None, rate: float | None = None, items: int = 7,
             zipf: float | None = None, token: str | None = None, seed: int = 1,
             start_delay: float | None = None, threads: int = 1,
             topics: tuple[str, ...] = DEFAULT_TOPICS,
             on_start: Callable[[float, Callable[[float], None]], None] | None = None) -> Records:
    """Run ``clients`` client processes against ``url`` and gather every request.

    ``rate`` is the total open-loop rate (split evenly, schedules interleaved); without it each
    process runs a closed loop (``threads`` clients in each). Several URLs (frontends): process k
    talks to ``url[k % len(url)]``. ``on_start(start_at)`` runs in this process while the load runs
    (the fault experiments kill replicas from there); calling its second argument ``stop(t)`` ends
    the run ``t`` seconds after ``start_at`` (before ``duration`` if that comes first).
    """
    global _STOP, _READY, _START
    assert count is not None or duration is not None
    start_at = time.time() + (start_delay if start_delay is not None else 0.5 + 0.02 * clients)
    per = rate / clients if rate else None
    urls = [url] if isinstance(url, str) else list(url)
    jobs = [Job(url=urls[k % len(urls)], mix=mix, start_at=start_at, count=count, duration=duration, rate=per,
                phase=(k / rate if rate else 0.0), items=items, zipf=zipf, token=token, seed=seed * 1000 + k,
                threads=threads, topics=topics)
            for k in range(clients)]
    ctx = mp.get_context("fork")
    _STOP = ctx.Value("d", float("inf"), lock=False)
    _READY, _START = ctx.Value("i", 0), ctx.Value("d", 0.0, lock=False)

    def stop(t: float) -> None:
        _STOP.value = t

    try:
        with ctx.Pool(clients) as pool:
            pending = pool.map_async(_worker, jobs, chunksize=1)
            deadline = time.monotonic() + 120  # forking many clients on a busy machine can take a while
            while _READY.value < clients and time.monotonic() < deadline and not pending.ready():
                time.sleep(0.01)
            start_at = time.time() + 0.1
            _START.value = start_at
            if on_start is not None:
                on_start(start_at, stop)
            results = pending.get()
    finally:
        _STOP = _READY = _START = None
    flat = [r for rs in results for r in rs]
    if not flat:
        return Records(np.array([], str), np.array([]), np.array([]), np.array([], int), start_at, 0.0)
    op, start, lat, status = (np.array(col) for col in zip(*flat, strict=True))
    order = np.argsort(start, kind="stable")
    wall = float(np.max(start + lat))
    return Records(op[order], start[order], lat[order], status[order].astype(int), start_at, wall)


def stop_group(proc: subprocess.Popen[Any], grace: float = 10) -> None:
    """SIGTERM the process group ``proc`` leads (started with ``start_new_session``), SIGKILL it
    if ``proc`` has not gone within ``grace`` seconds; returns once it has."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call; errors come back as the PygmyError, not raised."""
    t = time.perf_counter()
    try:
        result = fn()
    except PygmyError as exc:
        result = exc
    return time.perf_counter() - t, result


def metric_sum_count(text: str, route: str, metric: str = "pygmy_http_request_seconds",
                     label: str = "route") -> tuple[float, float]:
    """(sum, count) of one route's latency histogram in Prometheus text (or of the series whose
    ``label`` is ``route``, in another histogram)."""
    total = count = 0.0
    for line in text.splitlines():
        if f'{label}="{route}"' not in line:
            continue
        if line.startswith(metric + "_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(metric + "_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count
