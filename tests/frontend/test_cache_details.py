"""The read cache in detail: its events and counters, floors, grants at token boundaries, flushes.

Written against the mutants of ``pygmy.frontend.cache`` that ``test_cache.py`` let through (docs/testing.md,
"Mutation score"). The events feed the frontend's metrics and ``snapshot`` its ``/status``, so both
are checked exactly.
"""

from __future__ import annotations

import threading
import time

import pytest

from pygmy.frontend.cache import ReadCache


def value(v: str, version: int = 1):
    return lambda floor: (version, v)


def no_fetch(floor: int) -> tuple[int, str]:
    raise AssertionError("should have been a hit")


def test_every_event_and_counter() -> None:
    events: list[tuple[str, int]] = []
    c = ReadCache(capacity=2, on_event=lambda event, entries: events.append((event, entries)))
    c.get_or_fetch("a", value("A"), usable=True)
    c.get_or_fetch("a", no_fetch, usable=True)
    c.get_or_fetch("a", no_fetch, usable=True)
    c.get_or_fetch("b", value("B"), usable=True)
    c.get_or_fetch("c", value("C"), usable=True)  # evicts a, the least recently used
    c.get_or_fetch("d", value("D"), usable=True)  # evicts b
    c.hold(1, ["c", "x"])  # c is dropped; x was not cached: no invalidation for it
    c.hold(2, ["d"])
    c.get_or_fetch("d", value("D2", 9), usable=True)  # held: read through, nothing stored
    c.flush()
    c.flush()
    assert events == [
        ("miss", 0), ("store", 1), ("hit", 1), ("hit", 1),
        ("miss", 1), ("store", 2),
        ("miss", 2), ("eviction", 2), ("store", 2),
        ("miss", 2), ("eviction", 2), ("store", 2),
        ("invalidation", 1), ("invalidation", 0),
        ("miss", 0),
        ("flush", 0), ("flush", 0),
    ]
    assert c.snapshot() == {"enabled": True, "entries": 0, "capacity": 2, "hits": 2, "misses": 5,
                            "invalidations": 2, "evictions": 2, "flushes": 2}


@pytest.mark.parametrize(("capacity", "enabled", "size", "on"), [
    (0, True, 0, False), (-3, True, 0, False), (1, True, 1, True), (5, False, 5, False),
])
def test_capacity_and_enabled(capacity: int, enabled: bool, size: int, on: bool) -> None:
    c = ReadCache(capacity=capacity, enabled=enabled)
    assert (c.capacity, c.enabled) == (size, on)
    fetched: list[int] = []
    for _ in range(2):
        c.get_or_fetch("k", lambda f: fetched.append(f) or (1, "v"), usable=True)
    assert len(fetched) == (1 if on else 2)
    assert c.snapshot()["entries"] == (1 if on else 0) and c.snapshot()["capacity"] == size


def test_answers_that_must_not_be_cached_come_back_as_none_on_every_path() -> None:
    c = ReadCache(capacity=10)
    assert c.get_or_fetch("k", lambda f: None, usable=False) is None  # no lease
    c.hold(1, ["k"])
    assert c.get_or_fetch("k", lambda f: None, usable=True) is None  # held
    assert c.snapshot()["entries"] == 0


# -- floors -------------------------------------------------------------------------------------------
def test_floors_start_at_zero_and_only_rise() -> None:
    c = ReadCache(capacity=10)
    assert c.floor("k") == 0
    c.flush()
    assert c.floor("k") == 0
    c.hold(1, ["k"])
    c.release(1, ["k"], 1)
    assert c.floor("k") == 1
    c.hold(2, ["k"])
    c.release(2, ["k"], 10)
    c.hold(3, ["k"])
    c.release(3, ["k"], 5)  # an older write's release arriving late lowers nothing
    assert c.floor("k") == 10 and c.floor("other") == 0


def test_a_value_read_at_index_zero_is_cached() -> None:
    c = ReadCache(capacity=10)
    assert c.get_or_fetch("k", value("v", version=0), usable=True) == "v"
    assert c.get_or_fetch("k", no_fetch, usable=True) == "v"


def test_a_held_key_is_read_through_at_its_floor() -> None:
    c = ReadCache(capacity=10)
    c.hold(1, ["k"])
    c.release(1, ["k"], 7)
    c.hold(2, ["k", "j"])
    floors: list[int] = []
    assert c.get_or_fetch("k", lambda f: floors.append(f) or (8, "new"), usable=True) == "new"
    assert c.get_or_fetch("j", lambda f: floors.append(f) or (8, "j"), usable=True) == "j"
    assert floors == [7, 0]
    assert c.snapshot()["misses"] == 2 and c.snapshot()["entries"] == 0


