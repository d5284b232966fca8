"""Linearizable reads (guarantee 4, docs/replication.md), judged from outside by Porcupine on real processes (#15, #18).

Two frontends x two Gunicorn workers, 7 writers (one per book), 4 readers and 3 buyers; every
operation goes into a history that ``tools/lincheck`` checks per book (cost register and stock
counter). The same load against a deliberately broken build (a test-only mutation loaded through
``tests/mutations/sitecustomize.py``) must be caught: that is what shows the check can fail.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import requests
from harness import Cluster, cluster_env, start_cluster

from pygmy.cluster import launcher
from pygmy.experiments import harness as h
from pygmy.verify import lincheck
from pygmy.verify.linearizability import Verdict, Workload, run_and_check

TWO_BY_TWO = ("--frontends", "2", "--frontend-workers", "2")

#: Load focused on two books, read by many readers, so a short window of staleness is likely to be
#: seen twice in a row (once fresh, once stale): what a mutation test needs to be caught quickly.
#: How long every push takes where a test says so (tests/mutations/sitecustomize.py).
PUSH_DELAY = "0.05"
FOCUSED = {"items": [1, 2], "writers": 4, "readers": 8, "buyers": 2, "write_pause": 0.05}


def urls(c: Cluster) -> list[str]:
    return [c.url, c.cluster_config().frontend_url(2)]


@pytest.fixture(scope="module", autouse=True)
def checker() -> None:
    lincheck.build_checker()  # fails with a clear message when Go is missing


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator:
    started: list[Cluster] = []

    def make(*args: str, **env: str) -> Cluster:
        c = start_cluster(tmp_path, *TWO_BY_TWO, *args, env=cluster_env(**env))
        started.append(c)
        return c

    yield make
    for c in started:
        c.stop()


def assert_enough_work(v: Verdict, reads: int = 300, updates: int = 70, buys: int = 20) -> None:
    c = v.counts
    assert c.get("lookup/ok", 0) >= reads and c.get("update/ok", 0) >= updates and \
        c.get("buy/ok", 0) + c.get("buy/out_of_stock", 0) >= buys, f"too little work to judge: {v.summary()}"
    assert v.cache.get("hit", 0) > 0, f"no cache hit: this run could not catch a stale cache ({v.summary()})"
    assert v.buy_paths.get("event loop", 0) > 0 and v.buy_paths.get("route", 0) > 0, \
        f"buys did not take both paths through the frontend ({v.summary()})"


@pytest.mark.parametrize("tls", ["plain", "tls"])
def test_every_book_is_linearizable_with_no_fault(make_cluster, tmp_path: Path, tls: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Also with every hop over TLS (``--tls``, #38): HTTPS to both frontends (the event loop's
    shortcut included, which reads decrypted bytes there), mutual TLS behind them."""
    if tls == "tls":
        c = make_cluster("--tls")
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(c.data_dir / "certs" / "ca.pem"))
        assert c.url.startswith("https://")
    else:
        c = make_cluster()
    v = run_and_check(urls(c), c.admin_token(), 15, tmp_path / "history.json")
    assert_enough_work(v, reads=200, updates=50, buys=15)
    assert v.ok, v.summary() + "\n" + v.result.output
    if tls == "tls":
        return  # the focused load below is the mutation tests' own check, the same with or without TLS
    # The focused load the mutation tests use finds nothing on a correct build either.
    v = run_and_check(urls(c), c.admin_token(), 8, tmp_path / "focused.json", **FOCUSED)
    assert_enough_work(v, reads=200, updates=30, buys=10)
    assert v.ok, v.summary() + "\n" + v.result.output


def assert_caught(v: Verdict, what: str) -> None:
    """A broken build counts as caught only when Porcupine proved some book not linearizable: a
    check that timed out (unknown) proves nothing either way, so it does not count."""
    assert v.result.illegal, f"{what}: no book proved not linearizable ({v.result.items}): {v.summary()}"
    assert all(v.result.html[item].exists() for item in v.result.illegal), v.result.html


