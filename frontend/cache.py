"""The frontend's read cache: bounded LRU, version floors, single flight.

Correctness rests on four rules (see docs/architecture.md, "The cache", for the proof):

* an entry is used only while this worker holds a valid lease from the catalog leader
  (``Subscription``), checked under the lock at the moment of the hit;
* a *hold* on a key (pushed by the leader before it proposes a write to it, or listed in a lease
  grant) drops the entry, and while any hold is on the key it is neither served nor stored;
* every release (or invalidation) raises a *floor* (the log index of the change) for its key, and a
  fill whose version is below the floor is not stored: a fill that raced a write cannot resurrect
  the old value;
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
        self._held: dict[str, set[int]] = {}  # key -> tokens of the writes holding it
        self._holds: dict[int, list[str]] = {}  # token -> keys, for every hold in force
        self._released: set[int] = set()  # tokens released before their hold may have arrived
        self._dropped: dict[int, list[str]] = {}  # token -> keys its hold dropped: refreshed by its release
        self._lock = threading.Lock()
        #: Checked again under the lock at the moment of a hit, so a pause between the caller's
        #: lease check and the hit (GIL, CPU starvation) cannot stretch the lease (set by the owner).
        self.lease_valid: Callable[[], bool] = lambda: True

    # -- what invalidation and leases do --------------------------------------------------------
    def hold(self, token: int, keys: list[str]) -> None:
        """A write on ``keys`` is about to be proposed: drop them, serve and store none until released."""
        with self._lock:
            self._hold(token, keys)

    def _hold(self, token: int, keys: list[str]) -> None:
        if token in self._released or token in self._holds:
            return  # its release overtook it (pushes travel on different threads), or a repeat
        self._holds[token] = list(keys)
        for key in keys:
            self._held.setdefault(key, set()).add(token)
            self._flights.pop(key, None)
            if self._entries.pop(key, None) is not None:
                self._dropped.setdefault(token, []).append(key)
                self.stats.invalidations += 1
                self.on_event("invalidation", len(self._entries))

    def release(self, token: int, keys: list[str], version: int, values: dict[str, Any] | None = None) -> None:
        """The write is applied at ``version`` (0: it changed nothing): store its keys again, but
        only values read at ``version`` or later.

        ``values`` are what the leader read after applying it (at ``version`` or later): each
        refreshes an entry the hold dropped, under the rules of a fill read at ``version``. A value
        newer than ``version`` belongs to a later write, whose hold is then still in force here (it
        was acknowledged before that write was proposed) or whose release raised the floor above
        ``version``: either way it is not stored."""
        with self._lock:
            self._released.add(token)
            self._unhold(token, keys, version)
            for key in self._dropped.pop(token, ()):
                if values is not None and values.get(key) is not None:
                    self._put(key, version, values[key])

    def _unhold(self, token: int, keys: list[str], version: int) -> None:
        self._holds.pop(token, None)
        for key in keys:
            tokens = self._held.get(key)
            if tokens is not None:
                tokens.discard(token)
                if not tokens:
                    del self._held[key]
            if version > self._floors.get(key, 0):
                self._floors[key] = version

    def _sync_holds(self, pending: dict[int, list[str]], next_token: int, floor: int) -> None:
        """Take the holds a lease grant lists; end those the leader finished before the grant.

        A hold below ``next_token`` that the grant does not list was released by the leader before
        it granted, so ``floor`` (its applied index then) is at least that write's index.
        """
        for token, keys in pending.items():
            self._hold(token, keys)
        for token in [t for t in self._holds if t < next_token and t not in pending]:
            self._unhold(token, self._holds[token], floor)
            self._dropped.pop(token, None)
        self._released = {t for t in self._released if t >= next_token or t in pending}

    def renewed(self, pending: dict[int, list[str]], next_token: int, floor: int, flush: bool) -> None:
        """A lease grant arrived: flush first if it starts a new lease, and take its holds, atomically,
        so no fill can slip in between with a value a pending write is about to replace."""
        with self._lock:
            if flush:
                self._flush(floor)
            self._sync_holds(pending, next_token, floor)

    def flush(self, floor: int = 0) -> None:
        """Forget everything (new catalog leader, or the lease ran out); reads need index ``floor``."""
        with self._lock:
            self._flush(floor)

    def _flush(self, floor: int) -> None:
        self._entries.clear()
        # Floors and holds stay: a push may have arrived just before the lease answer that
        # triggered this flush, and must still hold back older fills.
        self._global_floor = max(self._global_floor, floor)
        self._flights.clear()
        self._generation += 1
        self.stats.flushes += 1
        self.on_event("flush", 0)

    def held(self, key: str) -> bool:
        with self._lock:
            return key in self._held

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
        # One critical section from the hold check to the flight: a hold that came between two
        # would let a flight begun after it live on past its release, and callers that began
        # after the write finished would join it and get the value from before the write.
        with self._lock:
            floor = max(self._global_floor, self._floors.get(key, 0))
            bypass = key in self._held  # a write is under way: read through, store nothing
            if not bypass:
                hit = self._hit(key)
                if hit is not None:
                    return hit[1]
            self.stats.misses += 1
            self.on_event("miss", len(self._entries))
            if not bypass:
                flight = self._flights.get(key)
                leader = flight is None
                if leader:
                    flight = self._flights[key] = _Flight()
                generation = self._generation
        if bypass:
            result = fetch(floor)
            return None if result is None else result[1]
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

    def peek(self, key: str) -> tuple[int, Any] | None:
        """``(version, value)`` if the entry may be served now (counted as a hit), else None and
        nothing counted: the caller then takes ``get_or_fetch``, which counts its own hit or miss.
        The caller checks the lease first, as for ``get_or_fetch``."""
        if not self.enabled:
            return None
        with self._lock:
            return None if key in self._held else self._hit(key)

    def _hit(self, key: str) -> tuple[int, Any] | None:
        hit = self._entries.get(key)
        if hit is None or not self.lease_valid():
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        self.on_event("hit", len(self._entries))
        return hit

    def _store(self, key: str, version: int, value: Any, generation: int) -> None:
        with self._lock:
            if generation == self._generation:  # else a flush went by while we fetched
                self._put(key, version, value)

    def _put(self, key: str, version: int, value: Any) -> None:
        if not self.enabled or key in self._held or version < max(self._global_floor, self._floors.get(key, 0)):
            return  # a write or release went by while this value was read: it may be old
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
