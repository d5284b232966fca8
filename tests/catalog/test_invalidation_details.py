"""The lease protocol's leader side in detail: tokens, releases, revocation arithmetic, the pushes.

Written against the mutants of ``pygmy.catalog.invalidation`` that the scenario tests in
``test_invalidation.py`` let through (docs/testing.md, "Mutation score"). A fake clock stands in for
``time`` inside the module, so every wait is exact; pushes are replaced by a recorder, except in the
last tests, which send real HTTP to a server on a thread of this process.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from harness import FakeLeadership
from prometheus_client import REGISTRY, CollectorRegistry, Counter

import pygmy.catalog.invalidation as inv_mod
from pygmy.catalog.invalidation import LEASE, Invalidator
from pygmy.kit.cachekeys import book_key, search_key
from pygmy.replication.node import ProposalTimeout
from pygmy.replication.transport import PUSH_CHANNEL, Channel, FrameServer


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)

class FakeNode(FakeLeadership):
    def __init__(self) -> None:
        self.name = "catalog-1"
        self.current_term = 1
        self.applied = 0
        self.timeouts: list[float | None] = []

    def wait_applied(self, index: int, timeout: float | None) -> bool:
        self.timeouts.append(timeout)
        return self.applied >= index


class Pushes:
    """Records every push; ``fail`` names the urls whose pushes fail, ``during`` runs inside a push."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.threads: list[str] = []
        self.fail: set[str] = set()
        self.during: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def __call__(self, url: str, body: dict[str, Any]) -> bool:
        with self._lock:
            self.calls.append((url, body))
            self.threads.append(threading.current_thread().name)
        if self.during is not None:
            self.during()
        return url not in self.fail

    def releases(self) -> list[tuple[str, dict[str, Any]]]:
        return [(url, body) for url, body in self.calls if "releases" in body]


Env = tuple[FakeClock, FakeNode, Invalidator, Pushes]


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    clock = FakeClock()
    monkeypatch.setattr(inv_mod, "time", clock)
    node = FakeNode()
    inv = Invalidator(node, "secret")  # type: ignore[arg-type]
    pushes = Pushes()
    monkeypatch.setattr(inv, "_push", pushes)
    # Every push through ``_push`` (on a pool thread), as to workers with a push in flight; the
    # tests at the end push to real workers from the writer's own thread.
    monkeypatch.setattr(inv, "_start", lambda url, body: None)
    monkeypatch.setattr(inv, "_send_unanswered", lambda url, body: False)
    yield clock, node, inv, pushes
    inv.stop()


def settled(inv: Invalidator) -> None:
    """Wait for every push the invalidator submitted (releases are not waited for by the code)."""
    inv._pool.shutdown(wait=True)


def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, "condition not met in 5 s"
        time.sleep(0.005)


def woke(clock: FakeClock) -> float:
    """Until when the caller slept, on the fake clock (``now`` if it did not sleep)."""
    return clock.now + sum(clock.slept)


def test_cache_keys() -> None:
    assert book_key(17) == "book:17"
    assert search_key("Distributed-Systems") == search_key(" distributed_systems ") == "topic:distributed systems"


# -- terms and tokens ---------------------------------------------------------------------------------
def test_a_new_leader_waits_one_lease_before_its_first_write(env: Env) -> None:
    clock, _node, inv, _pushes = env
    clock.now = 100.0
    inv.hold(["book:1"])
    assert clock.slept == [pytest.approx(LEASE)]  # exactly until 100 + LEASE: every lease of an older term is over
    clock.slept.clear()
    clock.now = 100.0 + LEASE
    inv.hold(["book:2"])
    assert clock.slept == []


def test_the_grant_names_the_token_of_the_next_write(env: Env) -> None:
    """``next_token`` tells a worker which holds are finished: exactly those below the next write's."""
    _clock, _node, inv, _pushes = env
    first = inv.hold(["book:1"])
    grant = inv.subscribe("w", "http://w")
    assert grant["next_token"] == first + 1
    second = inv.hold(["book:2"])
    assert second == grant["next_token"] and first >> 32 == second >> 32 == 1
    assert inv.subscribe("w", "http://w")["holds"] == [[first, ["book:1"]], [second, ["book:2"]]]
    inv.release(first, 5)
    assert inv.subscribe("w", "http://w") == {"continued": True, "holds": [[second, ["book:2"]]],
                                              "next_token": second + 1, "lease": inv.lease}


def test_a_lease_renewed_at_its_very_end_is_not_continued(env: Env) -> None:
    """At its expiry instant a worker is no longer pushed to, so a renewal then must flush."""
    clock, _node, inv, pushes = env
    clock.now = -1.0
    inv.hold(["book:0"])  # the new term's wait is over by t=0
    clock.now = 0.0
    assert inv.subscribe("w", "http://w")["continued"] is False
    clock.now = LEASE - 0.01
    assert inv.subscribe("w", "http://w")["continued"] is True  # lease now until 2 * LEASE - 0.01
    clock.now = inv._subs["w"][1]
    inv.hold(["book:1"])
    assert pushes.calls == []  # its lease ends right now: not a target
    assert inv.subscribe("w", "http://w")["continued"] is False