def undecidable(tmp_path: Path, unknowns: int) -> lincheck.CheckResult:
    """A history of one book with ``unknowns`` updates of unknown outcome (each adds a different
    power of two, so every subset of them is another stock) and a lookup that no subset explains
    (stock -1), checked with a 1 s limit: to prove it illegal Porcupine must try every subset."""
    ops = [{"client": k, "kind": "update", "item": 1, "invoke": k, "complete": None,
            "input": {"stock_delta": 2 ** k}, "output": None} for k in range(unknowns)]
    ops.append({"client": unknowns, "kind": "lookup", "item": 1, "invoke": unknowns, "complete": unknowns + 1,
                "input": {}, "output": {"cost": 100, "stock": -1}})
    path = tmp_path / f"undecidable-{unknowns}.json"
    path.write_text(json.dumps({"initial": {"1": {"cost": 100, "stock": 0}}, "ops": ops}))
    return lincheck.check(path, html_dir=tmp_path / f"undecidable-{unknowns}-html", timeout=1)


def test_a_check_that_timed_out_does_not_count_as_a_caught_build(tmp_path: Path) -> None:
    """Before #40 a broken build counted as caught whenever the check was not ok, a timeout
    (Porcupine's "unknown") included: a build could pass its mutation test with nothing proved.
    ``assert_caught`` takes only a proof (illegal)."""
    def verdict(result: lincheck.CheckResult) -> Verdict:
        return Verdict(result.ok, {}, {}, result, tmp_path, [])

    proved = undecidable(tmp_path, 3)  # 8 subsets: decided at once
    assert proved.illegal == [1]
    assert_caught(verdict(proved), "3 unknown updates")
    undecided = undecidable(tmp_path, 40)  # 2**40 subsets: not within the limit
    assert undecided.unknown == [1] and undecided.illegal == [] and not undecided.ok, undecided.output
    with pytest.raises(AssertionError, match="no book proved not linearizable"):
        assert_caught(verdict(undecided), "40 unknown updates")


def caught_within(c: Cluster, tmp_path: Path, rounds: int, seconds: float = 8) -> Verdict:
    """Run rounds of focused load until the checker proves a violation (or give up after ``rounds``).
    Each round's history is checked alone, so a round whose check could not decide is followed
    by another, not counted."""
    v = None
    for n in range(rounds):
        v = run_and_check(urls(c), c.admin_token(), seconds, tmp_path / f"history-{n}.json", **FOCUSED)
        if v.result.illegal:
            break
    assert v is not None
    return v


@pytest.mark.parametrize("mutation", ["invalidate-after-apply", "no-read-index"])
def test_the_checker_catches_a_broken_build(make_cluster, tmp_path: Path, mutation: str) -> None:
    # Misses spread over every replica, so follower reads (and their read index) are exercised;
    # pushes take 50 ms, as over a slow link, so a write readable before its hold arrives is seen.
    c = make_cluster("--read-from", "any", PYGMY_MUTATION=mutation, PYGMY_TEST_PUSH_DELAY=PUSH_DELAY)
    v = caught_within(c, tmp_path, rounds=5)
    assert_caught(v, f"{mutation}: not caught in 40 s of load")


def fault_windows(windows: int, begin: Callable[[], Callable[[], None]], hold: float, gap: float,
                  stop: threading.Event | None = None) -> threading.Thread:
    """``windows`` times, on a thread of its own: ``begin()`` a fault, wait ``hold`` s, end it (the
    function ``begin`` returned: called whatever happens), wait ``gap`` s. ``stop`` ends it early."""
    stop = stop or threading.Event()

    def run() -> None:
        for _ in range(windows):
            if stop.is_set():
                return
            end = begin()
            try:
                stop.wait(hold)
            finally:
                end()
            stop.wait(gap)

    t = threading.Thread(target=run, name="fault-windows")
    t.start()
    return t


def push_fault_windows(flag: Path, windows: int, fault: float = 0.6, clear: float = 0.3) -> threading.Thread:
    """Toggle the one-way push fault on frontend-1 ``windows`` times."""
    flag_down = partial(flag.unlink, missing_ok=True)
    return fault_windows(windows, lambda: (flag.touch(), flag_down)[1], fault, clear)


