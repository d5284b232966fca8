"""Issue #19, "Hold a sale day": what the cluster does when offered more buys than it can take.

A closed loop cannot overload anything (each client waits for its reply), so after measuring the
closed-loop capacity C (32 buyers: 4 processes x 8 threads), buys are offered OPEN-LOOP: each at its
scheduled time as its own request whatever is still outstanding, a fresh ``Idempotency-Key`` each,
a 5 s client timeout and no retries. Every latency counts from the request's *scheduled* time, so a
generator or a queue that falls behind shows up as latency (no coordinated omission).

On a cluster of 3+3 replicas with a 1,000-book catalogue and a stock nothing can exhaust:

1. normal: buys every 100 ms and lookups every 50 ms on an idle cluster (their p50s);
2. capacity C: 32 closed-loop buyers;
3. sweep: buys offered at 0.5, 1, 2, 3 and 4 x C; per point goodput (200 within 5 s), shed rate
   (429/503), other errors, requests without an answer within 5 s, accepted p50/p99, shed p99;
4. surge: 3 x C for 60 s while one client looks books up every 50 ms (from 5 s before until 30 s
   after it: a random book of the 1,000 each time, so nearly every lookup misses the cache and is a
   catalog read under the surge's writes) and another looks up one of the first seven books every
   50 ms (the issue's case: its lookups, on the default seven-book store, were nearly all cache
   hits), then a buy every 100 ms for 30 s: recovery is how long after the surge buys (median
   of 5) are back within 1.5x of normal and lookups answer under 0.5 s (``--quick``: a 20 s surge
   and 10 s after it). ``--kill-follower`` SIGKILLs an order
   (or catalog) follower half-way through the surge; ``--frontends 2`` spreads the load over two;
   ``--write-tolerance 3`` makes the frontends' write cap follow latency (``--frontend-write-tolerance``);
5. checks from outside, after the cluster settled: every buy without a definite answer (none, 429,
   5xx) is re-sent once with its key; then every acknowledged order must be found by
   ``GET /orders/N`` with its item and quantity, no key may give two orders nor two keys one order,
   and each book's stock sold must equal the buys whose key's final outcome is 200.

The open-loop generator is a few forked processes, each an asyncio loop with one aiohttp session
(unlimited connector, keep-alive) that fires every request due, then sleeps until the next is due on
the loop's clock; it records its own lag (send time minus schedule) and CPU. Its processes ask for
a higher CPU priority than the cluster's (see ``prioritise``): on a 2-core machine they would
otherwise be starved by the overloaded services and send late. It prints the figures of the
issue's "done when"; nothing here asserts a timing. Results: ``results/overload[_variant].json``,
every request in ``results/overload[_variant]_raw.csv.gz``, the plot ``plots/overload[_variant].png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import gc
import gzip
import json
import math
import multiprocessing as mp
import os
import random
import resource
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp
import numpy as np

from pygmy.catalog.books import synthetic
from pygmy.client.api import PygmyClient, PygmyError
from pygmy.cluster import launcher
from pygmy.cluster.local import LocalCluster
from pygmy.experiments import harness as h
from pygmy.experiments.writepath import cluster_cpu_s

BOOKS = 1000
TOPICS = 50
STOCK = 10**9
MULTIPLES = (0.5, 1.0, 2.0, 3.0, 4.0)
SURGE = 3.0
TIMEOUT = 5.0  # client timeout of every open-loop request, no retries
LOOKUP_EVERY = 0.05
#: The books the "hot" lookups ask for: as many as the default store has, so that they stay cached.
HOT_BOOKS = 7
PROBE_BUY_EVERY = 0.1
SHED = (429, 503)
BUY_BODY = b'{"quantity": 1}'
#: Generator processes sharing the bulk of the requests (plus one for the probes): fewer requests per
#: event loop keep each loop's bursts, and so the lag of the requests behind them, short.
BULK_PROCS = 3
#: Scheduling priority of the generator processes (root may go below 0; otherwise it stays at 0).
GENERATOR_NICE = -20
#: Goals of the issue's "done when" (printed next to the figures, never asserted).
GOALS = {"goodput": 0.9, "accepted_p99_ms": 1000.0, "shed_p99_ms": 50.0, "lookup_ratio": 3.0,
         "recovery_s": 2.0, "recovery_factor": 1.5, "lookup_ok_s": 0.5}
#: One record per request, the columns of ``Shots`` and of the raw CSV.
FIELDS = ("phase", "stream", "op", "sched", "latency", "lag", "status", "error", "retry_after", "key", "item",
          "order", "quantity", "frontend")


# -- the open-loop generator -------------------------------------------------------------------------
@dataclass(frozen=True)
class Stream:
    """Requests of one kind at a constant rate from ``start`` to ``end`` (seconds after the run's t0).

    ``lane`` "bulk" is shared by the bulk processes (schedules interleaved); "probe" runs in a process
    of its own, so a lookup every 50 ms is not queued behind thousands of buys in the same loop."""

    name: str
    op: str  # "buy" or "lookup"
    rate: float
    start: float
    end: float
    lane: str = "bulk"

    def times(self) -> np.ndarray:
        n = max(0, math.ceil((self.end - self.start) * self.rate - 1e-9))
        return self.start + np.arange(n) / self.rate


@dataclass
class Plan:
    """What one generator process sends: scheduled times (sorted), stream names, ops, global indexes."""

    sched: list[float]
    stream: list[str]
    op: list[str]
    index: list[int]


def plans(streams: Sequence[Stream], bulk_procs: int) -> list[Plan]:
    lanes: dict[str, list[tuple[float, str, str, int]]] = defaultdict(list)
    j = 0
    for s in streams:
        for t in s.times():
            lane = f"bulk{j % bulk_procs}" if s.lane == "bulk" else "probe"
            lanes[lane].append((float(t), s.name, s.op, j))
            j += 1
    out = []
    for lane in sorted(lanes):
        rows = sorted(lanes[lane])
        out.append(Plan([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows]))
    return out


async def _fire(plan: Plan, urls: Sequence[str], t0: float, seed: int, books: int) -> list[tuple[Any, ...]]:
    """Send each request of ``plan`` at its time as its own task; records per request (see FIELDS)."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    rows: list[tuple[Any, ...]] = []
    timeout = aiohttp.ClientTimeout(total=TIMEOUT)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        base = loop.time() + (t0 - time.time())  # the run's t0 on the loop's clock

        async def one(sched: float, stream: str, op: str, j: int) -> None:
            sent = loop.time() - base
            item, fe = rng.randint(1, HOT_BOOKS if stream == "hot" else books), j % len(urls)
            key = uuid.uuid4().hex if op == "buy" else ""
            status, error, retry, order, qty = 0, "", "", -1, 0
            try:
                if op == "buy":
                    headers = {"Content-Type": "application/json", "Idempotency-Key": key}
                    req = session.post(f"{urls[fe]}/buy/{item}", data=BUY_BODY, headers=headers)
                else:
                    req = session.get(f"{urls[fe]}/lookup/{item}")
                async with req as r:
                    code, retry = r.status, r.headers.get("Retry-After", "")
                    body = await r.read()
                if op == "buy" and code == 200:
                    d = json.loads(body)
                    order, qty = int(d["order_number"]), int(d["quantity"])
                status = code  # only a whole answer counts (a timeout while reading the body is none)
            except TimeoutError:
                error = "timeout"
            except (aiohttp.ClientError, OSError, ValueError, KeyError) as exc:
                error = type(exc).__name__
            rows.append(("", stream, op, sched, loop.time() - base - sched, sent - sched, status, error, retry,
                         key, item, order, qty, fe + 1))

        pending: set[asyncio.Task[None]] = set()
        i, n = 0, len(plan.sched)
        while i < n:
            now = loop.time() - base
            while i < n and plan.sched[i] <= now:
                task = loop.create_task(one(plan.sched[i], plan.stream[i], plan.op[i], plan.index[i]))
                pending.add(task)
                task.add_done_callback(pending.discard)
                i += 1
            if i < n:
                await asyncio.sleep(max(0.0, plan.sched[i] - (loop.time() - base)))
        if pending:
            await asyncio.gather(*pending)
    return rows


def prioritise() -> str:
    """Ask for more CPU than the cluster's processes (``GENERATOR_NICE``, where allowed): clients of
    a real shop do not share its cores, and a starved generator would send late and blame the
    lateness on the cluster. Each service runs in a session of its own, and with autogroup
    scheduling a session's processes share one weight, so the process also makes its own session
    and sets that group's nice value; without root nothing changes (the lag then shows it)."""
    with contextlib.suppress(OSError):
        os.setsid()
    with contextlib.suppress(OSError):
        Path("/proc/self/autogroup").write_text(str(GENERATOR_NICE))
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, GENERATOR_NICE)
    try:
        group = Path("/proc/self/autogroup").read_text().split()[-1]
    except (OSError, IndexError):
        group = "?"
    return f"nice {os.getpriority(os.PRIO_PROCESS, 0)}, autogroup nice {group}"


