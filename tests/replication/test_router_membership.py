"""Routers learn a tier's members while they run: from the configuration a replica's /status shows
(the leader's first), on a timer and as soon as a reply names a leader they do not know."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import urllib3
from flask import Flask, jsonify
from harness import StandIn

from pygmy.replication import router as router_module
from pygmy.replication.router import ChannelRouter, Sightings, TierRouter


class Replica:
    """A stand-in replica: its /status (role, term, the configuration it shows) and every other
    path answered as ``answer`` says."""

    def __init__(self, name: str) -> None:
        self.name, self.role, self.term = name, "follower", 1
        self.lease = True  # a leader's: whether its leader lease holds
        self.conf: dict[str, Any] = {}
        self.answer: tuple[int, dict[str, Any]] = (200, {"by": name})
        self.status_calls = 0
        app = Flask(name)

        @app.get("/status")
        def status() -> Any:
            self.status_calls += 1
            return jsonify({"name": name, "role": self.role, "term": self.term, "commit_index": 5,
                            "leader_lease": self.role == "leader" and self.lease, "membership": self.conf})

        @app.route("/<path:path>", methods=["GET", "POST"])
        def other(path: str) -> Any:
            code, body = self.answer
            resp = jsonify(body)
            resp.status_code = code
            return resp

        self.served = StandIn(app)
        self.url = self.served.url


@pytest.fixture()
def replicas() -> Iterator[dict[str, Replica]]:
    reps = {n: Replica(n) for n in ("t-1", "t-2", "t-3")}
    yield reps
    for r in reps.values():
        r.served.stop()


def configuration(reps: dict[str, Replica], voters: list[str], learners: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"voters": voters, "learners": list(learners),
            "urls": {n: reps[n].url for n in [*voters, *learners]}, "pending": False}


def test_a_look_at_the_leader_adds_and_drops_replicas(replicas: dict[str, Replica]) -> None:
    r = replicas
    router = TierRouter("t", {n: r[n].url for n in ("t-1", "t-2")}, "secret")
    try:
        r["t-1"].role = "leader"
        r["t-1"].conf = configuration(r, ["t-1", "t-3"], ("t-2",))
        r["t-2"].conf = configuration(r, ["t-1", "t-2"])  # behind: not believed over the leader
        router.leader_hint = "t-1"
        http = urllib3.PoolManager()
        assert router.sightings.look(http)
        assert r["t-1"].status_calls == 1 and r["t-2"].status_calls == 0  # the leader's answer is enough
        router.follow_members()
        assert sorted(router.names) == ["t-1", "t-2", "t-3"]
        r["t-1"].conf = configuration(r, ["t-1", "t-3"])
        assert router.sightings.look(http) and not router.sightings.look(http)
        router.follow_members()
        assert sorted(router.names) == ["t-1", "t-3"]
        r["t-1"].answer = (503, {"error": {"code": 503, "message": "busy"}})
        assert router.read("/books/1", time.monotonic() + 2).body == {"by": "t-3"}
        assert [s["name"] for s in router.statuses()] == ["t-1", "t-3"]
    finally:
        router.close()
        router.sightings.close()


def test_a_leader_whose_lease_lapsed_is_not_believed_over_a_newer_one(replicas: dict[str, Replica]) -> None:
    """t-1, asked first (the hint), still says it leads in term 1, but its lease has lapsed: it was
    cut off while t-2 was elected in term 2 and removed t-3. The look goes on to the others, and
    takes the configuration of the newest term's leader, not the first claim it heard."""
    r = replicas
    seen = Sightings()
    router = TierRouter("t", {n: r[n].url for n in r}, "secret", sightings=seen)
    try:
        r["t-1"].role, r["t-1"].lease = "leader", False
        r["t-1"].conf = configuration(r, ["t-1", "t-2", "t-3"])
        r["t-2"].role, r["t-2"].term = "leader", 2
        r["t-2"].conf = configuration(r, ["t-1", "t-2"])
        seen.leader = "t-1"
        assert seen.look(urllib3.PoolManager())
        assert r["t-1"].status_calls == 1 and r["t-2"].status_calls == 1
        router.follow_members()
        assert sorted(router.names) == ["t-1", "t-2"]
    finally:
        router.close()
        seen.close()


