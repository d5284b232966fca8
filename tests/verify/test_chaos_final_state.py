"""The chaos run's final read of every replica (``chaos.final_state``), in-process: what it asks
again and what it takes as the answer. Beside ``test_chaos.py``, whose runs need the nemesis' tools."""

from __future__ import annotations

import pytest
import requests

from pygmy.verify import chaos


class _Answers:
    """A session that answers each GET with the next of ``answers`` (a status code, or an
    exception to raise)."""

    def __init__(self, *answers: int | Exception) -> None:
        self.answers, self.calls = list(answers), 0

    def get(self, url: str, **kw: object) -> requests.Response:
        self.calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        r = requests.Response()
        r.status_code = answer
        return r


@pytest.mark.parametrize("answers, status, calls", [
    ((503, 503, 200), 200, 3),
    ((requests.ReadTimeout(), 404), 404, 2),
    ((409,), 409, 1),
    ((503,) * 5, 503, 5),
])
def test_the_final_read_tries_again_after_a_503_or_a_timeout_only(monkeypatch: pytest.MonkeyPatch, answers: tuple,
                                                                 status: int, calls: int) -> None:
    """A 503 (a follower that could not get a read index in time) or a timeout is asked again, up
    to five times; any other answer, and a 503 that persists, is the answer."""
    monkeypatch.setattr(chaos.time, "sleep", lambda s: None)
    session = _Answers(*answers)
    assert chaos._Patient(session).get("http://x/orders/1").status_code == status  # type: ignore[arg-type]
    assert session.calls == calls


def test_a_timeout_that_persists_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chaos.time, "sleep", lambda s: None)
    with pytest.raises(requests.Timeout):
        chaos._Patient(_Answers(*[requests.ReadTimeout()] * 5)).get("http://x")  # type: ignore[arg-type]


def test_updates_of_unknown_outcome_are_sent_again_under_their_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only updates of unknown outcome, each under its own key and body, through the frontends in
    turn, until an answer below 500: that answer is what ``chaos_check`` counts it by."""
    from pygmy.kit.config import ClusterConfig
    from pygmy.verify.lincheck import History

    history = History({1: {"cost": 1000, "stock": 10}, 2: {"cost": 2000, "stock": 5}})
    lost = history.invoke(0, "update", 1, {"stock_delta": 2, "cost": 1101, "key": "u-lost"})
    history.unknown(lost)
    done = history.invoke(0, "update", 2, {"stock_delta": 1, "cost": 2001, "key": "u-done"})
    history.ok(done, {"cost": 2001, "stock": 6})
    never = history.invoke(0, "update", 2, {"stock_delta": 3, "cost": 2002, "key": "u-never"})
    history.unknown(never)
    sent: list[tuple[str, dict, str]] = []
    answers: dict[str, list[int | Exception]] = {"u-lost": [requests.ConnectionError(), 503, 200], "u-never": [404]}

    def post(self: requests.Session, url: str, json: dict, headers: dict, timeout: float) -> requests.Response:
        sent.append((url, json, headers["Idempotency-Key"]))
        answer = answers[headers["Idempotency-Key"]].pop(0)
        if isinstance(answer, Exception):
            raise answer
        r = requests.Response()
        r.status_code = answer
        return r

    monkeypatch.setattr(requests.Session, "post", post)
    monkeypatch.setattr(chaos.time, "sleep", lambda s: None)
    config = ClusterConfig(port_base=9000, frontends=2)
    assert chaos.settle_updates(config, history, "token") == {"u-lost": 200, "u-never": 404}
    f1, f2 = config.frontend_url(1), config.frontend_url(2)
    assert sent == [(f"{f1}/update/1", {"stock_delta": 2, "cost": 11.01}, "u-lost"),
                    (f"{f2}/update/1", {"stock_delta": 2, "cost": 11.01}, "u-lost"),
                    (f"{f1}/update/1", {"stock_delta": 2, "cost": 11.01}, "u-lost"),
                    (f"{f1}/update/2", {"stock_delta": 3, "cost": 20.02}, "u-never")]


def test_an_answer_that_tells_nothing_leaves_an_update_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 401 (a wrong token) or a 400 says nothing of the update's outcome: it stays unknown (the
    stock equation allows it either way), never counted as not done."""
    from pygmy.kit.config import ClusterConfig
    from pygmy.verify.lincheck import History

    history = History({1: {"cost": 1000, "stock": 10}})
    history.unknown(history.invoke(0, "update", 1, {"stock_delta": 2, "cost": 1101, "key": "u-x"}))

    def post(self: requests.Session, url: str, **kw: object) -> requests.Response:
        r = requests.Response()
        r.status_code = 401
        return r

    monkeypatch.setattr(requests.Session, "post", post)
    assert chaos.settle_updates(ClusterConfig(port_base=9000), history, "wrong", timeout=0) == {"u-x": None}
    with pytest.raises(ValueError, match="admin token"):
        chaos.final_state(ClusterConfig(port_base=9000), "s", [1], history=history)
