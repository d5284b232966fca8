"""Test-side names for the local cluster driver (``cluster.local``), and the test-only hooks."""

import os
from pathlib import Path

from cluster.local import LocalCluster as Cluster
from cluster.local import free_port_base, pygmy, start_cluster

__all__ = ["MUTATIONS", "Cluster", "cluster_env", "free_port_base", "pygmy", "start_cluster"]

#: Test-only faults and mutations (``tests/mutations/sitecustomize.py``), for the processes of a cluster.
MUTATIONS = Path(__file__).resolve().parent / "mutations"


def cluster_env(**extra: str) -> dict[str, str]:
    """Environment that loads the test-only hooks into every service process."""
    path = os.pathsep.join(p for p in (str(MUTATIONS), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **extra}