def test_a_deposed_leader_is_not_believed_over_a_follower_of_a_newer_term(replicas: dict[str, Replica]) -> None:
    """t-1 still says it leads in term 1, its lease lapsed; t-3 leads in term 2 but does not answer
    this router: the configuration t-2 holds in term 2 is newer than anything t-1 can show."""
    r = replicas
    seen = Sightings()
    try:
        r["t-1"].role, r["t-1"].lease = "leader", False
        r["t-1"].conf = configuration(r, ["t-1", "t-2", "t-3"])
        r["t-2"].term, r["t-2"].conf = 2, configuration(r, ["t-2", "t-3"])
        seen.know({"t-1": r["t-1"].url, "t-2": r["t-2"].url, "t-3": "http://127.0.0.1:9"})
        seen.leader = "t-1"
        assert seen.look(urllib3.PoolManager())
        assert sorted(seen.members) == ["t-2", "t-3"]
    finally:
        seen.close()


def test_a_write_named_to_an_unknown_leader_finds_it(replicas: dict[str, Replica],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """t-3 was added and leads; the router knows t-1 and t-2 only, which answer 421 naming t-3:
    it looks at the members at once (not at the next MEMBERS_EVERY), and the write reaches t-3."""
    monkeypatch.setattr(router_module, "MEMBERS_EVERY", 60.0)
    r = replicas
    for n in ("t-1", "t-2"):
        r[n].answer = (421, {"error": {"code": 421, "message": "not the leader", "leader": "t-3"}})
        r[n].conf = configuration(r, ["t-1", "t-2", "t-3"])
    r["t-3"].role, r["t-3"].term = "leader", 2
    router = TierRouter("t", {n: r[n].url for n in ("t-1", "t-2")}, "secret")
    try:
        reply = router.write("/buy", {}, time.monotonic() + 5)
        assert reply.status == 200 and reply.replica == "t-3"
    finally:
        router.close()
        router.sightings.close()


def test_routers_sharing_sightings_follow_one_look(replicas: dict[str, Replica]) -> None:
    r = replicas
    seen = Sightings()
    peers = {n: r[n].url for n in ("t-1", "t-2")}
    http_router = TierRouter("t", peers, "secret", sightings=seen)
    frames = ChannelRouter("t", peers, "secret", "me", "buys", sightings=seen)
    try:
        r["t-1"].role = "leader"
        r["t-1"].conf = configuration(r, ["t-1", "t-2", "t-3"])
        seen.leader = "t-1"
        assert seen.look(urllib3.PoolManager())
        for router in (http_router, frames):
            router.follow_members()
            assert sorted(router.names) == ["t-1", "t-2", "t-3"]
        assert "t-3" in frames._clients and "t-3" in frames._status_pools
    finally:
        http_router.close()
        frames.close()
        seen.close()


def test_when_no_known_member_answers_the_deployments_configuration_is_asked(replicas: dict[str, Replica]) -> None:
    """Every replica a router knows was replaced while it was not looking (an order follower that
    sent the catalog nothing, then led): none answers, so it asks those ``cluster.json`` names now
    (``Sightings.configured``), and only then: while a known member answers, the file is not read."""
    r = replicas
    read: list[int] = []

    def configured() -> dict[str, str]:
        read.append(1)
        return {"t-2": r["t-2"].url, "t-3": r["t-3"].url}

    seen = Sightings(configured=configured)
    router = TierRouter("t", {"gone-1": "http://127.0.0.1:9", "gone-2": "http://127.0.0.1:9"}, "secret",
                        sightings=seen)
    try:
        assert seen._watching == os.getpid()  # looking from the start, not from its first request
        r["t-2"].role, r["t-2"].conf = "leader", configuration(r, ["t-2", "t-3"])
        http = urllib3.PoolManager()
        assert seen.look(http) and read == [1]
        router.follow_members()
        assert sorted(router.names) == ["t-2", "t-3"]
        assert not seen.look(http) and read == [1]  # a known member answered: the file is not read
    finally:
        router.close()
