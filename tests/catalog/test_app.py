"""The catalog's subscribe channel on real processes: a frontend worker subscribes as its own frontend."""

from __future__ import annotations

from harness import Cluster, wait_for

from pygmy.replication.transport import RAFT_PORT_OFFSET, SUBSCRIBE_CHANNEL, FrameClient
from pygmy.verify.chaos import leader_of


def test_a_worker_may_subscribe_only_as_its_own_frontend(fresh_cluster: Cluster) -> None:
    """The subscription id names the frontend whose worker asks (its hello's name, which a
    certificate must name under TLS): another frontend's worker subscribing under that id would
    take over the entry, and the pushes, of a worker still serving its cache under its lease."""
    cluster = fresh_cluster  # its own: the subscription made here names a listener nobody runs
    config = cluster.cluster_config()
    leader = str(wait_for("a catalog leader", lambda: leader_of(config, "catalog")))
    port = int(config.peers("catalog")[leader].rsplit(":", 1)[1]) + RAFT_PORT_OFFSET
    body = {"id": "frontend-1/1/abcdef", "url": "tcp://127.0.0.1:9", "rtt": 0.001}
    other = FrameClient(("127.0.0.1", port), cluster.secret(), "frontend-2/1", SUBSCRIBE_CHANNEL, 2.0)
    try:
        reply = other.call(body, 5.0)
    finally:
        other.close()
    assert reply["status"] == 403 and "may not subscribe as frontend-1" in reply["body"]["error"]["message"], reply
    own = FrameClient(("127.0.0.1", port), cluster.secret(), "frontend-1/1", SUBSCRIBE_CHANNEL, 2.0)
    try:
        assert own.call(body, 5.0)["status"] == 200
    finally:
        own.close()
