"""The read cache on its own, deterministically: bound, errors, single flight, the fill race, holds."""

from __future__ import annotations

import threading
import time

import pytest

from pygmy.frontend.cache import ReadCache


def write(c: ReadCache, key: str, version: int, token: int = 1) -> None:
    """A whole write as the cache sees it: the hold before the proposal, the release after apply."""
    c.hold(token, [key])
    c.release(token, [key], version)


def test_lru_bound_and_eviction_order() -> None:
    c = ReadCache(capacity=3)
    for i in range(3):
        c.get_or_fetch(f"k{i}", lambda f, i=i: (1, i), usable=True)
    c.get_or_fetch("k0", lambda f: pytest.fail("k0 should be cached"), usable=True)  # k0 now most recent
    c.get_or_fetch("k3", lambda f: (1, 3), usable=True)  # evicts k1, the least recently used
    snap = c.snapshot()
    assert snap["entries"] == 3 and snap["evictions"] == 1 and snap["hits"] == 1 and snap["misses"] == 4
    fetched = []
    c.get_or_fetch("k1", lambda f: fetched.append(1) or (1, 1), usable=True)
    assert fetched == [1]


def test_errors_are_never_cached() -> None:
    c = ReadCache(capacity=10)
    calls = []

    def failing(floor: int) -> tuple[int, str]:
        calls.append(floor)
        raise LookupError("404")

    for _ in range(2):
        with pytest.raises(LookupError):
            c.get_or_fetch("k", failing, usable=True)
    assert len(calls) == 2 and c.snapshot()["entries"] == 0
    assert c.get_or_fetch("k", lambda f: None, usable=True) is None  # fetch says "do not cache"
    assert c.snapshot()["entries"] == 0


def test_not_used_without_a_lease() -> None:
    c = ReadCache(capacity=10)
    c.get_or_fetch("k", lambda f: (1, "old"), usable=True)
    assert c.get_or_fetch("k", lambda f: (2, "new"), usable=False) == "new"
    assert c.get_or_fetch("k", lambda f: (3, "x"), usable=True) == "old"  # unusable reads don't fill


def test_single_flight() -> None:
    c = ReadCache(capacity=10)
    gate = threading.Event()
    calls = []

    def slow(floor: int) -> tuple[int, str]:
        calls.append(1)
        gate.wait(5)
        return 1, "v"

    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(c.get_or_fetch("k", slow, usable=True)))
               for _ in range(20)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while c.stats.misses < 20 and time.monotonic() < deadline:  # every caller has joined the one flight
        time.sleep(0.01)
    gate.set()
    for t in threads:
        t.join()
    assert calls == [1] and results == ["v"] * 20


def test_fill_racing_an_invalidation_is_not_stored() -> None:
    """Miss -> fetch old value -> invalidation arrives -> fill completes: the old value must not stick."""
    c = ReadCache(capacity=10)

    def fetch_old_then_invalidated(floor: int) -> tuple[int, str]:
        assert floor == 0
        write(c, "book:1", 7)  # the change at index 7 is held and released while our read is in flight
        return 5, "stock=10 (version 5)"

    assert c.get_or_fetch("book:1", fetch_old_then_invalidated, usable=True) == "stock=10 (version 5)"
    assert c.snapshot()["entries"] == 0
    floors = []
    assert c.get_or_fetch("book:1", lambda f: floors.append(f) or (7, "stock=9"), usable=True) == "stock=9"
    assert floors == [7], "the next read must ask a replica for at least the invalidated version"
    assert c.get_or_fetch("book:1", lambda f: pytest.fail("cached"), usable=True) == "stock=9"


def test_flush_during_fill_drops_it() -> None:
    c = ReadCache(capacity=10)

    def fetch(floor: int) -> tuple[int, str]:
        c.flush(floor=3)
        return 9, "v"

    c.get_or_fetch("k", fetch, usable=True)
    assert c.snapshot()["entries"] == 0 and c.floor("other") == 3


def test_disabled_cache_always_fetches_with_floors() -> None:
    c = ReadCache(capacity=10, enabled=False)
    write(c, "k", 4)
    seen = []
    for _ in range(2):
        c.get_or_fetch("k", lambda f: seen.append(f) or (4, "v"), usable=True)
    assert seen == [4, 4] and c.snapshot()["entries"] == 0


def test_callers_after_an_invalidation_do_not_join_an_older_fetch() -> None:
    """A caller arriving after the change was pushed must not get the in-flight fetch's old value."""
    c = ReadCache(capacity=10)
    started, release = threading.Event(), threading.Event()

    def slow_old(floor: int) -> tuple[int, str]:
        started.set()
        release.wait(5)
        return 5, "old"

    first: list[str] = []
    t = threading.Thread(target=lambda: first.append(c.get_or_fetch("book:1", slow_old, usable=True)))
    t.start()
    started.wait(5)
    write(c, "book:1", 7)  # the change is held, applied and released while the fetch runs
    floors = []
    late = c.get_or_fetch("book:1", lambda f: floors.append(f) or (7, "new"), usable=True)
    release.set()
    t.join()
    assert first == ["old"]  # began before the change: either answer is linearizable
    assert late == "new" and floors == [7]