def _child(args: tuple[Plan, list[str], float, int, int]) -> tuple[list[tuple[Any, ...]], float, str]:
    """One generator process: (records, CPU seconds it used, its priority)."""
    priority = prioritise()
    # Full collections over thousands of pending requests stalled the loop for 100+ ms: the objects
    # from before the run are frozen out of them, and collections are made rarer.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    rows = asyncio.run(_fire(*args))
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return rows, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), priority


@dataclass
class Shots:
    """Every request of some runs as numpy columns (FIELDS); times in seconds after the run's t0."""

    cols: dict[str, np.ndarray]

    @staticmethod
    def of(rows: Sequence[tuple[Any, ...]]) -> Shots:
        if not rows:
            return Shots({f: np.array([]) for f in FIELDS})
        cols = {f: np.array(c) for f, c in zip(FIELDS, zip(*rows, strict=True), strict=True)}
        order = np.argsort(cols["sched"], kind="stable")
        return Shots({f: c[order] for f, c in cols.items()})

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.__dict__["cols"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __len__(self) -> int:
        return len(self.cols["sched"])

    def where(self, mask: np.ndarray) -> Shots:
        return Shots({f: c[mask] for f, c in self.cols.items()})

    def rows(self) -> list[tuple[Any, ...]]:
        return list(zip(*(self.cols[f].tolist() for f in FIELDS), strict=True))


@dataclass
class Fired:
    shots: Shots
    cpu_s: list[float]  # per generator process
    wall_s: float
    t0: float  # wall time of the schedule's zero
    priority: str  # of the generator processes (``prioritise``)


def fire(urls: Sequence[str], streams: Sequence[Stream], *, bulk_procs: int = BULK_PROCS, seed: int = 1,
         books: int = BOOKS, phase: str = "", during: Callable[[float], None] | None = None) -> Fired:
    """Run ``streams`` open-loop from forked processes (``bulk_procs`` + one for the probe lane).

    ``during(t0)`` runs here while the load runs (t0: wall time of the schedule's zero)."""
    ps = plans(streams, bulk_procs)
    t0 = time.time() + 1.0  # forking is quick; every process then waits for t0
    ctx = mp.get_context("fork")
    with ctx.Pool(len(ps)) as pool:
        pending = pool.map_async(_child, [(p, list(urls), t0, seed * 1000 + k, books) for k, p in enumerate(ps)],
                                 chunksize=1)
        if during is not None:
            during(t0)
        end = max((s.end for s in streams), default=0.0)
        results = pending.get(timeout=max(0.0, t0 - time.time()) + end + TIMEOUT + 120)
    rows = [(phase, *r[1:]) for rs, _, _ in results for r in rs]
    return Fired(Shots.of(rows), [cpu for _, cpu, _ in results], time.time() - t0, t0, results[0][2])


# -- figures -----------------------------------------------------------------------------------------
def _ms(a: np.ndarray, q: float) -> float | None:
    return float(np.percentile(a, q) * 1000) if len(a) else None


def classify(s: Shots) -> dict[str, np.ndarray]:
    """Masks: ok (200 within 5 s), shed (429/503 within 5 s), noanswer (nothing within 5 s of the
    schedule), error (anything else: other statuses, connection errors)."""
    late = s.latency > TIMEOUT
    noanswer = ((s.status == 0) & (s.error == "timeout")) | late
    ok = (s.status == 200) & ~noanswer
    shed = np.isin(s.status, SHED) & ~noanswer
    return {"ok": ok, "shed": shed, "noanswer": noanswer, "error": ~(ok | shed | noanswer)}


def summary(s: Shots, seconds: float, capacity: float) -> dict[str, Any]:
    """Figures of one open-loop run of buys (``s`` holds only buys) over ``seconds`` of schedule."""
    m = classify(s)
    answered = s.status != 0
    shed_with_retry_after = int((m["shed"] & (s.retry_after != "")).sum())
    return {
        "offered": len(s), "offered_per_s": len(s) / seconds,
        "goodput_per_s": m["ok"].sum() / seconds, "goodput_over_capacity": m["ok"].sum() / seconds / capacity,
        "shed_per_s": m["shed"].sum() / seconds, "errors_per_s": m["error"].sum() / seconds,
        "ok": int(m["ok"].sum()), "shed": int(m["shed"].sum()), "errors": int(m["error"].sum()),
        "noanswer": int(m["noanswer"].sum()),
        "connection_errors": int((m["error"] & (s.status == 0)).sum()),
        "statuses": {str(k): int(v) for k, v in Counter(s.status.tolist()).items()},
        "error_kinds": {k: int(v) for k, v in Counter(s.error[s.error != ""].tolist()).items()},
        "accepted_p50_ms": _ms(s.latency[m["ok"]], 50), "accepted_p99_ms": _ms(s.latency[m["ok"]], 99),
        "shed_p50_ms": _ms(s.latency[m["shed"]], 50), "shed_p99_ms": _ms(s.latency[m["shed"]], 99),
        # the same from the actual send: what the server took, the generator's lag left out
        "accepted_p99_from_send_ms": _ms((s.latency - s.lag)[m["ok"]], 99),
        "shed_p99_from_send_ms": _ms((s.latency - s.lag)[m["shed"]], 99),
        "max_answered_ms": _ms(s.latency[answered], 100),
        "shed_with_retry_after": shed_with_retry_after,
        "lag_p50_ms": _ms(s.lag, 50), "lag_p99_ms": _ms(s.lag, 99), "lag_max_ms": _ms(s.lag, 100),
    }


def recovery(t: np.ndarray, ok: np.ndarray, good: np.ndarray, horizon: float) -> dict[str, float | None]:
    """Seconds after 0 until samples (sorted times ``t``) are good: ``first`` good one, and ``stable``:
    good from then on until the end (None if the last one is not). ``ok`` must hold as well."""
    g = ok & good
    if not len(t):
        return {"first": None, "stable": None}
    first = float(t[np.argmax(g)]) if g.any() else None
    bad = np.flatnonzero(~g)
    if not len(bad):
        stable: float | None = float(t[0])
    elif bad[-1] == len(t) - 1:
        stable = None
    else:
        stable = float(t[bad[-1] + 1])
    return {"first": None if first is None else max(0.0, first),
            "stable": None if stable is None else max(0.0, stable), "horizon": horizon}


def buy_recovery(s: Shots, normal_p50_ms: float, horizon: float) -> dict[str, float | None]:
    """The probe buyer after the surge (``s``, times after the surge's end): median latency of a
    sliding window of 5 consecutive buys (a failed one counts as infinitely slow) within 1.5x normal."""
    lat = np.where(s.status == 200, s.latency, np.inf)
    if len(lat) < 5:
        return {"first": None, "stable": None, "horizon": horizon}
    med = np.array([np.median(lat[k:k + 5]) for k in range(len(lat) - 4)])
    good = med * 1000 <= GOALS["recovery_factor"] * normal_p50_ms
    return recovery(s.sched[:len(med)], np.ones(len(med), bool), good, horizon)


# -- the outside checks ------------------------------------------------------------------------------
class Answer(NamedTuple):
    """One answer to a buy: ``status`` 0 for none; ``order`` the order number of a 200 (else -1)."""

    key: str
    item: int
    quantity: int
    status: int
    order: int


def definite(status: int) -> bool:
    """200, or a refusal that says the buy did not happen (a 4xx other than 429)."""
    return status == 200 or (400 <= status < 500 and status != 429)


def check(answers: Sequence[Answer], orders: Mapping[int, tuple[int, int] | None],
          sold: Mapping[int, int]) -> dict[str, Any]:
    """Judge the buys of a run from outside.

    ``answers``: every answer in the order received (a key's re-send after its first try);
    ``orders``: order number -> (item, quantity) as ``GET /orders/N`` showed it, None if not found
    (numbers it could not read are absent); ``sold``: book -> initial minus final stock.
    Lost: a key answered 200 whose order is missing or different, or that a later answer refused.
    Doubled: a key with two order numbers, or an order number given to two keys. Stock: for every
    book, sold minus the quantity of keys whose final outcome is 200 must be 0 (or at most the
    quantity of keys whose outcome is still unknown).
    """
    by_key: dict[str, list[Answer]] = defaultdict(list)
    for a in answers:
        by_key[a.key].append(a)
    lost: list[str] = []
    doubled: list[str] = []
    unknown: list[str] = []
    unverified = 0
    owners: dict[int, set[str]] = defaultdict(set)
    expected: Counter[int] = Counter()
    slack: Counter[int] = Counter()
    outcomes: Counter[str] = Counter()
    for key, ans in by_key.items():
        numbers = {a.order for a in ans if a.status == 200}
        for n in numbers:
            owners[n].add(key)
        if len(numbers) > 1:
            doubled.append(key)
        decided = [a for a in ans if definite(a.status)]
        final = decided[-1] if decided else None
        if numbers:
            if final is not None and final.status != 200:
                lost.append(key)  # acknowledged, then refused
            else:
                for n in numbers:
                    if n not in orders:
                        unverified += 1
                    elif orders[n] != (ans[0].item, ans[0].quantity):
                        lost.append(key)
                        break
            final = final if final is not None and final.status == 200 else next(a for a in ans if a.status == 200)
        if final is None:
            unknown.append(key)
            slack[ans[0].item] += ans[0].quantity
            outcomes["unknown"] += 1
        else:
            outcomes[str(final.status)] += 1
            if final.status == 200:
                expected[final.item] += final.quantity
    shared = sorted(n for n, ks in owners.items() if len(ks) > 1)
    books = set(sold) | set(expected)
    diff = {b: sold.get(b, 0) - expected.get(b, 0) for b in books}
    off = sorted(b for b in books if not 0 <= diff[b] <= slack.get(b, 0))
    out = {"keys": len(by_key), "acknowledged": sum(1 for ans in by_key.values() if any(a.status == 200 for a in ans)),
           "final_outcomes": dict(outcomes), "unknown": len(unknown), "lost": len(lost), "doubled_keys": len(doubled),
           "shared_orders": len(shared), "orders_unverified": unverified, "stock_sold": sum(sold.values()),
           "stock_expected": sum(expected.values()), "stock_difference": sum(diff.values()),
           "stock_unknown_slack": sum(slack.values()), "books_off": len(off),
           "examples": {"lost": lost[:5], "doubled": doubled[:5], "shared_orders": shared[:5], "books_off": off[:5]}}
    out["ok"] = not (lost or doubled or shared or off)
    return out


async def _limited(calls: Sequence[Callable[[aiohttp.ClientSession], Awaitable[Any]]], concurrency: int,
                   timeout: float) -> list[Any]:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout),
                                     connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def run(call: Callable[[aiohttp.ClientSession], Awaitable[Any]]) -> Any:
            async with sem:
                return await call(session)

        return await asyncio.gather(*(run(c) for c in calls))


