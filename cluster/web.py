"""Flask plumbing every Pygmy service shares: JSON errors, the cluster secret, body parsing."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from functools import wraps
from typing import Any, NoReturn

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from cluster.metrics import instrument

MAX_BODY = 64 * 1024


class ApiError(Exception):
    """An error answer with a status code; becomes ``{"error": {"code", "message"}}``."""

    def __init__(self, code: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.code, self.message, self.extra = code, message, extra


def error_response(code: int, message: str, **extra: Any) -> Response:
    body: dict[str, Any] = {"error": {"code": code, "message": message, **extra}}
    resp = jsonify(body)
    resp.status_code = code
    return resp


def fail(code: int, message: str, **extra: Any) -> NoReturn:
    raise ApiError(code, message, **extra)


def create_base_app(name: str) -> Flask:
    """A Flask app whose every error, including 404/405/413 and crashes, is a JSON body."""
    app = Flask(name)
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY
    instrument(app, name)
    app.json.sort_keys = False  # type: ignore[attr-defined]

    @app.errorhandler(ApiError)
    def _api_error(exc: ApiError) -> Response:
        return error_response(exc.code, exc.message, **exc.extra)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Response:
        code = exc.code or 500
        messages = {
            404: "no such resource", 405: f"method {request.method} not allowed here",
            413: f"request body larger than {MAX_BODY // 1024} KiB",
        }
        return error_response(code, messages.get(code, exc.description or exc.name))

    @app.errorhandler(Exception)
    def _crash(exc: Exception) -> Response:
        app.logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, "internal error")

    return app


def require_secret(secret: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Guard an internal or admin endpoint with ``Authorization: Bearer <secret>`` (constant time).

    No credentials: 401. Wrong credentials: 403. Either way the request changes nothing.
    """
    expected = f"Bearer {secret}".encode()

    def decorate(view: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(view)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            given = request.headers.get("Authorization")
            if not given:
                fail(401, "this endpoint needs the cluster secret (Authorization: Bearer <secret>)")
            if not hmac.compare_digest(given.encode("utf-8", "replace"), expected):
                fail(403, "wrong cluster secret")
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


