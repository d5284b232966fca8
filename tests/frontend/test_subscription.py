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
