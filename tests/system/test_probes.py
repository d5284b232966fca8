"""``/livez`` and ``/readyz`` on real processes (#39): every service is live and ready on a working
cluster; with two catalog replicas killed the catalog tier has no leader, and then the frontend and
the last catalog replica stay live while neither is ready (a liveness probe must not restart them
while their tier fails over); the killed replicas restarted, every service is ready again. (That a
replica still catching up is not ready is `tests/replication/test_node_probes.py`'s.)"""

from __future__ import annotations

import requests
from harness import Cluster, wait_for

from pygmy.verify.chaos import leader_of


def code(url: str) -> int:
    try:
        return requests.get(url, timeout=3).status_code
    except requests.RequestException:
        return 0


def replicas(c: Cluster) -> list[str]:
    cfg = c.cluster_config()
    return [*cfg.peers("catalog"), *cfg.peers("order")]


def all_ready(c: Cluster) -> bool:
    return code(f"{c.url}/readyz") == 200 and all(code(c.replica_url(n) + "/readyz") == 200 for n in replicas(c))


def test_live_while_the_catalog_elects_ready_only_with_leaders(fresh_cluster: Cluster) -> None:
    c = fresh_cluster
    wait_for("every service ready", lambda: all_ready(c), 30)
    body = requests.get(f"{c.url}/readyz", timeout=3).json()
    assert body["status"] == "ready" and set(body["leaders"]) == {"catalog", "order"}
    assert all(code(c.replica_url(n) + "/livez") == 200 for n in replicas(c)) and code(f"{c.url}/livez") == 200

    cfg = c.cluster_config()
    leader = str(wait_for("a catalog leader", lambda: leader_of(cfg, "catalog")))
    survivor = next(n for n in cfg.peers("catalog") if n != leader)
    gone = [n for n in cfg.peers("catalog") if n != survivor]
    for name in gone:
        c.kill(name)
    # No catalog leader: neither the frontend nor the survivor is ready; both are live throughout.
    wait_for("the frontend not ready", lambda: code(f"{c.url}/readyz") == 503, 15)
    wait_for(f"{survivor} not ready", lambda: code(c.replica_url(survivor) + "/readyz") == 503, 15)
    answer = requests.get(f"{c.url}/readyz", timeout=3).json()
    assert answer["error"]["leaders"]["catalog"] is None and "catalog" in answer["error"]["message"], answer
    for _ in range(10):
        assert code(f"{c.url}/livez") == 200
        assert code(c.replica_url(survivor) + "/livez") == 200
        assert code(c.replica_url(survivor) + "/readyz") == 503
    # The order tier is untouched: its replicas stay ready.
    assert all(code(c.replica_url(n) + "/readyz") == 200 for n in cfg.peers("order"))

    for name in gone:
        c.restart(name)
    wait_for("every service ready again", lambda: all_ready(c), 60)
