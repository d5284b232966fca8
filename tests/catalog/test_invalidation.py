"""The catalog leader's lease protocol, driven deterministically (issues #15 and #18).

A fake clock stands in for ``time`` inside ``pygmy.catalog.invalidation``: ``sleep`` does not block, it
records when the caller would wake, so the moment a write may be proposed is exact. Pushes are gated
by events, so the interleaving of concurrent writes is chosen by the test, not by the scheduler.
The rule checked is the worker's own: its lease lasts from when it *sent* the renewal for ``lease``
seconds less ``MARGIN``, and no write may go ahead (be proposed, hence become readable) while that
lease can still be valid unless the write's hold reached the worker.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from harness import FakeLeadership

import pygmy.catalog.invalidation as inv_mod
from pygmy.catalog.invalidation import Invalidator
from pygmy.frontend.subscription import MARGIN

LEASE = inv_mod.LEASE


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self._local = threading.local()

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        self._local.woke = max(getattr(self._local, "woke", 0.0), self.now + seconds)

    def woke(self) -> float:
        return getattr(self._local, "woke", 0.0)

class FakeNode(FakeLeadership):
    def __init__(self) -> None:
        self.current_term = 1
        self.applied = 0

    def wait_applied(self, index: int, timeout: float) -> bool:
        if self.applied < index:
            time.sleep(0.005)  # real time: the releasing thread polls, as on a real node
        return self.applied >= index


class Pushes:
    """Push outcomes chosen by the test: each publish's push waits for its gate, then fails or not."""

    def __init__(self) -> None:
        self.gates: dict[int, threading.Event] = {}
        self.started: dict[int, threading.Event] = {}
        self.outcome: dict[int, bool] = {}
        self.reached: list[tuple[str, int]] = []

    def expect(self, version: int, ok: bool, gated: bool = True) -> None:
        self.gates[version] = threading.Event()
        self.started[version] = threading.Event()
        self.outcome[version] = ok
        if not gated:
            self.gates[version].set()

    def push(self, url: str, body: dict[str, Any]) -> bool:
        (_token, keys), = body["holds"]
        version = int(keys[0].split(":")[1])
        self.started[version].set()
        assert self.gates[version].wait(5), "test never released the push"
        if self.outcome[version]:
            self.reached.append((url, version))
        return self.outcome[version]


@pytest.fixture
def setup(monkeypatch: pytest.MonkeyPatch):
    clock = FakeClock()
    monkeypatch.setattr(inv_mod, "time", clock)
    pushes = Pushes()
    inv = Invalidator(FakeNode(), "secret")  # type: ignore[arg-type]
    monkeypatch.setattr(inv, "_push", pushes.push)
    # Every push through ``_push`` on a pool thread, as to workers with a push in flight: the gates
    # here hold each one on its own. ``test_invalidation_details`` has the pushes written from the
    # writer's own thread, to real workers.
    monkeypatch.setattr(inv, "_start", lambda url, body: None)
    monkeypatch.setattr(inv, "_send_unanswered", lambda url, body: False)
    clock.now = -10.0
    inv.subscribe("warm-up", "http://warm-up")  # the new-term lease wait is long over by t=0
    clock.now = 0.0
    yield clock, pushes, inv
    inv.stop()


class Publish:
    """One write's hold on its own thread; ``ack`` is when it may be proposed, on the fake clock."""

    def __init__(self, clock: FakeClock, inv: Invalidator, version: int) -> None:
        self.clock, self.inv, self.version = clock, inv, version
        self.ack: float | None = None
        self.token = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.token = self.inv.hold([f"book:{self.version}"])
            self.ack = max(self.clock.now, self.clock.woke())
        except BaseException as exc:  # re-raised by join
            self.error = exc

    def join(self) -> float:
        self.thread.join(5)
        assert not self.thread.is_alive(), "publish did not return"
        if self.error is not None:
            raise self.error
        assert self.ack is not None
        return self.ack


def worker_lease_end(sent: float) -> float:
    """Until when a worker that sent its renewal at ``sent`` uses its cache (its own rule)."""
    return sent + LEASE - MARGIN


