"""A frontend worker's lease with the catalog leader, and the listener its holds arrive on.

Each Gunicorn worker runs its own listener (a ``FrameServer`` on a free port: one long-lived
connection from the catalog leader, frames of holds and releases) and renews its own lease (frames
on the catalog leader's peer port), because the catalog must reach every worker's cache, not
whichever worker the shared listening socket happens to pick. Before it proposes a write, the catalog leader pushes a *hold* on
the keys to every unexpired lease (one it cannot reach it waits out instead, at most one lease);
after the write is applied it pushes the *release* with the write's log index. So while our lease
is valid, no write our cache could contradict can have become readable anywhere; once it is not,
we stop using the cache until we hold a lease again.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from pygmy.frontend.cache import ReadCache
from pygmy.replication.router import ChannelRouter, TierUnavailable
from pygmy.replication.transport import CLIENT_ROLES, PUSH_CHANNEL, Channel, FrameServer

log = logging.getLogger(__name__)

#: How often a worker renews; the lease itself is granted by the catalog (``pygmy.catalog.invalidation``).
RENEW_EVERY = 0.1
#: How often once it has served no read for IDLE_AFTER: an idle cluster should cost almost nothing
#: (issue #10). A lease lasts 0.4 s less MARGIN from the renewal's send, so the next renewal's grant
#: still arrives inside it if the two round trips take under 0.15 s (an idle cluster answers in a
#: few ms): the first lookup after a quiet spell finds the lease valid and the cache as it was.
RENEW_IDLE = 0.2
IDLE_AFTER = 1.0
#: Safety margin against the two clocks' rates, taken off our own view of the lease.
MARGIN = 0.05
#: A renewal's budget: RENEWAL_RTTS of our renewals' round trip, within these bounds. The round
#: trip (the median of the last RTT_SAMPLES: a far link slows every renewal, a busy machine only
#: some) goes with each renewal: a far catalog leader grants a longer lease
#: (``pygmy.catalog.invalidation.Invalidator.lease_for``).
RENEWAL_TIMEOUT, RENEWAL_TIMEOUT_MAX, RENEWAL_RTTS = 0.5, 5.0, 4.0
RTT_SAMPLES, RTT_QUANTILE = 16, 0.5


def advertised_host(bind: str, advertise: str | None) -> str:
    if advertise:
        return advertise
    if bind not in ("0.0.0.0", "::", ""):
        return bind
    try:  # in a container: our own address on its network
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class Subscription:
    def __init__(self, cache: ReadCache, catalog: ChannelRouter, secret: str, bind: str, advertise: str | None,
                 frontend: str, shape: Callable[[str, Any], Any] = lambda key, value: value) -> None:
        """``shape(key, value)`` turns a value a release carries into what the cache keeps for ``key``
        (as a read would have filled it), or None to keep nothing."""
        self.cache, self.catalog, self.shape = cache, catalog, shape
        self.id = f"{frontend}/{os.getpid()}/{uuid.uuid4().hex[:6]}"
        self._valid_until = 0.0
        self._holder: tuple[str, int] | None = None  # (leader, term) that granted our lease
        self._stop = threading.Event()
        self._server = FrameServer(bind, 0, secret, {PUSH_CHANNEL: Channel(self._on_push, roles=CLIENT_ROLES[PUSH_CHANNEL])}, name=f"listener-{self.id}")
        self.url = f"tcp://{advertised_host(bind, advertise)}:{self._server.address[1]}"
        self._thread = threading.Thread(target=self._renew_loop, name="lease-renewal", daemon=True)
        self.pushes = 0
        self._reads_seen = (-1, 0.0)  # (hits + misses of our cache, when that count last moved)
        self._rtts: deque[float] = deque(maxlen=RTT_SAMPLES)  # our recent renewals' round trips
        #: Told after every renewal and every push (the owner mirrors them into per-worker metrics).
        self.on_change: Callable[[], None] = lambda: None

    def start(self) -> None:
        self._server.start()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._server.stop()
        self._thread.join(timeout=2)
        self.catalog.close()

    def valid(self) -> bool:
        return time.monotonic() < self._valid_until

    def holder(self) -> tuple[str, int] | None:
        return self._holder

    def valid_for(self) -> float:
        """Seconds left on our lease (0 once it lapsed)."""
        return max(0.0, self._valid_until - time.monotonic())

    # -- lease ------------------------------------------------------------------------------------
    def rtt(self) -> float:
        """Our renewals' round trip, as we tell the leader: the median of the recent ones."""
        if not self._rtts:
            return 0.0
        ordered = sorted(self._rtts)
        return ordered[min(len(ordered) - 1, int(RTT_QUANTILE * len(ordered)))]

    def renew(self) -> bool:
        sent = time.monotonic()
        rtt = self.rtt()
        budget = min(max(RENEWAL_TIMEOUT, RENEWAL_RTTS * rtt), RENEWAL_TIMEOUT_MAX)
        try:
            reply = self.catalog.call({"id": self.id, "url": self.url, "rtt": round(rtt, 4)}, deadline=sent + budget)
        except TierUnavailable:
            return False
        if reply.status != 200:
            return False
        self._rtts.append(time.monotonic() - sent)
        body = reply.body
        holder = (body["leader"], int(body["term"]))
        # New leader, a gap in our lease, or a push we missed: writes may have gone by without
        # reaching us. Start over from what the leader had applied when it granted this.
        flush = holder != self._holder or sent >= self._valid_until or not body.get("continued")
        pending = {int(t): [str(k) for k in keys] for t, keys in body.get("holds", [])}
        self.cache.renewed(pending, int(body.get("next_token", 0)), int(body["commit_index"]), flush)
        self._holder = holder
        # Only now, with the grant's holds in force, may the cache be used under this lease.
        self._valid_until = sent + float(body["lease"]) - MARGIN
        self.on_change()
        return True

    def _renew_loop(self) -> None:
        """Supervised: an unexpected error (a malformed grant, a bug) is logged and retried; the
        lease lapses meanwhile, so the worker reads without its cache rather than stale."""
        while not self._stop.is_set():
            try:
                ok = self.renew()
            except Exception:
                log.exception("lease renewal failed unexpectedly; retrying")
                ok = False
            self._stop.wait(self.renew_every() if ok else RENEW_EVERY / 2)

    def renew_every(self) -> float:
        """RENEW_EVERY while the worker serves reads, RENEW_IDLE once it has served none for IDLE_AFTER."""
        now, reads = time.monotonic(), self.cache.stats.hits + self.cache.stats.misses
        if reads != self._reads_seen[0]:
            self._reads_seen = (reads, now)
        return RENEW_EVERY if now - self._reads_seen[1] < IDLE_AFTER else RENEW_IDLE

    # -- pushes -----------------------------------------------------------------------------------
    def _on_push(self, peer: str, frame: Any) -> dict[str, Any]:
        """A frame from the catalog leader (authenticated by the transport): applied, then acknowledged."""
        try:
            self.apply_push(frame)
        except (ValueError, KeyError, TypeError, AttributeError):
            return {"error": {"code": 400, "message": "malformed invalidation"}}
        return {"ok": True}

    def apply_push(self, body: dict[str, Any]) -> None:
        """Holds first, then releases: one push may carry both, for different writes."""
        for token, keys in body.get("holds", []):
            self.cache.hold(int(token), [str(k) for k in keys])
        for token, keys, version, *values in body.get("releases", []):
            fresh = {str(k): self.shape(str(k), v) for k, v in values[0].items()} if values and values[0] else None
            self.cache.release(int(token), [str(k) for k in keys], int(version), fresh)
        self.pushes += 1
        self.on_change()
