"""Flask plumbing every Pygmy service shares: JSON errors, the secret and token guards, body parsing."""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Callable, Collection, Iterable
from email.utils import formatdate
from functools import wraps
from http import HTTPStatus
from typing import Any, NoReturn

import orjson
from flask import Flask, Request, Response, jsonify, request
from flask.json.provider import DefaultJSONProvider
from prometheus_client.registry import Collector
from werkzeug.exceptions import HTTPException
from werkzeug.http import HTTP_STATUS_CODES
from werkzeug.routing import Rule

from pygmy.kit import tls
from pygmy.kit.admission import Admission, Deferred, deadline_of
from pygmy.kit.codec import orjson_dumps
from pygmy.kit.logs import HEADER as REQUEST_ID_HEADER
from pygmy.kit.logs import reset_request_id, set_request_id, valid_request_id
from pygmy.kit.metrics import RequestMetrics, instrument

MAX_BODY = 64 * 1024
#: The app's own limits, below Gunicorn's (pygmy/cluster/serve.py), so the answer is ours and JSON.
MAX_URL = 8 * 1024
MAX_HEADERS = 16 * 1024
#: The 414's message, wherever it is given (the app, or the worker for a line Gunicorn would not read).
URL_TOO_LONG = f"URL longer than {MAX_URL // 1024} KiB"

access_log = logging.getLogger("pygmy.access")
#: Internal routes hit many times a second; their routine answers are logged at DEBUG only.
QUIET_PATHS = frozenset({"/raft/read_index"})
_ID_ENVIRON = "HTTP_" + REQUEST_ID_HEADER.upper().replace("-", "_")


