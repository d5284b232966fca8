"""The frontend's view of the tiers for ``/status``, fetched by one caller at a time and reused.

A view asks every replica of both tiers for its own status. ``/status`` is polled by ``pygmy up``,
experiments and every open dashboard; without reuse, N pollers cost N rounds of six requests each.
Here a view younger than ``max_age`` is served from memory, at most one refresh is in flight per
worker, and callers arriving during a refresh get the previous view (its age is in the answer).
No thread of its own: nothing is fetched while nobody asks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

#: How old a served view may be before the next caller refreshes it.
MAX_AGE = 0.25


class StatusView:
    def __init__(self, fetch: Callable[[], dict[str, Any]], max_age: float = MAX_AGE) -> None:
        self._fetch, self.max_age = fetch, max_age
        self._cond = threading.Condition()
        self._view: dict[str, Any] | None = None
        self._at = 0.0
        self._refreshing = False
        self.refreshes = 0

    def get(self) -> tuple[dict[str, Any], float]:
        """The view and its age in seconds."""
        with self._cond:
            while True:
                now = time.monotonic()
                if self._view is not None and (now - self._at <= self.max_age or self._refreshing):
                    return self._view, now - self._at
                if not self._refreshing:
                    self._refreshing = True
                    break
                self._cond.wait()  # the first view is on its way
        try:
            view = self._fetch()
        except BaseException:
            with self._cond:
                self._refreshing = False
                self._cond.notify_all()  # a waiter takes over the refresh
            raise
        with self._cond:
            self._view, self._at = view, time.monotonic()
            self.refreshes += 1
            self._refreshing = False
            self._cond.notify_all()
        return view, 0.0