def test_a_far_worker_gets_a_longer_lease_but_never_past_the_leader_lease_plus_one(env: Env) -> None:
    """A worker reports its renewals' round trip: nearby ones keep LEASE; a far one gets time for
    its grant and its next renewal to arrive, within LEASE_MAX, and never past the leader lease's
    end plus LEASE, all that a successor waits out (``_sync_term``)."""
    clock, node, inv, _pushes = env
    clock.now = 10.0
    assert inv.subscribe("near", "tcp://near:1", rtt=0.002)["lease"] == pytest.approx(LEASE)
    far = inv.subscribe("far", "tcp://far:1", rtt=0.3)["lease"]
    assert far == pytest.approx(inv_mod.LEASE_RTTS * 0.3 + LEASE / 2) and far > 2 * 0.3 + LEASE / 2
    assert inv.subscribe("far", "tcp://far:1", rtt=30)["lease"] == pytest.approx(inv_mod.LEASE_MAX)
    node.lease_until = 10.5
    assert inv.subscribe("far2", "tcp://far2:1", rtt=0.3)["lease"] == pytest.approx(0.5 + LEASE)
    assert inv._subs["far2"][1] == pytest.approx(10.5 + LEASE)


def test_a_renewal_never_shortens_the_lease_a_write_counts_on(env: Env) -> None:
    """A worker whose round trip fell gets a shorter lease at its next renewal; if that answer is
    lost or late it goes on with the longer grant before it. A write must still hold it (push, or
    wait out that grant when the push fails), so the table keeps the longer end."""
    clock, node, inv, pushes = env
    clock.now = -1.0
    inv.hold(["book:0"])  # the term's wait is over
    clock.now, node.lease_until = 0.0, 100.0
    first = inv.subscribe("w", "tcp://w:1", rtt=0.3)["lease"]  # the worker may use it until about 0 + first
    clock.now = 0.1
    assert inv.subscribe("w", "tcp://w:1", rtt=0.01)["lease"] == pytest.approx(LEASE)  # its answer lost
    clock.now = 0.1 + LEASE + 0.01  # past the second grant, inside the first
    assert clock.now < first
    pushes.fail.add("tcp://w:1")
    clock.slept.clear()
    inv.hold(["book:1"])  # w is held: pushed to, and (the push failed) its first grant waited out
    assert [u for u, b in pushes.calls if b.get("holds")] == ["tcp://w:1"]
    assert clock.now + sum(clock.slept) == pytest.approx(first)


def test_a_successor_after_a_hand_over_waits_out_a_far_grant_made_just_before(env: Env) -> None:
    """A far worker's grant runs to the leader lease's end plus a lease. Just before a hand-over
    that end is still ahead: voters that heard the old leader a moment ago elect its successor, and
    ``vote_quiet_s`` is negative (not clipped at 0), so the successor writes no sooner than that."""
    clock, node, inv, _pushes = env
    clock.now = -1.0
    inv.hold(["book:0"])
    clock.now, node.lease_until = 10.0, 10.2  # the leader lease, 200 ms past its last acknowledged send
    inv.subscribe("far", "tcp://far:1", rtt=0.3)
    granted_until = inv._subs["far"][1]
    assert granted_until == pytest.approx(10.2 + LEASE)
    from types import SimpleNamespace

    from pygmy.replication.node import ReplicaNode, ReplicationConfig

    config = ReplicationConfig()  # voters that heard the old leader 0 ticks ago: gap = 0 - the lease
    voted = SimpleNamespace(config=config, _leader_since=(2, 10.01, 0 - config.effective_lease_ticks()),
                            is_leader=lambda: True, term=lambda: 2)
    successor = FakeNode()
    successor.current_term, successor.leader_since = 2, 10.01
    successor.vote_quiet = ReplicaNode.vote_quiet_s(voted)  # type: ignore[arg-type]
    after = Invalidator(successor, "secret")  # type: ignore[arg-type]
    try:
        after._sync_term()
        assert after._ready_at >= granted_until
    finally:
        after.stop()


def test_a_push_to_a_far_worker_is_given_time_for_its_round_trip(env: Env) -> None:
    _clock, _node, inv, _pushes = env
    inv.subscribe("near", "tcp://near:1", rtt=0.001)
    inv.subscribe("far", "tcp://far:1", rtt=0.4)
    assert inv.push_timeout("tcp://near:1") == inv_mod.PUSH_TIMEOUT
    assert inv.push_timeout("tcp://far:1") == pytest.approx(inv_mod.PUSH_RTTS * 0.4)
    inv.subscribe("far", "tcp://far:1", rtt=59)
    assert inv.push_timeout("tcp://far:1") == inv_mod.PUSH_TIMEOUT_MAX