async def _get_json(session: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> tuple[int, Any]:
    try:
        async with session.request(method, url, **kw) as r:
            body = await r.read()
            status = r.status
        return status, (json.loads(body) if status == 200 else None)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return 0, None


def resend(urls: Sequence[str], s: Shots, concurrency: int = 16) -> Shots:
    """Each buy of ``s`` once more with its own key and item (phase "recheck"; latency from the re-send),
    spread over the frontends; few at a time, below any frontend's cap on buys in flight, so that
    the re-sends themselves are not shed (which would leave their outcome unknown)."""

    def call(k: int) -> Callable[[aiohttp.ClientSession], Awaitable[tuple[Any, ...]]]:
        async def go(session: aiohttp.ClientSession) -> tuple[Any, ...]:
            t = time.perf_counter()
            status, body = await _get_json(session, "POST", f"{urls[k % len(urls)]}/buy/{s.item[k]}", data=BUY_BODY,
                                           headers={"Content-Type": "application/json", "Idempotency-Key": s.key[k]})
            order, qty = (int(body["order_number"]), int(body["quantity"])) if body else (-1, 0)
            return ("recheck", "recheck", "buy", float(s.sched[k]), time.perf_counter() - t, 0.0, status,
                    "" if status else "failed", "", s.key[k], int(s.item[k]), order, qty, k % len(urls) + 1)
        return go

    return Shots.of(asyncio.run(_limited([call(k) for k in range(len(s))], concurrency, 30.0)))


def read_orders(urls: Sequence[str], numbers: Sequence[int], concurrency: int = 16) -> dict[int, tuple[int, int] | None]:
    """``GET /orders/N`` of each number: (item, quantity), None when 404, absent when unreadable.
    Few at a time, below a frontend worker's cap on reads in flight, so that none is shed."""

    def call(n: int) -> Callable[[aiohttp.ClientSession], Awaitable[tuple[int, int, Any]]]:
        async def go(session: aiohttp.ClientSession) -> tuple[int, int, Any]:
            return (n, *await _get_json(session, "GET", f"{urls[n % len(urls)]}/orders/{n}"))
        return go

    out: dict[int, tuple[int, int] | None] = {}
    for n, status, body in asyncio.run(_limited([call(n) for n in numbers], concurrency, 30.0)):
        if status == 200:
            out[n] = (int(body["item_number"]), int(body["quantity"]))
        elif status == 404:
            out[n] = None
    return out


def read_stock(url: str, books: int, concurrency: int = 16) -> dict[int, int]:
    def call(n: int) -> Callable[[aiohttp.ClientSession], Awaitable[tuple[int, int, Any]]]:
        async def go(session: aiohttp.ClientSession) -> tuple[int, int, Any]:
            return (n, *await _get_json(session, "GET", f"{url}/lookup/{n}"))
        return go

    got = asyncio.run(_limited([call(n) for n in range(1, books + 1)], concurrency, 30.0))
    missing = [n for n, status, _ in got if status != 200]
    if missing:
        raise RuntimeError(f"could not read the stock of {len(missing)} books, e.g. {missing[:5]}")
    return {n: int(body["stock"]) for n, _, body in got}


# -- the cluster between runs ------------------------------------------------------------------------
def seq_buys(url: str, n: int | None, books: int = BOOKS, *, until_fast_ms: float | None = None, limit_s: float = 60.0,
             phase: str = "drain") -> tuple[Shots, float]:
    """Sequential buys with fresh keys: ``n`` of them, or until 5 in a row answer 200 within
    ``until_fast_ms`` (at most ``limit_s``). Returns their records and the seconds it took."""
    rows: list[tuple[Any, ...]] = []
    t0 = time.perf_counter()
    streak = 0
    with PygmyClient(url, timeout=10.0) as cl:
        while True:
            if n is not None and len(rows) >= n:
                break
            if n is None and (streak >= 5 or time.perf_counter() - t0 > limit_s):
                break
            key, item = uuid.uuid4().hex, random.randint(1, books)
            t = time.perf_counter()
            status, order, qty, err = 200, -1, 0, ""
            try:
                body = cl.buy(item, 1, key=key)
                order, qty = int(body["order_number"]), int(body["quantity"])
            except PygmyError as exc:
                status, err = exc.status, ("" if exc.status else "failed")
            lat = time.perf_counter() - t
            rows.append((phase, phase, "buy", t - t0, lat, 0.0, status, err, "", key, item, order, qty, 1))
            fast = status == 200 and until_fast_ms is not None and lat * 1000 <= until_fast_ms
            streak = streak + 1 if fast else 0
            if status != 200:
                time.sleep(0.2)
    return Shots.of(rows), time.perf_counter() - t0


def caught_up(c: LocalCluster, timeout: float = 180) -> None:
    """Until every replica of both tiers has applied its leader's commit index (asking again while
    the frontend is still too busy to answer ``/status``)."""
    deadline = time.monotonic() + timeout
    for tier in ("catalog", "order"):
        while True:
            try:
                h.wait_caught_up(c, tier, timeout=max(1.0, deadline - time.monotonic()))
                break
            except (PygmyError, KeyError, TypeError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)


def follower(c: LocalCluster, tier: str) -> str:
    st = h.tier_status(c, tier)
    lead = st["leader"] or h.leader(c, tier)
    return next(r["name"] for r in st["replicas"] if r["name"] != lead)


# -- plot --------------------------------------------------------------------------------------------
def plot(settings: h.Settings, name: str, out: dict[str, Any], timeline: dict[str, list[Any]], title: str) -> str:
    fig, (a1, a2, a3) = h.figure(1, 3, figsize=(17, 5.6))
    pts = out["sweep"]
    x = [p["multiple"] for p in pts]
    cap = out["capacity_per_s"]
    a1.plot(x, [p["goodput_per_s"] for p in pts], "o-", color="tab:green", label="goodput (200 within 5 s)")
    a1.plot(x, [p["shed_per_s"] for p in pts], "s-", color="tab:orange", label="shed (429/503)")
    a1.plot(x, [p["noanswer"] / out["point_s"] for p in pts], "x-", color="tab:red", label="no answer in 5 s")
    a1.plot(x, [p["errors_per_s"] for p in pts], "^-", color="tab:gray", label="other errors")
    a1.plot(x, [p["offered_per_s"] for p in pts], ":", color="k", label="offered")
    a1.axhline(cap, color="tab:blue", lw=0.8, ls="--", label=f"closed-loop capacity C = {cap:.0f}/s")
    a1.axhline(GOALS["goodput"] * cap, color="tab:blue", lw=0.6, ls=":", label="0.9 C (goal)")
    a1.set(xlabel="offered load (multiple of C)", ylabel="buys per second", title="Goodput and shedding")
    a1.legend(fontsize="x-small")
    for key, style, label in (("accepted_p50_ms", "o-", "accepted p50"), ("accepted_p99_ms", "o--", "accepted p99"),
                              ("shed_p99_ms", "s:", "shed p99")):
        a2.plot(x, [p[key] if p[key] is not None else np.nan for p in pts], style, label=label)
    a2.axhline(GOALS["accepted_p99_ms"], color="tab:red", lw=0.6, ls=":", label="1 s (accepted p99 goal)")
    a2.set(xlabel="offered load (multiple of C)", ylabel="ms from scheduled send", yscale="log",
           title="Latency from the scheduled time")
    a2.legend(fontsize="x-small")
    t = np.array(timeline["t"])
    a3.step(t, timeline["offered"], where="post", color="k", lw=0.8, label="offered buys/s")
    a3.step(t, timeline["goodput"], where="post", color="tab:green", label="goodput/s")
    a3.step(t, timeline["shed"], where="post", color="tab:orange", label="shed/s")
    a3.step(t, timeline["noanswer"], where="post", color="tab:red", lw=0.8, label="no answer/s")
    a3.axvspan(0, out["surge"]["seconds"], color="tab:red", alpha=0.06)
    for ev in out["surge"].get("kills", []):
        a3.axvline(ev["at_s"], color="k", ls="--", lw=1)
        a3.text(ev["at_s"], a3.get_ylim()[1] * 0.95, f" SIGKILL {ev['victim']}", fontsize="x-small", va="top")
    a3.set(xlabel="seconds since the surge began (by scheduled time)", ylabel="requests per second",
           title=f"{SURGE:g}x C surge")
    b = a3.twinx()
    b.plot(t + 0.5, [v if v is not None else np.nan for v in timeline["lookup_p50_ms"]], ".-", color="tab:blue",
           ms=3, lw=0.8, label="lookup p50 per s (right; a timeout counts)")
    pts = np.array(timeline["after_buys"]).reshape(-1, 3)
    ok = pts[:, 2] == 200
    b.scatter(pts[ok, 0], pts[ok, 1], s=5, color="tab:purple", label="a buy every 100 ms after (right)")
    b.scatter(pts[~ok, 0], pts[~ok, 1], s=12, marker="x", color="tab:purple", lw=0.8, label="... failed (right)")
    b.set(ylabel="ms from scheduled send (log)", yscale="log")
    lines = a3.get_legend_handles_labels()
    lines2 = b.get_legend_handles_labels()
    a3.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize="x-small", loc="upper center",
              bbox_to_anchor=(0.5, -0.15), ncol=3)
    fig.suptitle(title, fontsize="medium")
    return h.save_plot(settings, fig, name)


