"""The routers between tiers under overload: shed answers are not retried, timeouts only within
the retry budget, and every hop carries what is left of the request's time."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import urllib3
from flask import Flask, jsonify, request
from harness import StandIn

from pygmy.kit.admission import DEADLINE_HEADER
from pygmy.kit.retry import RetryBudget
from pygmy.replication import router as router_module
from pygmy.replication.router import LEADER_HEADER, HopError, Reply, TierRouter, TierUnavailable, overloaded

Behaviour = Callable[[], tuple[int, dict[str, Any]]]


class FakeReplica:
    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[dict[str, str]] = []
        self.bodies: list[Any] = []
        self.behaviour: Behaviour = lambda: (200, {"ok": True, "by": name})
        self.leader: str | None = None  # whom it names as the leader (LEADER_HEADER)
        app = Flask(name)

        @app.route("/<path:path>", methods=["GET", "POST"])
        def any_path(path: str) -> Any:
            self.calls.append(dict(request.headers))
            self.bodies.append(request.get_json(silent=True))
            status, body = self.behaviour()
            resp = jsonify(body)
            resp.status_code = status
            if self.leader:
                resp.headers[LEADER_HEADER] = self.leader
            return resp

        self.served = StandIn(app)
        self.url = self.served.url

    def stop(self) -> None:
        self.served.stop()


def shed() -> tuple[int, dict[str, Any]]:
    return 503, {"error": {"code": 503, "message": "overloaded", "overloaded": True}}


def not_leader(leader: str | None) -> Behaviour:
    return lambda: (421, {"error": {"code": 421, "message": "not the leader", "leader": leader}})


@pytest.fixture()
def tier() -> Iterator[tuple[TierRouter, dict[str, FakeReplica]]]:
    replicas = {n: FakeReplica(n) for n in ("r1", "r2", "r3")}
    router = TierRouter("t", {n: r.url for n, r in replicas.items()}, "secret")
    yield router, replicas
    router.close()
    for r in replicas.values():
        r.stop()


def test_a_shed_write_comes_back_at_once_and_no_other_replica_is_asked(tier: Any) -> None:
    router, replicas = tier
    replicas["r1"].behaviour = shed
    replicas["r2"].behaviour = replicas["r3"].behaviour = not_leader("r1")
    router.leader_hint = "r1"
    reply = router.write("/buy", {"x": 1}, time.monotonic() + 5)
    assert overloaded(reply) and reply.replica == "r1"
    assert len(replicas["r1"].calls) == 1 and not replicas["r2"].calls and not replicas["r3"].calls


def test_every_hop_carries_what_is_left_of_the_deadline(tier: Any) -> None:
    router, replicas = tier
    replicas["r1"].behaviour = not_leader("r2")
    router.leader_hint = "r1"
    assert router.write("/buy", {}, time.monotonic() + 3).status == 200
    budgets = [int(c[DEADLINE_HEADER]) for r in ("r1", "r2") for c in replicas[r].calls]
    assert len(budgets) == 2 and all(0 < b <= 3000 for b in budgets)
    for r in replicas.values():
        r.calls.clear()
    assert router.read("/books/1", time.monotonic() + 2).status == 200
    reads = [c for r in replicas.values() for c in r.calls]
    assert reads and all(0 < int(c[DEADLINE_HEADER]) <= 2000 for c in reads)


def test_retries_after_timeouts_stop_when_the_budget_is_spent(tier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    router, replicas = tier
    monkeypatch.setattr(router_module, "READ_TIMEOUT", 0.2)

    def slow() -> tuple[int, dict[str, Any]]:
        time.sleep(0.5)
        return 200, {}

    replicas["r1"].behaviour = slow
    replicas["r2"].behaviour = replicas["r3"].behaviour = not_leader("r1")
    router.leader_hint = "r1"
    router.budget = RetryBudget(ratio=0.0, reserve_per_s=0.0, burst=1.0)
    with pytest.raises(TierUnavailable, match="retry budget spent"):
        router.write("/buy", {}, time.monotonic() + 10)
    assert len(replicas["r1"].calls) == 2  # the first try and the one retry the budget allowed
    # Fast refusals ("not the leader") cost no budget: a leader that answers again is found.
    replicas["r1"].behaviour = lambda: (200, {"by": "r1"})
    router.leader_hint = "r2"
    assert router.write("/buy", {}, time.monotonic() + 5).body == {"by": "r1"}


def test_a_write_shed_after_an_attempt_of_unknown_outcome_is_not_called_shed(
        tier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """"Overloaded" tells the client nothing was done. After an attempt that timed out (the leader
    may have done the work) or a 503 whose outcome is not known yet, a shed answer comes back as a
    plain 503: outcome unknown, retry with the same key."""
    router, replicas = tier
    monkeypatch.setattr(router_module, "READ_TIMEOUT", 0.2)
    calls = [0]

    def slow_then_shed() -> tuple[int, dict[str, Any]]:
        calls[0] += 1
        if calls[0] == 1:
            time.sleep(0.5)  # times out: the first attempt's outcome is unknown
            return 200, {}
        return shed()

    replicas["r1"].behaviour = slow_then_shed
    replicas["r2"].behaviour = replicas["r3"].behaviour = not_leader("r1")
    router.leader_hint = "r1"
    reply = router.write("/buy", {}, time.monotonic() + 5)
    assert reply.status == 503 and not overloaded(reply), reply
    assert "outcome is unknown" in reply.body["error"]["message"]
    assert len(replicas["r1"].calls) == 2

    unknown = iter([(503, {"error": {"code": 503, "message": "outcome not known yet"}})])
    replicas["r1"].behaviour = lambda: next(unknown, None) or shed()
    reply = router.write("/buy", {}, time.monotonic() + 5)
    assert reply.status == 503 and not overloaded(reply), reply
    replicas["r1"].behaviour = shed  # shed at the first attempt: nothing was done, and it says so
    assert overloaded(router.write("/buy", {}, time.monotonic() + 5))
    replicas["r2"].behaviour = shed  # a refused connection first reached nobody: shed still says so
    replicas["r1"].stop()
    router.leader_hint = "r1"
    reply = router.write("/buy", {}, time.monotonic() + 5)
    assert overloaded(reply) and reply.replica == "r2", reply


def test_a_shed_read_tries_another_replica_only_within_the_budget(tier: Any) -> None:
    router, replicas = tier
    for r in replicas.values():
        r.behaviour = shed
    replicas["r3"].behaviour = lambda: (200, {"by": "r3"})
    assert router.read("/books/1", time.monotonic() + 5).body == {"by": "r3"}
    router.budget = RetryBudget(ratio=0.0, reserve_per_s=0.0, burst=0.0)
    replicas["r3"].behaviour = shed
    reply = router.read("/books/1", time.monotonic() + 5)
    assert overloaded(reply)
    assert sum(len(r.calls) for r in replicas.values()) <= 3 + 1


EXPIRED = Reply(504, {"error": {"code": 504, "message": "expired"}}, "test")


def test_a_batch_is_one_request_and_each_caller_gets_its_own_answer(tier: Any) -> None:
    router, replicas = tier
    router.leader_hint = "r1"

    def per_item() -> tuple[int, dict[str, Any]]:
        items = request.get_json()["items"]
        return 200, {"results": [{"status": 200 if i["n"] % 2 else 409, "body": {"n": i["n"]}} for i in items]}

    replicas["r1"].behaviour = per_item
    now = time.monotonic()
    items = [({"n": 1}, now + 2), ({"n": 2}, now - 1), ({"n": 3}, now + 4), ({"n": 4}, now + 1)]
    replies = router.write_batch("/many", items, cap=3.0, expired=EXPIRED)
    assert [(r.status, r.body) for r in replies] == [(200, {"n": 1}), (504, EXPIRED.body), (200, {"n": 3}),
                                                     (409, {"n": 4})]
    (sent,) = replicas["r1"].bodies
    assert [i["n"] for i in sent["items"]] == [1, 3, 4]  # the expired one is never sent
    budgets = {i["n"]: i["timeout_ms"] for i in sent["items"]}
    assert 1000 < budgets[1] <= 2000 and 3000 < budgets[3] <= 4000 and 0 < budgets[4] <= 1000
    assert 0 < int(replicas["r1"].calls[0][DEADLINE_HEADER]) <= 3000  # the latest deadline, capped
    assert router.write_batch("/many", [({"n": 5}, now - 1)], cap=3.0, expired=EXPIRED) == [EXPIRED]
    assert len(replicas["r1"].bodies) == 1  # nothing live: no request at all


def test_a_failed_or_malformed_batch_answer_reaches_every_item(tier: Any) -> None:
    router, replicas = tier
    router.leader_hint = "r1"
    items = [({"n": 1}, time.monotonic() + 2), ({"n": 2}, time.monotonic() + 2)]
    replicas["r1"].behaviour = shed
    assert all(overloaded(r) for r in router.write_batch("/many", items, 3.0, EXPIRED))
    replicas["r1"].behaviour = lambda: (200, {"results": [{"status": 200, "body": {}}]})  # one result for two
    assert [r.status for r in router.write_batch("/many", items, 3.0, EXPIRED)] == [502, 502]
    replicas["r1"].behaviour = lambda: (200, {"results": [{"status": 200, "body": {}}, {"status": "x"}]})
    assert [r.status for r in router.write_batch("/many", items, 3.0, EXPIRED)] == [200, 502]
    replicas["r1"].behaviour = lambda: (400, {"error": {"code": 400, "message": "bad item"}})
    assert [(r.status, r.body["error"]["message"]) for r in router.write_batch("/many", items, 3.0, EXPIRED)] == [
        (400, "bad item")] * 2


def test_a_router_that_only_reads_learns_the_leader_from_the_answers(tier: Any) -> None:
    """Reads with ``prefer_leader`` go to the leader once any replica has named it, without a
    write ever having found it; a name that is not a peer is ignored."""
    router, replicas = tier
    for r in replicas.values():
        r.leader = "r3"
    assert router.leader_hint is None
    first = router.read("/books/1", time.monotonic() + 2, prefer_leader=True)
    assert first.status == 200 and first.leader == "r3" and router.leader_hint == "r3"
    replies = [router.read("/books/1", time.monotonic() + 2, prefer_leader=True) for _ in range(6)]
    assert {r.replica for r in replies} == {"r3"}
    replicas["r3"].leader = "elsewhere"
    router.read("/books/1", time.monotonic() + 2, prefer_leader=True)
    assert router.leader_hint == "r3"
    spread = {router.read("/books/1", time.monotonic() + 2).replica for _ in range(6)}
    assert spread == {"r1", "r2", "r3"}, "without prefer_leader reads still go round"


def test_routers_of_one_tier_share_the_leader_they_found(tier: Any) -> None:
    """A frontend's lease renewals (a frame router) find a new catalog leader; its catalog reads (an
    HTTP router sharing the tier's ``Sightings``) go there first from then on, instead of to the
    leader the reads last heard of, which may have stopped."""
    router, replicas = tier
    for r in replicas.values():
        r.leader = "r1"
    router.read("/books/1", time.monotonic() + 2, prefer_leader=True)
    assert router.leader_hint == "r1"
    renewals = TierRouter("t", router.peers, "secret", sightings=router.sightings)
    try:
        replicas["r1"].behaviour = not_leader("r2")  # it lost the lead; it names the new leader
        assert renewals.write("/subscribe", {}, time.monotonic() + 2).replica == "r2"
        assert router.leader_hint == "r2"
        for r in replicas.values():
            r.leader = "r2"
        assert {router.read("/books/1", time.monotonic() + 2, prefer_leader=True).replica for _ in range(4)} == {"r2"}
    finally:
        renewals.close()


def test_a_replica_that_could_not_serve_a_read_does_not_move_the_leader(tier: Any) -> None:
    """A refusal (503: no read index, the leader it knows may have stopped) names a leader that is
    not believed; a replica that serves the read is."""
    router, replicas = tier
    router.leader_hint = "r2"
    replicas["r2"].behaviour = lambda: (503, {"error": {"code": 503, "message": "no read index"}})
    replicas["r2"].leader = "r3"  # stale: r3 has stopped
    reply = router.read("/books/1", time.monotonic() + 2, prefer_leader=True)
    assert reply.status == 200 and reply.replica != "r2" and router.leader_hint == "r2"
    replicas["r1"].leader = replicas["r3"].leader = "r1"
    router.read("/books/1", time.monotonic() + 2, prefer_leader=True)
    assert router.leader_hint == "r1"


class ScriptedStatus:
    """Stands in for ``ChannelRouter._status``: what each replica answers now (None: silent), and
    who was asked."""

    def __init__(self, answers: dict[str, dict[str, Any] | None]) -> None:
        self.answers, self.asked = answers, []

    def __call__(self, name: str) -> dict[str, Any] | None:
        self.asked.append(name)
        return self.answers[name]


@pytest.fixture()
def looks(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[router_module.ChannelRouter, ScriptedStatus]]:
    """A frame router to three replicas nobody serves, its looks at /status scripted, one look per call."""
    monkeypatch.setattr(router_module, "STALL_CHECK", 0.0)
    router = router_module.ChannelRouter("t", {n: f"http://127.0.0.1:{9 + i}" for i, n in enumerate(("r1", "r2", "r3"))},
                                         "secret", "test", "raft")
    status = ScriptedStatus({"r1": None, "r2": {"role": "follower", "term": 4}, "r3": {"role": "follower", "term": 4}})
    monkeypatch.setattr(router, "_status", status)
    yield router, status
    router.close()


def test_a_stopped_leader_is_found_out_before_its_successor_is_elected(looks: Any) -> None:
    """The first look asks the stalled leader itself, finds it silent, so the look that finds a new
    leader goes there at once rather than waiting out a status timeout on the stopped one."""
    router, status = looks
    assert router._leader_elsewhere("r1") is None  # an election is on: nobody leads yet
    assert status.asked.count("r1") == 1 and router.sightings.silent("r1")
    status.asked.clear()
    status.answers["r2"] = {"role": "leader", "term": 5}
    assert router._leader_elsewhere("r1") == "r2"
    assert "r1" not in status.asked


def test_a_busy_leader_is_asked_about_itself_once_a_second_and_keeps_the_requests(looks: Any) -> None:
    """A leader that answers /status but not the request (busy) is asked at most once per SILENT_FOR
    while nobody else claims to lead; a claim from an older term does not take its requests away."""
    router, status = looks
    status.answers["r1"] = {"role": "leader", "term": 5}
    for _ in range(5):
        assert router._leader_elsewhere("r1") is None
    assert status.asked.count("r1") == 1 and not router.sightings.silent("r1")
    status.answers["r2"] = {"role": "leader", "term": 4}  # a deposed leader that has not heard yet
    assert router._leader_elsewhere("r1") is None
    assert status.asked.count("r1") == 2


def test_an_attempt_gets_what_the_answers_showed_and_more_after_running_out() -> None:
    """A LAN replica keeps READ_TIMEOUT; one whose answers take 0.6-0.9 s (a slow link) gets room
    for them; one attempt that ran out doubles the next, and an answer brings it back."""
    from pygmy.replication.router import MAX_ATTEMPT, READ_TIMEOUT, AttemptBudget

    lan = AttemptBudget()
    for _ in range(20):
        lan.answered(0.002)
    assert lan.attempt() == READ_TIMEOUT and not lan.slow()
    wan = AttemptBudget()
    for took in [0.6, 0.9, 0.7, 0.8] * 5:
        wan.answered(took)
    assert READ_TIMEOUT < wan.attempt() < MAX_ATTEMPT and wan.slow()
    wan.timed_out(wan.attempt())
    stretched = wan.attempt()
    assert stretched == min(MAX_ATTEMPT, 2 * stretched / 2) and stretched > READ_TIMEOUT
    wan.answered(0.7)
    assert wan.attempt() < stretched
    wan.timed_out(MAX_ATTEMPT)
    assert wan.attempt() == MAX_ATTEMPT
    connect = AttemptBudget()
    connect.connect_timed_out()
    connect.connect_timed_out()
    assert connect.connect == 4 * 0.25


def test_a_batch_sent_again_after_a_timeout_gives_each_item_the_time_it_has_left(
        tier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second attempt must not carry the budgets of the first: an item would be started by the
    leader after its caller's time ran out (``docs/api.md``: no tier starts work past it)."""
    router, replicas = tier
    monkeypatch.setattr(router_module, "READ_TIMEOUT", 0.2)
    calls = [0]

    def slow_once() -> tuple[int, dict[str, Any]]:
        calls[0] += 1
        if calls[0] == 1:
            time.sleep(0.5)  # the first attempt times out (0.2 s)
        return 200, {"results": [{"status": 200, "body": {}} for _ in request.get_json()["items"]]}

    replicas["r1"].behaviour = slow_once
    replicas["r2"].behaviour = replicas["r3"].behaviour = not_leader("r1")
    router.leader_hint = "r1"
    now = time.monotonic()
    replies = router.write_batch("/many", [({"n": 1}, now + 3), ({"n": 2}, now + 0.15)], cap=3.0, expired=EXPIRED)
    assert [r.status for r in replies] == [200, 200]
    first, second = (b for b in replicas["r1"].bodies if b is not None)
    before, after = ({i["n"]: i["timeout_ms"] for i in b["items"]} for b in (first, second))
    assert after[1] <= before[1] - 200, "the retry carried the first attempt's budget"
    assert after[2] == 0, "an item whose time ran out meanwhile goes with none left (the leader answers it 504)"