# -- releases -----------------------------------------------------------------------------------------
def test_a_release_is_pushed_with_its_index_to_live_workers_only(env: Env) -> None:
    clock, _node, inv, pushes = env
    clock.now = -1.0
    inv.subscribe("old", "http://old")  # expired by t=0
    clock.now = 0.0
    inv.subscribe("w1", "http://w1")  # until LEASE
    clock.now = 0.1
    inv.subscribe("w2", "http://w2")  # until 0.1 + LEASE
    token = inv.hold(["book:1", "book:2"])
    assert sorted(url for url, _ in pushes.calls) == ["http://w1", "http://w2"]
    assert all(body == {"holds": [[token, ["book:1", "book:2"]]]} for _, body in pushes.calls)
    clock.now = LEASE  # w1's lease ends now
    inv.release(token, 42)
    settled(inv)
    assert pushes.releases() == [("http://w2", {"releases": [[token, ["book:1", "book:2"], 42]]})]
    assert all(name.startswith("invalidate") for name in pushes.threads)



def test_a_release_carries_the_values_read_after_the_write(env: Env) -> None:
    """Caches that dropped the keys refresh them from these values instead of missing."""
    _clock, _node, inv, pushes = env
    inv.subscribe("w", "http://w")
    values = {"book:1": {"item_number": 1, "stock": 4}}
    with inv.holding(["book:1"]) as write:
        write.index, write.values = 12, values
    token = inv.hold(["book:2"])
    inv.release(token, 13, {})  # nothing read: a plain release
    settled(inv)
    assert sorted(body["releases"][0][2:] for _, body in pushes.releases()) == [[12, values], [13]]

def test_releasing_an_unknown_or_finished_token_does_nothing(env: Env) -> None:
    _clock, _node, inv, pushes = env
    inv.subscribe("w", "http://w")
    token = inv.hold(["book:1"])
    inv.release(token, 3)
    inv.release(token, 4)  # already released
    inv.release(token + 99, 5)  # never held
    settled(inv)
    assert [body["releases"][0][2] for _, body in pushes.releases()] == [3]


def test_no_release_is_pushed_after_stop(env: Env) -> None:
    _clock, _node, inv, pushes = env
    inv.subscribe("w", "http://w")
    token = inv.hold(["book:1"])
    inv.stop()
    inv.release(token, 3)  # the pool is shut down: submitting would raise
    assert pushes.releases() == [] and inv._pending == {}


def test_a_write_that_sets_no_index_releases_at_zero(env: Env) -> None:
    """The body of ``holding`` sets ``write.index`` when it changed something; left alone it is 0."""
    _clock, _node, inv, pushes = env
    inv.subscribe("w", "http://w")
    with inv.holding(["book:1"]) as write:
        assert write.index == 0
    settled(inv)
    assert inv._pending == {}
    assert [body["releases"][0][2] for _, body in pushes.releases()] == [0]


def test_a_timed_out_write_is_released_at_its_index_once_applied(env: Env) -> None:
    _clock, node, inv, pushes = env
    inv.subscribe("w", "http://w")
    node.applied = 7
    with pytest.raises(ProposalTimeout), inv.holding(["book:1"]):
        raise ProposalTimeout("slow", index=7)
    until(lambda: len(pushes.releases()) == 1)  # released from the pool's thread, once applied
    assert inv._pending == {}
    assert [body["releases"][0][1:] for _, body in pushes.releases()] == [[["book:1"], 7]]
    assert node.timeouts and all(t is not None and 0 < t <= 0.5 for t in node.timeouts)  # notices stop


def test_a_timed_out_write_is_never_released_by_a_later_term(env: Env) -> None:
    _clock, node, inv, pushes = env
    inv.subscribe("w", "http://w")
    node.applied = 7
    with pytest.raises(ProposalTimeout), inv.holding(["book:1"]):
        node.current_term = 2  # we lost the leadership: the new term's grants end the hold
        raise ProposalTimeout("slow", index=7)
    settled(inv)  # the releasing thread has given up (a release it tried would have emptied _pending)
    assert list(inv._pending.values()) == [["book:1"]] and pushes.releases() == []


def test_stop_cancels_queued_pushes_and_does_not_wait_for_running_ones(env: Env) -> None:
    _clock, _node, inv, pushes = env
    gate = threading.Event()
    pushes.during = lambda: gate.wait(5)
    urls = [f"http://w{i}" for i in range(40)]
    for i, url in enumerate(urls):
        inv.subscribe(f"w{i}", url)
    inv._pending[1 << 32 | 99] = ["book:1"]  # a write that needs no hold push for this test
    inv.release(1 << 32 | 99, 5)  # 40 pushes: some run (and block), the rest queue
    stopper = threading.Thread(target=inv.stop)
    stopper.start()
    stopper.join(1.0)
    alive = stopper.is_alive()
    gate.set()
    stopper.join(5)
    assert not alive, "stop waited for running pushes"
    settled(inv)
    assert 0 < len(pushes.calls) < len(urls), "queued pushes ran after stop"


# -- revocation ---------------------------------------------------------------------------------------
def started(env: Env) -> Env:
    clock, _node, inv, _pushes = env
    clock.now = -1.0
    inv.hold(["book:0"])  # the new term's wait is over by t=0
    clock.now = 0.0
    clock.slept.clear()
    return env


