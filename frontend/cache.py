"""The frontend's read cache: bounded LRU, version floors, single flight.

Correctness rests on three rules (see docs/architecture.md, "The cache"):

* an entry is used only while this worker holds a valid invalidation lease from the catalog leader
  (``Subscription``), so every acknowledged change has reached us first;
* every invalidation raises a *floor* (the log index of the change) for its key, and a fill whose
  version is below the floor is not stored: a fill that raced an invalidation cannot resurrect the
  old value;
* a flush (catalog leader change, lease lost) bumps the generation, so fills begun before it are
  dropped too.

One ``ReadCache`` per Gunicorn worker; invalidations reach every worker through its own listener.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Stats:
    hits: int = 0
    misses: int = 0
    invalidations: int = 0
    evictions: int = 0
    flushes: int = 0


@dataclass
class _Flight:
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None


class ReadCache:
    def __init__(self, capacity: int, enabled: bool = True,
                 on_event: Callable[[str, int], None] | None = None) -> None:
        """``on_event(event, entries)`` is told of every hit, miss, invalidation, eviction and flush."""
        self.on_event = on_event or (lambda event, entries: None)
        self.capacity = max(0, capacity)
        self.enabled = enabled and self.capacity > 0
        self.stats = Stats()
        self._entries: OrderedDict[str, tuple[int, Any]] = OrderedDict()
        self._floors: dict[str, int] = {}
        self._global_floor = 0
        self._generation = 0
        self._flights: dict[str, _Flight] = {}
        self._lock = threading.Lock()

    # -- what invalidation and leases do --------------------------------------------------------
    def invalidate(self, key: str, version: int) -> None:
        """A change at log index ``version`` touched ``key``: drop it and refuse older fills."""
        with self._lock:
            if version > self._floors.get(key, 0):
                self._floors[key] = version
            # A fetch already in flight may return the old value: callers arriving from now on
            # (after the change, which is acknowledged only once we are told) must not join it.
            self._flights.pop(key, None)
            if self._entries.pop(key, None) is not None:
                self.stats.invalidations += 1
                self.on_event("invalidation", len(self._entries))

    def flush(self, floor: int = 0) -> None:
        """Forget everything (new catalog leader, or the lease ran out); reads need index ``floor``."""
        with self._lock:
            self._entries.clear()
            # Floors stay: a push for a change newer than ``floor`` may have arrived just before
            # the lease answer that triggered this flush, and must still hold back older fills.
            self._global_floor = max(self._global_floor, floor)
            self._flights.clear()
            self._generation += 1
            self.stats.flushes += 1
            self.on_event("flush", 0)

    def floor(self, key: str) -> int:
        """The oldest log index a read of ``key`` may return (what a replica must have applied)."""
        with self._lock:
            return max(self._global_floor, self._floors.get(key, 0))

    # -- reads ------------------------------------------------------------------------------------
    def get_or_fetch(self, key: str, fetch: Callable[[int], tuple[int, Any] | None], usable: bool) -> Any:
        """The cached value, or one fetch per key however many callers miss at once.

        ``fetch(floor)`` returns ``(version, value)`` to cache, or ``None`` for an answer that must
        not be cached (errors); it raises to fail every waiting caller alike. ``usable`` is False
        when the lease is not valid: then the cache is neither read nor filled.
        """
        if not (self.enabled and usable):
            result = fetch(self.floor(key))
            return None if result is None else result[1]
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.stats.hits += 1
                self.on_event("hit", len(self._entries))
                return hit[1]
            self.stats.misses += 1
            self.on_event("miss", len(self._entries))
            flight = self._flights.get(key)
            leader = flight is None
            if leader:
                flight = self._flights[key] = _Flight()
            generation = self._generation
            floor = max(self._global_floor, self._floors.get(key, 0))
        assert flight is not None
        if not leader:
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            return flight.value
        try:
            result = fetch(floor)
            flight.value = None if result is None else result[1]
            if result is not None:
                self._store(key, result[0], result[1], generation)
            return flight.value
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            with self._lock:
                if self._flights.get(key) is flight:
                    del self._flights[key]
            flight.done.set()

    def _store(self, key: str, version: int, value: Any, generation: int) -> None:
        with self._lock:
            if generation != self._generation or version < max(self._global_floor, self._floors.get(key, 0)):
                return  # an invalidation or flush went by while we fetched: this value may be old
            self._entries[key] = (version, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
                self.stats.evictions += 1
                self.on_event("eviction", len(self._entries))
            self.on_event("store", len(self._entries))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"enabled": self.enabled, "entries": len(self._entries), "capacity": self.capacity,
                    "hits": self.stats.hits, "misses": self.stats.misses,
                    "invalidations": self.stats.invalidations, "evictions": self.stats.evictions,
                    "flushes": self.stats.flushes}
