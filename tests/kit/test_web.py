"""The HTTP edge every service shares (``pygmy.kit.web.Edge``): ids, size limits, metrics by route,
access lines, and answers given before Flask (``shortcut``)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from prometheus_client import REGISTRY

from pygmy.kit.web import ApiError, create_base_app, fail, json_object


def count(service: str, route: str, method: str, status: int) -> float:
    value = REGISTRY.get_sample_value("pygmy_http_requests_total", {
        "service": service, "route": route, "method": method, "status": str(status)})
    return value or 0.0


def timed(service: str, route: str) -> float:
    return REGISTRY.get_sample_value("pygmy_http_request_seconds_count", {"service": service, "route": route}) or 0.0


def make_app(service: str) -> Any:
    app = create_base_app(service)

    @app.get("/books/<int:n>")
    def book(n: int) -> Any:
        if n == 13:
            fail(409, "unlucky")
        return {"n": n}

    @app.post("/boom")
    def boom() -> Any:
        raise RuntimeError("a bug")

    return app


def test_every_answer_is_counted_and_timed_by_the_route_it_matched() -> None:
    app = make_app("edge-metrics")
    client = app.test_client()
    assert client.get("/books/1").json == {"n": 1}
    assert client.get("/books/2").status_code == 200
    assert client.get("/books/13").status_code == 409
    assert client.get("/nowhere").status_code == 404
    assert client.post("/books/1").status_code == 405
    assert client.post("/boom").status_code == 500
    assert count("edge-metrics", "/books/<int:n>", "GET", 200) == 2
    assert count("edge-metrics", "/books/<int:n>", "GET", 409) == 1
    assert count("edge-metrics", "unmatched", "GET", 404) == 1
    assert count("edge-metrics", "/boom", "POST", 500) == 1
    assert timed("edge-metrics", "/books/<int:n>") == 3


def test_request_ids_are_taken_or_made_echoed_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    app = make_app("edge-ids")
    client = app.test_client()
    with caplog.at_level(logging.DEBUG, logger="pygmy.access"):
        given = client.get("/books/1", headers={"X-Request-Id": "abc-123"})
        made = client.get("/books/1")
        bad = client.get("/books/1", headers={"X-Request-Id": "no spaces allowed"})
        refused = client.get("/books/13", headers={"X-Request-Id": "r-409"})
    assert given.headers["X-Request-Id"] == "abc-123"
    assert len(made.headers["X-Request-Id"]) >= 16
    assert bad.headers["X-Request-Id"] not in ("no spaces allowed", made.headers["X-Request-Id"])
    lines = [r for r in caplog.records if r.name == "pygmy.access"]
    assert [(r.levelno, r.status) for r in lines] == [(logging.DEBUG, 200)] * 3 + [(logging.INFO, 409)]
    assert lines[-1].path == "/books/13" and lines[-1].method == "GET" and lines[-1].duration_ms >= 0
    assert refused.headers["X-Request-Id"] == "r-409"


def test_urls_and_headers_over_our_limits_are_refused_as_json_before_the_app() -> None:
    app = make_app("edge-limits")
    client = app.test_client()
    long_url = client.get("/books/1?" + "x=1&" * 3000)
    assert long_url.status_code == 414 and long_url.json["error"]["code"] == 414
    big = client.get("/books/1", headers={"X-Pad": "p" * 17_000})
    assert big.status_code == 431 and "16 KiB" in big.json["error"]["message"]
    assert big.headers["X-Request-Id"]
    assert client.get("/books/1", headers={"X-Pad": "p" * 15_000}).status_code == 200
    assert count("edge-limits", "unmatched", "GET", 414) == 1 and count("edge-limits", "/books/<int:n>", "GET", 200) == 1


def test_a_shortcut_answers_before_flask_or_passes_the_request_on() -> None:
    app = make_app("edge-shortcut")
    seen: list[str] = []

    def shortcut(environ: dict[str, Any]) -> Any:
        seen.append(environ["PATH_INFO"])
        if environ["PATH_INFO"] == "/books/7":
            return "/books/<int:n>", b'{"n":7,"fast":true}\n', [("X-Cache", "hit")]
        return None

    app.extensions["pygmy_edge"].shortcut = shortcut
    client = app.test_client()
    fast = client.get("/books/7", headers={"X-Request-Id": "fast-1"})
    assert fast.status_code == 200 and fast.json == {"n": 7, "fast": True}
    assert fast.headers["Content-Type"] == "application/json" and fast.headers["X-Cache"] == "hit"
    assert fast.headers["X-Request-Id"] == "fast-1" and int(fast.headers["Content-Length"]) == len(fast.data)
    assert client.get("/books/8").json == {"n": 8}  # passed on to Flask
    assert seen == ["/books/7", "/books/8"]
    assert count("edge-shortcut", "/books/<int:n>", "GET", 200) == 2


def test_answers_are_the_json_flask_would_write_compact_through_orjson() -> None:
    """``CompactJSON``: the same values and key order as Flask's provider; what orjson cannot encode
    (an integer over 64 bits, a lone surrogate) and other layouts fall back to Flask's own dumps."""
    import datetime
    import json

    from flask.json.provider import DefaultJSONProvider

    app = create_base_app("json-svc")
    flask_json = DefaultJSONProvider(app)
    flask_json.sort_keys = False
    when = datetime.datetime(2026, 11, 25, 12, 0, tzinfo=datetime.UTC)
    for value in ({"z": 1, "a": [1.5, None, True], "t": "RPCs f\u00fcr Dummies"}, {"n": 2**70}, ["\ud800"],
                  {"at": when}, 1e16, {"x": float("nan"), "y": None}):
        ours = app.json.dumps(value, separators=(",", ":"))
        assert repr(json.loads(ours)) == repr(json.loads(flask_json.dumps(value, separators=(",", ":"))))
        if isinstance(value, dict):
            assert list(json.loads(ours)) == list(value)  # key order kept
    assert app.json.dumps({"t": "\u00e9"}, separators=(",", ":")) == '{"t":"\u00e9"}'  # orjson: UTF-8
    assert app.json.dumps({"a": 1}) == '{"a": 1}'  # no separators given: Flask's own layout
    with app.test_request_context():
        resp = app.json.response({"b": 2, "a": "\u00e9"})
    assert resp.get_data() == '{"b":2,"a":"\u00e9"}\n'.encode()
    assert resp.mimetype == "application/json"


@pytest.mark.parametrize("raw", [b"[" * 2000, b'{"a":' * 2000, b"nul", b" "])
def test_a_body_that_is_not_json_is_a_400_however_deep_it_nests(raw: bytes) -> None:
    """``json`` raises RecursionError, not ValueError, for arrays nested past its stack: still the
    client's mistake (400), never a crash of the thread, or event loop, reading it."""
    with pytest.raises(ApiError) as caught:
        json_object(raw)
    assert caught.value.code == 400
