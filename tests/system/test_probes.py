"""``/livez`` and ``/readyz`` on real processes (#39): every service is live and ready on a working
cluster; with two catalog replicas killed the catalog tier has no leader, and then the frontend and
the last catalog replica stay live while neither is ready (a liveness probe must not restart them
while their tier fails over); the killed replicas restarted, every service is ready again. A
replica installing a snapshot longer than a turn may take is live, and not ready, throughout.
(That a replica still catching up is not ready is `tests/replication/test_node_probes.py`'s.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import requests
from harness import Cluster, cluster_env, free_port_base, wait_for

from pygmy.verify.chaos import leader_of


def code(url: str, timeout: float = 3) -> int:
    try:
        return requests.get(url, timeout=timeout).status_code
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


def test_a_replica_installing_a_long_snapshot_is_live_and_not_ready(tmp_path: Path) -> None:
    """A catalog follower comes back past what its leader keeps and installs a snapshot that takes
    4 s (a hook: as a large state's copy and sync would), twice the 2 s within which a live replica
    takes a turn: a liveness probe restarting it then would only begin the install again. Each
    ``/livez`` answers 200 within a kubelet's default timeout (before: after 2 s, the turn it waited
    for in vain)."""
    flag = tmp_path / "slow-install"
    env = cluster_env(PYGMY_TEST_SLOW_INSTALL=str(flag), PYGMY_RAFT_KEEP_ENTRIES="10", PYGMY_RAFT_COMPACT_SLACK="5")
    c = Cluster(tmp_path / "d", free_port_base(), [], env).start(reset=True)
    try:
        cfg = c.cluster_config()
        leader = str(wait_for("a catalog leader", lambda: leader_of(cfg, "catalog")))
        victim = next(n for n in cfg.peers("catalog") if n != leader)
        c.kill(victim)
        auth = {"Authorization": f"Bearer {c.admin_token()}"}
        for _ in range(30):  # past what the leader keeps: only a snapshot brings it back
            r = requests.post(f"{c.url}/update/1", json={"stock_delta": 1}, headers=auth, timeout=10)
            assert r.status_code == 200, r.text
        flag.write_text("catalog 4")
        restored = Path(f"{flag}.restored")
        restarted = threading.Thread(target=c.restart, args=(victim,))
        restarted.start()
        during: list[tuple[int, int]] = []  # (livez, readyz) between the install's start and its copy
        deadline = time.monotonic() + 60
        while not restored.exists():
            assert time.monotonic() < deadline, f"{victim} never restored: {during[-5:]}"
            if not flag.exists():  # taken: the install is under way
                # Within a kubelet's default probe timeout, 1 s (a probe that times out fails).
                looks = (code(c.replica_url(victim) + "/livez", 1.0), code(c.replica_url(victim) + "/readyz", 1.0))
                if not restored.exists():
                    during.append(looks)
            time.sleep(0.05)
        restarted.join(60)
        assert len(during) >= 5, f"too few looks during the install: {during}"
        assert all(live == 200 for live, _ in during), f"not live while installing: {during}"
        assert all(ready == 503 for _, ready in during), f"ready while installing: {during}"
        wait_for(f"{victim} ready", lambda: code(c.replica_url(victim) + "/readyz") == 200, 30)
        assert c.client().lookup(1)["stock"] >= 30
    finally:
        c.stop()
