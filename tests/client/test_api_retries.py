"""The client library's retries keep what an error says true: a buy shed after an attempt whose
outcome is unknown is not reported as shed ("overloaded" promises that nothing was done)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask, jsonify
from harness import StandIn

from pygmy.client.api import PygmyClient, PygmyError, overloaded
from pygmy.kit.retry import RetryBudget

UNKNOWN = (503, {"error": {"code": 503, "message": "the buy's outcome is not known yet"}})
SHED = (503, {"error": {"code": 503, "message": "overloaded", "overloaded": True}})


@pytest.fixture
def frontend() -> Iterator[tuple[str, list[tuple[int, dict[str, Any]]]]]:
    answers: list[tuple[int, dict[str, Any]]] = []
    app = Flask("frontend")

    @app.post("/buy/<item>")
    def buy(item: str) -> Any:
        status, body = answers.pop(0)
        resp = jsonify(body)
        resp.status_code = status
        resp.headers["Retry-After"] = "0"
        return resp

    served = StandIn(app)
    yield served.url, answers
    served.stop()


def buy(url: str) -> PygmyError:
    budget = RetryBudget(ratio=1.0, reserve_per_s=10.0, burst=10.0)
    with PygmyClient(url, retries=3, budget=budget) as client, pytest.raises(PygmyError) as caught:
        client.buy(1, key="k1")
    return caught.value


def test_a_buy_shed_after_an_attempt_of_unknown_outcome_is_not_called_shed(frontend: Any) -> None:
    url, answers = frontend
    answers += [UNKNOWN, SHED, SHED, SHED]
    error = buy(url)
    assert error.status == 503 and not overloaded(error), error.body
    assert "outcome is unknown" in str(error)
    assert answers == []  # every retry was made


def test_a_buy_shed_at_every_attempt_says_so(frontend: Any) -> None:
    url, answers = frontend
    answers += [SHED, SHED, SHED, SHED]
    assert overloaded(buy(url))
