"""Replicas replaced online with ``pygmy member``, on real processes, under load (#37).

Clients buy, update and read through the frontend the whole time (the nemesis run's workload,
every operation recorded for Porcupine). Then, one tier after the other:

- catalog-3 is SIGKILLed for good; ``pygmy member add catalog catalog-4 URL`` (at an address and
  port of its own, a "new host" on loopback), ``pygmy start catalog-4``, wait until ``pygmy member
  list`` says it has caught up as a learner, ``promote``, ``remove catalog-3``; the same for the
  order tier (order-3 -> order-4);
- the catalog leader is SIGKILLed for good and replaced the same way (catalog-5);
- the order leader, alive, is replaced: a new replica is added and promoted, then ``pygmy member
  remove`` of the leader makes it hand leadership over before it is removed, and it is stopped.

Everything is judged from outside by ``pygmy.verify.chaos_check``, as the fault tests are: every
acknowledged buy is an order on every order replica, none doubled, stock adds up book by book on
every catalog replica, the replicas of a tier (the current members) agree on one applied index and
one state digest (recomputed from their rows), and Porcupine finds every book linearizable. The
frontend learns the members without a restart. Refused changes change nothing.
"""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from harness import BackgroundLoad, Cluster, free_port_base, pygmy, wait_for

from pygmy.cluster import local
from pygmy.replication.transport import RAFT_PORT_OFFSET
from pygmy.verify import chaos_check
from pygmy.verify.chaos import final_state, leader_of

ITEMS = list(range(1, 8))






def free_address(host: str) -> str:
    """``http://host:P`` with P and its peer port (P + 50) free on ``host``, from this test
    worker's share of the ports (``PYGMY_PORT_SLICE``)."""
    low, high = local._port_slice()
    for _ in range(200):
        port = random.randrange(low, high - RAFT_PORT_OFFSET)
        ok = True
        for p in (port, port + RAFT_PORT_OFFSET):
            with socket.socket() as s:
                try:
                    s.bind((host, p))
                except OSError:
                    ok = False
                    break
        if ok:
            return f"http://{host}:{port}"
    raise RuntimeError(f"no free port pair on {host}")


class Operator:
    """What an operator types, on the cluster ``c``: ``pygmy member ...`` and ``pygmy start``."""

    def __init__(self, c: Cluster) -> None:
        self.c = c

    def member(self, *args: str, ok: bool = True) -> str:
        r = pygmy("member", *args, "--data-dir", str(self.c.data_dir), env=self.c.env, timeout=120)
        assert (r.returncode == 0) == ok, f"pygmy member {' '.join(args)}: {r.returncode}\n{r.stdout}{r.stderr}"
        return r.stdout + r.stderr

    def members(self, tier: str) -> dict[str, Any]:
        return json.loads(self.member("list", tier, "--json"))

    def roles(self, tier: str) -> dict[str, str]:
        return {m["name"]: m["role"] for m in self.members(tier)["members"]}

    def replace(self, tier: str, old: str, new: str, host: str, kill_first: bool = True) -> None:
        """``old`` out, ``new`` in: add it as a learner, start it, promote it once caught up,
        remove ``old`` (SIGKILLed first, for good, or, alive, stopped once removed)."""
        if kill_first:
            self.c.kill(old)
        url = free_address(host)
        self.member("add", tier, new, url)
        self.c.restart(new)  # pygmy start: the first start of a replica cluster.json now names
        wait_for(f"{new} caught up as a learner",
                 lambda: {m["name"]: m for m in self.members(tier)["members"]}[new]["caught_up"])
        assert self.roles(tier)[new] == "learner"
        self.member("promote", tier, new, "--wait", "60")
        self.member("remove", tier, old, "--wait", "30")
        if not kill_first:
            self.c.kill(old)
        roles = self.roles(tier)
        assert old not in roles and roles[new] == "voter" and len(roles) == 3, roles


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path / "d", free_port_base(), [])
    c.start(reset=True)
    yield c
    c.stop()


