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