def test_concurrent_failed_publishes_wait_for_the_latest_lease(setup) -> None:
    """Two publishes fail to reach a worker that renewed between them: neither may ack before the
    renewed lease ends, whichever of them revokes the worker first."""
    clock, pushes, inv = setup
    inv.subscribe("w", "http://w")  # t=0
    pushes.expect(10, ok=False)
    clock.now = 0.1
    a = Publish(clock, inv, 10)
    assert pushes.started[10].wait(5)  # A took its snapshot of the leases: w until 0.4
    clock.now = 0.2
    assert inv.subscribe("w", "http://w")["continued"] is True  # renewal during A: w until 0.6
    renewed_lease_end = worker_lease_end(sent=0.2)
    pushes.expect(11, ok=False)
    clock.now = 0.25
    b = Publish(clock, inv, 11)
    assert pushes.started[11].wait(5)
    pushes.gates[11].set()  # B fails first and revokes w
    assert b.join() >= renewed_lease_end
    pushes.gates[10].set()  # then A fails; w is already gone from the table
    assert a.join() >= renewed_lease_end, "change 10 went ahead while the worker's lease was valid"


def test_publish_starting_while_a_worker_is_revoked_waits_for_its_lease(setup) -> None:
    """A publish that starts after a worker was revoked, before it renewed, neither reaches it nor
    may ignore it: it waits for the lease the worker held."""
    clock, pushes, inv = setup
    inv.subscribe("w", "http://w")  # t=0: lease until 0.4, by the worker's rule until 0.35
    pushes.expect(10, ok=False, gated=False)
    clock.now = 0.1
    a = Publish(clock, inv, 10)
    assert a.join() >= worker_lease_end(sent=0.0)
    clock.now = 0.15  # w revoked, not yet renewed
    pushes.expect(11, ok=True, gated=False)
    c = Publish(clock, inv, 11)
    assert c.join() >= worker_lease_end(sent=0.0), "change 11 went ahead while w could still use its cache"


def test_a_revoked_worker_that_renews_flushes_and_is_pushed_again(setup) -> None:
    """After the revoked worker renews (and is told to flush), later publishes reach it and wait no more."""
    clock, pushes, inv = setup
    inv.subscribe("w", "http://w")
    pushes.expect(10, ok=False, gated=False)
    clock.now = 0.1
    Publish(clock, inv, 10).join()
    clock.now = 0.2
    assert inv.subscribe("w", "http://w")["continued"] is False  # not continued: the worker must flush
    pushes.expect(11, ok=True, gated=False)
    clock.now = 0.25
    assert Publish(clock, inv, 11).join() == pytest.approx(0.25)
    assert ("http://w", 11) in pushes.reached


def test_a_grant_during_a_write_carries_its_hold_until_release(setup) -> None:
    """A worker that subscribes while a write is pending must hold its keys too; once the write is
    released, grants no longer list it and ``next_token`` tells the worker it is finished."""
    clock, pushes, inv = setup
    pushes.expect(10, ok=True, gated=False)
    write = Publish(clock, inv, 10)
    write.join()
    token = write.token
    grant = inv.subscribe("late", "http://late")
    assert grant["continued"] is False
    assert grant["holds"] == [[token, ["book:10"]]] and grant["next_token"] > token
    inv.release(token, 42)
    grant = inv.subscribe("late", "http://late")
    assert grant["holds"] == [] and grant["next_token"] > token


def test_a_new_term_waits_a_lease_and_drops_the_old_terms_holds(setup) -> None:
    clock, pushes, inv = setup
    inv.hold(["book:1"])  # nobody leased: goes ahead at once
    node = inv.node
    node.current_term = 2
    clock.now = 1.0
    w = Publish(clock, inv, 11)  # no pushes expected: nobody holds a lease in term 2 yet
    assert w.join() >= 1.0 + LEASE  # every lease of term 1 has run out by then
    grant = inv.subscribe("w", "http://w")
    assert [t >> 32 for t, _ in grant["holds"]] == [2]  # the term-1 hold is gone; term 2's is listed
    assert grant["next_token"] >> 32 == 2


