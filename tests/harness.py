"""Test-side names for the local cluster driver (``cluster.local``)."""

from cluster.local import LocalCluster as Cluster
from cluster.local import free_port_base, pygmy, start_cluster

__all__ = ["Cluster", "free_port_base", "pygmy", "start_cluster"]
