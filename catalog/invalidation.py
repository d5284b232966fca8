"""The catalog leader's side of cache invalidation: leases for frontend workers, pushes before acks.

Every committed change to a book is pushed to every frontend worker holding an unexpired lease
before the change is acknowledged. A worker that does not answer is not waited on forever: we wait
until its lease has run out (it stops using its cache by then, by its own clock) and drop it.

A new leader knows none of the leases its predecessor granted, so it acknowledges no change until
one lease period after it took over; by then every old lease has expired or been renewed with us.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import requests
from prometheus_client import Histogram

from catalog.books import topic_key
from replication.node import ReplicaNode
from replication.router import pooled_session

log = logging.getLogger(__name__)

PUBLISH_SECONDS = Histogram(
    "pygmy_invalidation_seconds", "Time a change waits for every leased frontend worker to drop it",
    buckets=(0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)

LEASE = 0.4
PUSH_TIMEOUT = 0.3


def change_for(book: dict[str, Any]) -> dict[str, Any]:
    """The cache keys a change to ``book`` makes stale, and the log index of that change."""
    return {"keys": [f"book:{book['item_number']}", f"topic:{topic_key(book['topic'])}"],
            "version": book["version"]}


class Invalidator:
    def __init__(self, node: ReplicaNode, secret: str, lease: float = LEASE) -> None:
        self.node = node
        self.lease = lease
        self._term = -1  # the leadership term our subscriber table belongs to
        self._subs: dict[str, tuple[str, float]] = {}  # id -> (url, expiry on our monotonic clock)
        self._lock = threading.Lock()
        self._ready_at = 0.0
        self._session = pooled_session(64)
        self._headers = {"Authorization": f"Bearer {secret}"}
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="invalidate")

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._session.close()

    def _sync_term(self) -> None:
        """Start a fresh table, and the lease wait, the first time we act in a new leadership term.

        Checked on every subscribe and publish, not left to a listener thread: a worker that
        subscribes, or a write that is acknowledged, right after an election must already see it.
        """
        term = self.node.term()
        if term != self._term:
            self._term = term
            self._subs.clear()
            self._ready_at = time.monotonic() + self.lease

    def subscribe(self, sub_id: str, url: str) -> bool:
        """Grant or renew a lease of ``self.lease`` seconds.

        Returns whether it continues an unbroken lease. When it does not (new subscriber, expired,
        or revoked after a missed push), the worker must flush: it may have missed changes.
        """
        now = time.monotonic()
        with self._lock:
            self._sync_term()
            old = self._subs.get(sub_id)
            self._subs[sub_id] = (url, now + self.lease)
        return old is not None and old[1] > now

    def publish(self, changes: list[dict[str, Any]]) -> None:
        """Return once every leased frontend worker has dropped these keys or lost its lease."""
        started = time.perf_counter()
        try:
            self._publish(changes)
        finally:
            if changes:
                PUBLISH_SECONDS.observe(time.perf_counter() - started)

    def _publish(self, changes: list[dict[str, Any]]) -> None:
        with self._lock:
            self._sync_term()
            ready_at = self._ready_at
        now = time.monotonic()
        if now < ready_at:
            time.sleep(ready_at - now)
        if not changes:
            return
        now = time.monotonic()
        with self._lock:
            targets = {sid: (url, exp) for sid, (url, exp) in self._subs.items() if exp > now}
        if not targets:
            return
        body = {"changes": changes}
        futures = {self._pool.submit(self._push, url, body): sid for sid, (url, _) in targets.items()}
        done, _ = wait(futures, timeout=PUSH_TIMEOUT + 0.2)
        failed = [futures[f] for f in futures if f not in done or not f.result()]
        if failed:
            log.warning("invalidation not acknowledged by %s; waiting out their lease", ", ".join(failed))
            with self._lock:
                # Revoke: the next renewal starts a new lease (the worker flushes). Wait out the
                # lease as it stands now, renewals during the push included.
                latest = max(self._subs.pop(sid, targets[sid])[1] for sid in failed)
            remaining = latest - time.monotonic()
            if remaining > 0:
                time.sleep(remaining)

    def _push(self, url: str, body: dict[str, Any]) -> bool:
        try:
            r = self._session.post(url + "/invalidate", json=body, headers=self._headers,
                                   timeout=(0.1, PUSH_TIMEOUT))
            return r.status_code == 200
        except requests.RequestException:
            return False
