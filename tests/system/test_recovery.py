"""Guarantee 6 (docs/replication.md): a restarted replica catches up on what it missed — only that,
unless its log is gone — and serves no read from before it caught up."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import requests
from harness import Cluster, free_port_base
from test_faults import leader, wait_converged

from pygmy.catalog.books import synthetic


def follower_of(c: Cluster, tier: str) -> str:
    lead = leader(c, tier)
    return next(f"{tier}-{k}" for k in (1, 2, 3) if f"{tier}-{k}" != lead)


def write_while_down(c: Cluster, victim: str, writes: int) -> None:
    c.kill(victim)
    with c.client() as client:
        for i in range(writes):
            client.update(1 + i % 7, cost=float(10 + i))
    st = requests.get(c.url + "/status", timeout=5).json()["catalog"]["replicas"]
    assert not next(r for r in st if r["name"] == victim)["alive"]


def costs_after(writes: int) -> dict[int, float]:
    """The cost of each book after ``write_while_down(.., writes)``: its last update wins."""
    return {1 + i % 7: float(10 + i) for i in range(writes)}


def read_while_recovering(c: Cluster, victim: str, expected: dict[int, float], timeout: float = 30) -> int:
    """7.6: read the restarted replica directly until it has caught up. It may refuse (503) or not be
    up yet, but every answer it gives is the latest value. Returns how many answers it gave: reading
    goes on past the catch-up until it has answered, since a replica may catch up before its first
    answer (in milliseconds, for a short gap), and a check that saw no answer would prove nothing."""
    auth = {"Authorization": f"Bearer {c.secret()}"}
    answered = 0
    deadline = time.monotonic() + timeout
    while True:
        for item, cost in expected.items():
            try:
                r = requests.get(f"{c.replica_url(victim)}/books/{item}", headers=auth, timeout=5)
            except requests.RequestException:
                continue
            assert r.status_code in (200, 503), r.text
            if r.status_code == 200:
                answered += 1
                assert r.json()["cost"] == cost, f"{victim} answered book {item} from before it caught up"
        st = requests.get(c.url + "/status", timeout=5).json()["catalog"]["replicas"]
        if answered and len({r["applied_index"] for r in st}) == 1 and all(r["alive"] for r in st):
            return answered
        assert time.monotonic() < deadline, f"{victim} did not catch up"


def snapshot_lines(c: Cluster, name: str) -> list[str]:
    return [ln for ln in (c.data_dir / "logs" / f"{name}.log").read_text().splitlines()
            if "installed a snapshot" in ln]


@pytest.fixture
def small_log_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # Keep only 60 applied entries (compacting in steps of 20) so the snapshot path is reachable fast.
    monkeypatch.setenv("PYGMY_RAFT_KEEP_ENTRIES", "60")
    monkeypatch.setenv("PYGMY_RAFT_COMPACT_SLACK", "20")
    c = Cluster(tmp_path / "d", free_port_base(), []).start(reset=True)
    yield c
    c.stop()


def test_catch_up_from_the_log_then_by_snapshot_then_from_nothing(small_log_cluster: Cluster) -> None:
    c = small_log_cluster
    # 1. Missed fewer entries than the leader keeps: the log path, no snapshot.
    victim = follower_of(c, "catalog")
    write_while_down(c, victim, 30)
    c.restart(victim)
    assert read_while_recovering(c, victim, costs_after(30)) > 0
    st = wait_converged(c)
    assert len({r["state_digest"] for r in st["catalog"]["replicas"]}) == 1
    assert snapshot_lines(c, victim) == []

    # 2. Missed more than the leader keeps: only then a snapshot.
    victim = follower_of(c, "catalog")
    write_while_down(c, victim, 150)
    c.restart(victim)
    read_while_recovering(c, victim, costs_after(150))
    st = wait_converged(c)
    assert len({r["state_digest"] for r in st["catalog"]["replicas"]}) == 1
    assert snapshot_lines(c, victim), "a follower behind the compacted log must be sent a snapshot"

    # 3. A replica whose whole data directory is gone is rebuilt from its peers.
    victim = follower_of(c, "catalog")
    c.kill(victim)
    shutil.rmtree(c.data_dir / victim)
    with c.client() as client:
        client.update(3, stock_delta=5)
    c.restart(victim)
    st = wait_converged(c)
    assert len({r["state_digest"] for r in st["catalog"]["replicas"]}) == 1
    with c.client() as client:
        assert client.lookup(3)["stock"] == 1005


def test_a_new_replica_of_a_big_catalogue_copies_the_built_one_and_reads_no_file(tmp_path: Path) -> None:
    """``pygmy up --books`` builds the catalogue once; a replica started from nothing copies it. With
    the JSON file gone, a replica that parsed it would not start: this one starts, catches up and
    agrees with its peers."""
    books = tmp_path / "books.json"
    books.write_text(json.dumps(synthetic(300, topics=5)))
    c = Cluster(tmp_path / "d", free_port_base(), ["--books", str(books)]).start(reset=True)
    try:
        assert (c.data_dir / "seed" / "catalog.db").exists()
        victim = follower_of(c, "catalog")
        c.kill(victim)
        shutil.rmtree(c.data_dir / victim)
        books.unlink()
        with c.client() as client:
            client.update(250, stock_delta=5)
        c.restart(victim)
        st = wait_converged(c)
        assert len({r["state_digest"] for r in st["catalog"]["replicas"]}) == 1
        auth = {"Authorization": f"Bearer {c.secret()}"}
        got = requests.get(f"{c.replica_url(victim)}/books/250", headers=auth, timeout=5).json()
        assert got["stock"] == 1005 and got["title"] == "Synthetic book 250"
    finally:
        c.stop()
