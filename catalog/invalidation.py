"""The catalog leader's side of the cache protocol: leases for frontend workers, holds before writes.

A write to a book becomes readable anywhere only after its old value has left every cache that a
valid lease lets a worker use (docs/architecture.md, "The cache", has the proof):

1. ``hold(keys)`` registers the write as *pending* and pushes ``hold`` to every leased worker: the
   worker drops the keys and neither serves nor stores them until released. A worker that does not
   answer is revoked and its lease waited out (at most one lease); so is any worker revoked by an
   earlier write and not renewed since. Only then is the command proposed to the log.
2. Once the command is applied here (or has failed), ``release(token, index)`` unregisters it and
   pushes ``release`` with the log index: the worker stores the keys again, but only values read at
   that index or later. Releases are not waited for (their acknowledgements are read, and dropped,
   by the next push): a worker they miss keeps the hold until its next grant.
3. Every lease grant carries the pending holds, so a worker granted a lease mid-write holds them too.

A new leader knows none of the leases its predecessor granted, so it proposes no write until every
old lease has expired: a lease less ``ReplicaNode.vote_quiet_s`` after it became leader.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

from prometheus_client import Counter, Histogram

from pygmy.replication.batching import Combiner, CombinerTimeout
from pygmy.replication.node import NotLeader, ProposalTimeout, ReplicaNode
from pygmy.replication.transport import PUSH_CHANNEL, FrameClient, after_reply, subscriber_address

log = logging.getLogger(__name__)

PUBLISH_SECONDS = Histogram(
    "pygmy_invalidation_seconds", "Time a write waits for every leased frontend worker to hold its keys",
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)

PUSH_BATCH = Histogram(
    "pygmy_invalidation_batch_size", "Holds and releases carried by one push frame to one worker",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
)
PUSH_FAILURES = Counter("pygmy_invalidation_push_failures", "Push frames a worker did not acknowledge")

LEASE = 0.4
PUSH_TIMEOUT = 0.3
#: A worker far from us (it reports its renewals' round trip) gets a longer lease and more time to
#: answer a push: a grant takes a round trip to arrive and the next renewal another, so a lease of
#: LEASE would be over before it could be used. Within LEASE_MAX, and never past our leader lease's
#: end plus LEASE (``subscribe``), which is all a successor waits out: nearby workers keep LEASE.
LEASE_RTTS = 3.0
LEASE_MAX = 3.0
PUSH_RTTS = 3.0
PUSH_TIMEOUT_MAX = 2.0
#: Tokens are ``term << TERM_SHIFT | n``: unique across leaders, and ordered, so a grant's
#: ``next_token`` tells a worker which holds the leader has finished with.
TERM_SHIFT = 32


class Write:
    """What a held write learns while it runs: the log index its effect became readable at."""

    def __init__(self) -> None:
        self.index: int | None = 0  # 0: changed nothing; None: unknown (the command may still commit)
        #: Held keys' values read here after the write applied: caches refresh from them.
        self.values: dict[str, Any] | None = None


class Invalidator:
    def __init__(self, node: ReplicaNode, secret: str, lease: float = LEASE) -> None:
        self.node = node
        self.lease = lease
        self._term = -1  # the leadership term our tables belong to
        self._subs: dict[str, tuple[str, float]] = {}  # id -> (url, expiry on our monotonic clock)
        self._rtts: dict[str, float] = {}  # url -> the round trip its worker last reported
        #: Revoked workers that have not renewed since -> the latest lease ever granted to them.
        #: Every hold reads it, so no write proceeds while such a worker may still use its cache.
        self._revoked: dict[str, float] = {}
        self._pending: dict[int, list[str]] = {}  # token -> keys of a write not yet released
        self._seq = 0
        self._lock = threading.Lock()
        self._ready_at = 0.0
        self._secret = secret
        self._channels: dict[str, _Channel] = {}  # url -> connection to that worker
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="invalidate")
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()

    def _sync_term(self) -> None:
        """Start fresh tables, and the lease wait, the first time we act in a new leadership term.

        Checked on every subscribe and hold, not left to a listener thread: a worker that
        subscribes, or a write that starts, right after an election must already see it.
        """
        term = self.node.term()
        if term != self._term:
            self._term = term
            self._subs.clear()
            self._revoked.clear()  # the lease wait below outlasts every lease of the old term
            self._pending.clear()  # workers drop these at their next grant from us (next_token)
            self._seq = 0
            # Every lease our predecessors granted ends by their leader lease's end plus a lease
            # (``subscribe`` caps grants so), and that end came ``vote_quiet_s`` or more before our
            # election (``ReplicaNode.vote_quiet_s``). Without the start of our leadership (a race
            # with the node's loop), wait a whole lease from now, which is later still.
            start = self.node.leadership_start()
            self._ready_at = (time.monotonic() + self.lease if start is None else
                              start + self.lease - self.node.vote_quiet_s())

    def _next_token(self) -> int:
        return (self._term << TERM_SHIFT) | (self._seq + 1)

    # -- leases -------------------------------------------------------------------------------------
    def lease_for(self, rtt: float) -> float:
        """The lease a worker whose renewals take ``rtt`` s is offered: ``self.lease`` nearby."""
        return min(max(self.lease, LEASE_RTTS * rtt + self.lease / 2), max(self.lease, LEASE_MAX))

    def subscribe(self, sub_id: str, url: str, rtt: float = 0.0) -> dict[str, Any]:
        """Grant or renew a lease (``lease`` in the answer: ``lease_for(rtt)`` seconds at most),
        with the holds the worker must keep. ``rtt``: the worker's renewals' round trip, as it measured it.

        ``continued`` says whether it continues an unbroken lease. When it does not (new subscriber,
        expired, or revoked after a missed push), the worker must flush: it may have missed changes.
        """
        with self._lock:
            # The time read under the lock: read before it, by a thread that then stalled, it could
            # call a lease continued that had ended, after a write skipped the worker for it.
            now = time.monotonic()
            # Never past our leader lease's end plus ``self.lease``, even if this thread stalled since
            # the caller checked the lease: a successor's wait (``_sync_term``) counts on it.
            expiry = min(now + self.lease_for(rtt), self.node.leader_lease_until() + self.lease)
            self._sync_term()
            old = self._subs.get(sub_id)
            # Never shortened (a lower rtt gives a shorter lease): the worker goes on using the longer
            # grant before this one if this answer is lost or late, and writes skip it by this entry.
            self._subs[sub_id] = (url, expiry if old is None else max(expiry, old[1]))
            self._rtts[url] = rtt
            # A revoked worker gets ``continued: false`` (old is None) and flushes before it uses
            # this lease; later writes reach it again, so they need not wait for the old one.
            self._revoked.pop(sub_id, None)
            return {"continued": old is not None and old[1] > now, "lease": max(0.0, expiry - now),
                    "holds": [[t, keys] for t, keys in self._pending.items()],
                    "next_token": self._next_token()}

    # -- writes -------------------------------------------------------------------------------------
    @contextmanager
    def holding(self, keys: list[str]) -> Iterator[Write]:
        """Hold ``keys`` in every leased cache around a write; the body sets ``write.index``.

        NotLeader means nothing was written, ProposalTimeout carries the index to wait for. No keys
        (a batch of buys of items that are no books): no cache can hold one, so no round at all.
        """
        if not keys:
            yield Write()
            return
        token = self.hold(keys)
        write = Write()
        try:
            yield write
        except NotLeader:
            write.index = 0
            raise
        except ProposalTimeout as exc:
            write.index = None
            if exc.index is not None:
                self._pool.submit(self._release_when_applied, token, exc.index, self._term)
            raise
        except BaseException:
            write.index = None  # outcome unknown: keep the hold until a new term clears it
            raise
        finally:
            if write.index is not None:
                self.release(token, write.index, write.values)

    def hold(self, keys: list[str]) -> int:
        """Register a write on ``keys`` and return once no usable cache can serve their old values."""
        started = time.perf_counter()
        with self._lock:
            self._sync_term()
            self._seq += 1
            token = (self._term << TERM_SHIFT) | self._seq
            self._pending[token] = list(keys)
            ready_at = self._ready_at
        now = time.monotonic()
        if now < ready_at:
            time.sleep(ready_at - now)
        now = time.monotonic()
        with self._lock:
            targets = {sid: (url, exp) for sid, (url, exp) in self._subs.items() if exp > now}
            # Workers revoked by any write and not renewed since are not pushed to, and may still
            # hold a lease (and a cache with the old values): wait their leases out too.
            owed = max((until for until in self._revoked.values() if until > now), default=0.0)
        if targets:
            failed = self._push_all(targets, {"holds": [[token, keys]]})
            if failed:
                log.warning("hold not acknowledged by %s; waiting out their lease", ", ".join(failed))
                owed = max(owed, self._revoke(failed, targets))
        remaining = owed - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        PUBLISH_SECONDS.observe(time.perf_counter() - started)
        return token

    def release(self, token: int, index: int, values: dict[str, Any] | None = None) -> None:
        """The write is applied here at ``index`` (0: it changed nothing): let caches store its keys
        again, from values read at ``index`` or later, such as ``values`` (read here after it was
        applied: a cache that dropped a key refreshes it instead of missing on its next read).
        Written once the write's answer is (``after_reply``), and never waited for."""
        with self._lock:
            keys = self._pending.pop(token, None)
            if keys is None:
                return  # a new term cleared it; workers drop it at their next grant
            now = time.monotonic()
            targets = {sid: (url, exp) for sid, (url, exp) in self._subs.items() if exp > now}
        if targets and not self._stopping.is_set():
            body = {"releases": [[token, keys, index, values] if values else [token, keys, index]]}

            def push() -> None:
                if self._stopping.is_set():
                    return  # stopped since: workers drop the hold at their next grant, from whoever leads
                for url, _ in targets.values():
                    # A worker this misses keeps the hold (safe) until its next grant: ``next_token``
                    # then tells it we are done, and the grant's index is at least ``index``.
                    if not self._send_unanswered(url, body):  # a push in flight there: in its next frame
                        with contextlib.suppress(RuntimeError):  # the pool shut down meanwhile (stop)
                            self._pool.submit(self._push, url, body)

            # Written once the write's answer has gone (when a frame asked for it: the order leader's
            # decrements), by the thread that wrote it: the answer needs none of this. Each release
            # frame is written without waiting for its acknowledgement (the next push on that
            # connection reads and drops it); a worker with a push in flight gets it in its next
            # frame, from the pool. A release is never waited for; a late one only holds longer.
            after_reply(push)

    def _release_when_applied(self, token: int, index: int, term: int) -> None:
        """A write that timed out may still commit: release it once applied here, never earlier."""
        while not self._stopping.is_set() and self.node.term() == term:
            if self.node.wait_applied(index, 0.5):
                self.release(token, index)
                return

    # -- pushes -------------------------------------------------------------------------------------
    def push_timeout(self, url: str) -> float:
        """How long a push to ``url`` may take to be acknowledged: PUSH_TIMEOUT nearby, more for a far worker."""
        return min(max(PUSH_TIMEOUT, PUSH_RTTS * self._rtts.get(url, 0.0)), PUSH_TIMEOUT_MAX)

    def _push_all(self, targets: dict[str, tuple[str, float]], body: dict[str, Any]) -> list[str]:
        """Push ``body`` to every target; the targets that did not acknowledge it within the round's
        time (the largest push timeout among them, and 0.2 s).

        A nearby worker with an open connection and no push in flight gets it from this thread,
        which writes to every such worker and then reads each answer (``_Channel.start``): no
        thread hand-off per worker. Any other (far, not connected yet, or busy) gets it from a pool
        thread: its answer or its connection may take longer than a nearby answer, and must not
        keep the connections of others, waiting here to be read, from their next pushes."""
        end = time.monotonic() + max(self.push_timeout(url) for url, _ in targets.values()) + 0.2
        started: dict[str, Callable[[], bool]] = {}
        futures: dict[Future[bool], str] = {}
        try:
            for sid, (url, _) in targets.items():
                acknowledged = self._start(url, body) if self.push_timeout(url) <= PUSH_TIMEOUT else None
                if acknowledged is not None:
                    started[sid] = acknowledged
                else:
                    futures[self._pool.submit(self._push, url, body)] = sid
        finally:
            acks = _acknowledge_all(started)
        failed = [sid for sid, ok in acks.items() if not ok]
        if futures:
            done, _ = wait(futures, timeout=max(0.0, end - time.monotonic()))
            failed += [futures[f] for f in futures if f not in done or f.exception() is not None or not f.result()]
        return failed

    def _revoke(self, failed: list[str], targets: dict[str, tuple[str, float]]) -> float:
        """Revoke workers a push missed; returns until when the latest lease granted to any of them runs.

        The latest lease is the largest of: what our snapshot saw, what the table holds now
        (renewals granted during the push), and what another write that revoked the worker first
        recorded (it popped the table entry, so the table alone would understate it).
        """
        with self._lock:
            for sid in failed:
                current = self._subs.pop(sid, None)
                self._revoked[sid] = max(self._revoked.get(sid, 0.0), targets[sid][1],
                                         current[1] if current else 0.0)
            now = time.monotonic()
            for sid in [s for s, until in self._revoked.items() if until <= now]:
                del self._revoked[sid]  # lease over: nothing left to wait for
            return max((self._revoked.get(sid, 0.0) for sid in failed), default=0.0)

    def _push(self, url: str, body: dict[str, Any]) -> bool:
        """Deliver ``body`` to one worker; True once it acknowledged (pushes to the same worker that
        meet here go out together, in one frame)."""
        channel, timeout = self._channel(url)
        return channel.push(body, timeout)

    def _start(self, url: str, body: dict[str, Any]) -> Callable[[], bool] | None:
        """``_Channel.start`` on the connection to one worker."""
        channel, timeout = self._channel(url)
        return channel.start(body, timeout)

    def _send_unanswered(self, url: str, body: dict[str, Any]) -> bool:
        """``_Channel.send_unanswered`` on the connection to one worker."""
        return self._channel(url)[0].send_unanswered(body)

    def _channel(self, url: str) -> tuple[_Channel, float]:
        """The connection to one worker (opened on first use), and how long a push may take there."""
        with self._lock:
            channel = self._channels.get(url)
            if channel is None:
                # Channels of workers that no longer hold or owe a lease are closed as others open,
                # once idle: one may be a target of a push in flight, perhaps on this very thread.
                # A lease that ran out counts for nothing (a renewal after it flushes all the same):
                # its entry goes, or a dead worker's (a respawned one's predecessor) stayed for the term.
                now = time.monotonic()
                for sid in [sid for sid, (_, exp) in self._subs.items() if exp <= now]:
                    del self._subs[sid]
                live = {u for u, _ in self._subs.values()}
                for old in [u for u in self._channels if u not in live]:
                    if self._channels[old].close_if_idle():
                        del self._channels[old]
                        self._rtts.pop(old, None)
                channel = self._channels[url] = _Channel(url, self._secret, self.node.name)
            return channel, self.push_timeout(url)


