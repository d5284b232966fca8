"""Flask plumbing every Pygmy service shares: JSON errors, the secret and token guards, body parsing."""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable, Iterable
from functools import wraps
from typing import Any, NoReturn

from flask import Flask, Response, g, jsonify, request
from prometheus_client.registry import Collector
from werkzeug.exceptions import HTTPException

from cluster.admission import Admission, deadline_of
from cluster.logs import HEADER as REQUEST_ID_HEADER
from cluster.logs import current_request_id
from cluster.metrics import instrument

MAX_BODY = 64 * 1024
#: The app's own limits, below Gunicorn's (cluster/serve.py), so the answer is ours and JSON.
MAX_URL = 8 * 1024
MAX_HEADERS = 16 * 1024

access_log = logging.getLogger("pygmy.access")
#: Internal routes hit many times a second; their routine answers are logged at DEBUG only.
QUIET_PATHS = frozenset({"/raft/read_index"})


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


def create_base_app(name: str, extra_metrics: Callable[[], Iterable[Collector]] | None = None,
                    limits: dict[str, int] | None = None) -> Flask:
    """A Flask app whose every error, including 404/405/413/414/431 and crashes, is a JSON body.

    In front of it, admission control (``cluster/admission.py``): ``limits`` caps the requests in
    flight per class, and every request's time budget is read from its header.

    It also gives every request an id (``X-Request-Id``, echoed back) and writes one access line
    per request, so a request can be followed across services in the logs.
    """
    app = Flask(name)
    app.wsgi_app = Admission(app.wsgi_app, name, limits or {})  # type: ignore[method-assign]
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY
    instrument(app, name, extra_metrics)
    app.json.sort_keys = False  # type: ignore[attr-defined]

    @app.before_request
    def _limits_and_id() -> None:
        g.pygmy_access_started = time.perf_counter()
        current_request_id()
        target = request.environ.get("RAW_URI") or request.full_path
        if len(target) > MAX_URL:
            fail(414, f"URL longer than {MAX_URL // 1024} KiB")
        size = sum(len(k) + len(v) + 4 for k, v in request.headers.items())
        if size > MAX_HEADERS:
            fail(431, f"request headers larger than {MAX_HEADERS // 1024} KiB in all")

    @app.after_request
    def _echo_and_log(resp: Response) -> Response:
        rid = current_request_id()
        if rid:
            resp.headers[REQUEST_ID_HEADER] = rid
        code = resp.status_code
        if code in (401, 403):
            level = logging.WARNING  # refused credentials are worth seeing
        elif (request.path in QUIET_PATHS and (code < 400 or code == 421)) or (
                request.method == "GET" and code < 400):
            # Read-index requests and successful reads: routine and many per second. A line
            # each would cost more than a cached lookup itself; PYGMY_LOG_LEVEL=DEBUG shows them.
            level = logging.DEBUG
        else:
            level = logging.INFO
        if not access_log.isEnabledFor(level):
            return resp
        started = g.get("pygmy_access_started")
        duration = None if started is None else round((time.perf_counter() - started) * 1000, 3)
        path = request.path if len(request.path) <= 512 else request.path[:512] + "..."
        access_log.log(level, "%s %s %s", request.method, path, code,
                        extra={"method": request.method, "path": path, "status": resp.status_code,
                               "duration_ms": duration})
        return resp

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
            414: f"URL longer than {MAX_URL // 1024} KiB",
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


def require_secret(secret: str, what: str = INTERNAL) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Guard an endpoint with ``Authorization: Bearer <secret>`` (constant time): the internal
    secret on internal endpoints, the admin token on the admin one.

    No credentials: 401. Wrong credentials: 403. Either way the request changes nothing.
    """
    expected = f"Bearer {secret}".encode()

    def decorate(view: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(view)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            refused = secret_refusal(request.headers.get("Authorization"), expected, what)
            if refused:
                fail(*refused)
            return view(*args, **kwargs)

        return guarded

    return decorate


def json_body(required: bool = False) -> dict[str, Any]:
    """The request's JSON object; 400 for anything else (an empty body is ``{}`` unless required)."""
    raw = request.get_data(cache=True)
    if not raw.strip():
        if required:
            fail(400, "a JSON object body is required")
        return {}
    try:
        data = request.get_json(force=True, silent=False)
    except HTTPException:
        fail(400, "body is not valid JSON")
    if not isinstance(data, dict):
        fail(400, "body must be a JSON object")
    return data


def parse_item(value: str, what: str = "item number") -> int:
    """Path numbers: positive integers that fit SQLite, else a clear 400."""
    if not value.isascii() or not value.isdigit() or len(value) > 18 or int(value) < 1:
        fail(400, f"malformed {what} {value[:40]!r}: expected a positive integer")
    return int(value)


def query_int(name: str, lo: int, hi: int, default: int) -> int:
    """A query parameter that must be a plain decimal integer within bounds, else a clear 400."""
    raw = request.args.get(name)
    if raw is None:
        return default
    if not raw.isascii() or not raw.isdigit() or len(raw) > 18 or not lo <= int(raw) <= hi:
        fail(400, f"{name} must be an integer between {lo} and {hi}, not {raw[:40]!r}")
    return int(raw)


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
