"""A replica whose disk fills degrades and recovers by itself (#16), on real processes.

Each replica's data dir is its own small tmpfs, mounted by this test (root only) and unmounted at
the end. Filling one to the last byte, under load: the replica reports ``disk full``, fails its
health check and serves no reads; a full leader is replaced; writes go on; freeing the space brings
it back to its peers' state with no restart. Every SQLite file passes ``PRAGMA integrity_check``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from harness import Cluster, free_port_base
from test_faults import (
    Load,
    assert_only_failover_errors,
    check_invariants,
    leader,
    run_faulty_load,
    wait_acked,
)

from pygmy.verify import nemesis
from pygmy.verify.nemesis import fill
from pygmy.verify.own_orders import own_order_reads

NAMES = [f"{tier}-{k}" for tier in ("catalog", "order") for k in (1, 2, 3)]
#: How long a disk stays full once the replica has noticed (the issue's runs used 10 s).
FULL_FOR = 2.0


def wait_for(cond: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if cond():
                return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


#: Full disks are what these tests inject: replicas count storage faults and log them, nothing else.
pytestmark = pytest.mark.allow_faults("storage", logs=[r"disk full: database or disk is full"])


@pytest.fixture
def tmpfs_cluster(tmp_path: Path) -> Iterator[Cluster]:
    data = tmp_path / "d"
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(nemesis.tmpfs_disks([data / name for name in NAMES]))
        except RuntimeError as exc:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {exc}")
        c = Cluster(data, free_port_base(), ["--frontends", "2", "--frontend-workers", "2"]).start(reset=True)
        try:
            yield c
        finally:
            c.stop()
        verdicts = nemesis.integrity({name: data / name for name in NAMES})  # every database whole
        assert len(verdicts) == 2 * len(NAMES) and set(verdicts.values()) == {"ok"}, verdicts


def test_full_disks_on_leaders_and_followers_degrade_and_recover(tmpfs_cluster: Cluster) -> None:
    c = tmpfs_cluster
    load = Load()

    def status(name: str) -> dict:
        return c.replica_get(name, "/status").json()

    def phase(tier: str, role: str) -> None:
        lead = leader(c, tier)
        name = lead if role == "leader" else next(n for n in NAMES if n.startswith(tier) and n != lead)
        fill(c.data_dir / name)
        filled = time.monotonic()
        wait_for(lambda: (status(name)["error"] or "").startswith("disk full"), 30, f"{name} reports disk full")
        noticed = time.monotonic()
        seen: list[str] = []  # the role in every sample while the disk stays full: never flapping back

        def failed() -> bool:
            s = status(name)
            seen.append(s["role"] if (s["error"] or "").startswith("disk full") else f"{s['role']} ({s['error']})")
            return s["role"] == "failed"

        assert failed()
        assert c.replica_get(name, "/health").status_code == 503
        # Failed: not ready, but live (it retries by itself; a restart would not give space back).
        assert c.replica_get(name, "/readyz").status_code == 503
        assert c.replica_get(name, "/livez").status_code == 200
        read = "/books/1" if tier == "catalog" else "/orders/1"
        assert c.replica_get(name, read).status_code == 503, "a full replica must serve no reads"
        if role == "leader":
            wait_for(lambda: leader(c, tier, timeout=1) != name, 30, f"a new {tier} leader")
        replaced = time.monotonic()
        acked = len(load.acked)
        wait_for(lambda: failed() and len(load.acked) >= acked + 5, 15, f"writes go on with {name} full")
        until = time.monotonic() + FULL_FOR
        while time.monotonic() < until:
            failed()
            time.sleep(0.05)
        assert set(seen) == {"failed"}, f"{name} stopped reporting its full disk while it was full: {seen}"
        (c.data_dir / name / "filler").unlink()
        freed = time.monotonic()
        wait_for(lambda: status(name)["error"] is None and status(name)["role"] in ("leader", "follower")
                 and status(name)["applied_index"] >= status(leader(c, tier))["applied_index"] - 5,
                 30, f"{name} recovers by itself")
        # Figures for the record (pytest -s shows them); no test asserts a timing.
        print(f"{tier} {role} {name}: full noticed {noticed - filled:.2f} s after the fill; "
              f"{'new leader' if role == 'leader' else 'checked'} {replaced - noticed:.2f} s later; "
              f"recovered {time.monotonic() - freed:.2f} s after space returned")

    def faults() -> None:
        wait_acked(load)  # load before the first fault
        for tier in ("catalog", "order"):
            for role in ("leader", "follower"):
                with load.fault(f"{tier} {role}'s disk full"):  # from the fill until it has recovered
                    phase(tier, role)
                    wait_acked(load)
        wait_acked(load)  # and after

    run_faulty_load(c, faults, load)
    # Lookups never fail; a buy may be refused with 503 and Retry-After while a full leader is
    # replaced, nothing else (no timeout, no cut connection, no other error).
    assert_only_failover_errors(load, buys=50, reads=50)
    check_invariants(c, load)  # nothing acknowledged lost, no oversell, equal digests
    for name in NAMES:
        assert os.path.ismount(c.data_dir / name)


def test_a_buyer_reads_their_own_order_with_and_without_a_full_follower(tmpfs_cluster: Cluster) -> None:
    """GET /orders/N right after the buy that returned N: always 200, through every frontend and
    worker, also while an order follower's disk is full (its reads would be behind)."""
    c = tmpfs_cluster
    urls = [c.url, f"http://127.0.0.1:{c.port_base + 1}"]
    assert own_order_reads(urls, 100) == []
    lead = leader(c, "order")
    follower = next(n for n in NAMES if n.startswith("order") and n != lead)
    fill(c.data_dir / follower)
    try:
        own_order_reads(urls, 20)  # writes make the full follower notice
        wait_for(lambda: (c.replica_get(follower, "/status").json()["error"] or "").startswith("disk full"),
                 30, f"{follower} reports disk full")
        assert own_order_reads(urls, 100) == []
    finally:
        (c.data_dir / follower / "filler").unlink()