def _acknowledge_all(started: dict[str, Callable[[], bool]]) -> dict[str, bool]:
    """Each started push's acknowledgement (``_Channel.start``); every connection is given back,
    even if reading one answer raises."""
    acks: dict[str, bool] = {}
    rest = iter(started.items())
    try:
        for sid, acknowledged in rest:
            acks[sid] = acknowledged()
    finally:
        for _, acknowledged in rest:  # only after an error: the others' connections, given back
            with contextlib.suppress(BaseException):
                acknowledged()
    return acks


def _observe(frame: dict[str, Any]) -> None:
    """A push frame went out: how many holds and releases it carried."""
    PUSH_BATCH.observe(len(frame["holds"]) + len(frame["releases"]))


class _Channel:
    """The connection to one frontend worker. Pushes are combined (``pygmy.replication.batching``): one
    frame carries the holds and releases of every write waiting for this worker, and the worker's
    one acknowledgement answers them all."""

    def __init__(self, url: str, secret: str, name: str) -> None:
        self.client = FrameClient(subscriber_address(url), secret, name, PUSH_CHANNEL, connect_timeout=0.1)
        self._combiner: Combiner[dict[str, Any], bool] = Combiner(self._send)
        self.timeout = PUSH_TIMEOUT  # the latest push's (the worker's round trip may change)

    def push(self, body: dict[str, Any], timeout: float = PUSH_TIMEOUT) -> bool:
        """Deliver ``body``; True once the worker acknowledged it (pushes that meet here go out
        together, in one frame)."""
        self.timeout = timeout
        try:
            return self._combiner.call(body, 2 * timeout + 0.1)
        except CombinerTimeout:
            return False  # still queued: it may go out later, which only holds a key longer

    def start(self, body: dict[str, Any], timeout: float) -> Callable[[], bool] | None:
        """Write ``body`` now if the connection is open and no push is in flight on it, and return
        the function that reads its acknowledgement (True if acknowledged, within ``timeout`` of
        the write) and frees the connection, which must be called. None: not connected, or busy;
        ``push`` it instead (connecting is left to a thread that may wait for it)."""
        if not self._combiner.claim():
            return None
        if not self.client.is_open():  # checked once claimed: nobody else may reset it now
            self._combiner.unclaim()
            return None
        frame = self._frame([body])
        try:
            reply: Callable[[], Any] | None = self.client.start_call(frame, timeout)
        except OSError:
            reply = None
        except BaseException:
            self._combiner.unclaim()
            raise

        def acknowledged() -> bool:
            try:
                if reply is None:
                    return False
                ok = self._acknowledged(reply)  # frees the connection whatever happens
                _observe(frame)  # a frame that went out (counted after: it must not keep the connection)
                return ok
            finally:
                self._combiner.unclaim()

        if reply is None:
            PUSH_FAILURES.inc()
        return acknowledged

    def send_unanswered(self, body: dict[str, Any]) -> bool:
        """Write ``body`` now, if no push is in flight here and that cannot block, leaving its
        acknowledgement for the next push to read and drop: for a release, which nobody waits for
        (a lost one only holds a key longer). False: nothing written; ``push`` it."""
        if not self._combiner.claim():
            return False
        frame = self._frame([body])
        try:
            sent = self.client.send_nowait(frame, owed=True)
        finally:
            self._combiner.unclaim()
        if sent:
            _observe(frame)
        return sent

    def _send(self, bodies: list[dict[str, Any]]) -> list[bool]:
        frame = self._frame(bodies)
        _observe(frame)
        return [self._acknowledged(lambda: self.client.call(frame, self.timeout))] * len(bodies)

    @staticmethod
    def _frame(bodies: list[dict[str, Any]]) -> dict[str, Any]:
        return {"holds": [h for body in bodies for h in body.get("holds", ())],
                "releases": [r for body in bodies for r in body.get("releases", ())]}

    def _acknowledged(self, reply: Callable[[], Any]) -> bool:
        """Whether ``reply()`` (reading the worker's answer) says the push is acknowledged."""
        try:
            ok = reply() == {"ok": True}
        except OSError:
            ok = False
        except Exception:  # never leave the pushes of a frame without an answer
            log.exception("push to %s failed unexpectedly", self.client.address)
            ok = False
        if not ok:
            PUSH_FAILURES.inc()
        return ok

    def close_if_idle(self) -> bool:
        """Close the connection unless a push is in flight or queued on it: True if closed."""
        if not self._combiner.claim():
            return False
        try:
            self.client.close()
        finally:
            self._combiner.unclaim()
        return True

    def close(self) -> None:
        self.client.close()
