"""Test-side names for the local cluster driver (``cluster.local``), and the test-only hooks."""

import os
import threading
from pathlib import Path
from typing import Any

from werkzeug.serving import make_server

from cluster.local import LocalCluster as Cluster
from cluster.local import free_port_base, pygmy, start_cluster

__all__ = ["MUTATIONS", "Cluster", "FakeLeadership", "StandIn", "cluster_env", "free_port_base", "pygmy",
           "start_cluster"]

#: Test-only faults and mutations (``tests/mutations/sitecustomize.py``), for the processes of a cluster.
MUTATIONS = Path(__file__).resolve().parent / "mutations"


def cluster_env(**extra: str) -> dict[str, str]:
    """Environment that loads the test-only hooks into every service process."""
    path = os.pathsep.join(p for p in (str(MUTATIONS), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **extra}


class StandIn:
    """A WSGI app on a free loopback port, served from a thread until ``stop()``: a stand-in for a
    frontend or a replica in tests of the code that calls them."""

    def __init__(self, app: Any) -> None:
        self.http = make_server("127.0.0.1", 0, app, threaded=True)
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.http.shutdown()
        self.thread.join(5)


class FakeLeadership:
    """What ``catalog.invalidation`` asks a replication node about its leadership, as the test sets it."""

    current_term = 1
    #: When this node became leader of ``current_term`` (None: not known, as in a race with its loop).
    leader_since: float | None = None
    #: Until when the leader lease holds (tests of the cap on grants set it).
    lease_until = float("inf")
    vote_quiet = 0.1

    def term(self) -> int:
        return self.current_term

    def leadership_start(self) -> float | None:
        return self.leader_since

    def leader_lease_until(self) -> float:
        return self.lease_until

    def vote_quiet_s(self) -> float:
        return self.vote_quiet
