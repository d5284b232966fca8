"""Test-side names for the local cluster driver (``cluster.local``), and the test-only hooks."""

import os
import threading
from pathlib import Path
from typing import Any

from werkzeug.serving import make_server

from cluster.local import LocalCluster as Cluster
from cluster.local import free_port_base, pygmy, start_cluster

__all__ = ["MUTATIONS", "Cluster", "StandIn", "cluster_env", "free_port_base", "pygmy", "start_cluster"]

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