def test_the_lease_is_checked_again_at_the_hit() -> None:
    """A caller that saw a valid lease, then stalled until it ran out, must not get a hit."""
    c = ReadCache(capacity=10)
    c.get_or_fetch("k", lambda f: (1, "old"), usable=True)
    c.lease_valid = lambda: False  # the lease ran out between the caller's check and the hit
    assert c.get_or_fetch("k", lambda f: (2, "new"), usable=True) == "new"


def test_a_held_key_is_neither_served_nor_stored() -> None:
    """Between the hold and the release the write may become readable anywhere: no hit, no fill."""
    c = ReadCache(capacity=10)
    c.get_or_fetch("book:1", lambda f: (3, "old"), usable=True)
    c.hold(5, ["book:1"])
    assert c.get_or_fetch("book:1", lambda f: (4, "read through"), usable=True) == "read through"
    assert c.snapshot()["entries"] == 0
    c.release(5, ["book:1"], 8)
    floors: list[int] = []
    assert c.get_or_fetch("book:1", lambda f: floors.append(f) or (8, "new"), usable=True) == "new"
    assert floors == [8] and c.get_or_fetch("book:1", lambda f: pytest.fail("cached"), usable=True) == "new"


def test_a_read_after_the_release_does_not_join_a_read_begun_under_the_hold() -> None:
    """A read during a hold goes to a replica on its own, as no flight: one begun under the hold
    may return what was there before the write, and a reader that came after the write finished
    (after the release) must not be handed that by joining it."""
    c = ReadCache(capacity=10)
    c.hold(5, ["book:1"])
    fetching, finish = threading.Event(), threading.Event()

    def old_read(floor: int) -> tuple[int, str]:
        fetching.set()
        finish.wait(5)
        return 4, "before the write"

    def new_read(floor: int) -> tuple[int, str]:
        fetched_after.set()
        return 8, "after the write"

    got: dict[str, str] = {}
    fetched_after = threading.Event()
    during = threading.Thread(target=lambda: got.update(during=c.get_or_fetch("book:1", old_read, usable=True)))
    after = threading.Thread(target=lambda: got.update(after=c.get_or_fetch("book:1", new_read, usable=True)))
    during.start()
    try:
        assert fetching.wait(5)
        c.release(5, ["book:1"], 8)
        after.start()
        assert fetched_after.wait(5), "the read after the release joined the one begun under the hold"
    finally:
        finish.set()
        during.join(5)
        if after.ident is not None:  # started
            after.join(5)
    assert got == {"during": "before the write", "after": "after the write"}


def test_a_fill_begun_before_a_hold_is_dropped_after_the_release() -> None:
    c = ReadCache(capacity=10)

    def fetch_old(floor: int) -> tuple[int, str]:
        write(c, "book:1", 9, token=3)  # hold and release both go by while the old read is in flight
        return 6, "old"

    assert c.get_or_fetch("book:1", fetch_old, usable=True) == "old"
    assert c.snapshot()["entries"] == 0


def test_a_release_that_overtakes_its_hold_wins() -> None:
    """Pushes are handled on different threads: a late hold for a released write is ignored."""
    c = ReadCache(capacity=10)
    c.release(4, ["book:1"], 10)
    c.hold(4, ["book:1"])
    assert not c.held("book:1")


def test_a_grant_brings_pending_holds_and_ends_finished_ones() -> None:
    c = ReadCache(capacity=10)
    c.get_or_fetch("book:2", lambda f: (1, "two"), usable=True)
    c.hold(1, ["book:1"])  # its release will never reach us
    c.renewed({2: ["book:2"]}, next_token=3, floor=12, flush=False)
    assert c.held("book:2") and not c.held("book:1")
    assert c.floor("book:1") == 12, "a hold ended by a grant raises the floor to the grant's index"
    assert c.snapshot()["entries"] == 0  # book:2 was dropped by its hold
    c.hold(2, ["book:2"])
    c.release(2, ["book:2"], 13)
    c.renewed({2: ["book:2"]}, next_token=3, floor=12, flush=False)  # a grant older than that release
    assert not c.held("book:2"), "a grant computed before a release must not bring the hold back"


