"""Retries that cannot amplify an overload: a budget and jittered exponential backoff (issue #19).

Used by the ``pygmy`` client and by the routers between tiers. Under overload each retry is one
more request to a server that is already refusing or timing out, so retries are bounded as a
share of the requests made (Finagle's and gRPC's retry budgets, Google SRE's "retry budget"),
and spaced with full jitter so that clients that failed together do not come back together.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

#: What is left of a request's time, in whole milliseconds; services read it (pygmy/kit/admission.py)
#: and pass it on to every tier they call. Here, not in ``pygmy.client.api``, so that services import
#: the header without Requests.
DEADLINE_HEADER = "X-Request-Timeout-Ms"

#: Retries may add this share of the requests made, beyond the reserve.
RATIO = 0.1
#: Retries always available per second, so that a lone caller still rides out a failover.
RESERVE_PER_S = 10.0
#: The most retries saved up for a burst (a leader failover fails every request in flight at once).
BURST = 20.0


class RetryBudget:
    """A token bucket: each request deposits ``ratio`` of a token, time adds ``reserve_per_s``, and
    a retry takes a whole token; with none left, the caller gives up with the answer it has.
    Thread-safe; one per client or router (per process, so several workers each keep their own)."""

    def __init__(self, ratio: float = RATIO, reserve_per_s: float = RESERVE_PER_S, burst: float = BURST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ratio, self.reserve_per_s, self.burst = ratio, reserve_per_s, burst
        self._clock = clock
        self._tokens = burst
        self._last = clock()
        self._lock = threading.Lock()
        self.requests = self.retries = self.refused = 0

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.reserve_per_s)
        self._last = now

    def request(self) -> None:
        """A first attempt was made."""
        with self._lock:
            self.requests += 1
            self._refill()
            self._tokens = min(self.burst, self._tokens + self.ratio)

    def try_retry(self) -> bool:
        """May one more attempt be made? Takes a token if so."""
        with self._lock:
            self._refill()
            if self._tokens >= 1:
                self._tokens -= 1
                self.retries += 1
                return True
            self.refused += 1
            return False


def backoff(attempt: int, base: float = 0.02, cap: float = 0.5, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry ``attempt`` (1, 2, ...): uniform up to ``base * 2**(attempt-1)``,
    at most ``cap`` ("full jitter")."""
    return (rng or random).uniform(0, min(cap, base * 2 ** max(0, attempt - 1)))


def retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds (the delay form; an HTTP date is not used by Pygmy), or None."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if 0 <= seconds <= 3600 else None


def says_overloaded(status: int, body: Any) -> bool:
    """An answer that sheds: 503 whose body says ``"overloaded": true`` (what ``Admission`` refuses
    with, and what the routers pass on). It promises nothing was done (docs/api.md)."""
    error = body.get("error") if isinstance(body, dict) else None
    return status == 503 and isinstance(error, dict) and error.get("overloaded") is True
