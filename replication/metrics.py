"""Prometheus metrics of one replica: term, role, indexes, follower lag, elections, failovers, catch-up.

A replica runs a single Gunicorn worker, so a plain (non-multiprocess) collector in that process
sees the node itself. Gauges are read from the node at scrape time; the counters (elections, leader
changes) and the catch-up time need every transition, so a small watcher thread samples the node's
view every ``SAMPLE_EVERY`` seconds (reads only: it never touches the event loop).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from replication.core import CANDIDATE

SAMPLE_EVERY = 0.02
ROLES = ("leader", "follower", "candidate", "recovering")


class ReplicaWatcher:
    """Counts elections this replica started and leader changes it saw; times its catch-up."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self.elections = 0
        self.leader_changes = 0
        self.catch_up_seconds: float | None = None
        self._started = time.monotonic()
        self._last_role: str | None = None
        self._last_leader: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-metrics", daemon=True)

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)

    def sample(self) -> None:
        core, view = self.node.core, self.node._view
        role, leader = core.role, core.leader
        if role == CANDIDATE and self._last_role != CANDIDATE:
            self.elections += 1  # a real election (term + 1), not a pre-vote
        if leader is not None and leader != self._last_leader:
            if self._last_leader is not None or self.catch_up_seconds is not None:
                self.leader_changes += 1  # the first leader we learn of at start is no failover
            self._last_leader = leader
        self._last_role = role
        if self.catch_up_seconds is None and view.get("role") in ("leader", "follower"):
            self.catch_up_seconds = time.monotonic() - self._started

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY):
            try:
                self.sample()
            except Exception:  # a torn read during a role change: the next sample is fine
                continue


class ReplicaCollector(Collector):
    """Scrape-time gauges and counters of one replica, labelled with its service name."""

    def __init__(self, name: str, node: Any, watcher: ReplicaWatcher) -> None:
        self.name, self.node, self.watcher = name, node, watcher

    def collect(self) -> Iterator[Any]:
        node, core, w = self.node, self.node.core, self.watcher
        view = node._view
        svc = [self.name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["service"])
            g.add_metric(svc, value)
            return g

        yield gauge("pygmy_replica_term", "Current Raft term", float(view.get("term", 0)))
        roles = GaugeMetricFamily("pygmy_replica_role", "1 for this replica's current role", labels=["service", "role"])
        for role in ROLES:
            roles.add_metric([self.name, role], 1.0 if view.get("role") == role else 0.0)
        yield roles
        commit, applied = int(view.get("commit", 0)), int(node.applied_index())
        yield gauge("pygmy_replica_commit_index", "Highest log index known committed", float(max(commit, applied)))
        yield gauge("pygmy_replica_applied_index", "Highest log index applied to the state", float(applied))
        yield gauge("pygmy_replica_apply_lag", "Committed but not yet applied entries (commit - applied)",
                    float(max(0, commit - applied)))
        lag = GaugeMetricFamily("pygmy_replica_follower_lag",
                                "Leader only: entries each follower is behind the leader's log (last - match)",
                                labels=["service", "follower"])
        if view.get("role") == "leader":
            last = core.last_index
            for peer in list(node.peers):
                pr = core.progress(peer) if peer != node.name else None
                if pr is not None:
                    lag.add_metric([self.name, peer], float(max(0, last - pr.match)))
        yield lag
        elections = CounterMetricFamily("pygmy_replica_elections", "Elections this replica started",
                                        labels=["service"])
        elections.add_metric(svc, float(w.elections))
        yield elections
        changes = CounterMetricFamily("pygmy_replica_leader_changes",
                                      "Leader changes (failovers) this replica has seen", labels=["service"])
        changes.add_metric(svc, float(w.leader_changes))
        yield changes
        if w.catch_up_seconds is not None:
            yield gauge("pygmy_replica_catch_up_seconds",
                        "Seconds from process start until the replica left 'recovering'", w.catch_up_seconds)