def test_a_release_with_values_refreshes_what_its_hold_dropped_and_nothing_else() -> None:
    """The leader reads the books a write changed after applying it and sends them with the release:
    an entry the hold dropped comes back without a read; a key this worker had not cached stays out."""
    c = ReadCache(capacity=10)
    c.get_or_fetch("book:1", lambda f: (3, "old"), usable=True)
    c.hold(5, ["book:1", "book:2"])
    c.release(5, ["book:1", "book:2"], 8, {"book:1": "new", "book:2": "two"})
    assert c.get_or_fetch("book:1", lambda f: pytest.fail("refreshed by the release"), usable=True) == "new"
    assert c.snapshot()["entries"] == 1
    assert c.get_or_fetch("book:2", lambda f: (8, "read"), usable=True) == "read"


def test_a_release_value_is_not_stored_under_a_later_hold_below_a_later_floor_or_after_a_flush() -> None:
    c = ReadCache(capacity=10)
    floors: list[int] = []

    def fetch(floor: int) -> tuple[int, str]:
        floors.append(floor)
        return floor, f"read at {floor}"

    c.get_or_fetch("book:1", lambda f: (3, "old"), usable=True)
    c.hold(5, ["book:1"])
    c.hold(6, ["book:1"])  # a later write to the same book, proposed before 5's release arrived
    c.release(5, ["book:1"], 8, {"book:1": "as of 8 or later"})  # may already show write 6
    assert c.get_or_fetch("book:1", fetch, usable=True) == "read at 8" and c.snapshot()["entries"] == 0
    c.release(6, ["book:1"], 9)
    assert c.get_or_fetch("book:1", fetch, usable=True) == "read at 9"

    c.hold(7, ["book:1"])
    c.release(8, ["book:1"], 12)  # a later write released first: the floor is 12
    c.release(7, ["book:1"], 11, {"book:1": "as of 11"})
    assert c.get_or_fetch("book:1", fetch, usable=True) == "read at 12"

    c.hold(9, ["book:1"])
    c.flush(floor=20)  # the lease lapsed: pushes may have been missed
    c.release(9, ["book:1"], 13, {"book:1": "as of 13"})
    assert c.get_or_fetch("book:1", fetch, usable=True) == "read at 20"
    assert floors == [8, 9, 12, 20]

    off = ReadCache(capacity=10, enabled=False)
    off.hold(1, ["book:1"])
    off.release(1, ["book:1"], 2, {"book:1": "x"})
    assert off.snapshot()["entries"] == 0


class _HoldBetween:
    """The cache's lock, through which a hold from another thread lands the moment the reader
    first lets go of it (as the scheduler may have it land): between two of its critical sections,
    if it has two before its flight."""

    def __init__(self, c: ReadCache, key: str) -> None:
        self.c, self.key, self.lock, self.reader = c, key, c._lock, threading.get_ident()
        self.landed = False

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
        if not self.landed and threading.get_ident() == self.reader:
            self.landed = True
            self.c.hold(1, [self.key])


def test_a_hold_that_lands_as_a_read_misses_leaves_no_flight_for_later_reads_to_join() -> None:
    """Reader A misses; the hold of a write lands; A's read goes out and is slow; the write commits
    and is released; reader B, who began after the write finished, must not be handed A's answer,
    read before the write (``_put`` refuses to store it, but a joined flight is given it)."""
    import pygmy.frontend.cache as cache_module

    c = ReadCache(capacity=10)
    joined, go, a_fetching = threading.Event(), threading.Event(), threading.Event()

    class Watched(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            joined.set()
            return super().wait(timeout)

    original = cache_module._Flight.__init__

    def flight_init(self: object, *args: object, **kw: object) -> None:
        original(self, *args, **kw)  # type: ignore[arg-type]
        self.done = Watched()  # type: ignore[attr-defined]

    got: dict[str, object] = {}

    def slow_old(floor: int) -> tuple[int, str]:
        a_fetching.set()
        assert go.wait(5)
        return 5, "old"

    def reader_a() -> None:
        c._lock = _HoldBetween(c, "book:1")  # type: ignore[assignment]
        got["a"] = c.get_or_fetch("book:1", slow_old, usable=True)

    cache_module._Flight.__init__ = flight_init  # type: ignore[method-assign]
    try:
        a = threading.Thread(target=reader_a)
        a.start()
        assert a_fetching.wait(5)
        c.release(1, ["book:1"], 7)  # the write committed at 7 and was released
        b = threading.Thread(target=lambda: got.setdefault("b", c.get_or_fetch(
            "book:1", lambda floor: (7, "new") if floor >= 7 else (5, "old"), usable=True)))
        b.start()
        while b.is_alive() and not joined.is_set():
            time.sleep(0.001)
        go.set()
        a.join(5)
        b.join(5)
    finally:
        cache_module._Flight.__init__ = original  # type: ignore[method-assign]
    assert got["b"] == "new", "a read that began after the write got the value from before it"