# -- grants -------------------------------------------------------------------------------------------
def test_a_grant_that_flushes_raises_the_global_floor() -> None:
    c = ReadCache(capacity=10)
    c.get_or_fetch("k", value("old"), usable=True)
    c.renewed({}, next_token=1, floor=12, flush=True)
    assert c.snapshot()["entries"] == 0 and c.snapshot()["flushes"] == 1
    assert c.floor("k") == 12 and c.floor("other") == 12


def test_a_grant_does_not_end_the_hold_of_the_write_it_names_next() -> None:
    """A hold pushed right after the grant was computed can arrive first: its token is next_token."""
    c = ReadCache(capacity=10)
    c.hold(3, ["k"])
    c.renewed({}, next_token=3, floor=7, flush=False)
    assert c.held("k")
    c.renewed({}, next_token=4, floor=9, flush=False)
    assert not c.held("k") and c.floor("k") == 9


def test_a_released_hold_is_forgotten() -> None:
    c = ReadCache(capacity=10)
    c.hold(1, ["k"])
    c.release(1, ["k"], 5)
    c.renewed({}, next_token=2, floor=9, flush=False)
    assert c.floor("k") == 5  # no second, later end of the same hold


def test_a_release_that_overtook_its_hold_survives_a_grant_before_the_write() -> None:
    c = ReadCache(capacity=10)
    c.release(5, ["k"], 8)
    c.renewed({}, next_token=5, floor=4, flush=False)  # computed before write 5 was held
    c.hold(5, ["k"])  # the hold finally arrives
    assert not c.held("k")


def test_a_release_outlives_grants_that_still_list_its_hold() -> None:
    """Grants computed before the release reached the leader's table may arrive after it, twice."""
    c = ReadCache(capacity=10)
    c.release(4, ["k"], 8)
    c.renewed({4: ["k"]}, next_token=6, floor=7, flush=False)
    assert not c.held("k")
    c.renewed({4: ["k"]}, next_token=6, floor=7, flush=False)
    assert not c.held("k")


# -- flushes and flights ------------------------------------------------------------------------------
def test_a_fill_racing_a_second_flush_is_dropped() -> None:
    c = ReadCache(capacity=10)
    c.flush()

    def fetch(floor: int) -> tuple[int, str]:
        c.flush()
        return 1, "v"

    assert c.get_or_fetch("k", fetch, usable=True) == "v"
    assert c.snapshot()["entries"] == 0


def test_every_caller_of_a_failed_flight_gets_its_error() -> None:
    c = ReadCache(capacity=10)
    gate = threading.Event()

    def failing(floor: int) -> tuple[int, str]:
        gate.wait(5)
        raise LookupError("catalog unavailable")

    outcomes: list[object] = []

    def caller() -> None:
        try:
            outcomes.append(c.get_or_fetch("k", failing, usable=True))
        except LookupError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(5)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while c.stats.misses < 5 and time.monotonic() < deadline:  # all joined the one flight
        time.sleep(0.005)
    gate.set()
    for t in threads:
        t.join(5)
    assert len(outcomes) == 5 and all(isinstance(o, LookupError) for o in outcomes)


def test_peek_serves_only_what_a_hit_would_and_counts_only_hits() -> None:
    """``peek`` (the edge's cached lookups) under the rules of ``get_or_fetch``'s hit: no entry, a
    held key or a lapsed lease give None and count nothing, for the full path to count."""
    events: list[str] = []
    c = ReadCache(capacity=2, on_event=lambda event, entries: events.append(event))
    lease = [True]
    c.lease_valid = lambda: lease[0]
    assert c.peek("a") is None
    c.get_or_fetch("a", value("A", 4), usable=True)
    c.get_or_fetch("b", value("B"), usable=True)
    events.clear()
    assert c.peek("a") == (4, "A")
    c.get_or_fetch("c", value("C"), usable=True)  # a was used last: b is evicted, not a
    assert c.peek("a") == (4, "A") and c.peek("b") is None
    c.hold(1, ["a"])
    assert c.peek("a") is None
    c.release(1, ["a"], 5, {"a": "A2"})  # the release refreshes what the hold dropped
    assert c.peek("a") == (5, "A2")
    lease[0] = False
    assert c.peek("a") is None
    assert events == ["hit", "miss", "eviction", "store", "hit", "invalidation", "store", "hit"]
    assert c.snapshot()["hits"] == 3
    assert ReadCache(capacity=0).peek("a") is None