def timeline_of(s: Shots, start: float, end: float) -> dict[str, list[Any]]:
    """Per second of scheduled time (``s`` times relative to the surge): surge buys by outcome and
    lookup p50; and every buy after the surge as (time, latency ms, status)."""
    edges = np.arange(math.floor(start), math.ceil(end) + 1)
    buys, looks = s.where(s.stream == "surge"), s.where(s.stream == "lookup")
    m = classify(buys)
    out: dict[str, list[Any]] = {"t": edges[:-1].tolist()}
    for k, mask in (("offered", np.ones(len(buys), bool)), ("goodput", m["ok"]), ("shed", m["shed"]),
                    ("noanswer", m["noanswer"])):
        out[k] = np.histogram(buys.sched[mask], edges)[0].tolist()
    idx = np.digitize(looks.sched, edges) - 1
    out["lookup_p50_ms"] = [_ms(looks.latency[idx == k], 50) for k in range(len(edges) - 1)]
    out["lookup_failed"] = [int(((idx == k) & (looks.status != 200)).sum()) for k in range(len(edges) - 1)]
    after = s.where(s.stream == "after")
    out["after_buys"] = [[round(float(t), 3), round(float(lat) * 1000, 1), int(st)]
                         for t, lat, st in zip(after.sched, after.latency, after.status, strict=True)]
    return out