@pytest.mark.parametrize("mutation", [None, "ignore-lost-pushes"])
def test_lost_pushes_to_one_frontend_hide_no_write(make_cluster, tmp_path: Path, mutation: str | None) -> None:
    """Pushes from the catalog to frontend-1's workers are lost one way in 20 windows while their
    renewals and reads go on (#15): no read may be stale. Counting a lost push as delivered must be caught."""
    flag = tmp_path / "push-fault"
    # Slow pushes as in the mutation tests: the correct build must stay linearizable with them.
    env = {"PYGMY_TEST_PUSH_FAULT": str(flag), "PYGMY_TEST_PUSH_FAULT_SERVICE": "frontend-1",
           "PYGMY_TEST_PUSH_DELAY": PUSH_DELAY}
    if mutation:
        env["PYGMY_MUTATION"] = mutation
    c = make_cluster("--read-from", "any", **env)  # follower reads on the correct build too
    faults = push_fault_windows(flag, windows=20, fault=0.4, clear=0.2)
    try:
        v = run_and_check(urls(c), c.admin_token(), 12, tmp_path / "history.json")
    finally:
        faults.join(30)
        flag.unlink(missing_ok=True)
    assert not faults.is_alive()
    if mutation is None:
        assert_enough_work(v, reads=150, updates=20, buys=10)
        assert v.ok, v.summary() + "\n" + v.result.output
    else:
        assert_caught(v, f"{mutation}: stale reads under lost pushes not caught")


#: Cache leases of 2 s: longer than a failover takes to let a write through (about 0.5 s: an
#: election, then a router's first look elsewhere 0.25 s into a stalled request; over 1 s on a
#: loaded CI machine, whose election windows stretch), so a new leader that did not wait them out
#: would be seen.
LONG_LEASES = {"PYGMY_TEST_CACHE_LEASE": "2.0"}

#: Writes few enough that a book is often cached with no write of it in flight when its leader
#: stops (a write in flight holds its book in every cache until a new lease flushes them).
FAILOVER_LOAD = {"items": [1, 2, 3], "writers": 3, "readers": 8, "buyers": 2, "write_pause": 0.3}


def catalog_term(c: Cluster) -> int:
    return max(int(r.get("term", 0)) for r in h.tier_status(c, "catalog")["replicas"])


def catalog_leader(c: Cluster, timeout: float = 20) -> tuple[str, int]:
    """The catalog leader's name and term, as the replica itself says (a frontend's view may be old)."""
    deadline = time.monotonic() + timeout
    while True:
        name = h.leader(c, "catalog")
        status = h.replica_status(c, name)
        if status is not None and status.get("role") == "leader":
            return name, int(status["term"])
        assert time.monotonic() < deadline, f"no catalog leader confirmed itself within {timeout} s"
        time.sleep(0.05)


def catalog_leader_pauses(c: Cluster, flag: Path, pauses: int, stop: threading.Event, pause: float = 2.4,
                          gap: float = 0.6, paused: Callable[[str, int], None] = lambda name, term: None
                          ) -> threading.Thread:
    """SIGSTOP the catalog leader's process group for ``pause`` s, ``pauses`` times, with ``flag``
    there meanwhile (``paused`` is told the leader's name and term); every stopped group is
    continued and the flag removed."""

    def begin() -> Callable[[], None]:
        name, term = catalog_leader(c)
        group = c.process_groups()[name]

        def end() -> None:
            os.killpg(group, signal.SIGCONT)
            flag.unlink(missing_ok=True)

        try:
            launcher.pause(group)
            flag.touch()
            paused(name, term)
        except BaseException:
            end()
            raise
        return end

    return fault_windows(pauses, begin, pause, gap, stop)


#: The book only the failover prober writes (FAILOVER_LOAD's writers write books 1 to 3).
PROBED = 4


@dataclass
class ProbedFailovers(Workload):
    """The load plus a prober: each time the catalog leader is paused (its name and term put on
    ``paused``), it waits for a leader of a later term, updates book PROBED through frontend-0 at
    once and then reads it through frontend-1, whose workers cannot renew and have it cached from
    the readers. A new leader that writes before the old leader's cache leases are over lets those
    reads show the old value at a pause, not only when some writer's update happens to fall in
    that window."""

    cluster: Cluster | None = None
    paused: queue.Queue[tuple[str, int]] = field(default_factory=queue.Queue)
    #: The costs of the probe updates a new leader answered with 200.
    probes: list[int] = field(default_factory=list)

    def targets(self) -> list[Any]:
        return super().targets() + [self._prober]

    def _prober(self, k: int) -> None:
        assert self.cluster is not None
        writer, reader = next(self._clients), next(self._clients)
        cost = self.history.initial[PROBED]["cost"]
        with requests.Session() as s:
            while not self._stop.is_set():
                try:
                    old, term = self.paused.get(timeout=0.1)
                except queue.Empty:
                    continue
                if not self._new_leader(old, term):
                    continue
                cost += 1
                r = self._update(s, writer, PROBED, cost, 1, lambda attempt: self.urls[0])
                if r is not None and r.status_code == 200:
                    self.probes.append(cost)
                for _ in range(6):
                    if self._stop.is_set():
                        return
                    self._lookup(reader, self.urls[1], PROBED)

    def _new_leader(self, old: str, term: int, within: float = 2.0) -> bool:
        """Whether a catalog replica other than ``old`` leads in a term after ``term`` within
        ``within`` s (asked every 10 ms; ``old`` is not asked: it is stopped)."""
        assert self.cluster is not None
        others = [n for n in self.cluster.cluster_config().peers("catalog") if n != old]
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and not self._stop.is_set():
            for name in others:
                status = h.replica_status(self.cluster, name, timeout=0.2)
                if status is not None and status.get("role") == "leader" and int(status["term"]) > term:
                    return True
            time.sleep(0.01)
        return False


