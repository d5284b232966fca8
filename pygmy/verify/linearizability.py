"""Linearizability from outside: concurrent writers, readers and buyers, judged by Porcupine.

Per book, one writer raises the cost step by step and adds a little stock (admin updates), readers
look books up through every frontend on fresh connections (so every Gunicorn worker's cache
serves), and buyers buy with ``Idempotency-Key``. Every operation is recorded with its invoke and
complete times and outcome (``pygmy.verify.lincheck.History``); the Go checker then decides, per
book, whether the cost register and stock counter histories are linearizable.

``python -m pygmy.verify.linearizability --runs 10 --duration 60`` (``make lincheck``) runs it on
fresh local clusters of 2 frontends x 2 workers and writes histories and verdicts to
``experiments/results/linearizability/``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from pygmy import ROOT
from pygmy.kit.retry import says_overloaded
from pygmy.verify import lincheck
from pygmy.verify.lincheck import History

RESULTS = ROOT / "experiments" / "results" / "linearizability"
#: Answers that say the operation had no effect: the checker needs no record of them.
DEFINITE_FAILURES = {400, 401, 403, 404, 409, 422}


def cents(cost: float) -> int:
    return round(cost * 100)


def shed(r: requests.Response) -> bool:
    """A 503 whose body says ``"overloaded": true``: refused at once, nothing done (docs/api.md). The
    history records it as not having happened, so Porcupine checks that promise too: a shed write
    that changed a book anyway leaves a read no order of the others explains."""
    if r.status_code != 503:
        return False
    try:
        return says_overloaded(r.status_code, r.json())
    except ValueError:
        return False


@dataclass
class Workload:
    """The load of one run; ``errors`` keeps what no guarantee allows (the run fails on any)."""

    urls: list[str]
    token: str  # the admin token: writers post POST /update
    items: list[int]
    writers: int = 7
    readers: int = 4
    buyers: int = 3
    timeout: float = 10.0
    #: Seconds a writer waits between updates: without it every book is rewritten before most
    #: lookups, so caches are hardly used and a stale cache could go unseen.
    write_pause: float = 0.15
    history: History = field(init=False)
    cache: Counter[str] = field(default_factory=Counter)
    #: Buys answered (200 or 409) by the way they took through the frontend: ``event loop`` or ``route``.
    buy_paths: Counter[str] = field(default_factory=Counter)
    #: Writes refused at once (``shed``), by kind: left out of the history as never done.
    shed: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        with requests.Session() as s:
            initial = {}
            for item in self.items:
                book = s.get(f"{self.urls[0]}/lookup/{item}", timeout=self.timeout).json()
                initial[item] = {"cost": cents(book["cost"]), "stock": book["stock"]}
        self.history = History(initial)
        self._stop = threading.Event()
        self._clients = itertools.count()

    def targets(self) -> list[Any]:
        """One client function per thread, each called with its index."""
        return [self._writer] * self.writers + [self._reader] * self.readers + [self._buyer] * self.buyers

    def run(self, seconds: float, drain: float = 0.0) -> History:
        """Run every client for ``seconds``; any exception in a client thread fails the run.
        ``drain``: how long a client may still be finishing its last operation (retries) after that."""
        targets = self.targets()
        failures: list[BaseException] = []

        def guarded(fn: Any, k: int) -> None:
            try:
                fn(k)
            except BaseException as exc:  # re-raised below: a dead client thread must not pass quietly
                failures.append(exc)
                self._stop.set()

        threads = [threading.Thread(target=guarded, args=(fn, k), name=f"lin-{fn.__name__}-{k}")
                   for k, fn in enumerate(targets)]
        for t in threads:
            t.start()
        self._stop.wait(seconds)
        self._stop.set()
        for t in threads:
            t.join(self.timeout + drain + 5)
        alive = [t.name for t in threads if t.is_alive()]
        if failures:
            raise failures[0]
        if alive:
            raise RuntimeError(f"client threads did not stop: {alive}")
        return self.history

    # -- clients ------------------------------------------------------------------------------------
    def _url(self, k: int, i: int) -> str:
        return self.urls[(k + i) % len(self.urls)]

    def _call(self, session: requests.Session, method: str, url: str, **kw: Any) -> requests.Response | None:
        """The answer, or None when the outcome is unknown (timeout, connection lost)."""
        try:
            return session.request(method, url, timeout=(2.0, self.timeout), **kw)
        except requests.RequestException:
            return None

    def _delta(self, item: int, i: int) -> int:
        """The stock a writer's ``i``-th update of ``item`` adds."""
        return 1 + i % 3

    def _send(self, send: Any) -> requests.Response | None:
        """One request (``send(attempt)``); subclasses may retry it under the same key."""
        return send(0)

    def _writer(self, k: int) -> None:
        item = self.items[k % len(self.items)]
        client = next(self._clients)
        # Writers sharing a book write costs of their own (k apart), so every value names its write.
        cost = self.history.initial[item]["cost"] + (k // len(self.items)) * 100_000
        with requests.Session() as s:
            for i in itertools.count():
                if self._stop.wait(self.write_pause if i else 0):
                    return
                cost += 1
                self._update(s, client, item, cost, self._delta(item, i), lambda a, i=i: self._url(k, i + a))

    def _update(self, s: requests.Session, client: int, item: int, cost: int, delta: int,
                url: Callable[[int], str]) -> requests.Response | None:
        """One recorded update of ``item`` to ``cost`` (cents) and by ``delta``, sent (and maybe
        sent again, ``_send``) to ``url(attempt)`` under one key; its last answer."""
        auth = {"Authorization": f"Bearer {self.token}"}
        key = f"lin-{uuid.uuid4().hex}"
        body = {"stock_delta": delta, "cost": cost / 100}
        op = self.history.invoke(client, "update", item, {"stock_delta": delta, "cost": cost, "key": key})
        r = self._send(lambda a: self._call(s, "POST", f"{url(a)}/update/{item}", json=body,
                                            headers={**auth, "Idempotency-Key": key}))
        if r is not None and shed(r):
            self.history.drop(op)
            self.shed["update"] += 1
        elif r is None or r.status_code >= 500:
            self.history.unknown(op)
        elif r.status_code == 200:
            book = r.json()
            self.history.ok(op, {"cost": cents(book["cost"]), "stock": book["stock"]})
        elif r.status_code in DEFINITE_FAILURES:
            self.history.drop(op)
            self.errors.append(f"update {item}: {r.status_code} {r.text[:200]}")
        else:
            self.history.unknown(op)
        return r

    def _reader(self, k: int) -> None:
        client = next(self._clients)
        for i in itertools.count():
            if self._stop.is_set():
                return
            self._lookup(client, self._url(k, i), self.items[(i * 3 + k) % len(self.items)])

    def _lookup(self, client: int, url: str, item: int) -> None:
        """One recorded lookup of ``item`` through the frontend at ``url``."""
        op = self.history.invoke(client, "lookup", item)
        # A new connection each time, so the kernel spreads reads over every worker.
        r = self._call(requests, "GET", f"{url}/lookup/{item}", headers={"Connection": "close"})
        if r is None or r.status_code != 200:
            self.history.drop(op)  # a failed read changes nothing
            if r is not None and r.status_code in DEFINITE_FAILURES:
                self.errors.append(f"lookup {item}: {r.status_code} {r.text[:200]}")
            return
        book = r.json()
        self.history.ok(op, {"cost": cents(book["cost"]), "stock": book["stock"]})
        self.cache[r.headers.get("X-Cache", "?")] += 1

    def _buyer(self, k: int) -> None:
        client = next(self._clients)
        with requests.Session() as s:
            for i in itertools.count():
                if self._stop.is_set():
                    return
                item = self.items[(i + k) % len(self.items)]
                op = self.history.invoke(client, "buy", item, {"quantity": 1})
                # One buy in three has no body (quantity 1 by default): it arrives in one segment and a
                # frontend worker's event loop takes it (pygmy/cluster/worker.py). One in three sends its
                # body chunked, which the event loop always leaves to a pool thread and the Flask route.
                # The rest send a JSON body, which may arrive with the headers or after them: either way.
                body: dict[str, Any] = ({} if i % 3 == 0 else {"json": {"quantity": 1}} if i % 3 == 1 else
                                        {"data": iter([b'{"quantity": 1}']),
                                         "headers": {"Content-Type": "application/json"}})
                # One in four asks to close its connection: the event loop's answer then says so
                # (pygmy/cluster/worker.py ``said_closing``), and the session opens a new one.
                close = {"Connection": "close"} if i % 4 == 2 else {}
                headers = {"Idempotency-Key": f"lin-{uuid.uuid4().hex}", **close, **body.pop("headers", {})}
                r = self._call(s, "POST", f"{self._url(k, i)}/buy/{item}", **body, headers=headers)
                if r is not None and shed(r):
                    self.history.drop(op)
                    self.shed["buy"] += 1
                    continue
                if r is None or r.status_code >= 500:
                    self.history.unknown(op)
                    continue
                if r.status_code in (200, 409):  # Gunicorn's header is on what a pool thread answered
                    self.buy_paths["route" if "Server" in r.headers else "event loop"] += 1
                if r.status_code == 200:
                    self.history.ok(op, {"ok": True})
                elif r.status_code == 409:
                    self.history.ok(op, {"ok": False, "out_of_stock": True})
                else:
                    self.history.drop(op)
                    self.errors.append(f"buy {item}: {r.status_code} {r.text[:200]}")


@dataclass
class Verdict:
    ok: bool
    counts: dict[str, int]
    cache: dict[str, int]
    result: lincheck.CheckResult
    history: Path
    errors: list[str]
    buy_paths: dict[str, int] = field(default_factory=dict)
    shed: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        bad = {i: v for i, v in self.result.items.items() if v != "ok"}
        return (f"{'linearizable' if self.ok else 'NOT LINEARIZABLE'}: {sum(self.counts.values())} ops "
                f"{dict(sorted(self.counts.items()))}, cache {dict(self.cache)}, buys by path {self.buy_paths}"
                + (f", shed {dict(self.shed)}" if self.shed else "")
                + (f", books failing {bad}, see {sorted(map(str, self.result.html.values()))}" if bad else "")
                + (f", client errors {self.errors[:3]}" if self.errors else ""))


def run_and_check(urls: list[str], token: str, seconds: float, out: Path, items: list[int] | None = None,
                  load_class: Callable[..., Workload] = Workload, **sizes: Any) -> Verdict:
    """One run: load for ``seconds``, save the history to ``out``, check it (HTML beside it).
    With fewer ``items`` than writers, several writers share a book (each still raises its cost).
    ``load_class``: a Workload with clients of its own (a test's)."""
    load = load_class(urls, token, items or list(range(1, 8)), **sizes)
    history = load.run(seconds)
    history.save(out)
    result = lincheck.check(out, html_dir=out.parent / f"{out.stem}-html", timeout=120)
    return Verdict(result.ok and not load.errors, history.counts(), dict(load.cache), result, out, load.errors,
                   dict(load.buy_paths), dict(load.shed))


def main(argv: list[str] | None = None) -> int:
    from pygmy.cluster.local import LocalCluster, free_port_base

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    lincheck.build_checker()
    verdicts = []
    for n in range(1, args.runs + 1):
        base = free_port_base()
        with tempfile.TemporaryDirectory(prefix="pygmy-lin-") as data:
            cluster = LocalCluster(Path(data), base, ["--frontends", "2", "--frontend-workers", "2"])
            cluster.start(reset=True)
            try:
                urls = [cluster.url, f"http://127.0.0.1:{base + 1}"]
                verdict = run_and_check(urls, cluster.admin_token(), args.duration, args.out / f"run-{n}.json")
            finally:
                cluster.stop()
        print(f"run {n}: {verdict.summary()}", flush=True)
        verdicts.append({"run": n, "ok": verdict.ok, "counts": verdict.counts, "cache": verdict.cache,
                         "items": verdict.result.items, "errors": verdict.errors[:20]})
    (args.out / "summary.json").write_text(json.dumps(verdicts, indent=1))
    failed = [v["run"] for v in verdicts if not v["ok"]]
    print(f"{len(verdicts) - len(failed)} of {len(verdicts)} runs linearizable" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