# -- the experiment ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    point_s: float  # the capacity run and each point of the sweep
    surge_s: float
    pre_s: float  # lookups before the surge
    post_s: float  # lookups and the probe buyer after it
    normal_s: float
    multiples: tuple[float, ...]
    books: int
    #: A pause for the machine to settle after the start and after each point of the sweep, before
    #: the next measurement; none at tiny size, where no figure is read (the tests run it end to end).
    settle_s: float = 0.0

    @staticmethod
    def of(settings: h.Settings) -> Sizes:
        return Sizes(point_s=settings.size(20.0, 8.0, 2.0), surge_s=settings.size(60.0, 20.0, 3.0),
                     pre_s=settings.size(5.0, 5.0, 1.0), post_s=settings.size(30.0, 10.0, 3.0),
                     normal_s=settings.size(10.0, 10.0, 2.0), multiples=settings.size(MULTIPLES, MULTIPLES, (0.5, 2.0)),
                     books=settings.size(BOOKS, BOOKS, 50), settle_s=settings.size(1.0, 1.0, 0.0))


def measure_normal(urls: Sequence[str], z: Sizes) -> dict[str, Any]:
    """A buy every 100 ms and a lookup every 50 ms on the idle cluster (the probe process)."""
    f = fire(urls, [Stream("normal", "buy", 1 / PROBE_BUY_EVERY, 0, z.normal_s, "probe"),
                    Stream("lookup", "lookup", 1 / LOOKUP_EVERY, 0, z.normal_s, "probe")], books=z.books, phase="normal")
    s = f.shots
    ok = s.status == 200
    return {"buy": h.stats(s.latency[ok & (s.op == "buy")]), "lookup": h.stats(s.latency[ok & (s.op == "lookup")]),
            "failed": int((~ok).sum()), "lag_p99_ms": _ms(s.lag, 99)}


def measure_capacity(c: LocalCluster, urls: Sequence[str], z: Sizes, procs: int = 4, threads: int = 8) -> dict[str, Any]:
    """32 closed-loop buyers (as ``experiments/writepath.py``), the processes spread over the frontends."""
    cpu0 = cluster_cpu_s(c)
    rec = h.run_load(urls, procs, {"buy": 1.0}, duration=z.point_s, items=z.books, threads=threads)
    return {"per_s": rec.throughput("buy"), "clients": f"{procs} processes x {threads} threads over {len(urls)} frontend(s)",
            "buys": int(rec.select("buy").sum()), "errors": rec.errors(), "buy": rec.stats("buy"),
            "cluster_cpu_cores": (cluster_cpu_s(c) - cpu0) / max(rec.wall, 1e-9)}


def normal_and_capacity(c: LocalCluster, urls: Sequence[str], z: Sizes) -> tuple[dict[str, Any], dict[str, Any]]:
    """What a surge is measured against, on a cluster just started: the settled machine's normal
    figures (``measure_normal``) and the closed-loop capacity (``measure_capacity``); then buys until
    they are fast again (3x the normal p50), so that what comes next starts from a drained cluster."""
    time.sleep(2 * z.settle_s)
    seq_buys(c.url, 10, z.books, phase="warm")
    normal = measure_normal(urls, z)
    capacity = measure_capacity(c, urls, z)
    seq_buys(c.url, None, z.books, until_fast_ms=3 * normal["buy"]["p50"], phase="warm")
    return normal, capacity


