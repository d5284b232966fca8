"""Replicas replaced online with ``pygmy member``, on real processes, under load (#37).

Clients buy, update and read through the frontend the whole time (the nemesis run's workload,
every operation recorded for Porcupine). Then, one tier after the other, on one cluster:

- catalog-3 is SIGKILLed for good; ``pygmy member add catalog catalog-4 URL`` (at an address and
  port of its own, a "new host" on loopback), ``pygmy start catalog-4``, wait until ``pygmy member
  list`` says it has caught up as a learner, ``promote``, ``remove catalog-3``
  (``pygmy.verify.hosts.replace``, as the nemesis' ``host-lost`` does it on hosts of their own); the
  same for the order tier (order-3 -> order-4);
and on another:

- the catalog leader is SIGKILLed for good and replaced the same way (catalog-4);
- the order leader, alive, is replaced: a new replica is added and promoted, then killed while the
  tier is idle (buys paused): every voter holds the whole log, so the new one, whose name is the
  greatest, is the one a hand-over by log and name would pick. ``pygmy member remove`` of the
  leader makes it hand leadership over, to a live voter, before it is removed; it is stopped and
  the new replica started again.

On a third, catalog-3 is replaced under its own name at a new address: removed, stopped, its disk
wiped, added again at the new URL, started, promoted.

Everything is judged from outside by ``pygmy.verify.chaos_check``, as the fault tests are: every
acknowledged buy is an order on every order replica, none doubled, stock adds up book by book on
every catalog replica, the replicas of a tier (the current members) agree on one applied index and
one state digest (recomputed from their rows), and Porcupine finds every book linearizable. The
frontend learns the members without a restart. Refused changes change nothing.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from harness import BackgroundLoad, Cluster, cluster_env, free_port_base, judge_from_outside, wait_for

from pygmy.cluster import launcher
from pygmy.order.app import ORPHAN_AGE, SCAN_EVERY
from pygmy.verify import hosts
from pygmy.verify.chaos import leader_of

ITEMS = list(range(1, 8))


def replace(c: Cluster, op: hosts.Operator, load: BackgroundLoad, tier: str, old: str, new: str, host: str,
            kill_first: bool) -> str:
    """``old`` out, ``new`` in (``pygmy.verify.hosts.replace``: add, start, promote once caught up,
    remove), ``old`` SIGKILLed first, for good, or, alive, stopped once removed (the leader then,
    whichever it is by the removal); the name of the one replaced."""
    if kill_first:
        c.kill(old)
        hosts.replace(op, tier, old, new, hosts.free_address(host), c.restart)
    else:
        old = hand_over_past_a_dead_voter(c, op, load, tier, old, new, host)
    roles = op.roles(tier)
    assert old not in roles and roles[new] == "voter" and len(roles) == 3, roles
    return old


def hand_over_past_a_dead_voter(c: Cluster, op: hosts.Operator, load: BackgroundLoad, tier: str, old: str, new: str,
                                host: str) -> str:
    """The leader replaced by ``new``, with a hand-over that must pass over a dead voter: ``new``
    added, caught up and promoted, then SIGKILLed once every voter holds the whole log (buys
    paused), and the leader removed a few election windows later. A leader that handed over by log
    and name alone would tell the dead ``new`` to campaign, and the tier would wait out an election
    timeout for nothing (``RaftCore.handover_target``). Then the removed leader is stopped and
    ``new`` started again, a voter of three. Returns the removed leader's name (``old``, unless an
    election moved leadership meanwhile)."""
    op.change("add", tier, new, hosts.free_address(host))
    c.restart(new)
    caught_up = lambda: any(m["name"] == new and m["caught_up"] for m in op.members(tier)["members"])  # noqa: E731
    hosts.wait_until(f"{new} caught up as a learner", caught_up, 60)
    op.change("promote", tier, new, "--wait", "60")
    load.buying.clear()
    try:
        for _attempt in range(3):
            # Idle: the buys under way answered, and the orphan scan's entry for their keys made (it
            # records what it read every SCAN_EVERY s, once a key is ORPHAN_AGE old); then nothing
            # appends, and every voter holds the same log.
            quiet, seen = ORPHAN_AGE + SCAN_EVERY + 1, {"index": -1, "since": 0.0}

            def idle(quiet: float = quiet, seen: dict = seen) -> bool:
                view = op.members(tier)
                if view["last_index"] != seen["index"]:
                    seen.update(index=view["last_index"], since=time.monotonic())
                return time.monotonic() - seen["since"] >= quiet and all(m["lag"] == 0 for m in view["members"])

            # Asked every 0.3 s: the quiet is counted from when a poll first saw the last index, so
            # at every 1 s it ran on up to 2 s past the quiet it needs, and no less is ever waited.
            hosts.wait_until(f"the {tier} tier idle, every voter holding the whole log", idle, 60)
            c.kill(new)
            lead = str(wait_for(f"a {tier} leader", lambda: leader_of(c.cluster_config(), tier)))
            time.sleep(3 * c.replica_get(lead, "/status").json()["timers"]["election_ms"] / 1000)
            # Still the whole log on the dead voter (an entry since, such as the key expiry's, would
            # leave it behind, and a hand-over by log alone would pass it over too: no test).
            view = op.members(tier)
            if view["leader"] == lead and view["last_index"] == seen["index"] and \
                    all(m["lag"] == 0 for m in view["members"]):
                break
            c.restart(new)
            hosts.wait_until(f"{new} back, caught up", caught_up, 60)
        else:
            raise AssertionError(f"the {tier} tier never stayed idle for the hand-over: {view}")
        old = lead
        left = op.change("remove", tier, old, "--wait", "60")
    finally:
        load.buying.set()
    assert set(left["voters"]) == set(c.cluster_config().peers(tier)) - {old} and new in left["voters"], left
    told = re.findall(r"handing leadership over to ([\w-]+)", (c.data_dir / "logs" / f"{old}.log").read_text())
    assert told and new not in told, f"{old} handed leadership over to {told}"
    c.kill(old)
    c.restart(new)
    hosts.wait_until(f"{new} back, caught up", caught_up, 60)
    return old


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


#: Two runs, each on a cluster of its own, so that pytest-xdist can run them side by side: followers
#: lost for good (and the refusals), then leaders (one lost for good, one alive, handed over).
STEPS = {
    "followers": [("catalog", "catalog-3", "catalog-4", "127.0.0.2", True),
                  ("order", "order-3", "order-4", "127.0.0.3", True)],
    "leaders": [("catalog", None, "catalog-4", "127.0.0.4", True),   # its leader, lost for good
                ("order", None, "order-4", "127.0.0.5", False)],     # its leader, alive: handed over
}


def refusals_change_nothing(op: hosts.Operator) -> None:
    """Refused changes change nothing, and say why."""
    before = op.members("catalog")
    assert "already a member" in op.member("add", "catalog", "catalog-2", "http://127.0.0.9:9999", ok=False)
    assert "not a catalog replica" in op.member("add", "catalog", "order-4", "http://127.0.0.9:9999", ok=False)
    assert "not a member" in op.member("promote", "catalog", "catalog-9", ok=False)
    assert "voter already" in op.member("promote", "catalog", "catalog-1", ok=False)
    assert "not a member" in op.member("lead", "catalog", "catalog-9", ok=False)
    assert "not a catalog replica" in op.member("lead", "catalog", "order-1", ok=False)
    op.member("add", "catalog", "catalog-9", "http://127.0.0.9:9999")  # never started: it lags
    assert "not caught up" in op.member("promote", "catalog", "catalog-9", ok=False)
    assert "not another voter" in op.member("lead", "catalog", "catalog-9", ok=False)  # a learner
    lead, term = before["leader"], before["term"]
    assert op.json("lead", "catalog", lead) == {"tier": "catalog", "leader": lead, "term": term}  # nothing to do
    op.member("remove", "catalog", "catalog-9")
    after = op.members("catalog")
    assert [(m["name"], m["role"], m["url"]) for m in after["members"]] == \
        [(m["name"], m["role"], m["url"]) for m in before["members"]]


@pytest.mark.parametrize("who", list(STEPS))
def test_replicas_and_leaders_are_replaced_online_under_load(cluster: Cluster, tmp_path: Path, who: str) -> None:
    c, op = cluster, hosts.Operator(cluster.data_dir, cluster.env)
    if who == "followers":
        refusals_change_nothing(op)
    load = BackgroundLoad([c.url], c.admin_token(), ITEMS, writers=2, readers=2, buyers=2, searchers=0, order_readers=1)
    windows: list[dict[str, Any]] = []
    load.start()
    try:
        load.buys_acked(5)
        expected = {"catalog": {"catalog-1", "catalog-2", "catalog-3"}, "order": {"order-1", "order-2", "order-3"}}
        for tier, old, new, host, kill_first in STEPS[who]:
            old = old or str(wait_for(f"a {tier} leader", lambda tier=tier: leader_of(c.cluster_config(), tier)))
            start = time.monotonic_ns()
            old = replace(c, op, load, tier, old, new, host, kill_first)
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
    judge(c, load, history, windows, tmp_path / "run", members)


def judge(c: Cluster, load: BackgroundLoad, history: Any, windows: list[dict[str, Any]], run: Path,
          members: dict[str, set[str]]) -> None:
    """From outside (``chaos_check``): every acknowledged buy an order on every order replica, none
    doubled, stock adding up on every catalog replica, one index and digest per tier, Porcupine."""
    result, final = judge_from_outside(c, run, history, windows, ITEMS)
    assert {n for n in final["replicas"]} == members["catalog"] | members["order"]
    assert load.errors == [], load.errors[:5]
    counts = result["by_outcome"]
    assert counts.get("buy/ok", 0) >= 10 and counts.get("update/ok", 0) >= 10, counts


def test_a_name_removed_and_added_again_elsewhere_is_reached_by_every_replica(cluster: Cluster, tmp_path: Path) -> None:
    """A catalog replica is lost for good and replaced under the same name at another address (a
    new machine that keeps the old one's name): removed, stopped, its disk wiped, added again at the
    new URL, started there. It catches up as a learner (the leader reaches it at the new address)
    and is promoted, and made leader (``pygmy member lead``); then another voter is removed, leaving
    catalog-3 and one more: every commit needs both, so that one reaches catalog-3 at its new
    address too. Before, every replica dialled the peers it started with at their first URLs for
    good: the learner was never reached.

    A learner, catalog-4, was down the whole time: its log still has catalog-3 at the old address
    and lacks the entries that moved it. Started again, it answers its leader where the leader's
    hello says it serves, catches up and is promoted. Before, it answered to the old address for good, and the
    leader, hearing nothing, never sent it what it lacked. Under load, judged from outside."""
    c, op = cluster, hosts.Operator(cluster.data_dir, cluster.env)
    name, behind = "catalog-3", "catalog-4"
    load = BackgroundLoad([c.url], c.admin_token(), ITEMS, writers=2, readers=2, buyers=2, searchers=0, order_readers=1)
    windows: list[dict[str, Any]] = []
    caught_up = lambda who: any(  # noqa: E731
        m["name"] == who and m["caught_up"] for m in op.members("catalog")["members"])
    load.start()
    try:
        load.buys_acked(5)
        start = time.monotonic_ns()
        op.change("add", "catalog", behind, hosts.free_address("127.0.0.8"))
        c.restart(behind)
        hosts.wait_until(f"{behind} caught up", lambda: caught_up(behind), 60)
        c.kill(behind)
        wait_for(f"{behind} gone", lambda: not launcher.running(c.cluster_config(), behind), 10)
        op.change("remove", "catalog", name, "--wait", "60")  # a leader hands over first
        c.kill(name)
        wait_for(f"{name} gone", lambda: not launcher.running(c.cluster_config(), name), 10)
        shutil.rmtree(c.cluster_config().replica_dir(name))
        url = hosts.free_address("127.0.0.7")
        added = op.change("add", "catalog", name, url)
        assert added["urls"][name] == url and name in added["learners"], added
        c.restart(name)
        hosts.wait_until(f"{name} caught up at {url}", lambda: caught_up(name), 60)
        op.change("promote", "catalog", name, "--wait", "60")
        load.buys_acked(3)
        assert f"{name} leads catalog" in op.member("lead", "catalog", name, "--wait", "30")
        wait_for(f"{name} leading", lambda: op.members("catalog")["leader"] == name)  # (no election since)
        gone = "catalog-1"
        left = op.change("remove", "catalog", gone, "--wait", "60")
        c.kill(gone)
        voters = {name, "catalog-2"}
        assert set(left["voters"]) == voters and left["urls"][name] == url, left
        load.buys_acked(3)  # each committed by both voters left, catalog-3 at its new address
        c.restart(behind)
        hosts.wait_until(f"{behind} caught up, its log having had {name} at the old address",
                         lambda: caught_up(behind), 60)
        assert set(op.change("promote", "catalog", behind, "--wait", "60")["voters"]) == {*voters, behind}
        windows.append({"kind": "replace-same-name", "detail": f"{name} at {url}, {gone} removed, {behind} back",
                        "start": start, "end": time.monotonic_ns()})
        load.buys_acked(5)
    finally:
        history = load.finish()
    judge(c, load, history, windows, tmp_path / "run",
          {"catalog": {*voters, behind}, "order": {"order-1", "order-2", "order-3"}})


def test_a_replica_killed_installing_a_snapshot_after_a_replacement_keeps_the_configuration(tmp_path: Path) -> None:
    """A catalog follower is down while the other follower is replaced (catalog-4 in its place).
    Back, it is past what the leader keeps and gets the state as a snapshot, and is SIGKILLed right
    after restoring its state from it, before its log store records the install (a hook,
    tests/mutations/sitecustomize.py). Restarted, it finishes the install with the snapshot's
    configuration on its disk: before, with none, and it fell back to the members it was started
    with (stale wherever those are given once, as in a container). Then judged from outside."""
    flag = tmp_path / "crash-install"
    env = cluster_env(PYGMY_TEST_CRASH_INSTALL=str(flag), PYGMY_RAFT_KEEP_ENTRIES="10", PYGMY_RAFT_COMPACT_SLACK="5")
    c = Cluster(tmp_path / "d", free_port_base(), [], env)
    c.start(reset=True)
    try:
        op = hosts.Operator(c.data_dir, c.env)
        load = BackgroundLoad([c.url], c.admin_token(), ITEMS, writers=2, readers=2, buyers=2, searchers=0,
                              order_readers=1)
        windows: list[dict[str, Any]] = []
        load.start()
        try:
            load.buys_acked(5)
            lead = str(wait_for("a catalog leader", lambda: leader_of(c.cluster_config(), "catalog")))
            victim, old = [n for n in ("catalog-1", "catalog-2", "catalog-3") if n != lead]
            start = time.monotonic_ns()
            c.kill(victim)
            hosts.replace(op, "catalog", old, "catalog-4", hosts.free_address("127.0.0.6"), c.restart)
            c.kill(old)
            load.buys_acked(20)  # past what the leader keeps (with the updates): only a snapshot brings it back
            flag.write_text("catalog")
            with contextlib.suppress(AssertionError):
                c.restart(victim)  # (it may die of the hook before its start-up is over: as meant)
            wait_for("the install cut short by the hook", lambda: not flag.exists(), 30)
            wait_for(f"{victim} gone", lambda: not launcher.running(c.cluster_config(), victim), 10)
            windows.append({"kind": "install-crash", "detail": f"{old} -> catalog-4, {victim} killed installing",
                            "start": start, "end": time.monotonic_ns()})
            load.buys_acked(3)
        finally:
            history = load.finish()
        voters = {lead, victim, "catalog-4"}
        raft = c.data_dir / victim / "raft.db"

        def meta() -> dict[str, str]:
            conn = sqlite3.connect(f"{raft.resolve().as_uri()}?mode=ro", uri=True)
            try:
                return dict(conn.execute("SELECT key, value FROM raft_meta").fetchall())
            finally:
                conn.close()

        killed = meta()  # what the kill left: the install begun, with the snapshot's configuration
        assert killed.get("installing_index") and killed.get("installing_membership"), killed
        assert set(json.loads(killed["installing_membership"])["voters"]) == voters
        c.restart(victim)  # with nothing written meanwhile: its log store is as its start left it
        started = meta()
        assert "installing_index" not in started and started.get("snapshot_membership"), started
        assert set(json.loads(started["snapshot_membership"])["voters"]) == voters
        wait_for(f"{victim} caught up", lambda: any(m["name"] == victim and m["caught_up"]
                                                     for m in op.members("catalog")["members"]), 30)
        members = {"catalog": voters, "order": {"order-1", "order-2", "order-3"}}
        judge(c, load, history, windows, tmp_path / "run", members)
    finally:
        c.stop()
