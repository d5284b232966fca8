"""Retries that cannot amplify an overload (pygmy/kit/retry.py) and the client's use of them."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask, jsonify, request
from harness import StandIn

from pygmy.client.api import DEADLINE_HEADER, PygmyClient, PygmyError
from pygmy.kit.retry import RetryBudget, backoff, retry_after


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_budget_allows_a_burst_then_a_share_of_requests_then_the_reserve_over_time() -> None:
    clock = Clock()
    budget = RetryBudget(ratio=0.1, reserve_per_s=2.0, burst=5.0, clock=clock)
    assert [budget.try_retry() for _ in range(6)] == [True] * 5 + [False]
    for _ in range(100):  # 100 requests earn 10 retries, but the bucket holds 5
        budget.request()
    assert sum(budget.try_retry() for _ in range(20)) == 5
    for _ in range(30):
        budget.request()
    assert sum(budget.try_retry() for _ in range(20)) == 3  # 30 x 0.1
    clock.t += 1.0
    assert sum(budget.try_retry() for _ in range(20)) == 2  # the reserve: 2 per second
    assert budget.retries == 15 and budget.refused == 1 + 15 + 17 + 18


def test_backoff_is_jittered_exponential_and_capped() -> None:
    rng = random.Random(7)
    for attempt in range(1, 12):
        ceiling = min(0.5, 0.02 * 2 ** (attempt - 1))
        waits = [backoff(attempt, rng=rng) for _ in range(200)]
        assert all(0 <= w <= ceiling for w in waits)
        assert max(waits) > ceiling / 2  # spread, not a constant
    assert retry_after("2") == 2.0 and retry_after(" 0 ") == 0.0
    assert retry_after("soon") is None and retry_after(None) is None and retry_after("-1") is None


class Server:
    """A frontend stand-in: answers ``script`` in turn (status, Retry-After), then 200."""

    def __init__(self) -> None:
        self.script: list[tuple[int, str | None]] = []
        self.calls: list[dict[str, str]] = []
        app = Flask("fake")

        @app.route("/<path:path>", methods=["GET", "POST"])
        def any_path(path: str) -> Any:
            self.calls.append(dict(request.headers))
            if self.script:
                status, after = self.script.pop(0)
                resp = jsonify({"error": {"code": status, "message": "busy"}})
                resp.status_code = status
                if after is not None:
                    resp.headers["Retry-After"] = after
                return resp
            return jsonify({"ok": True})

        self.served = StandIn(app)
        self.url = self.served.url

    def stop(self) -> None:
        self.served.stop()


@pytest.fixture()
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.stop()


def test_reads_are_retried_after_503_and_every_request_carries_its_budget(server: Server) -> None:
    server.script = [(503, "0"), (503, None)]
    with PygmyClient(server.url, timeout=5, retries=3) as c:
        assert c.lookup(1) == {"ok": True}
    assert len(server.calls) == 3
    budgets = [int(h[DEADLINE_HEADER]) for h in server.calls]
    assert all(0 < b <= 5000 for b in budgets) and budgets == sorted(budgets, reverse=True)


def test_no_retries_unless_asked_and_never_for_a_buy_without_a_key(server: Server) -> None:
    with PygmyClient(server.url, timeout=5) as c:
        server.script = [(503, "0")]
        with pytest.raises(PygmyError) as err:
            c.lookup(1)
        assert err.value.status == 503 and err.value.retry_after == 0.0
    with PygmyClient(server.url, timeout=5, retries=3) as c:
        server.script = [(503, "0")]
        with pytest.raises(PygmyError):
            c.buy(1)
        server.script = [(503, "0")]
        assert c.buy(1, key="k1") == {"ok": True}
        server.script = [(409, None)]  # an answer, not a failure: never retried
        with pytest.raises(PygmyError):
            c.buy(1, key="k2")
    assert len(server.calls) == 1 + 1 + 2 + 1


def test_retry_after_is_honoured_even_when_that_means_giving_up(server: Server) -> None:
    server.script = [(503, "30")]
    with PygmyClient(server.url, timeout=2, retries=3) as c, pytest.raises(PygmyError) as err:
        c.lookup(1)
    assert err.value.status == 503 and len(server.calls) == 1


def test_an_empty_budget_stops_retries(server: Server) -> None:
    budget = RetryBudget(ratio=0.0, reserve_per_s=0.0, burst=1.0)
    with PygmyClient(server.url, timeout=5, retries=5, budget=budget) as c:
        server.script = [(503, "0")] * 3
        with pytest.raises(PygmyError):
            c.lookup(1)
    assert len(server.calls) == 2 and budget.refused == 1