def sweep(c: LocalCluster, urls: Sequence[str], z: Sizes, cap: float, drain_ms: float,
          phases: list[Shots]) -> list[dict[str, Any]]:
    """Buys open-loop at each multiple of ``cap``; after each point, sequential buys until the
    cluster answers them fast again (the drain, recorded)."""
    out = []
    for k, mult in enumerate(z.multiples):
        cpu0 = cluster_cpu_s(c)
        f = fire(urls, [Stream("sweep", "buy", mult * cap, 0, z.point_s)], seed=10 + k, books=z.books,
                 phase=f"sweep{mult:g}")
        cpu = (cluster_cpu_s(c) - cpu0) / f.wall_s
        drain, waited = seq_buys(c.url, None, z.books, until_fast_ms=drain_ms, phase=f"drain{mult:g}")
        phases += [f.shots, drain]
        p = {"multiple": mult, **summary(f.shots, z.point_s, cap), "generator_cpu_cores": sum(f.cpu_s) / f.wall_s,
             "cluster_cpu_cores": cpu, "drain_s": waited, "fast_again_s": time.time() - f.t0 - z.point_s}
        out.append(p)
        print(f"  {mult:g}x C: offered {p['offered_per_s']:.0f}/s, goodput {p['goodput_per_s']:.0f}/s "
              f"({p['goodput_over_capacity']:.2f} C), shed {p['shed_per_s']:.0f}/s, errors {p['errors_per_s']:.0f}/s, "
              f"no answer {p['noanswer']}; accepted p50/p99 {h.fmt(p['accepted_p50_ms'])}/"
              f"{h.fmt(p['accepted_p99_ms'])} ms, shed p99 {h.fmt(p['shed_p99_ms'])} ms; generator lag p99 "
              f"{h.fmt(p['lag_p99_ms'])} ms, {p['generator_cpu_cores']:.2f} cores; buys fast again "
              f"{p['fast_again_s']:.1f} s after the last was offered", flush=True)
        time.sleep(z.settle_s)
    return out


def surge(c: LocalCluster, urls: Sequence[str], z: Sizes, cap: float, kill: str | None) -> tuple[Fired, list[dict[str, Any]], float]:
    """Lookups every 50 ms from ``pre_s`` before the surge until ``post_s`` after it, ``SURGE`` x
    ``cap`` buys for ``surge_s``, then a buy every 100 ms; followers killed half-way if asked.
    Returns the run (times shifted: 0 is the surge's first buy), the kills and the cluster's CPU."""
    tiers = ("order", "catalog") if kill == "both" else (kill,) if kill else ()
    victims = [follower(c, tier) for tier in tiers]
    kills: list[dict[str, Any]] = []

    def during(t0: float) -> None:
        time.sleep(max(0.0, t0 + z.pre_s + z.surge_s / 2 - time.time()))
        for v in victims:
            role = (h.replica_status(c, v) or {}).get("role")
            pid = launcher.kill(c.cluster_config(), v)
            kills.append({"victim": v, "role_before": role, "pgid": pid, "at_s": time.time() - t0 - z.pre_s})
            print(f"  SIGKILL {v} (was {role}) at {kills[-1]['at_s']:.1f} s into the surge", flush=True)

    end = z.pre_s + z.surge_s
    cpu0 = cluster_cpu_s(c)
    f = fire(urls, [Stream("lookup", "lookup", 1 / LOOKUP_EVERY, 0, end + z.post_s, "probe"),
                    Stream("hot", "lookup", 1 / LOOKUP_EVERY, 0, end + z.post_s, "probe"),
                    Stream("surge", "buy", SURGE * cap, z.pre_s, end),
                    Stream("after", "buy", 1 / PROBE_BUY_EVERY, end, end + z.post_s, "probe")],
             seed=99, books=z.books, phase="surge", during=during if victims else None)
    cpu = (cluster_cpu_s(c) - cpu0) / f.wall_s
    f.shots.cols["sched"] = f.shots.sched - z.pre_s
    return f, kills, cpu


def _probe(s: Shots, stream: str, surge_s: float) -> tuple[Shots, float | None, float | None, int]:
    """A lookup probe's shots during the surge, its p50 before and during it (answered ones) and how
    many failed during it (no 200, or not within the client's timeout)."""
    looks = s.where(s.stream == stream)
    before, during = looks.where(looks.sched < 0), looks.where((looks.sched >= 0) & (looks.sched < surge_s))
    failed = int(((during.status != 200) | (during.latency > TIMEOUT)).sum())
    return (during, _ms(before.latency[before.status == 200], 50),
            _ms(during.latency[during.status == 200], 50), failed)


def surge_figures(f: Fired, z: Sizes, cap: float, normal_buy_ms: float) -> dict[str, Any]:
    s = f.shots
    looks = s.where(s.stream == "lookup")
    during, lb, ld, failed = _probe(s, "lookup", z.surge_s)
    hot_during, hb, hd, hot_failed = _probe(s, "hot", z.surge_s)
    after_l = looks.where(looks.sched >= z.surge_s)
    after_b = s.where(s.stream == "after")
    for part in (after_l, after_b):
        part.cols["sched"] = part.sched - z.surge_s
    in_surge = s.where((s.sched >= 0) & (s.sched < z.surge_s))
    return {"seconds": z.surge_s, "multiple": SURGE, **summary(s.where(s.stream == "surge"), z.surge_s, cap),
            "generator_cpu_cores": sum(f.cpu_s) / f.wall_s, "generator_cpu_s": f.cpu_s,
            "generator_priority": f.priority,
            "all_requests_noanswer": int(classify(in_surge)["noanswer"].sum()),
            "all_requests_max_answered_ms": _ms(in_surge.latency[in_surge.status != 0], 100),
            "lookup_before_p50_ms": lb, "lookup_during_p50_ms": ld, "lookup_during_p99_ms": _ms(during.latency, 99),
            "lookup_ratio": h.ratio(ld, lb), "lookups_during": len(during) + len(hot_during),
            "lookups_failed": failed + hot_failed,
            "hot_lookup_before_p50_ms": hb, "hot_lookup_during_p50_ms": hd, "hot_lookup_ratio": h.ratio(hd, hb),
            "lookup_lag_p99_ms": _ms(looks.lag, 99),
            "buy_recovery_s": buy_recovery(after_b, normal_buy_ms, z.post_s),
            "lookup_recovery_s": recovery(after_l.sched, after_l.status == 200,
                                          after_l.latency <= GOALS["lookup_ok_s"], z.post_s),
            "after_buy_p50_ms": _ms(after_b.latency[after_b.status == 200], 50)}


def outside_checks(c: LocalCluster, urls: Sequence[str], z: Sizes, initial: Mapping[int, int],
                   phases: list[Shots], drain_ms: float, restart: Sequence[str] = ()) -> tuple[dict[str, Any], Shots]:
    """Settle (sequential buys until fast, ``restart`` the killed replicas, every replica caught up),
    re-send every buy without a definite answer once, then judge (``check``)."""
    settle, waited = seq_buys(c.url, None, z.books, until_fast_ms=drain_ms, limit_s=120, phase="settle")
    settled_at = time.time()
    phases.append(settle)
    for name in restart:
        c.restart(name)
    caught_up(c)
    everything = Shots.of([r for p in phases for r in p.rows()])
    buys = everything.where(everything.op == "buy")
    again = buys.where(~np.array([definite(int(x)) for x in buys.status], bool))
    t = time.monotonic()
    rechecked = resend(urls, again)
    resend_s, t = time.monotonic() - t, time.monotonic()
    numbers = sorted({int(n) for n in np.concatenate([buys.order, rechecked.order]) if n > 0})
    orders = read_orders(urls, numbers)
    orders_s = time.monotonic() - t
    final = read_stock(c.url, z.books)
    out = check(answers_of(buys, rechecked), orders, {b: initial[b] - final[b] for b in initial})
    out.update({"resent": len(again), "resent_answers": {str(k): int(v) for k, v in
                                                         Counter(rechecked.status.tolist()).items()},
                "orders_read": len(numbers), "settle_s": waited, "settled_at": settled_at, "resend_s": resend_s,
                "orders_s": orders_s})
    print(f"  checks: settled in {waited:.1f} s; {len(again)} buys re-sent in {resend_s:.0f} s, {len(numbers)} orders "
          f"read in {orders_s:.0f} s", flush=True)
    return out, rechecked


