"""``pygmy member``'s client side against a stand-in leader: what it does when an attempt goes unanswered."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from flask import Flask, jsonify, request
from harness import StandIn

from pygmy.cluster import members
from pygmy.cluster.local import free_port
from pygmy.kit.config import ClusterConfig

NEW = "http://127.0.0.9:9104"


def leader(answers: list[tuple[int, dict[str, Any]]], view: dict[str, Any]) -> tuple[StandIn, list[str]]:
    """A leader answering each change with the next of ``answers`` and ``GET /members`` with ``view``."""
    app = Flask("leader")
    asked: list[str] = []

    @app.route("/members", methods=["GET", "POST"])
    @app.route("/members/<name>", methods=["DELETE"])
    @app.route("/members/<name>/promote", methods=["POST"])
    def change(name: str | None = None) -> Any:
        asked.append(request.method)
        if request.method == "GET":
            return jsonify(view)
        status, body = answers.pop(0)
        return jsonify(body), status

    return StandIn(app), asked


def cluster(tmp_path: Path, url: str) -> ClusterConfig:
    config = ClusterConfig(data_dir=str(tmp_path / "d"))
    config.secret(create=True)
    config.members = {"catalog": {"catalog-1": url}}
    config.save()
    return config


#: A change's answer when it may have been made: not committed in time.
UNKNOWN = (503, {"error": {"code": 503, "kind": "outcome_unknown", "message": "its outcome is unknown"}})


def refusal(kind: str) -> tuple[int, dict[str, Any]]:
    return 409, {"error": {"code": 409, "kind": kind, "message": f"refused: {kind}"}}


VIEW = {"leader": "catalog-1", "term": 2, "last_index": 9, "pending": False, "members": [
    {"name": "catalog-1", "url": "http://x1", "role": "voter", "lag": 0, "caught_up": True},
    {"name": "catalog-4", "url": NEW, "role": "learner", "lag": 0, "caught_up": True}]}


def test_an_add_whose_first_attempt_went_unanswered_is_recorded_once_the_leader_has_it(tmp_path: Path) -> None:
    """The first POST is answered 503 (its outcome unknown: it may have been made); the retry is
    refused as a duplicate: the leader's configuration says it was made, so it is recorded."""
    standin, asked = leader([UNKNOWN, refusal("duplicate")],
                            VIEW)
    try:
        config = cluster(tmp_path, standin.url)
        out = io.StringIO()
        assert members.run(config, "add", "catalog", "catalog-4", NEW, 0, False, out) == 0
        assert asked == ["POST", "POST", "GET"]
        again = ClusterConfig.load(str(config.root))
        assert again.members["catalog"] == {"catalog-1": "http://x1", "catalog-4": NEW}
        assert again.tier_learners["catalog"] == ["catalog-4"] and "added catalog-4" in out.getvalue()
    finally:
        standin.stop()


@pytest.mark.parametrize("first", [None, 503])
def test_a_duplicate_is_still_refused_when_nothing_was_left_unanswered_or_the_url_differs(
        tmp_path: Path, first: int | None) -> None:
    """Without an unanswered attempt, a duplicate is the operator's mistake; with one, a name
    present at another URL is someone else's replica: refused either way, nothing recorded."""
    answers = ([] if first is None else [UNKNOWN]) + [refusal("duplicate")]
    standin, _ = leader(answers, VIEW)
    try:
        config = cluster(tmp_path, standin.url)
        url = NEW if first is None else "http://127.0.0.9:9999"
        with pytest.raises(members.MemberError, match="refused: duplicate"):
            members.run(config, "add", "catalog", "catalog-4", url, 0, False, io.StringIO())
        assert ClusterConfig.load(str(config.root)).members["catalog"] == {"catalog-1": standin.url}
    finally:
        standin.stop()


def test_a_promote_and_a_remove_made_by_an_unanswered_attempt_are_recorded(tmp_path: Path) -> None:
    promoted = {**VIEW, "members": [{**m, "role": "voter"} for m in VIEW["members"]]}
    standin, _ = leader([UNKNOWN, refusal("not_learner")], promoted)
    try:
        config = cluster(tmp_path, standin.url)
        assert members.run(config, "promote", "catalog", "catalog-4", None, 0, False, io.StringIO()) == 0
        assert ClusterConfig.load(str(config.root)).tier_learners["catalog"] == []
    finally:
        standin.stop()
    removed = {**VIEW, "members": VIEW["members"][:1]}
    standin, _ = leader([UNKNOWN, refusal("unknown")], removed)
    try:
        config = cluster(tmp_path, standin.url)
        assert members.run(config, "remove", "catalog", "catalog-4", None, 0, False, io.StringIO()) == 0
        assert ClusterConfig.load(str(config.root)).members["catalog"] == {"catalog-1": "http://x1"}
    finally:
        standin.stop()


def test_a_change_that_never_reached_a_leader_leaves_its_refusal_standing(tmp_path: Path) -> None:
    """A replica that refused the connection, or a 503 that is not "outcome unknown" (no leader
    known, not ready), proposed nothing: a refusal after it is the operator's to read, even where
    the leader's configuration happens to look as asked (promoting a voter)."""
    promoted = {**VIEW, "members": [{**m, "role": "voter"} for m in VIEW["members"]]}
    not_ready = (503, {"error": {"code": 503, "message": "catalog-1 is not ready"}})
    standin, asked = leader([not_ready, refusal("not_learner")], promoted)
    try:
        config = cluster(tmp_path, standin.url)
        dead = f"http://127.0.0.1:{free_port()}"  # a replica lost for good: nothing listens
        config.members = {"catalog": {"catalog-3": dead, "catalog-1": standin.url}}
        config.save()
        with pytest.raises(members.MemberError, match="refused: not_learner"):
            members.run(config, "promote", "catalog", "catalog-4", None, 0, False, io.StringIO())
        assert "GET" not in asked
    finally:
        standin.stop()
