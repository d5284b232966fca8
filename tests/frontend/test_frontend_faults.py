"""A paused or dead frontend never blocks writes, and a paused one never serves what it cached before
a write that happened while it slept: its workers' leases lapse, the catalog leader revokes them,
and on waking they drop their caches before answering again."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from harness import Cluster, free_port_base

from pygmy.cluster import launcher

ITEM = 3


@pytest.fixture
def two_frontends(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path / "d", free_port_base(), ["--frontends", "2", "--frontend-workers", "2"]).start(reset=True)
    yield c
    c.stop()


def lookups(url: str, n: int = 12) -> list[tuple[float, str]]:
    """``n`` lookups on fresh connections (so both workers answer): (cost, X-Cache)."""
    out = []
    for _ in range(n):
        r = requests.get(f"{url}/lookup/{ITEM}", headers={"Connection": "close"}, timeout=10)
        assert r.status_code == 200, r.text
        out.append((r.json()["cost"], r.headers.get("X-Cache", "?")))
    return out


def update(c: Cluster, cost: float) -> None:
    r = requests.post(f"{c.url}/update/{ITEM}", json={"cost": cost}, timeout=30,
                      headers={"Authorization": f"Bearer {c.admin_token()}"})
    assert r.status_code == 200, r.text


def test_a_paused_then_a_dead_frontend_blocks_no_write_and_serves_nothing_stale(two_frontends: Cluster) -> None:
    c = two_frontends
    second = c.cluster_config().frontend_url(2)
    pgid = int((c.data_dir / "run" / "frontend-2.pid").read_text())
    update(c, 41.0)
    assert {cost for cost, _ in lookups(second)} == {41.0}
    assert any(hit == "hit" for _, hit in lookups(second)), "frontend-2 must have the book cached"

    try:
        launcher.pause(pgid)  # its workers hold leases and cached values, and cannot answer
        update(c, 42.0)  # acknowledged: the leader waits out their leases instead of them
        assert {cost for cost, _ in lookups(c.url)} == {42.0}
    finally:
        os.killpg(pgid, signal.SIGCONT)
    assert {cost for cost, _ in lookups(second, 20)} == {42.0}, "a woken frontend served a value from before"

    c.kill("frontend-2")  # dead: no process left to answer a push
    update(c, 43.0)
    assert {cost for cost, _ in lookups(c.url)} == {43.0}
    c.restart("frontend-2")
    deadline = time.monotonic() + 30
    while True:
        try:
            assert {cost for cost, _ in lookups(second)} == {43.0}
            break
        except requests.RequestException:
            assert time.monotonic() < deadline, "frontend-2 did not come back"
            time.sleep(0.2)