def done_when(out: dict[str, Any], z: Sizes) -> list[list[str]]:
    """The issue's "done when" as rows (measure, value, goal, met)."""
    su, ch, cap = out["surge"], out["checks"], out["capacity_per_s"]

    def rec_s(r: dict[str, Any]) -> str:
        if r["first"] is None:
            return f"not within {z.post_s:g} s"
        stable = "never" if r["stable"] is None else f"{r['stable']:.1f} s"
        return f"{r['first']:.1f} s (for good from {stable})"

    def met(v: float | None, goal: float, le: bool = True) -> str:
        if v is None:
            return "-"
        return "yes" if (v <= goal if le else v >= goal) else "NO"

    br, lr = su["buy_recovery_s"], su["lookup_recovery_s"]
    return [
        ["closed-loop capacity C", f"{cap:.0f} buys/s", "", ""],
        [f"goodput at {SURGE:g}x C for {z.surge_s:g} s", f"{su['goodput_per_s']:.0f}/s = {su['goodput_over_capacity']:.2f} C",
         ">= 0.9 C", met(su["goodput_over_capacity"], GOALS["goodput"], le=False)],
        ["accepted buys p99 (from schedule)", f"{h.fmt(su['accepted_p99_ms'])} ms "
         f"({h.fmt(su['accepted_p99_from_send_ms'])} from the send)", "<= 1000 ms",
         met(su["accepted_p99_ms"], GOALS["accepted_p99_ms"])],
        ["shed buys (429/503) p99", f"{h.fmt(su['shed_p99_ms'])} ms ({h.fmt(su['shed_p99_from_send_ms'])} from "
         f"the send; {su['shed']} shed, "
         f"{su['shed_with_retry_after']} with Retry-After)", "<= 50 ms", met(su["shed_p99_ms"], GOALS["shed_p99_ms"])],
        ["requests without an answer in 5 s", f"{su['all_requests_noanswer']} (buys {su['noanswer']} of {su['offered']})",
         "0", met(su["all_requests_noanswer"], 0)],
        ["max latency of an answered request", f"{h.fmt(su['all_requests_max_answered_ms'])} ms", "", ""],
        ["other buy errors (connection errors)", f"{su['errors']} ({su['connection_errors']})", "", ""],
        ["lookups during the surge failed", f"{su['lookups_failed']} of {su['lookups_during']}", "0",
         met(su["lookups_failed"], 0)],
        ["lookup p50 during / before the surge (random books: misses)", f"{h.fmt(su['lookup_during_p50_ms'])} / "
         f"{h.fmt(su['lookup_before_p50_ms'])} ms = {h.fmt(su['lookup_ratio'])}x", "<= 3x",
         met(su["lookup_ratio"], GOALS["lookup_ratio"])],
        *([["  of the seven hot books (cached)", f"{h.fmt(su['hot_lookup_during_p50_ms'])} / "
            f"{h.fmt(su['hot_lookup_before_p50_ms'])} ms = {h.fmt(su['hot_lookup_ratio'])}x", "<= 3x",
            met(su["hot_lookup_ratio"], GOALS["lookup_ratio"])]] if "hot_lookup_ratio" in su else []),
        [f"buy recovery (median of 5 <= 1.5x normal {out['normal']['buy']['p50']:.1f} ms)",
         rec_s(br) + ("" if br["first"] is not None else
                      f"; 5 sequential buys fast again {su['fast_again_s']:.1f} s after the surge"), "<= 2 s",
         met(br["first"] if br["first"] is not None else math.inf, GOALS["recovery_s"])],
        ["lookup recovery (answers < 0.5 s)", rec_s(lr), "", ""],
        ["lost acknowledged buys", str(ch["lost"]), "0", met(ch["lost"], 0)],
        ["keys with two orders / orders of two keys", f"{ch['doubled_keys']} / {ch['shared_orders']}", "0",
         met(ch["doubled_keys"] + ch["shared_orders"], 0)],
        ["stock sold - buys whose key ended 200", f"{ch['stock_difference']} (books off {ch['books_off']}, unknown "
         f"keys {ch['unknown']})", "0", met(ch["books_off"], 0)],
        ["generator lag p99 / max (surge buys)", f"{h.fmt(su['lag_p99_ms'])} / {h.fmt(su['lag_max_ms'])} ms; CPU "
         f"{su['generator_cpu_cores']:.2f} cores (cluster {su['cluster_cpu_cores']:.2f})", "", ""],
    ]


SWEEP_COLUMNS = ["x C", "offered/s", "goodput/s", "goodput/C", "shed/s", "errors/s", "no answer", "accepted p50 ms",
                 "accepted p99 ms", "shed p99 ms", "max answered ms", "gen lag p99 ms", "fast again s"]


