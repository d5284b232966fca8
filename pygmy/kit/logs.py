"""Structured logs: one JSON object per line, each carrying the request id it belongs to.

Every service logs to stderr (``pygmy up`` sends that to ``D/logs/<name>.log``). A request id
(``X-Request-Id``) is taken from the incoming request or made up, echoed in the response and sent on
with every call to another tier (``pygmy.replication.router``), so ``grep <id> D/logs/*.log`` follows one
buy through frontend, order and catalog.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import uuid
from collections.abc import Iterator
from contextvars import ContextVar, Token
from datetime import UTC, datetime
from typing import Any

HEADER = "X-Request-Id"
#: Ids we accept from outside: short and printable, so they are safe to log and to pass on.
_VALID_ID = re.compile(r"^[A-Za-z0-9._:/+=@-]{1,128}$")
#: Attributes every LogRecord has; anything else was passed with ``extra=`` and goes into the JSON.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


_ID_PREFIX = uuid.uuid4().hex[:12]
_ID_COUNTER = itertools.count(1)


def new_request_id() -> str:
    """Unique across hosts and processes (random prefix, pid) and cheap: no random bytes per request."""
    return f"{_ID_PREFIX}{os.getpid():x}-{next(_ID_COUNTER)}"


#: The id of the request this thread is serving: set by the HTTP edge (``pygmy.kit.web.Edge``) and
#: by the frame server (``ReplicaRuntime.serve_frames``) for the time of each request.
_REQUEST_ID: ContextVar[str | None] = ContextVar("pygmy_request_id", default=None)


def valid_request_id(given: Any) -> str:
    """``given`` if it is an id we accept from outside, else a new one."""
    return given if isinstance(given, str) and _VALID_ID.match(given) else new_request_id()


def set_request_id(rid: str | None) -> Token[str | None]:
    """Log with ``rid`` and carry it on until ``reset_request_id`` (the HTTP edge's own scope)."""
    return _REQUEST_ID.set(rid)


def reset_request_id(token: Token[str | None]) -> None:
    _REQUEST_ID.reset(token)


@contextlib.contextmanager
def request_id_scope(rid: str) -> Iterator[None]:
    """While serving a request that came as a frame, log with its id and carry it on."""
    token = _REQUEST_ID.set(rid)
    try:
        yield
    finally:
        _REQUEST_ID.reset(token)


def current_request_id() -> str | None:
    """The id of the request this thread is serving, if any (outbound calls carry it on)."""
    return _REQUEST_ID.get()


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class RequestIdFilter(logging.Filter):
    """Stamps each record with the current request's id (None outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            try:
                record.request_id = current_request_id()
            except Exception:  # never lose a log line over its id
                record.request_id = None
        return True


def handler(service: str) -> logging.Handler:
    h = logging.StreamHandler()
    h.setFormatter(JsonFormatter(service))
    h.addFilter(RequestIdFilter())
    return h


def setup(service: str, level: int | None = None) -> None:
    """Send the root logger (every app logger) to one JSON handler on stderr, replacing any other.

    The level is ``PYGMY_LOG_LEVEL`` (e.g. ``DEBUG`` to see every request) unless given; INFO by default.
    """
    if level is None:
        name = os.environ.get("PYGMY_LOG_LEVEL", "INFO").upper()
        level = logging.getLevelName(name) if isinstance(logging.getLevelName(name), int) else logging.INFO
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler(service))
    root.setLevel(level)


def gunicorn_logconfig(service: str) -> dict[str, Any]:
    """Gunicorn's own lines (boot, worker exits, bad requests) in the same JSON format."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter, "service": service}},
        "filters": {"rid": {"()": RequestIdFilter}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json", "filters": ["rid"],
                                "stream": "ext://sys.stderr"}},
        "loggers": {
            "gunicorn.error": {"level": "INFO", "handlers": ["stderr"], "propagate": False},
            "gunicorn.access": {"level": "WARNING", "handlers": [], "propagate": False},
        },
        "root": {"level": "INFO", "handlers": ["stderr"]},
    }
