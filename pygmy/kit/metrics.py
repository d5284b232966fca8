"""Prometheus metrics shared by every service, in prometheus-client's multiprocess mode.

Gunicorn runs several worker processes; each writes its samples to files in the service's own
``PROMETHEUS_MULTIPROC_DIR`` (set by ``pygmy serve`` before any worker starts), and ``/metrics`` on
any worker reads them all. The frontend's ``/status`` reads its cache counters the same way, so
both report the whole frontend, not the one worker that happened to answer.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable
from typing import Any

from flask import Flask, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.registry import Collector

ENV = "PROMETHEUS_MULTIPROC_DIR"

REQUESTS = Counter("pygmy_http_requests_total", "HTTP requests answered", ["service", "route", "method", "status"])
_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
LATENCY = Histogram("pygmy_http_request_seconds", "Time to answer an HTTP request", ["service", "route"],
                    buckets=_SECONDS)
#: The same for a request served as a frame on the peer transport (``ReplicaRuntime.serve_frames``),
#: by the HTTP route whose work it does.
FRAME_LATENCY = Histogram(
    "pygmy_frame_request_seconds", "Time to answer a request sent as a frame on the peer transport",
    ["service", "route"], buckets=_SECONDS)
CACHE_EVENTS = Counter("pygmy_cache_events_total", "Frontend cache hits, misses, invalidations, evictions, flushes",
                       ["service", "event"])
BUY_BATCH = Histogram(
    "pygmy_buy_batch_size", "Buys carried together: a frontend worker's buys in one order request, their "
    "decrements in one catalog request, intents, confirms or refusals in one order log entry", ["service", "what"],
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256))
CACHE_ENTRIES = Gauge("pygmy_cache_entries", "Entries in the frontend caches", ["service"],
                      multiprocess_mode="livesum")
#: One figure of one frontend worker, per process (``pid`` label) while it lives: what the dashboard
#: shows per worker. ``field``: hits, misses, invalidations, entries, pushes, lease_until (Unix time
#: its lease runs to), lease_term (the catalog term that granted it).
FRONTEND_WORKER = Gauge("pygmy_frontend_worker", "A frontend worker's own cache and lease figures",
                        ["service", "field"], multiprocess_mode="liveall")


def worker_exited(pid: int) -> None:
    if os.environ.get(ENV):
        multiprocess.mark_process_dead(pid)


class RequestMetrics:
    """Counts and times answered HTTP requests (``REQUESTS``, ``LATENCY``) for one service.

    The labelled children are looked up once per route and status, not per request: on a cached
    lookup, the frontend's cheapest answer, the lookup cost more than the increment itself."""

    def __init__(self, service: str) -> None:
        self.service = service
        self._counts: dict[tuple[str, str, int], Any] = {}
        self._times: dict[str, Any] = {}

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.count(route, method, status)
        timing = self._times.get(route)
        if timing is None:
            timing = self._times.setdefault(route, LATENCY.labels(self.service, route))
        timing.observe(seconds)

    def count(self, route: str, method: str, status: int) -> None:
        """Count an answer given before any work (a refusal): it has no time worth a histogram's write."""
        count = self._counts.get((route, method, status))
        if count is None:
            count = self._counts.setdefault((route, method, status),
                                            REQUESTS.labels(self.service, route, method, str(status)))
        count.inc()


def instrument(app: Flask, extra: Callable[[], Iterable[Collector]] | None = None) -> None:
    """Serve ``/metrics`` (requests are counted and timed at the edge, ``pygmy.kit.web.Edge``)."""

    @app.get("/metrics")
    def metrics() -> Response:
        text = generate_latest(registry_for_scrape())
        if extra:
            # Extra (in-process) collectors get a registry of their own per scrape: registering
            # them in the shared or default registry would fail on the second scrape.
            own = CollectorRegistry(auto_describe=False)
            for collector in extra():
                own.register(collector)
            text += generate_latest(own)
        return Response(text, mimetype=CONTENT_TYPE_LATEST)


class _Collector(multiprocess.MultiProcessCollector):
    """prometheus-client's multiprocess collector, less the files another worker has just created
    and not yet sized: read at that instant, an empty file failed the whole scrape (a frontend's
    ``/status`` answered 500 once while a worker started). Such a file holds no sample yet."""

    def collect(self) -> Iterable[Any]:
        files = []
        for path in glob.glob(os.path.join(self._path, "*.db")):
            try:
                if os.path.getsize(path) >= _HEADER:
                    files.append(path)
            except FileNotFoundError:  # a dead worker's live gauges, removed since the glob
                pass
        return self.merge(files, accumulate=True)


#: A multiprocess file's header: the bytes used (4) and padding (4), written when it is sized.
_HEADER = 8


def registry_for_scrape() -> CollectorRegistry:
    registry = CollectorRegistry()
    if os.environ.get(ENV):
        _Collector(registry)
    else:  # single process (tests, tools): the default registry has everything
        from prometheus_client import REGISTRY

        return REGISTRY
    return registry


def totals(metric: str, label: str) -> dict[str, float]:
    """Sum one metric's samples across all worker processes, by one label (e.g. cache events)."""
    out: dict[str, float] = {}
    for family in registry_for_scrape().collect():
        for sample in family.samples:
            if sample.name == metric and label in sample.labels:
                key = sample.labels[label]
                out[key] = out.get(key, 0.0) + sample.value
    return out