def run(settings: h.Settings, frontends: int = 1, kill: str | None = None,
        write_tolerance: float | None = None) -> dict[str, Any]:
    """``kill``: None, "order", "catalog" or "both" (a follower of that tier, half-way through the surge).
    ``write_tolerance``: the frontends' write cap follows latency (``--frontend-write-tolerance``)."""
    started = time.monotonic()
    z = Sizes.of(settings)
    suffix = ((f"_{frontends}frontends" if frontends > 1 else "") + (f"_kill_{kill}" if kill else "")
              + (f"_tolerance{write_tolerance:g}" if write_tolerance else ""))
    name = "overload" + suffix
    args = ["--frontends", str(frontends)] if frontends > 1 else []
    if write_tolerance:
        args += ["--frontend-write-tolerance", f"{write_tolerance:g}"]
    out: dict[str, Any] = {"sizes": asdict(z), "frontends": frontends, "kill_follower": kill, "timeout_s": TIMEOUT,
                           "point_s": z.point_s, "load_1min_before": h.machine()["load_1min"],
                           "generator": f"{BULK_PROCS} bulk processes + 1 probe process, each asyncio + aiohttp"}
    phases: list[Shots] = []
    timings: dict[str, float] = {}

    def lap(what: str, t: float) -> None:
        timings[what] = time.monotonic() - t
        print(f"  [{what}: {timings[what]:.0f} s]", flush=True)

    with h.cluster(settings, *args, books=synthetic(z.books, topics=TOPICS, stock=STOCK)) as c:
        urls = [c.cluster_config().frontend_url(k) for k in range(1, frontends + 1)]
        t = time.monotonic()
        out["normal"], out["capacity"] = normal_and_capacity(c, urls, z)
        normal_buy = out["normal"]["buy"]["p50"]
        drain_ms = 3 * normal_buy
        cap = out["capacity_per_s"] = out["capacity"]["per_s"]
        print(f"normal: buy p50 {normal_buy:.1f} ms, lookup p50 {out['normal']['lookup']['p50']:.1f} ms", flush=True)
        print(f"capacity C: {cap:.0f} buys/s (32 closed-loop buyers; p50 {out['capacity']['buy']['p50']:.0f} ms, "
              f"{out['capacity']['errors']} errors)", flush=True)
        lap("normal and capacity", t)

        t = time.monotonic()
        initial = read_stock(c.url, z.books)
        out["sweep"] = sweep(c, urls, z, cap, drain_ms, phases)
        best = max(p["goodput_per_s"] for p in out["sweep"])
        if best > 1.15 * cap:
            out["warning"] = (f"open-loop goodput reached {best:.0f}/s = {best / cap:.2f} C: either the closed-loop run "
                              "was disturbed (a busy machine) or the cluster does more with more requests in flight "
                              "than 32 closed-loop buyers keep there (batching); the multiples are of the closed-loop C")
            print(f"  WARNING: {out['warning']}", flush=True)
        lap("sweep", t)

        t = time.monotonic()
        f, kills, cpu = surge(c, urls, z, cap, kill)
        phases.append(f.shots)
        lap("surge", t)

        t = time.monotonic()
        out["checks"], rechecked = outside_checks(c, urls, z, initial, phases, drain_ms,
                                                  restart=[k["victim"] for k in kills])
        lap("checks", t)
    out["surge"] = {**surge_figures(f, z, cap, normal_buy), "cluster_cpu_cores": cpu, "kills": kills,
                    # an upper bound when the probes saw no recovery: the settle's buys after the surge
                    "fast_again_s": out["checks"].pop("settled_at") - f.t0 - z.pre_s - z.surge_s}
    out["surge_timeline"] = timeline = timeline_of(f.shots, -z.pre_s, z.surge_s + z.post_s)
    out["timings_s"] = {**timings, "total": time.monotonic() - started}
    out["load_1min_after"] = h.machine()["load_1min"]

    rows = done_when(out, z)
    sweep_rows = [[p["multiple"], p["offered_per_s"], p["goodput_per_s"], p["goodput_over_capacity"], p["shed_per_s"],
                   p["errors_per_s"], p["noanswer"], p["accepted_p50_ms"], p["accepted_p99_ms"], p["shed_p99_ms"],
                   p["max_answered_ms"], p["lag_p99_ms"], p["fast_again_s"]] for p in out["sweep"]]
    what = (f"{frontends} frontends" if frontends > 1 else "1 frontend") + (
        f", {' and '.join(k['victim'] for k in kills)} killed mid-surge" if kills else "") + (
        f", write cap following latency (tolerance {write_tolerance:g})" if write_tolerance else "")
    print(f"\nsweep (open loop, {z.point_s:g} s per point, capacity C = {cap:.0f} buys/s):")
    print(_text_table(SWEEP_COLUMNS, sweep_rows))
    print(f"\nsurge ({what}):")
    print(_text_table(["measure", "value", "goal", "met"], rows))
    print(f"checks: {json.dumps({k: v for k, v in out['checks'].items() if k != 'examples'})}")
    print(f"run took {out['timings_s']['total']:.0f} s (load average {out['load_1min_before']:.1f} before, "
          f"{out['load_1min_after']:.1f} after)", flush=True)
    p = plot(settings, name, out, timeline, f"Overload, {what} (C = {cap:.0f} buys/s, {settings.label})")
    raw = _save_raw(settings, name, Shots.of([r for q in (*phases, rechecked) for r in q.rows()]))
    h.save(settings, name, {
        "title": "11. Overload (a sale day)" + (f": {what}" if suffix else ""),
        "description": f"Issue #19. Closed-loop capacity C from 32 buyers; then buys offered open-loop (a fresh key "
                       f"each, {TIMEOUT:g} s timeout, no retries; latency from the scheduled send) at "
                       f"{', '.join(f'{m:g}' for m in z.multiples)} x C for {z.point_s:g} s each, and a {SURGE:g}x C "
                       f"surge of {z.surge_s:g} s with two lookups every 50 ms (a random book of the 1,000, nearly always a cache miss, and one of the first seven, cached) and a buy every 100 ms after it. {what}; "
                       f"{z.books:,} books. The checks re-send every buy without a definite answer once with its key, "
                       "read every acknowledged order and the stock of every book. See experiments/overload.py.",
        "results": out, "raw": raw,
        "table": {"columns": ["measure", "value", "goal", "met"], "rows": rows},
        "tables": [{"caption": f"Buys offered open-loop at multiples of C = {cap:.0f} buys/s, {z.point_s:g} s each "
                               "(latencies in ms from the scheduled send; fast again: seconds after the last offered "
                               "buy until 5 sequential buys in a row took at most 3x the normal p50)", "columns": SWEEP_COLUMNS, "rows": sweep_rows}],
        "plots": [p]})
    return out


def answers_of(buys: Shots, rechecked: Shots) -> list[Answer]:
    """Every first try's answer, then the re-sends' (one unit each)."""
    return [Answer(str(k), int(i), 1, int(st), int(o)) for part in (buys, rechecked)
            for k, i, st, o in zip(part.key, part.item, part.status, part.order, strict=True)]


def _text_table(columns: list[str], rows: list[list[Any]]) -> str:
    cells = [columns] + [[h.fmt(v) if not isinstance(v, str) else v for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells)


def _save_raw(settings: h.Settings, name: str, s: Shots) -> str:
    """Every request of the run, gzipped CSV (``results/<name>_raw.csv.gz``)."""
    settings.results_dir.mkdir(parents=True, exist_ok=True)
    path = settings.results_dir / f"{name}_raw.csv.gz"
    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(FIELDS)
        for r in s.rows():
            w.writerow([round(v, 6) if isinstance(v, float) else v for v in r])
    return path.name


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pygmy.experiments.overload")
    p.add_argument("--quick", action="store_true", help="shorter points and a 20 s surge (about 4 minutes)")
    p.add_argument("--frontends", type=int, default=1, help="frontends to spread the load over (default 1)")
    p.add_argument("--kill-follower", nargs="?", const="order", choices=("order", "catalog", "both"),
                   help="SIGKILL a follower of this tier (default order) half-way through the surge")
    p.add_argument("--write-tolerance", type=float, metavar="X",
                   help="the frontends' write cap follows latency, X times its baseline (default: a fixed cap)")
    p.add_argument("--results-dir", type=Path, default=h.RESULTS)
    p.add_argument("--plots-dir", type=Path, default=h.PLOTS)
    a = p.parse_args(argv)  # a bad --write-tolerance: `pygmy up` refuses it at once, saying why
    with contextlib.suppress(KeyboardInterrupt):
        run(h.Settings(quick=a.quick, results_dir=a.results_dir, plots_dir=a.plots_dir, progress=False),
            frontends=a.frontends, kill=a.kill_follower, write_tolerance=a.write_tolerance)


if __name__ == "__main__":
    main()