def test_a_connect_takes_no_longer_than_the_deadline_leaves(tier: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A link that taught its budget a 1 s connect, with 0.5 s left of the deadline: the attempt
    must not wait 1 s for a connection (a partitioned leader drops the SYNs) past the deadline."""
    router, _ = tier
    router.leader_hint = "r1"
    for name in router.peers:
        router.attempt_budget(name).connect = 1.0
    seen: list[Any] = []

    def urlopen(*args: Any, timeout: Any, **kw: Any) -> Any:
        seen.append(timeout)
        raise urllib3.exceptions.ConnectTimeoutError(None, "dropped")

    for pool in router._pools.values():
        monkeypatch.setattr(pool, "urlopen", urlopen)
    with pytest.raises(TierUnavailable):
        router.write("/buy", {}, time.monotonic() + 0.5)
    assert seen and all(t.connect_timeout <= 0.5 for t in seen), [t.connect_timeout for t in seen]
    # A connect cut short by the deadline says nothing of the link: no budget learned from it.
    assert all(router.attempt_budget(n).connect == 1.0 for n in router.peers)


def test_statuses_taken_while_a_member_is_replaced_are_of_the_members_as_they_were() -> None:
    """A replacement learnt while the replicas' ``/status`` are asked replaces the router's peers:
    a replica it removed that does not answer is reported as it was known, not a KeyError."""
    router = TierRouter("t", {"t-1": "http://127.0.0.1:9", "t-2": "http://127.0.0.1:9"}, "secret")
    try:
        def call(name: str, *args: Any, **kw: Any) -> Any:
            router._set_peers({"t-1": "http://127.0.0.1:9", "t-4": "http://127.0.0.1:9"})  # t-2 replaced
            raise HopError(f"{name}: down")

        router._call = call  # type: ignore[method-assign]
        assert router.statuses() == [{"name": "t-1", "url": "http://127.0.0.1:9", "alive": False},
                                     {"name": "t-2", "url": "http://127.0.0.1:9", "alive": False}]
    finally:
        router.close()
