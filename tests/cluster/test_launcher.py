"""``pygmy up`` / ``kill`` / ``start`` as a user runs them, and durability across whole-cluster restarts."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import requests
from harness import Cluster, free_port_base, pygmy

from client.api import PygmyError


def groups(data_dir: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in (data_dir / "run").glob("*.pid")}


def alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_writes_run_files_and_stops_everything(tmp_path: Path) -> None:
    c = Cluster(tmp_path / "d", free_port_base(), ["--frontend-workers", "2"]).start(reset=True)
    try:
        names = {f"{t}-{k}" for t in ("catalog", "order") for k in (1, 2, 3)} | {"frontend-1"}
        pids = groups(c.data_dir)
        assert set(pids) == names
        assert all(alive(p) for p in pids.values())
        assert c.config()["port_base"] == c.port_base
        assert {p.stem for p in (c.data_dir / "logs").glob("*.log")} == names
        assert (c.data_dir / "secret").stat().st_mode & 0o077 == 0
    finally:
        c.stop()
    assert c.proc is not None and c.proc.returncode == 0
    assert not any(alive(p) for p in pids.values()), "pygmy up left services running"
    assert groups(c.data_dir) == {}


def test_kill_and_start_one_service(fresh_cluster: Cluster) -> None:
    c = fresh_cluster
    pid = groups(c.data_dir)["order-2"]
    c.kill("order-2")
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)
    with pytest.raises(requests.RequestException):
        requests.get(c.replica_url("order-2") + "/health", timeout=1)
    r = pygmy("kill", "order-2", "--data-dir", str(c.data_dir))
    assert r.returncode != 0 and "not running" in r.stderr
    c.restart("order-2")
    assert requests.get(c.replica_url("order-2") + "/health", timeout=2).status_code == 200
    assert groups(c.data_dir)["order-2"] != pid
    r = pygmy("start", "order-2", "--data-dir", str(c.data_dir))
    assert r.returncode != 0 and "already running" in r.stderr
    r = pygmy("kill", "nonsense-9", "--data-dir", str(c.data_dir))
    assert r.returncode != 0 and "unknown service name" in r.stderr
    with c.client() as client:
        assert client.buy(1)["item_number"] == 1


def snapshot(c: Cluster, orders: list[int]) -> tuple[list[int], list[dict]]:
    with c.client() as client:
        stock = [client.lookup(i)["stock"] for i in range(1, 8)]
        return stock, [client.order(n) for n in orders]


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_whole_cluster_restart_loses_nothing(tmp_path: Path, how: str) -> None:
    c = Cluster(tmp_path / "d", free_port_base(), []).start(reset=True)
    try:
        with c.client() as client:
            orders = [client.buy(1 + i % 7, quantity=1 + i % 3)["order_number"] for i in range(12)]
            client.update(2, stock_delta=7, cost=99.0)
        before = snapshot(c, orders)
        if how == "sigkill":
            c.crash()
        else:
            c.stop()
        c.start(reset=False)
        assert snapshot(c, orders) == before
        with c.client() as client:
            assert client.lookup(2)["cost"] == 99.0
            assert client.buy(3)["order_number"] > max(orders)
    finally:
        c.stop()


def test_reset_starts_empty(tmp_path: Path) -> None:
    c = Cluster(tmp_path / "d", free_port_base(), []).start(reset=True)
    try:
        with c.client() as client:
            n = client.buy(1)["order_number"]
        c.stop()
        c.start(reset=True)
        with c.client() as client, pytest.raises(PygmyError) as e:
            client.order(n)
        assert e.value.status == 404
    finally:
        c.stop()


def test_up_refuses_busy_ports(tmp_path: Path, cluster: Cluster) -> None:
    r = pygmy("up", "--port-base", str(cluster.port_base), "--data-dir", str(tmp_path / "other"), timeout=30)
    assert r.returncode != 0 and "in use" in r.stderr
