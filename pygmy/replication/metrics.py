"""Prometheus metrics of one replica: term, role, indexes, follower lag, elections, failovers, catch-up.

A replica runs a single Gunicorn worker, so a plain (non-multiprocess) collector in that process
sees the node itself. Everything is read from the node at scrape time; the node counts elections,
leader changes and its catch-up time itself, as its view changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

ROLES = ("leader", "follower", "candidate", "recovering")


class ReplicaCollector(Collector):
    """Scrape-time gauges and counters of one replica, labelled with its service name."""

    def __init__(self, name: str, node: Any) -> None:
        self.name, self.node = name, node

    def collect(self) -> Iterator[Any]:
        node, core, w = self.node, self.node.core, self.node
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
        timers = view.get("timers", {})
        rtt = GaugeMetricFamily("pygmy_replica_rtt_seconds",
                                "Leader only: each follower's measured heartbeat round trip (median of the last 64)",
                                labels=["service", "peer"])
        for peer, ms in timers.get("rtt_ms", {}).items():
            rtt.add_metric([self.name, peer], ms / 1000.0)
        yield rtt
        timer = GaugeMetricFamily("pygmy_replica_timer_seconds",
                                  "Raft timers in force: heartbeat, election window, lease, probe",
                                  labels=["service", "timer"])
        for key in ("heartbeat", "election", "lease", "probe"):
            if f"{key}_ms" in timers:
                timer.add_metric([self.name, key], timers[f"{key}_ms"] / 1000.0)
        yield timer
        elections = CounterMetricFamily("pygmy_replica_elections", "Elections this replica started",
                                        labels=["service"])
        elections.add_metric(svc, float(w.elections))
        yield elections
        changes = CounterMetricFamily("pygmy_replica_leader_changes",
                                      "Leader changes (failovers) this replica has seen", labels=["service"])
        changes.add_metric(svc, float(w.leader_changes))
        yield changes
        faults = CounterMetricFamily("pygmy_replica_loop_faults",
                                     "Faults the replica survived by kind: storage (a full or failing disk), "
                                     "error (an exception in a turn of the event loop: a bug), sender (a "
                                     "sender thread's unexpected error)", labels=["service", "kind"])
        for kind, count in sorted(w.loop_faults.items()):
            faults.add_metric([self.name, kind], float(count))
        yield faults
        if w.catch_up_seconds is not None:
            yield gauge("pygmy_replica_catch_up_seconds",
                        "Seconds from process start until the replica left 'recovering'", w.catch_up_seconds)