def test_a_worker_that_renews_during_a_failed_push_is_waited_out_to_its_new_lease(
        env: Env, caplog: pytest.LogCaptureFixture) -> None:
    clock, _node, inv, pushes = started(env)
    inv.subscribe("w", "http://w")  # until LEASE
    pushes.fail.add("http://w")

    def renew() -> None:
        clock.now = 0.2
        inv.subscribe("w", "http://w")  # until 0.2 + LEASE, granted while the push was out

    pushes.during = renew
    clock.now = 0.1
    with caplog.at_level(logging.WARNING, logger="pygmy.catalog.invalidation"):
        inv.hold(["book:1"])
    assert woke(clock) == pytest.approx(0.2 + LEASE)
    assert [r.getMessage() for r in caplog.records] == ["hold not acknowledged by w; waiting out their lease"]
    assert inv._revoked == {"w": pytest.approx(0.2 + LEASE)} and "w" not in inv._subs


def test_the_warning_names_every_worker_a_hold_missed(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    clock, _node, inv, pushes = started(env)
    for w in ("w1", "w2", "w3"):
        inv.subscribe(w, f"http://{w}")
    pushes.fail.update({"http://w1", "http://w3"})
    with caplog.at_level(logging.WARNING, logger="pygmy.catalog.invalidation"):
        inv.hold(["book:1"])
    assert [r.getMessage() for r in caplog.records] == ["hold not acknowledged by w1, w3; waiting out their lease"]


def test_a_failed_push_waits_out_the_lease_it_saw_even_if_a_new_term_cleared_the_tables(env: Env) -> None:
    clock, node, inv, pushes = started(env)
    inv.subscribe("w", "http://w")  # until LEASE
    pushes.fail.add("http://w")

    def new_term() -> None:
        node.current_term = 2
        inv.subscribe("x", "http://x")  # the first act of term 2 clears the leases and revocations

    pushes.during = new_term
    clock.now = 0.1
    inv.hold(["book:1"])
    assert woke(clock) == pytest.approx(LEASE), "the write went ahead while w could still use its cache"


def test_a_worker_whose_lease_ran_out_during_the_push_is_not_waited_for(env: Env) -> None:
    clock, _node, inv, pushes = started(env)
    inv.subscribe("w", "http://w")  # until LEASE
    pushes.fail.add("http://w")

    def slow() -> None:
        clock.now = LEASE + 0.1

    pushes.during = slow
    clock.now = 0.1
    inv.hold(["book:1"])
    assert clock.slept == []
    assert inv._revoked == {}  # nothing left to wait for: forgotten
    pushes.during = None
    clock.now = LEASE + 0.2
    inv.hold(["book:2"])
    assert clock.slept == []


def test_a_push_that_never_answers_counts_as_failed(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    clock, _node, inv, pushes = started(env)
    monkeypatch.setattr(inv_mod, "PUSH_TIMEOUT", 0.05)  # the wait is PUSH_TIMEOUT + 0.2 s, real time
    gate, answered = threading.Event(), threading.Event()

    def hang() -> None:
        gate.wait(5)
        answered.set()

    pushes.during = hang
    inv.subscribe("w", "http://w")
    try:
        inv.hold(["book:1"])
        gave_up = not answered.is_set()  # the hold went on while the push still hung
    finally:
        gate.set()
    assert gave_up
    assert "w" in inv._revoked and clock.slept == [pytest.approx(LEASE)]


def test_publish_time_is_observed(env: Env) -> None:
    _clock, _node, inv, _pushes = started(env)
    before = REGISTRY.get_sample_value("pygmy_invalidation_seconds_sum") or 0.0
    count = REGISTRY.get_sample_value("pygmy_invalidation_seconds_count") or 0.0
    inv.hold(["book:1"])
    assert 0 <= REGISTRY.get_sample_value("pygmy_invalidation_seconds_sum") - before < 1.0
    assert REGISTRY.get_sample_value("pygmy_invalidation_seconds_count") == count + 1


# -- the push itself, over a real connection -------------------------------------------------------
class Worker:
    """A fake frontend worker's listener: records frames, answers like the real one (or not at all)."""

    answer: Any = {"ok": True}
    delay = 0.0
    seen: list[tuple[str, Any]] = []
    answered: list[Any] = []  # frames answered, once the delay is over

    @staticmethod
    def handle(peer: str, frame: Any) -> Any:
        Worker.seen.append((peer, frame))
        time.sleep(Worker.delay)
        Worker.answered.append(frame)
        return Worker.answer


@pytest.fixture
def worker() -> Iterator[str]:
    Worker.answer, Worker.delay, Worker.seen, Worker.answered = {"ok": True}, 0.0, [], []
    server = FrameServer("127.0.0.1", 0, "s3cret", {PUSH_CHANNEL: Channel(Worker.handle)}, name="fake-worker")
    server.start()
    yield f"tcp://127.0.0.1:{server.address[1]}"
    server.stop()


def test_a_push_sends_the_body_with_the_secret_and_needs_an_acknowledgement(worker: str) -> None:
    inv = Invalidator(FakeNode(), "s3cret")  # type: ignore[arg-type]
    try:
        body = {"holds": [[5, ["book:1"]]]}
        assert inv._push(worker, body) is True
        assert Worker.seen == [("catalog-1", {"holds": [[5, ["book:1"]]], "releases": []})]
        Worker.answer = {"error": {"code": 400, "message": "malformed invalidation"}}
        assert inv._push(worker, body) is False
    finally:
        inv.stop()
    wrong = Invalidator(FakeNode(), "wrong")  # type: ignore[arg-type]
    try:
        assert wrong._push(worker, {"holds": [[6, ["book:2"]]]}) is False  # refused at the hello
        assert len(Worker.seen) == 2
    finally:
        wrong.stop()


def test_pushes_that_meet_go_out_as_one_frame(worker: str) -> None:
    """While a frame is on its way, pushes to the same worker queue up and leave together."""
    inv = Invalidator(FakeNode(), "s3cret")  # type: ignore[arg-type]
    try:
        Worker.delay = 0.05
        results: list[bool] = []
        threads = [threading.Thread(target=lambda t=t: results.append(inv._push(worker, {"holds": [[t, ["book:1"]]]})))
                   for t in range(1, 9)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [True] * 8
        tokens = sorted(h[0] for _, frame in Worker.seen for h in frame["holds"])
        assert tokens == list(range(1, 9)) and len(Worker.seen) < 8
    finally:
        inv.stop()


def test_a_push_to_a_slow_or_absent_worker_fails(worker: str) -> None:
    inv = Invalidator(FakeNode(), "s3cret")  # type: ignore[arg-type]
    try:
        Worker.delay = inv_mod.PUSH_TIMEOUT + 0.5
        assert inv._push(worker, {"holds": []}) is False
        assert Worker.seen and not Worker.answered  # given up on while the worker still worked on it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        assert inv._push(f"tcp://127.0.0.1:{port}", {"holds": []}) is False  # connection refused
    finally:
        inv.stop()


def test_opening_a_channel_closes_those_of_workers_without_a_lease_only(
        worker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that still holds a lease keeps its connection (pushes reuse it, no new hello)."""
    clock = FakeClock()
    monkeypatch.setattr(inv_mod, "time", clock)
    inv = Invalidator(FakeNode(), "s3cret")  # type: ignore[arg-type]
    try:
        inv.subscribe("live", worker)
        gone = "tcp://127.0.0.1:9"  # never leased: its channel is dropped when another opens
        assert inv._push(worker, {"holds": [[1, ["book:1"]]]}) is True
        assert inv._push(gone, {"holds": [[1, ["book:1"]]]}) is False
        live = inv._channels[worker]
        assert inv._push("tcp://127.0.0.1:7", {"holds": [[2, ["book:2"]]]}) is False
        assert inv._channels.get(worker) is live and gone not in inv._channels
        assert inv._push(worker, {"holds": [[2, ["book:2"]]]}) is True
        assert live.client.connects == 1
    finally:
        inv.stop()


def test_a_worker_whose_lease_ran_out_leaves_the_table_and_its_connection_closes(
        worker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead worker (Gunicorn respawned it under a new id) never renews: once its lease is over,
    the next channel opened drops its entry and closes its connection, rather than keep both for
    the rest of the term. Were it alive, its next renewal would flush all the same."""
    clock = FakeClock()
    monkeypatch.setattr(inv_mod, "time", clock)
    inv = Invalidator(FakeNode(), "s3cret")  # type: ignore[arg-type]
    try:
        inv.subscribe("dead", worker)
        assert inv._push(worker, {"holds": [[1, ["book:1"]]]}) is True
        clock.now = inv._subs["dead"][1]  # its lease ends now
        assert inv._push("tcp://127.0.0.1:7", {"holds": [[2, ["book:2"]]]}) is False
        assert "dead" not in inv._subs and worker not in inv._channels
        assert inv.subscribe("dead", worker)["continued"] is False
    finally:
        inv.stop()


def test_a_frame_carries_the_holds_and_releases_of_every_push_in_it(worker: str) -> None:
    channel = inv_mod._Channel(worker, "s3cret", "catalog-1")
    size = "pygmy_invalidation_batch_size_sum"
    before = REGISTRY.get_sample_value(size) or 0.0
    try:
        bodies = [{"holds": [[1, ["book:1"]]]}, {"releases": [[0, ["book:9"], 4]]},
                  {"holds": [[2, ["book:2"]]], "releases": [[3, ["book:3"], 5, {"book:3": {"stock": 1}}]]}]
        assert channel._send(bodies) == [True, True, True]
    finally:
        channel.close()
    assert Worker.seen == [("catalog-1", {
        "holds": [[1, ["book:1"]], [2, ["book:2"]]],
        "releases": [[0, ["book:9"], 4], [3, ["book:3"], 5, {"book:3": {"stock": 1}}]]})]
    assert REGISTRY.get_sample_value(size) == before + 4  # the batch histogram counts holds and releases


def test_a_frame_that_fails_unexpectedly_fails_every_push_in_it_and_is_counted(
        worker: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    channel = inv_mod._Channel(worker, "s3cret", "catalog-1")
    failures = "pygmy_invalidation_push_failures_total"
    before = REGISTRY.get_sample_value(failures) or 0.0
    try:
        assert channel._send([{"holds": [[1, ["book:1"]]]}]) == [True]
        assert REGISTRY.get_sample_value(failures) == before  # an acknowledged frame is no failure

        def broken(frame: Any, timeout: float) -> Any:
            raise RuntimeError("bug in the transport")

        monkeypatch.setattr(channel.client, "call", broken)
        with caplog.at_level(logging.ERROR, logger="pygmy.catalog.invalidation"):
            results = channel._send([{"holds": [[2, ["book:2"]]]}, {"releases": [[2, ["book:2"], 3]]}])
    finally:
        channel.close()
    assert results == [False, False] and all(r is False for r in results)
    assert REGISTRY.get_sample_value(failures) == before + 1
    (record,) = caplog.records
    assert record.exc_info is not None and record.exc_info[0] is RuntimeError
    assert "failed unexpectedly" in record.getMessage() and str(channel.client.address) in record.getMessage()


def test_a_push_queued_behind_a_frame_that_never_returns_fails_in_time(
        worker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A push that waits behind a frame still in flight gives up after twice the push timeout (that
    frame, then its own) and a little more, and counts as failed: the hold goes on to revoke."""
    monkeypatch.setattr(inv_mod, "PUSH_TIMEOUT", 0.05)  # gives up after 2 * 0.05 + 0.1 s
    channel = inv_mod._Channel(worker, "s3cret", "catalog-1")
    in_flight, release = threading.Event(), threading.Event()

    def stuck(frame: Any, timeout: float) -> Any:
        in_flight.set()
        release.wait(5)
        return {"ok": True}

    monkeypatch.setattr(channel.client, "call", stuck)
    first: list[bool] = []
    sender = threading.Thread(target=lambda: first.append(channel.push({"holds": [[1, ["book:1"]]]})))
    try:
        sender.start()
        assert in_flight.wait(5)
        assert channel.push({"holds": [[2, ["book:2"]]]}) is False
        assert not first  # given up on while the frame ahead of it was still in flight
    finally:
        release.set()
        sender.join(5)
        channel.close()
    assert first == [True]  # the frame in flight was answered in the end


def second_worker(handle: Callable[[str, Any], Any]) -> tuple[FrameServer, str]:
    server = FrameServer("127.0.0.1", 0, "s3cret", {PUSH_CHANNEL: Channel(handle)}, name="fake-worker-2")
    server.start()
    return server, f"tcp://127.0.0.1:{server.address[1]}"


def pool_submissions(inv: Invalidator, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """What the invalidator hands to its pool from now on."""
    submitted: list[Any] = []
    real = inv._pool.submit
    monkeypatch.setattr(inv._pool, "submit", lambda fn, *a, **k: (submitted.append((fn, a)), real(fn, *a, **k))[1])
    return submitted


def test_a_hold_is_written_to_every_worker_then_each_answer_read_on_the_writers_own_thread(
        worker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No pool thread once connected: both frames are out before the first worker answers, and each
    answer counts."""
    answered_before_b: list[int] = []

    def b(peer: str, frame: Any) -> Any:
        answered_before_b.append(len(Worker.answered))
        return {"ok": True}

    other, url_b = second_worker(b)
    inv = Invalidator(FakeNode(), "s3cret")  # type: ignore[arg-type]
    try:
        inv.subscribe("a", worker)
        inv.subscribe("b", url_b)
        targets = {"a": (worker, 0.0), "b": (url_b, 0.0)}
        body = {"holds": [[1, ["book:1"]]]}
        submitted = pool_submissions(inv, monkeypatch)
        assert inv._push_all(targets, body) == []
        assert len(submitted) == 2, "not connected yet: connected from pool threads"
        Worker.delay, answered_before_b[:] = 0.1, []
        assert inv._push_all(targets, body) == []
        assert len(submitted) == 2, "connected: nothing more through the pool"
        assert answered_before_b == [1], "b had its frame before a answered it"
        assert Worker.seen[1:] == [("catalog-1", {"holds": [[1, ["book:1"]]], "releases": []})]
        Worker.answer = {"error": {"code": 400, "message": "malformed invalidation"}}
        assert inv._push_all(targets, body) == ["a"]
        other.stop()
        assert inv._push_all(targets, body) == ["a", "b"], "a worker gone is a push failed"
        for ch in inv._channels.values():
            assert ch._combiner.claim(), "every connection given back"
            ch._combiner.unclaim()
    finally:
        inv.stop()
        other.stop()


def test_a_far_worker_and_a_busy_one_get_the_hold_from_the_pool(worker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A far worker's answer may take seconds: read on this thread, it would keep a nearby worker's
    connection (started first, read later) from other writes' pushes that long."""
    inv = Invalidator(FakeNode(), "s3cret")  # type: ignore[arg-type]
    try:
        assert inv._push(worker, {"holds": []}) is True  # connected
        submitted = pool_submissions(inv, monkeypatch)
        inv._rtts[worker] = 0.5  # far: its push timeout is 1.5 s
        assert inv._push_all({"a": (worker, 0.0)}, {"holds": [[1, ["book:1"]]]}) == []
        assert len(submitted) == 1
        inv._rtts[worker] = 0.0
        Worker.delay = 0.2
        first: list[bool] = []
        sender = threading.Thread(target=lambda: first.append(inv._push(worker, {"holds": [[2, ["book:2"]]]})))
        sender.start()
        until(lambda: len(Worker.seen) == 3)
        channel = inv._channels[worker]
        assert channel.start({"holds": []}, 1.0) is None and channel.send_unanswered({"releases": []}) is False
        assert inv._push_all({"a": (worker, 0.0)}, {"holds": [[3, ["book:3"]]]}) == []
        assert len(submitted) == 2, "busy: in its next frame, from the pool"
        sender.join(5)
        assert first == [True]
        assert [f["holds"] for _, f in Worker.seen[1:]] == [[[1, ["book:1"]]], [[2, ["book:2"]]], [[3, ["book:3"]]]]
    finally:
        inv.stop()


def test_a_release_is_written_at_once_and_its_answer_read_and_dropped_by_the_next_push(worker: str) -> None:
    """Nobody waits for a release: the next push reads its answer first (here an error, which a
    push that took it for its own would report as failed) and then its own."""
    channel = inv_mod._Channel(worker, "s3cret", "catalog-1")
    try:
        release = {"releases": [[1, ["book:1"], 4]]}
        assert channel.send_unanswered(release) is False, "not connected: never waits to connect"
        assert channel.start({"holds": []}, 1.0) is None, "nor does a started push"
        assert channel.push({"holds": [[1, ["book:1"]]]}) is True
        Worker.answer = {"error": {"code": 400, "message": "malformed invalidation"}}
        assert channel.send_unanswered(release) is True
        until(lambda: len(Worker.answered) == 2)
        Worker.answer = {"ok": True}
        assert channel.push({"holds": [[2, ["book:2"]]]}) is True
        acknowledged = channel.start({"holds": [[3, ["book:3"]]]}, 1.0)
        assert acknowledged is not None and acknowledged() is True
        assert [f["holds"] or f["releases"] for _, f in Worker.seen] == [
            [[1, ["book:1"]]], [[1, ["book:1"], 4]], [[2, ["book:2"]]], [[3, ["book:3"]]]]
    finally:
        channel.close()


def test_a_started_push_frees_its_connection_whatever_counting_it_raises(
        worker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection is the started push's until its answer is read: an error after the write (in
    counting the frame) must not leave it held, which would wedge every later push and ``stop``."""
    channel = inv_mod._Channel(worker, "s3cret", "catalog-1")
    try:
        assert channel.push({"holds": []}) is True  # connected

        def broken(frame: Any) -> None:
            raise RuntimeError("a metric failed")

        monkeypatch.setattr(inv_mod, "_observe", broken)
        acknowledged = channel.start({"holds": [[1, ["book:1"]]]}, 1.0)
        assert acknowledged is not None
        with pytest.raises(RuntimeError):
            acknowledged()
        monkeypatch.undo()
        assert channel.push({"holds": [[2, ["book:2"]]]}) is True
    finally:
        closing = threading.Thread(target=channel.close, daemon=True)
        closing.start()
        closing.join(2)
    assert not closing.is_alive(), "the connection's lock was left held"


def test_releases_after_a_write_are_written_by_the_thread_that_answered_it(
        worker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    inv = Invalidator(FakeNode(), "s3cret")  # type: ignore[arg-type]
    monkeypatch.setattr(inv.node, "leadership_start", lambda: time.monotonic() - 10, raising=False)
    try:
        inv.subscribe("w", worker)
        assert inv._push(worker, {"holds": []}) is True  # connected
        submitted = pool_submissions(inv, monkeypatch)
        with inv.holding(["book:1"]) as write:
            write.index = 7
        until(lambda: len(Worker.seen) == 3)
        assert Worker.seen[2][1]["releases"] == [[Worker.seen[1][1]["holds"][0][0], ["book:1"], 7]]
        assert not submitted, "neither the hold nor the release went through the pool"
    finally:
        inv.stop()


def test_an_error_reading_one_answer_still_gives_back_every_connection() -> None:
    given_back: list[str] = []

    def answer(name: str, result: Any) -> Callable[[], bool]:
        def read() -> bool:
            given_back.append(name)
            if isinstance(result, BaseException):
                raise result
            return bool(result)
        return read

    assert inv_mod._acknowledge_all({"a": answer("a", True), "b": answer("b", False)}) == {"a": True, "b": False}
    given_back.clear()
    with pytest.raises(KeyboardInterrupt):
        inv_mod._acknowledge_all({"a": answer("a", KeyboardInterrupt()), "b": answer("b", True),
                                  "c": answer("c", RuntimeError())})
    assert given_back == ["a", "b", "c"]


def test_opening_a_channel_leaves_a_stale_one_open_while_a_push_holds_it(worker: str) -> None:
    """A writer's own started channel (its worker's lease just lapsed) is not closed under it when
    the next channel of the same round opens: that close would wait on the writer itself."""
    inv = Invalidator(FakeNode(), "s3cret")  # type: ignore[arg-type]
    try:
        assert inv._push(worker, {"holds": []}) is True  # connected; the worker holds no lease
        channel = inv._channels[worker]
        acknowledged = channel.start({"holds": [[1, ["book:1"]]]}, 1.0)
        assert acknowledged is not None
        inv._channel("tcp://127.0.0.1:9")  # would close the stale channel, were it idle
        assert inv._channels.get(worker) is channel
        assert acknowledged() is True
        inv._channel("tcp://127.0.0.1:7")  # idle now: closed
        assert worker not in inv._channels
    finally:
        inv.stop()


def test_a_renewal_that_stalls_before_its_lock_does_not_continue_a_lease_a_write_skipped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The renewing thread stalls before it takes the lock; meanwhile the worker's lease ends, and
    a write, skipping the expired worker, holds and releases a book. Then the renewal must not
    say ``continued`` (with no hold to keep): the worker would go on serving the book as before."""
    clock = FakeClock()
    monkeypatch.setattr(inv_mod, "time", clock)
    inv = Invalidator(FakeNode(), "s3cret")  # type: ignore[arg-type]
    inv.node.leader_since = -10.0  # type: ignore[attr-defined]
    real = inv._lock

    class StallFirst:
        fired = False

        def __enter__(self) -> None:
            if not StallFirst.fired:
                StallFirst.fired = True
                inv._lock = real  # the write's own turns take the lock as usual
                clock.now += 10 * inv.lease  # the lease ran out meanwhile
                token = inv.hold(["book:1"])  # the worker is expired: not pushed to, nor waited for
                inv.release(token, 7)
                inv._lock = self  # type: ignore[assignment]
            real.acquire()

        def __exit__(self, *exc: object) -> None:
            real.release()

    try:
        inv.subscribe("w", "tcp://127.0.0.1:9")
        inv._lock = StallFirst()  # type: ignore[assignment]
        grant = inv.subscribe("w", "tcp://127.0.0.1:9")
        assert grant["continued"] is False and grant["holds"] == []
    finally:
        inv._lock = real
        inv.stop()


def test_a_hold_a_nearby_worker_missed_counts_with_a_far_one_pushed_from_the_pool(
        env: Env, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The writer's own thread writes the hold to a nearby worker, which does not acknowledge it;
    a far one gets it from a pool thread and does. The nearby one's miss must survive the pool's
    results: it is revoked (its lease waited out), or it would serve what the write changes."""
    clock, _node, inv, pushes = started(env)
    inv.subscribe("near", "http://near")
    inv.subscribe("far", "http://far", rtt=0.5)  # its push timeout is past PUSH_TIMEOUT: a pool thread's
    started_for: list[str] = []

    def start(url: str, body: dict[str, Any]) -> Callable[[], bool]:
        started_for.append(url)
        return lambda: False  # written, never acknowledged

    monkeypatch.setattr(inv, "_start", start)
    with caplog.at_level(logging.WARNING, logger="pygmy.catalog.invalidation"):
        inv.hold(["book:1"])
    assert started_for == ["http://near"] and [url for url, _ in pushes.calls] == ["http://far"]
    assert [r.getMessage() for r in caplog.records] == ["hold not acknowledged by near; waiting out their lease"]
    assert "near" in inv._revoked and "far" not in inv._revoked
    assert woke(clock) == pytest.approx(LEASE)  # the write waited out the lease the nearby one held


def test_a_hold_whose_write_failed_is_not_acknowledged_and_frees_the_connection(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """``_Channel.start`` on an open connection whose write fails (reset meanwhile): its
    acknowledgement is False, the failure is counted, and the next push may go."""
    failures = Counter("failures", "push failures", registry=CollectorRegistry())
    monkeypatch.setattr(inv_mod, "PUSH_FAILURES", failures)
    channel = inv_mod._Channel("tcp://127.0.0.1:9", "s3cret", "catalog-1")
    frames = "pygmy_invalidation_batch_size_count"
    sent_before = REGISTRY.get_sample_value(frames) or 0.0

    def reset(frame: Any, timeout: float) -> Any:
        raise ConnectionResetError("reset by peer")

    try:
        channel.client.is_open = lambda: True  # type: ignore[method-assign]
        channel.client.start_call = reset  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR, logger="pygmy.catalog.invalidation"):
            acknowledged = channel.start({"holds": [[1, ["book:1"]]]}, 0.3)
            assert acknowledged is not None and acknowledged() is False
        assert failures._value.get() == 1 and caplog.records == []  # a failure, not a bug
        assert (REGISTRY.get_sample_value(frames) or 0.0) == sent_before  # no frame went out
        assert channel.close_if_idle(), "the connection was not given back"
    finally:
        channel.close()