@pytest.mark.parametrize("mutation", [None, "no-lease-wait"])
def test_a_new_catalog_leader_writes_only_once_old_cache_leases_are_over(make_cluster, tmp_path: Path,
                                                                         mutation: str | None) -> None:
    """The catalog leader is SIGSTOPped six times under load, and each time a new one is elected
    while frontend-1's workers, which cannot renew meanwhile (as if cut off from the new leader),
    still hold the old leader's leases and serve their caches. At each pause a prober writes a book
    as soon as a new leader leads and reads it through frontend-1 (``ProbedFailovers``). The new
    leader's wait (docs/architecture.md, case 3) keeps every read linearizable; a build that skips
    it is caught, by the probes as well as when a writer happens to write at the right moment."""
    flag = tmp_path / "renew-fault"
    env = dict(LONG_LEASES, PYGMY_TEST_RENEW_FAULT=str(flag), **({"PYGMY_MUTATION": mutation} if mutation else {}))
    c = make_cluster(**env)
    term, stop, paused, probes = catalog_term(c), threading.Event(), queue.Queue[tuple[str, int]](), list[int]()
    pauses = catalog_leader_pauses(c, flag, pauses=6, stop=stop, paused=lambda name, t: paused.put((name, t)))
    load = partial(ProbedFailovers, cluster=c, paused=paused, probes=probes)
    try:
        v = run_and_check(urls(c), c.admin_token(), 19, tmp_path / "history.json", load_class=load,
                          **{**FAILOVER_LOAD, "items": [*FAILOVER_LOAD["items"], PROBED]})
        pauses.join(30)
    finally:
        stop.set()
        pauses.join(30)
    assert not pauses.is_alive()
    # Each pause outlasts an election: six new catalog leaders at least, or the run proved little.
    assert catalog_term(c) >= term + 6, f"catalog term {term} -> {catalog_term(c)}: too few failovers"
    assert len(probes) >= 3, f"only {len(probes)} probe updates answered in 6 pauses: {v.summary()}"
    if mutation is None:
        assert_enough_work(v, reads=150, updates=20, buys=5)
        assert v.ok, v.summary() + "\n" + v.result.output
    else:
        # Usually the prober's book is among those proved (5 of 6 runs); the writers' books often are too.
        assert_caught(v, f"{mutation}: stale reads across catalog failovers not caught")


#: Many buyers and writers against a frontend cap of 4 writes in flight that follows their latency
#: (#42): a good share of them is shed.
SURGE = {"items": [1, 2, 3], "writers": 4, "readers": 6, "buyers": 10, "write_pause": 0.05}


@pytest.mark.parametrize("mutation", [None, "shed-after-buy"])
def test_shed_writes_did_nothing(make_cluster, tmp_path: Path, mutation: str | None) -> None:
    """A 503 with ``"overloaded": true`` promises that nothing was done (docs/api.md), and the
    history records such a write as never made: a shed buy or update that changed a book anyway
    leaves reads that no order of the others explains. Here the frontends' write caps are small and
    follow latency (``--frontend-write-tolerance``), so many writes are shed; the mutation answers
    every third bought book as shed, and is caught."""
    c = make_cluster("--frontend-write-limit", "4", "--frontend-write-tolerance", "1.5",
                     **({"PYGMY_MUTATION": mutation} if mutation else {}))
    v = run_and_check(urls(c), c.admin_token(), 6, tmp_path / "history.json", **SURGE)
    assert v.shed.get("buy", 0) > 0, f"no buy was shed: this run checked nothing of the promise ({v.summary()})"
    if mutation:
        assert_caught(v, mutation)
        return
    assert_enough_work(v, reads=100, updates=20, buys=20)
    assert v.ok, v.summary() + "\n" + v.result.output