def frontend_sees(c: Cluster, tier: str, names: set[str]) -> bool:
    try:
        st = requests.get(f"{c.url}/status", timeout=3).json()
    except (requests.RequestException, ValueError):
        return False
    return {r["name"] for r in st[tier]["replicas"]} == names and st[tier]["leader"] in names


def test_replicas_and_leaders_are_replaced_online_under_load(cluster: Cluster, tmp_path: Path) -> None:
    c, op = cluster, Operator(cluster)
    # Refused changes change nothing, and say why.
    before = op.members("catalog")
    assert "already a member" in op.member("add", "catalog", "catalog-2", "http://127.0.0.9:9999", ok=False)
    assert "not a catalog replica" in op.member("add", "catalog", "order-4", "http://127.0.0.9:9999", ok=False)
    assert "not a member" in op.member("promote", "catalog", "catalog-9", ok=False)
    assert "voter already" in op.member("promote", "catalog", "catalog-1", ok=False)
    op.member("add", "catalog", "catalog-9", "http://127.0.0.9:9999")  # never started: it lags
    assert "not caught up" in op.member("promote", "catalog", "catalog-9", ok=False)
    op.member("remove", "catalog", "catalog-9")
    after = op.members("catalog")
    assert [(m["name"], m["role"], m["url"]) for m in after["members"]] == \
        [(m["name"], m["role"], m["url"]) for m in before["members"]]

    load = BackgroundLoad([c.url], c.admin_token(), ITEMS, writers=2, readers=2, buyers=2, searchers=0, order_readers=1)
    windows: list[dict[str, Any]] = []
    load.start()
    try:
        load.buys_acked(5)
        steps = [("catalog", "catalog-3", "catalog-4", "127.0.0.2", True),
                 ("order", "order-3", "order-4", "127.0.0.3", True),
                 ("catalog", None, "catalog-5", "127.0.0.4", True),   # its leader, lost for good
                 ("order", None, "order-5", "127.0.0.5", False)]      # its leader, alive: handed over
        expected = {"catalog": {"catalog-1", "catalog-2", "catalog-3"}, "order": {"order-1", "order-2", "order-3"}}
        for tier, old, new, host, kill_first in steps:
            old = old or str(wait_for(f"a {tier} leader", lambda tier=tier: leader_of(c.cluster_config(), tier)))
            start = time.monotonic_ns()
            op.replace(tier, old, new, host, kill_first)
            windows.append({"kind": f"replace-{tier}", "detail": f"{old} -> {new}", "start": start,
                            "end": time.monotonic_ns()})
            expected[tier] = expected[tier] - {old} | {new}
            load.buys_acked(3)
        members = {t: set(c.cluster_config().peers(t)) for t in ("catalog", "order")}
        assert members == expected
        for tier in ("catalog", "order"):  # the frontend learnt them, without a restart
            wait_for(f"the frontend routing to {sorted(members[tier])}",
                     lambda tier=tier: frontend_sees(c, tier, members[tier]), 30)
        load.buys_acked(3)
    finally:
        history = load.finish()

    run = tmp_path / "run"
    run.mkdir()
    history.save(run / "history.json")
    (run / "nemesis.json").write_text(json.dumps({"windows": windows, "errors": []}))
    max_order = max((n for n, _ in load.acked), default=0)
    final = final_state(c.cluster_config(), c.secret(), ITEMS, max_order)
    (run / "final.json").write_text(json.dumps(final))
    result = chaos_check.check(run, timeout=120)
    print(chaos_check.summary(result))
    assert result["ok"], chaos_check.summary(result)
    assert {n for n in final["replicas"]} == members["catalog"] | members["order"]
    assert load.errors == [], load.errors[:5]
    counts = result["by_outcome"]
    assert counts.get("buy/ok", 0) >= 20 and counts.get("update/ok", 0) >= 10, counts