class ApiError(Exception):
    """An error answer with a status code; becomes ``{"error": {"code", "message"}}``."""

    def __init__(self, code: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code, self.message, self.extra = code, message, extra


def error_body(code: int, message: str, **extra: Any) -> dict[str, Any]:
    """Every error answer's shape, over HTTP or frames: ``{"error": {"code", "message", ...}}``."""
    return {"error": {"code": code, "message": message, **extra}}


def error_response(code: int, message: str, **extra: Any) -> Response:
    resp = jsonify(error_body(code, message, **extra))
    resp.status_code = code
    return resp


def fail(code: int, message: str, **extra: Any) -> NoReturn:
    raise ApiError(code, message, **extra)


def request_deadline(default: float) -> float:
    """This request's deadline (``time.monotonic()``): what its caller said is left of its time
    (``X-Request-Timeout-Ms``), and at most ``default`` seconds from now."""
    return deadline_of(request.environ, default)


def check_deadline(deadline: float, what: str) -> None:
    """Refuse (504) to start ``what`` once the request's time is up: its caller has gone."""
    if time.monotonic() >= deadline:
        fail(504, f"the request's time budget was spent before {what}")


def _headers_size(environ: dict[str, Any]) -> int:
    """The request headers' size as sent (name, value, ": " and CRLF each), from the WSGI environ."""
    size = 0
    for key, value in environ.items():
        if key.startswith("HTTP_") or key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            size += len(key) - (5 if key[0] == "H" else 0) + len(value) + 4
    return size


_RULE = "pygmy.url_rule"


class EdgeRequest(Request):
    """Flask's request, keeping the route it matched in the environ, where the ``Edge`` finds it
    after Flask has let go of the request (it clears ``werkzeug.request`` when it pops it)."""

    @property  # type: ignore[override]
    def url_rule(self) -> Rule | None:
        return self.environ.get(_RULE)

    @url_rule.setter
    def url_rule(self, rule: Rule | None) -> None:
        self.environ[_RULE] = rule


#: An answer given without Flask: the route it counts under, the JSON body, extra headers.
Shortcut = tuple[str, bytes, list[tuple[str, str]]]
#: How the work of a deferred answer answers: ``(status code, JSON body, extra headers)``, once.
Answer = Callable[[int, bytes, list[tuple[str, str]]], None]
#: A write the app can take without Flask: the route it counts under, and the work, which it starts
#: with the ``Answer`` to call when done (``Edge.deferred``).
Later = tuple[str, Callable[[Answer], None]]


class Edge:
    """WSGI middleware around each service's Flask app: what every admitted request gets.

    - an id (``X-Request-Id``, taken if acceptable, else made up; echoed back, logged with every
      line the request causes and sent on with every call to another tier);
    - our own limits on the URL and the headers, answered as JSON (below Gunicorn's);
    - a count and a time in ``/metrics``, by route and status, and one access line (DEBUG for
      successful reads and the peers' read-index requests, which are many per second).

    Done here rather than in Flask's before/after hooks: on a cached lookup, the frontend's
    cheapest answer, four hooks cost as much as the lookup (their context proxies and the
    per-request label lookups).

    ``shortcut(environ)``, if set, may answer a request without Flask: ``(route, body, headers)``
    for a 200 JSON answer, or None to go on to Flask. The frontend answers cached lookups so
    (``frontend/app.py``), which makes a hit cheaper than a bare Flask endpoint's answer.

    ``deferred(path, headers, body)``, if set, may take a POST that has wholly arrived without
    Flask and answer it later (``early``): the frontend's buys, which wait on the order tier.
    """

    def __init__(self, app: Callable[..., Any], service: str) -> None:
        self.app = app
        self.metrics = RequestMetrics(service)
        self.shortcut: Callable[[dict[str, Any]], Shortcut | None] | None = None
        self.deferred: Callable[[str, dict[bytes, bytes], bytes], Later | None] | None = None

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        started = time.perf_counter()
        rid = valid_request_id(environ.get(_ID_ENVIRON))
        token = set_request_id(rid)
        try:
            return self._serve(environ, start_response, rid, started)
        finally:
            reset_request_id(token)

    def _serve(self, environ: dict[str, Any], start_response: Callable[..., Any], rid: str,
               started: float) -> Iterable[bytes]:
        status: list[str] = []

        def respond(line: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            status.append(line)
            headers.append((REQUEST_ID_HEADER, rid))
            return start_response(line, headers, exc_info)

        method = environ.get("REQUEST_METHOD", "GET")
        route: str | None = None
        if len(environ.get("RAW_URI") or environ.get("PATH_INFO", "")) > MAX_URL:
            result: Iterable[bytes] = _refuse(respond, 414, URL_TOO_LONG)
        elif _headers_size(environ) > MAX_HEADERS:
            result = _refuse(respond, 431, f"request headers larger than {MAX_HEADERS // 1024} KiB in all")
        elif self.shortcut is not None and (answer := self.shortcut(environ)) is not None:
            route, body, headers = answer
            respond("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body))), *headers])
            result = [body]
        else:
            result = self.app(environ, respond)
            route = None
        code = int(status[-1][:3]) if status else 500
        if route is None:
            rule = environ.get(_RULE)
            route = rule.rule if rule is not None else "unmatched"
        self._record(route, method, environ.get("PATH_INFO", ""), code, started)
        return result

    def early(self, method: str, path: str, query: str, headers: dict[bytes, bytes],
              body: bytes = b"") -> bytes | Deferred | None:
        """The whole HTTP answer to a request not yet parsed, if the ``shortcut`` gives one, or a
        ``Deferred`` one if ``deferred`` takes it; else None.

        For ``pygmy/cluster/worker.py``, which answers so from Gunicorn's event loop: a cached read then
        costs no pool thread, no parse into an environ and no hand-off between threads (each a
        wait for the worker's GIL under load), and a buy holds no thread while the order tier
        works on it. ``path`` is decoded as in ``PATH_INFO``, ``query`` as sent, ``headers``
        have lower-case names; the request is short (the worker looks at 8 KiB at most), so the
        size limits hold. The answer is the one ``__call__`` would give, with the same id, count
        and access line."""
        started = time.perf_counter()
        request_id = headers.get(b"x-request-id")
        rid = valid_request_id(request_id.decode("latin-1") if request_id is not None else None)
        if method == "POST" and self.deferred is not None:
            later = self.deferred(path, headers, body)
            if later is None:
                return None
            route, work = later

            def start(deliver: Callable[[bytes], None]) -> None:
                def answer(code: int, out: bytes, extra: list[tuple[str, str]]) -> None:
                    token = set_request_id(rid)
                    try:
                        self._record(route, method, path, code, started)
                    finally:
                        reset_request_id(token)
                    deliver(_render(code, out, extra, rid))

                token = set_request_id(rid)  # the work's own log lines carry the id too
                try:
                    work(answer)
                finally:
                    reset_request_id(token)

            return Deferred(start)
        if self.shortcut is None or method != "GET":
            return None
        answer = self.shortcut({"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query})
        if answer is None:
            return None
        route, out, extra = answer
        token = set_request_id(rid)
        try:
            self._record(route, method, path, 200, started)
        finally:
            reset_request_id(token)
        return _render(200, out, extra, rid)

    def _record(self, route: str, method: str, path: str, code: int, started: float) -> None:
        """The request's count and time in ``/metrics`` and its access line."""
        elapsed = time.perf_counter() - started
        self.metrics.observe(route, method, code, elapsed)
        if code in (401, 403):
            level = logging.WARNING  # refused credentials are worth seeing
        elif (code < 400 and method == "GET") or (path in QUIET_PATHS and (code < 400 or code == 421)):
            # Successful reads and read-index requests: routine and many per second. A line
            # each would cost more than a cached lookup itself; PYGMY_LOG_LEVEL=DEBUG shows them.
            level = logging.DEBUG
        else:
            level = logging.INFO
        if access_log.isEnabledFor(level):
            path = path if len(path) <= 512 else path[:512] + "..."
            access_log.log(level, "%s %s %s", method, path, code, extra={
                "method": method, "path": path, "status": code, "duration_ms": round(elapsed * 1000, 3)})


def _render(code: int, body: bytes, headers: list[tuple[str, str]], rid: str) -> bytes:
    """A whole HTTP/1.1 answer with a JSON body, as Flask under Gunicorn would write it (status
    line as Werkzeug's, less Gunicorn's ``Server`` and ``Connection`` headers)."""
    head = "".join(f"{k}: {v}\r\n" for k, v in headers)
    return (f"HTTP/1.1 {code} {HTTP_STATUS_CODES.get(code, 'UNKNOWN').upper()}\r\nDate: {_http_date()}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{head}"
            f"{REQUEST_ID_HEADER}: {rid}\r\n\r\n").encode("latin-1") + body


def _http_date() -> str:
    """Now as an HTTP ``Date`` (the same string for a whole second: formatting it costs more than a hit)."""
    now = int(time.time())
    if _date[0] != now:
        _date[:] = [now, formatdate(now, usegmt=True)]
    return _date[1]


_date: list[Any] = [0, ""]


def _refuse(start_response: Callable[..., Any], code: int, message: str) -> list[bytes]:
    body = json.dumps(error_body(code, message)).encode()
    start_response(f"{code} {HTTPStatus(code).phrase}", [("Content-Type", "application/json"),
                                                         ("Content-Length", str(len(body)))])
    return [body]



#: Datetimes and dataclasses go to Flask's ``default``, which writes them its own way.
_ORJSON_PASS = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS


class CompactJSON(DefaultJSONProvider):
    """Flask's compact JSON (every answer, and a cache hit's body, encoded per request) through
    orjson: ``json.dumps`` was a ninth of a frontend's CPU under the 40/40/20 mix. Keys keep their
    order; text is UTF-8 rather than ``\\u`` escapes (the same JSON). What orjson cannot encode
    (integers over 64 bits, lone surrogates, subclasses, floats that are not finite) and any other
    layout go to Flask's own ``dumps``.
    Request bodies are still read by ``json``, so what a request may say is unchanged."""

    sort_keys = False

    def dumps(self, obj: Any, **kwargs: Any) -> str:
        if kwargs.keys() == {"separators"} and kwargs["separators"] == (",", ":"):
            data = orjson_dumps(obj, self.default, _ORJSON_PASS)
            if data is not None:
                return data.decode()
        return super().dumps(obj, **kwargs)


def create_base_app(name: str, extra_metrics: Callable[[], Iterable[Collector]] | None = None,
                    limits: dict[str, int] | None = None, tolerances: dict[str, float] | None = None) -> Flask:
    """A Flask app whose every error, including 404/405/413/414/431 and crashes, is a JSON body.

    In front of it, admission control (``pygmy/kit/admission.py``): ``limits`` caps the requests in
    flight per class (``tolerances``: the classes whose cap follows their latency), and every
    request's time budget is read from its header. Then the ``Edge``:
    ids, size limits, metrics and the access log of every admitted request.
    """
    app = Flask(name)
    app.json = CompactJSON(app)
    app.request_class = EdgeRequest
    edge = app.extensions["pygmy_edge"] = Edge(app.wsgi_app, name)
    app.wsgi_app = Admission(edge, name, limits or {}, edge.metrics, tolerances)  # type: ignore[method-assign]
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY
    instrument(app, extra_metrics)

    @app.errorhandler(ApiError)
    def _api_error(exc: ApiError) -> Response:
        extra = dict(exc.extra)
        retry = extra.pop("retry_after", None)  # a header, not part of the body
        resp = error_response(exc.code, exc.message, **extra)
        if retry is not None:
            resp.headers["Retry-After"] = str(retry)
        return resp

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Response:
        code = exc.code or 500
        messages = {
            404: "no such resource", 405: f"method {request.method} not allowed here",
            413: f"request body larger than {MAX_BODY // 1024} KiB",
            414: URL_TOO_LONG,
            431: f"request headers larger than {MAX_HEADERS // 1024} KiB",
        }
        resp = error_response(code, messages.get(code, exc.description or exc.name))
        allow = dict(exc.get_headers()).get("Allow")
        if allow:  # 405 names the methods that would work
            resp.headers["Allow"] = allow
        return resp

    @app.errorhandler(Exception)
    def _crash(exc: Exception) -> Response:
        app.logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal error")

    return app


INTERNAL = "internal secret"
ADMIN = "admin token"


def secret_refusal(given: str | None, expected: bytes, what: str = INTERNAL) -> tuple[int, str] | None:
    """Why ``given`` (an Authorization header) is refused, or None; the comparison is constant time.

    No credentials: 401. Wrong credentials: 403. Every guarded endpoint uses this; ``what`` names the
    credential it wants (the internal secret, or the admin token on ``POST /update``).
    """
    if not given:
        return 401, f"this endpoint needs the {what} (Authorization: Bearer <{what.replace(' ', '-')}>)"
    if not hmac.compare_digest(given.encode("utf-8", "replace"), expected):
        return 403, f"wrong {what}"
    return None


def require_secret(secret: str, what: str = INTERNAL, roles: Collection[str] | None = None,
                   ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Guard an endpoint with ``Authorization: Bearer <secret>`` (constant time): the internal
    secret on internal endpoints, the admin token on the admin one; with TLS, also with the roles
    whose certificates may call it (``tls.role_refusal``; None: any its listener takes).

    No credentials: 401. Wrong credentials, or a certificate of another role: 403. Either way the
    request changes nothing.
    """
    expected = f"Bearer {secret}".encode()

    def decorate(view: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(view)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            refused = (secret_refusal(request.headers.get("Authorization"), expected, what)
                       or tls.role_refusal(request.environ, roles))
            if refused:
                fail(*refused)
            return view(*args, **kwargs)

        return guarded

    return decorate


def json_body(required: bool = False) -> dict[str, Any]:
    """The request's JSON object; 400 for anything else (an empty body is ``{}`` unless required)."""
    return json_object(request.get_data(cache=True), required)


def json_object(raw: bytes, required: bool = False) -> dict[str, Any]:
    """``raw`` as a JSON object, read as Flask reads a body; 400 for anything else (``json_body``;
    the frontend's event loop reads a buy's body with it too). Only a body of no bytes is empty:
    one of whitespace is not JSON, and must not buy a book as an empty one does."""
    if not raw:
        if required:
            fail(400, "a JSON object body is required")
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than ``json`` reads
        fail(400, "body is not valid JSON")
    if not isinstance(data, dict):
        fail(400, "body must be a JSON object")
    return data


def plain_int(value: str) -> int | None:
    """A plain decimal integer that fits SQLite, or None: "²".isdigit() is true but int("²")
    fails, and a number of thousands of digits is not worth parsing."""
    return int(value) if value.isascii() and value.isdigit() and len(value) <= 18 else None


def parse_item(value: str, what: str = "item number") -> int:
    """Path numbers: positive integers that fit SQLite, else a clear 400."""
    if (number := plain_int(value)) is None or number < 1:
        fail(400, f"malformed {what} {value[:40]!r}: expected a positive integer")
    return number


def query_int(name: str, lo: int, hi: int, default: int) -> int:
    """A query parameter that must be a plain decimal integer within bounds, else a clear 400."""
    raw = request.args.get(name)
    if raw is None:
        return default
    if (number := plain_int(raw)) is None or not lo <= number <= hi:
        fail(400, f"{name} must be an integer between {lo} and {hi}, not {raw[:40]!r}")
    return number


def int_field(data: dict[str, Any], name: str, lo: int, hi: int, default: int | None = None) -> int:
    """A JSON integer (not bool, not float) within bounds."""
    if name not in data:
        if default is None:
            fail(400, f"{name} is required")
        return default
    v = data[name]
    if not isinstance(v, int) or isinstance(v, bool):
        fail(400, f"{name} must be an integer")
    if not lo <= v <= hi:
        fail(400, f"{name} must be between {lo} and {hi}")
    return v




MAX_STOCK_DELTA = 1_000_000_000
MAX_COST = 1_000_000_000.0


def update_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The ``stock_delta`` and ``cost`` of an admin update, checked; 400 unless at least one is given."""
    out: dict[str, Any] = {}
    if "stock_delta" in body:
        out["stock_delta"] = int_field(body, "stock_delta", -MAX_STOCK_DELTA, MAX_STOCK_DELTA)
    if "cost" in body:
        cost = body["cost"]
        if not isinstance(cost, int | float) or isinstance(cost, bool) or not 0 <= cost <= MAX_COST:
            fail(400, f"cost must be a number from 0 to {MAX_COST:.0f}")
        out["cost"] = float(cost)
    if not out:
        fail(400, "give stock_delta, cost, or both")
    return out
