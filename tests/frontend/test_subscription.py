"""A frontend worker's lease renewals: often while it serves reads, half as often once it is idle."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pygmy.catalog.invalidation import LEASE
from pygmy.frontend import subscription
from pygmy.frontend.cache import ReadCache
from pygmy.frontend.subscription import IDLE_AFTER, RENEW_EVERY, RENEW_IDLE, Subscription


def test_an_idle_worker_renews_half_as_often_and_a_read_brings_it_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle: no hit or miss for IDLE_AFTER. The next renewal still comes well inside the lease, so the
    first read after a quiet spell finds the lease valid (and the cache as it was)."""
    clock = [100.0]
    monkeypatch.setattr(subscription.time, "monotonic", lambda: clock[0])
    cache = ReadCache(16)
    sub = SimpleNamespace(cache=cache, _reads_seen=(-1, 0.0))
    every = lambda: Subscription.renew_every(sub)  # type: ignore[arg-type]  # noqa: E731
    assert every() == RENEW_EVERY  # just started
    clock[0] += IDLE_AFTER - 0.01
    assert every() == RENEW_EVERY
    clock[0] += 0.02
    assert every() == RENEW_IDLE
    cache.stats.misses += 1  # a lookup
    assert every() == RENEW_EVERY
    clock[0] += IDLE_AFTER + 0.01
    assert every() == RENEW_IDLE
    cache.stats.hits += 1
    assert every() == RENEW_EVERY
    assert RENEW_IDLE + 0.15 <= LEASE - subscription.MARGIN  # 150 ms for the two round trips


def test_a_worker_reports_its_renewals_round_trip_and_gives_a_far_leader_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each renewal carries the median of the recent round trips (what a far leader lengthens
    the lease by), and its budget grows with them; a near leader keeps the 0.5 s budget."""
    from pygmy.replication.router import Reply

    clock = [100.0]
    monkeypatch.setattr(subscription.time, "monotonic", lambda: clock[0])
    calls: list[tuple[dict, float]] = []
    took = [0.3]

    def call(body: dict, deadline: float) -> Reply:
        calls.append((body, deadline - clock[0]))
        clock[0] += took[0]
        return Reply(200, {"leader": "catalog-1", "term": 1, "commit_index": 0, "lease": 1.0, "continued": True,
                           "holds": [], "next_token": 1}, "catalog-1")

    sub = Subscription.__new__(Subscription)
    sub.cache, sub.catalog, sub.id, sub.url = ReadCache(4), SimpleNamespace(call=call), "w", "tcp://w:1"
    sub._rtts, sub._holder, sub._valid_until, sub.on_change = subscription.deque(maxlen=16), None, 0.0, lambda: None
    assert sub.renew()
    assert calls[-1] == ({"id": "w", "url": "tcp://w:1", "rtt": 0.0}, subscription.RENEWAL_TIMEOUT)
    for _ in range(5):
        sub.renew()
    assert calls[-1][0]["rtt"] == pytest.approx(0.3)
    assert calls[-1][1] == pytest.approx(subscription.RENEWAL_RTTS * 0.3)
    assert sub.valid_for() == pytest.approx(1.0 - 0.3 - subscription.MARGIN)
