"""The launcher's control socket: how a dashboard's kill, pause and start buttons reach ``pygmy up``.

``pygmy up`` owns every service process it starts (it reaps them and stops them on exit), so faults
injected from a page are carried out by it too: it listens on a Unix socket in the run dir
(``D/run/control.sock``, mode 0600) and a frontend worker sends one JSON request per connection.
Only local processes that can open that file can use it. A cluster not started by ``pygmy up``
(containers, a test harness) has no socket: the dashboard shows no fault buttons and the frontend
refuses fault requests.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SOCKET_NAME = "control.sock"
ACTIONS = ("kill", "pause", "start")
#: The longest pause a request may ask for: a replica must not stay stopped by mistake for long.
MAX_PAUSE = 60.0
MAX_REQUEST = 4096
#: The kernel's limit on a Unix socket's path (``sun_path``), terminating NUL included.
MAX_PATH = 107


class ControlError(Exception):
    """A request the launcher could not carry out, with the HTTP status the frontend answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def socket_path(run_dir: Path) -> Path:
    return run_dir / SOCKET_NAME


def available(run_dir: Path) -> bool:
    """Whether a launcher serves fault requests for this data dir (its socket exists)."""
    path = socket_path(run_dir)
    try:
        return path.is_socket()
    except OSError:
        return False


def request(run_dir: Path, body: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """Send one request to the launcher and return its answer; ``ControlError`` if it refused or is
    not there."""
    path = socket_path(run_dir)
    if not available(run_dir):
        raise ControlError(409, "fault injection needs a cluster started by `pygmy up` on this machine")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(str(path))
            s.sendall(json.dumps(body).encode() + b"\n")
            s.shutdown(socket.SHUT_WR)
            raw = b""
            while chunk := s.recv(65536):
                raw += chunk
        except OSError as exc:
            raise ControlError(503, f"the launcher (pygmy up) did not answer: {exc}") from None
    try:
        answer = json.loads(raw)
    except ValueError:
        raise ControlError(503, "the launcher (pygmy up) gave no answer") from None
    if "error" in answer:
        raise ControlError(int(answer["error"]["code"]), str(answer["error"]["message"]))
    return answer


class ControlServer:
    """Serves requests on the socket, one at a time, on a thread of its own; ``close`` stops it.

    ``handle(request)`` carries a request out and returns the answer, or raises ``ControlError``.
    ``idle()`` runs about every 0.2 s between requests (the launcher resumes paused services there).
    """

    def __init__(self, run_dir: Path, handle: Callable[[dict[str, Any]], dict[str, Any]],
                 idle: Callable[[], None] = lambda: None) -> None:
        self.path = socket_path(run_dir)
        if len(str(self.path)) > MAX_PATH:
            raise ControlError(500, f"the control socket's path is too long for a Unix socket: {self.path}")
        self._handle, self._idle = handle, idle
        self.path.unlink(missing_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # owner only: the socket is as powerful as `kill`
        try:
            self._sock.bind(str(self.path))
        finally:
            os.umask(old)
        self._sock.listen(8)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        self.path.unlink(missing_ok=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self._idle()
            except Exception:
                log.exception("control: idle work failed")
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                continue
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(2.0)
        raw = b""
        try:
            while len(raw) <= MAX_REQUEST and (chunk := conn.recv(4096)):
                raw += chunk
        except OSError:
            return
        try:
            body = json.loads(raw) if len(raw) <= MAX_REQUEST else None
            if not isinstance(body, dict):
                raise ControlError(400, "a control request is one JSON object")
            answer = self._handle(body)
        except ControlError as exc:
            answer = {"error": {"code": exc.status, "message": str(exc)}}
        except ValueError:
            answer = {"error": {"code": 400, "message": "a control request is one JSON object"}}
        except Exception as exc:  # a bug must not take the launcher's control thread down
            log.exception("control: request failed")
            answer = {"error": {"code": 500, "message": f"the launcher failed: {exc}"}}
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps(answer).encode())
