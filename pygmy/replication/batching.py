"""Combining concurrent calls into one: whoever finds the way free carries everyone's.

Used where one round trip can serve many callers at the cost of one: the catalog leader's pushes to
a frontend worker (one frame for the holds and releases of many writes) and the order leader's
decrements (one catalog request, one log entry, for the buys in flight). No thread of its own: a
caller that finds no batch in flight sends everything queued so far, itself included, and hands
each caller its own result; callers arriving meanwhile queue for the next batch. So a lone caller
pays nothing extra, and under load the batch grows with the concurrency. A combiner may also
``linger``: while the batch before carried several items, the next waits a little for more before
it goes (group commit's delay), where a batch costs much more than an item in it; a caller that
only ever follows batches of one still pays nothing extra.

A caller that cannot wait (Gunicorn's event loop, answering a buy without a thread of its own:
``pygmy/cluster/worker.py``) ``submit``s its item with a callback instead. Its batches are sent by one
helper thread the combiner starts on first use and ``stop`` ends; the callback runs on whichever
thread finished the batch. The helper sends a batch in the context (``contextvars``) its first
item was submitted in, as that caller's own thread would have: so a lone buy's request id travels
with it to the order and catalog tiers.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

#: When a lingering combiner calls the way busy: the batch before carried at least
#: ``LINGER_SIBLINGS`` items (PostgreSQL's ``commit_siblings``) and ended under ``LINGER_RECENT``
#: seconds ago (a burst that ended longer ago leaves no one to wait for).
LINGER_SIBLINGS = 2
LINGER_RECENT = 0.1


class CombinerTimeout(Exception):
    """The caller's item was not carried within its wait. ``sent`` says whether it had gone out in a
    batch (its outcome is unknown); if not, it was withdrawn from the queue and never will."""

    def __init__(self, message: str, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


class _Slot(Generic[T, R]):
    __slots__ = ("item", "sent", "done", "result", "error", "callback", "deadline", "context")

    def __init__(self, item: T, callback: Callable[[R | BaseException], None] | None = None,
                 deadline: float = float("inf")) -> None:
        self.item = item
        self.sent = False  # taken into a batch: can no longer be withdrawn
        self.done = False
        self.result: R | None = None
        self.error: BaseException | None = None
        #: A submitted item's: told its outcome once.
        self.callback = callback
        #: Checked when a batch is formed: an item whose time ran out is withdrawn, never sent.
        self.deadline = deadline
        self.context = contextvars.copy_context() if callback is not None else None


class Combiner(Generic[T, R]):
    """``send(items) -> results`` (one result per item, in order) runs for a batch of callers at a time.
    If it raises, every caller of that batch gets the exception."""

    def __init__(self, send: Callable[[list[T]], list[R]], max_batch: int = 256, linger: float = 0.0) -> None:
        """``linger``: group commit's delay (PostgreSQL's ``commit_delay`` with ``commit_siblings``):
        a batch waits that long for more items before it goes, but only while others are calling,
        that is, while the batch before it carried at least ``LINGER_SIBLINGS`` items and ended under
        ``LINGER_RECENT`` ago; never into the last ``linger`` of a queued item's time, and not once
        ``max_batch`` items are queued. A caller that only follows batches of one never waits;
        where a batch costs much the same whatever it carries, fewer, larger ones cost less per item."""
        self._send = send
        self.max_batch = max_batch
        self.linger = linger
        self._last_size, self._last_end = 0, float("-inf")  # the batch before: how many, ended when
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        #: On the same lock: what a lingering batch waits on; arrivals and ``stop`` wake it alone.
        self._company = threading.Condition(lock)
        self._queue: list[_Slot[T, R]] = []
        self._busy = False
        self._helper: ThreadPoolExecutor | None = None  # sends the batches of submitted items
        self._stopped = False

    def call(self, item: T, wait: float) -> R:
        """Carry ``item`` in the next batch and return its result; raises what ``send`` raised, or
        CombinerTimeout if no batch carried it within ``wait`` seconds (withdrawn if still queued,
        so that an overloaded caller's expired work is dropped rather than done late)."""
        (result,) = self.call_many([item], [wait])
        if isinstance(result, BaseException):
            raise result
        return result

    def call_many(self, items: list[T], waits: list[float], grace: float = 0.0) -> list[R | BaseException]:
        """``call`` for several items at once (a caller that itself carries a batch, such as a
        frontend worker's buys): each has its own wait and gets its own result or exception, and
        they may ride in different batches. Returns when every item has its outcome. ``grace``: how
        much longer than its wait an item already sent is waited for (one still queued is
        withdrawn at its wait's end all the same)."""
        now = time.monotonic()
        deadlines = [now + w for w in waits]
        # Each slot knows its deadline: another thread's batch taken after it leaves it out.
        slots: list[_Slot[T, R]] = [_Slot(item, deadline=d) for item, d in zip(items, deadlines, strict=True)]
        out: list[R | BaseException | None] = [None] * len(slots)
        waiting = set(range(len(slots)))
        with self._cond:
            self._queue.extend(slots)
            self._company.notify()
            while True:
                now = time.monotonic()
                for i in list(waiting):
                    slot = slots[i]
                    if slot.done:
                        out[i] = slot.error if slot.error is not None else slot.result
                    elif deadlines[i] + (grace if slot.sent else 0.0) <= now:
                        if not slot.sent:
                            self._queue.remove(slot)
                        out[i] = CombinerTimeout("sent, but no result in time" if slot.sent else
                                                 "not sent in time; withdrawn", sent=slot.sent)
                    else:
                        continue
                    waiting.discard(i)
                if not waiting:
                    return out  # type: ignore[return-value]
                if not self._busy and any(not slots[i].sent for i in waiting):
                    self._send_next()
                    continue
                self._cond.wait(min(deadlines[i] + (grace if slots[i].sent else 0.0) for i in waiting) - now)

    def submit(self, item: T, wait: float, callback: Callable[[R | BaseException], None]) -> None:
        """Carry ``item`` in a batch without waiting for it: ``callback`` is told its result, what
        ``send`` raised, or CombinerTimeout if no batch took it within ``wait`` seconds (then it
        was never sent). The callback runs on another thread, and must not raise or block."""
        slot: _Slot[T, R] = _Slot(item, callback, time.monotonic() + wait)
        with self._cond:
            if self._stopped:
                raise RuntimeError("the combiner is stopped")
            self._queue.append(slot)
            self._company.notify()
            self._kick()

    def claim(self) -> bool:
        """Take the way for a send of the caller's own, outside any batch, if it is free now (no
        batch in flight, none queued): True if taken, and then ``unclaim`` must give it back. So a
        caller that sends to several destinations can write to each and then read each answer on
        its own thread, without a thread per destination; callers meanwhile queue as for a batch."""
        with self._cond:
            if self._busy or self._queue or self._stopped:
                return False
            self._busy = True
            return True

    def unclaim(self) -> None:
        """Give back the way ``claim`` took: the next batch may go."""
        with self._cond:
            self._busy = False
            self._cond.notify_all()
            self._kick()

    def stop(self) -> None:
        """End the helper thread once its batch is sent; later ``submit`` calls raise. Submitted
        items still queued are withdrawn and told so at once: no helper would send them now."""
        with self._cond:
            self._stopped = True
            self._company.notify()  # a lingering batch ends its wait (its submitted items withdrawn below)
            helper = self._helper
            withdrawn = [s for s in self._queue if s.callback is not None]
            self._queue = [s for s in self._queue if s.callback is None]
            for slot in withdrawn:
                slot.error = CombinerTimeout("not sent: the combiner was stopped", sent=False)
                slot.done = True
        for slot in withdrawn:
            self._tell(slot)
        if helper is not None:
            helper.shutdown(wait=True, cancel_futures=True)

    def _kick(self) -> None:
        """Have the helper send the queue if a submitted item waits in it and no batch is in flight
        (a waiting ``call`` would send it too; whoever comes first). Called with the lock held."""
        if self._busy or self._stopped or not any(s.callback is not None for s in self._queue):
            return
        if self._helper is None:
            self._helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="combiner")
        self._helper.submit(self._drain)

    def _drain(self) -> None:
        with self._cond:
            while not self._busy and self._queue and any(s.callback is not None for s in self._queue):
                self._send_next(adopt=True)

    def _send_next(self, adopt: bool = False) -> None:
        """Send the next batch from the queue (the lock held, released while it is sent); items
        whose time ran out while queued are withdrawn (told so if submitted), not sent. ``adopt``: the helper sends
        it, in the context its first submitted item came with."""
        self._busy = True
        self._linger()
        now = time.monotonic()
        expired = [s for s in self._queue if s.deadline <= now]
        if expired:
            self._queue = [s for s in self._queue if s.deadline > now]
            for slot in expired:  # under the lock: an owner that wakes now finds it withdrawn, not queued
                slot.error = CombinerTimeout("not sent in time; withdrawn", sent=False)
                slot.done = True
        batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
        for slot in batch:
            slot.sent = True
        self._cond.release()
        try:
            for slot in expired:
                if slot.callback is not None:
                    self._tell(slot)
            context = next((s.context for s in batch if s.context is not None), None) if adopt else None
            if context is not None:
                context.run(self._run, batch)
            elif batch:
                self._run(batch)
        finally:
            self._cond.acquire()
            self._busy = False
            self._last_size, self._last_end = len(batch), time.monotonic()
            self._cond.notify_all()
            self._kick()

    def _linger(self) -> None:
        """Wait (the lock released, the way kept) for company if the batch before says others are
        calling: ``linger`` at most, and never into the last ``linger`` of any queued item's time,
        so that a short deadline is not spent here. Arrivals queue meanwhile, as behind any batch."""
        started = time.monotonic()
        if self.linger <= 0 or self._last_size < LINGER_SIBLINGS or started - self._last_end > LINGER_RECENT:
            return
        while not self._stopped and len(self._queue) < self.max_batch:
            soonest = min((s.deadline for s in self._queue), default=float("inf"))
            left = min(started + self.linger, soonest - self.linger) - time.monotonic()
            if left <= 0:
                return
            self._company.wait(left)

    def _run(self, batch: list[_Slot[T, R]]) -> None:
        try:
            results = self._send([s.item for s in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"{len(results)} results for {len(batch)} items")
            for slot, result in zip(batch, results, strict=True):
                slot.result = result
        except BaseException as exc:  # every caller of the batch hears of it
            for slot in batch:
                slot.error = exc
        for slot in batch:
            slot.done = True
            if slot.callback is not None:
                self._tell(slot)

    @staticmethod
    def _tell(slot: _Slot[T, R]) -> None:
        assert slot.callback is not None
        try:
            slot.callback(slot.error if slot.error is not None else slot.result)  # type: ignore[arg-type]
        except Exception:  # one caller's broken callback must not cost the others their answers
            log.exception("a combiner callback failed")
