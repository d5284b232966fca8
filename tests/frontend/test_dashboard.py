"""``/dashboard``'s HTTP side: the page and its files, the state it polls, and fault requests (the
browser itself is in ``test_dashboard_browser.py``)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from harness import Cluster

from pygmy.replication.node import ReplicationConfig


def state(c: Cluster) -> dict[str, Any]:
    r = requests.get(c.url + "/dashboard/state", timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


def until(check: Any, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_page_and_its_files_come_from_the_package(cluster: Cluster) -> None:
    page = requests.get(cluster.url + "/dashboard", timeout=5)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    links = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert {"/dashboard/static/vendor/uPlot.iife.min.js", "/dashboard/static/dashboard.js"} <= set(links)
    for src in links:
        if src.startswith("data:"):
            continue
        assert src.startswith("/dashboard/static/"), f"{src}: every file is served by the frontend (no CDN)"
        assert requests.get(cluster.url + src, timeout=5).status_code == 200, src
    assert "MIT License" in requests.get(cluster.url + "/dashboard/static/vendor/uPlot.LICENSE", timeout=5).text
    for bad in ("/dashboard/static/../dashboard.py", "/dashboard/static/%2e%2e/app.py", "/dashboard/static/nope.js"):
        r = requests.get(cluster.url + bad, timeout=5)
        assert r.status_code == 404 and "error" in r.json(), bad


def test_state_shows_every_replica_both_leaders_workers_and_operations(cluster: Cluster) -> None:
    config = cluster.cluster_config()
    before = state(cluster)
    with cluster.client() as client:
        client.lookup(1)
        client.search("distributed systems")
        client.buy(3)
    seen: list[dict[str, Any]] = []

    def settled() -> dict[str, Any] | None:
        """The buy counted, and every worker there with its lease (a renewal may lag under load)."""
        s = state(cluster)
        seen.append(s)
        ok = (s["operations"]["buy"]["count"] > before["operations"]["buy"]["count"]
              and len(s["workers"]) == config.frontend_workers and all(w["lease_valid"] for w in s["workers"]))
        return s if ok else None

    after = until(settled)
    assert after, f"the buy, a worker or a lease is missing from the state: {seen[-1]['workers']}"
    for tier in ("catalog", "order"):
        view = after["tiers"][tier]
        assert [r["name"] for r in view["replicas"]] == list(config.peers(tier))
        assert view["leader"] in config.peers(tier)
        assert all(r["alive"] and r["state_digest"] for r in view["replicas"])
    for op in ("search", "lookup", "buy"):
        o = after["operations"][op]
        assert o["count"] > before["operations"][op]["count"], op
        assert o["buckets"][-1] == [None, o["count"]], "the last bucket is +Inf and holds every request"
        counts = [n for _, n in o["buckets"]]
        assert counts == sorted(counts), "buckets are cumulative"
    pids = {w["pid"] for w in after["workers"]}
    assert len(pids) == config.frontend_workers
    assert all(w["lease_term"] >= 1 and 0 < w["lease_left_ms"] <= 1000 for w in after["workers"])
    # A lookup counts as a hit or a miss only where its worker held its lease then (on a busy
    # machine a renewal may lag): once every lease is valid, a lookup must be counted.
    with cluster.client() as client:
        client.lookup(2)

    def counted() -> dict[str, Any] | None:
        s = state(cluster)
        return s if sum(w["hits"] + w["misses"] for w in s["workers"]) >= 1 else None

    assert until(counted), f"no worker counted a lookup: {state(cluster)['workers']}"
    assert after["faults"] is True, "a cluster started by pygmy up has the launcher's control socket"


def test_state_carries_each_replicas_timers_and_its_leaders_round_trips(cluster: Cluster) -> None:
    """What the page's timers and round trips are drawn from: every replica's own ``timers``, in ms,
    and on each leader the median and p99 round trip to every follower (issue #37)."""
    floor = ReplicationConfig.from_env({})

    def measured() -> dict[str, Any] | None:
        """Both leaders with a sample of every follower (a new leadership measures afresh)."""
        s = state(cluster)
        for view in s["tiers"].values():
            leader = next((r for r in view["replicas"] if r["name"] == view["leader"]), {})
            if set(leader.get("timers", {}).get("rtt_ms", {})) != {r["name"] for r in view["replicas"]} - {view["leader"]}:
                return None
        return s

    s = until(measured)
    assert s, f"a leader's round trips are missing: {state(cluster)['tiers']}"
    for view in s["tiers"].values():
        for r in view["replicas"]:
            t = r["timers"]
            assert t["adapt"] is True, r
            # Never below the configured timers; a lease shorter than the window, which outlasts a heartbeat.
            assert t["heartbeat_ms"] >= floor.heartbeat_ticks * floor.tick_ms, r
            assert t["election_ms"] >= floor.election_ticks_min * floor.tick_ms, r
            assert t["heartbeat_ms"] < t["election_ms"] and 0 < t["lease_ms"] < t["election_ms"], r
            assert t["probe_ms"] >= 2 * t["heartbeat_ms"], r
            if r["name"] != view["leader"]:
                assert "rtt_ms" not in t and "rtt_tail_ms" not in t, "only a leader measures round trips"
                continue
            assert t["rtt_tail_ms"].keys() == t["rtt_ms"].keys()
            assert all(0 <= t["rtt_ms"][p] <= t["rtt_tail_ms"][p] for p in t["rtt_ms"]), t


@pytest.mark.parametrize("body,token,code", [
    ({"action": "kill", "name": "catalog-1"}, None, 401),
    ({"action": "kill", "name": "catalog-1"}, "secret", 403),
    ({"action": "explode", "name": "catalog-1"}, "admin", 400),
    ({"action": "kill", "name": "frontend-1"}, "admin", 400),
    ({"action": "kill", "name": "catalog-9"}, "admin", 400),
    ({"action": "pause", "name": "order-3", "seconds": 0}, "admin", 400),
    ({"action": "pause", "name": "order-3", "seconds": 61}, "admin", 400),
    ({"action": "pause", "name": "order-3", "seconds": True}, "admin", 400),
    ({"action": "start", "name": "order-3"}, "admin", 409),  # it runs already
    ("kill catalog-1", "admin", 400),
])
def test_bad_fault_requests_are_refused_and_change_nothing(cluster: Cluster, body: Any, token: str | None,
                                                           code: int) -> None:
    """The internal secret is not the admin token: a replica's credential cannot inject faults."""
    groups = cluster.process_groups()
    headers = {}
    if token:
        headers["Authorization"] = f"Bearer {cluster.admin_token() if token == 'admin' else cluster.secret()}"
    kw: dict[str, Any] = {"json": body} if isinstance(body, dict) else {"data": body}
    r = requests.post(cluster.url + "/dashboard/faults", headers=headers, timeout=10, **kw)
    assert r.status_code == code, r.text
    assert r.json()["error"]["code"] == code
    assert cluster.process_groups() == groups
    assert all(r["alive"] for t in state(cluster)["tiers"].values() for r in t["replicas"])


def test_pause_stops_a_replica_for_its_seconds_then_it_resumes(cluster: Cluster) -> None:
    auth = {"Authorization": f"Bearer {cluster.admin_token()}"}

    def order3() -> dict[str, Any]:
        return next(r for r in state(cluster)["tiers"]["order"]["replicas"] if r["name"] == "order-3")

    r = requests.post(cluster.url + "/dashboard/faults", headers=auth, timeout=10,
                      json={"action": "pause", "name": "order-3", "seconds": 1.5})
    assert r.status_code == 200 and r.json()["message"] == "paused order-3 for 1.5 s", r.text
    stopped = (Path("/proc") / str(cluster.process_groups()["order-3"]) / "stat").read_text()
    assert stopped[stopped.rindex(")") + 2] == "T", "the service's processes are stopped (SIGSTOP)"
    assert until(lambda: not order3()["alive"], timeout=5), "a paused replica stops answering"
    assert until(lambda: order3()["alive"], timeout=10), "and answers again once its pause is over"