def test_a_new_leader_waits_from_its_election_what_an_old_lease_can_outlast_it(setup) -> None:
    """Old grants end by the old leader lease's end plus a lease; that end came ``vote_quiet_s``
    before any successor's election. So the wait is counted from the election, not the first act."""
    clock, _pushes, inv = setup
    node = inv.node
    node.current_term, node.leader_since = 2, 1.0
    clock.now = 1.05  # first act in term 2, a little after becoming leader
    w = Publish(clock, inv, 11)
    assert w.join() == pytest.approx(1.0 + LEASE - node.vote_quiet_s())
    node.current_term, node.leader_since = 3, None  # leadership start not known yet: a whole lease from now
    clock.now = 3.0
    assert Publish(clock, inv, 12).join() == pytest.approx(3.0 + LEASE)


def test_a_successor_waits_what_its_voters_quiet_leaves_of_a_lease() -> None:
    """Voters that last heard a leader 300 ms ago (the soonest anyone votes): 290 ms counted from the
    first tick after hearing, against a 200 ms leader lease, leaves 90 ms, so a new catalog leader
    waits 0.31 s from its election. Voters that had heard nothing for 600 ms: 390 ms, a 0.01 s wait.
    A node that does not lead counts on nothing: a whole lease. Voters that still heard their leader
    (a hand-over) leave less than nothing: a longer wait."""
    from types import SimpleNamespace

    from pygmy.replication.node import ReplicaNode, ReplicationConfig

    def quiet_s(ticks: int, leading: bool = True) -> float:
        config = ReplicationConfig()  # the core's election_gap: the voters' quiet less the lease
        node = SimpleNamespace(config=config, _leader_since=(4, 1.0, ticks - config.effective_lease_ticks()),
                               is_leader=lambda: leading, term=lambda: 4)
        return ReplicaNode.vote_quiet_s(node)  # type: ignore[arg-type]

    assert quiet_s(30) == pytest.approx(0.09)
    assert LEASE - quiet_s(30) == pytest.approx(0.31)
    assert quiet_s(60) == pytest.approx(0.39)
    assert quiet_s(60, leading=False) == 0.0
    # Voters that heard their leader 50 ms ago (a hand-over): its lease may run 160 ms past the
    # election, and so may what it granted under it; the wait is that much longer than a lease.
    assert quiet_s(5) == pytest.approx(-0.16)
    assert LEASE - quiet_s(5) == pytest.approx(LEASE + 0.16)


def test_a_grant_never_outlasts_the_leader_lease_by_more_than_a_lease(setup) -> None:
    """A grant computed by a thread that stalled after the caller checked the leader lease must not
    reach further than the successor's wait allows."""
    clock, _pushes, inv = setup
    inv.node.lease_until = 0.1  # the leader lease is about to end
    assert inv.subscribe("w", "http://w")["lease"] == LEASE  # within the cap
    clock.now = 0.3
    assert inv.subscribe("w", "http://w")["lease"] == pytest.approx(0.1 + LEASE - 0.3)
    assert inv._subs["w"][1] == pytest.approx(0.1 + LEASE)
    inv.node.lease_until = float("inf")
    assert inv.subscribe("w", "http://w")["lease"] == pytest.approx(LEASE)


def test_holding_releases_by_outcome(setup) -> None:
    """NotLeader: nothing written, release at once; a timeout with a known index: release only
    once that index is applied here; an unknown outcome: keep holding."""
    from pygmy.replication.node import NotLeader, ProposalTimeout

    _clock, _pushes, inv = setup
    with pytest.raises(NotLeader), inv.holding(["book:1"]):
        raise NotLeader(None, None)
    assert inv._pending == {}
    with pytest.raises(ProposalTimeout), inv.holding(["book:2"]):
        raise ProposalTimeout("slow", index=7)
    assert list(inv._pending.values()) == [["book:2"]]  # not applied yet: still held
    inv.node.applied = 7
    deadline = time.monotonic() + 5
    while inv._pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert inv._pending == {}
    with pytest.raises(ProposalTimeout), inv.holding(["book:3"]):
        raise ProposalTimeout("stalled")
    assert list(inv._pending.values()) == [["book:3"]]


def test_a_write_that_holds_no_key_pushes_nothing(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of buys of items that are no books: no cache holds them, so no hold round (pushes to
    every worker, and the wait for their answers) and no release."""
    _clock, _pushes, inv = setup
    pushed: list[Any] = []
    monkeypatch.setattr(inv, "_push", lambda url, body: pushed.append(body) or True)
    inv.subscribe("w", "http://w")
    with inv.holding([]) as write:
        write.index = 9
    assert pushed == [] and inv._pending == {}
