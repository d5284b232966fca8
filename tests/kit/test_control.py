"""The launcher's control socket (``pygmy/kit/control.py``) and what ``pygmy up`` does with it
(``launcher.Faults``), without a cluster: the whole path with one is in ``tests/frontend/test_dashboard*.py``."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pygmy.cluster.launcher import Faults
from pygmy.kit import control
from pygmy.kit.config import ClusterConfig


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, list[dict[str, Any]], list[int]]]:
    seen: list[dict[str, Any]] = []
    idles: list[int] = []

    def handle(req: dict[str, Any]) -> dict[str, Any]:
        seen.append(req)
        if req.get("action") == "refuse":
            raise control.ControlError(409, "not now")
        if req.get("action") == "crash":
            raise KeyError("a bug")
        return {"ok": True, "message": f"did {req['action']}"}

    server = control.ControlServer(tmp_path, handle, lambda: idles.append(1))
    server.start()
    yield tmp_path, seen, idles
    server.close()
    assert not control.available(tmp_path), "closing removes the socket"


def test_requests_get_the_launchers_answers(served: tuple[Path, list, list]) -> None:
    run, seen, idles = served
    assert control.available(run)
    assert (run / control.SOCKET_NAME).stat().st_mode & 0o077 == 0, "only the owner may use it"
    assert control.request(run, {"action": "kill", "name": "catalog-1"}) == {"ok": True, "message": "did kill"}
    with pytest.raises(control.ControlError) as refused:
        control.request(run, {"action": "refuse"})
    assert (refused.value.status, str(refused.value)) == (409, "not now")
    with pytest.raises(control.ControlError) as crashed:
        control.request(run, {"action": "crash"})
    assert crashed.value.status == 500
    assert control.request(run, {"action": "again"})["ok"], "a failed request does not stop the server"
    assert [r["action"] for r in seen] == ["kill", "refuse", "crash", "again"]
    assert idles, "idle work runs between requests"


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b"{" + b" " * (control.MAX_REQUEST + 10) + b"}"])
def test_malformed_requests_are_refused(served: tuple[Path, list, list], raw: bytes) -> None:
    run, seen, _ = served
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(run / control.SOCKET_NAME))
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        answer = s.recv(65536)
    assert b'"code": 400' in answer
    assert seen == []


def test_without_a_launcher_requests_are_refused(tmp_path: Path) -> None:
    assert not control.available(tmp_path)
    with pytest.raises(control.ControlError) as refused:
        control.request(tmp_path, {"action": "kill", "name": "catalog-1"})
    assert refused.value.status == 409 and "pygmy up" in str(refused.value)


@pytest.mark.parametrize("req,code", [
    ({"action": "explode", "name": "catalog-1"}, 400),
    ({"action": "kill", "name": "catalog-7"}, 404),
    ({"action": "kill", "name": ["catalog-1"]}, 404),
    ({"action": "kill", "name": "catalog-1"}, 409),  # nothing runs here
    ({"action": "pause", "name": "order-2", "seconds": -1}, 400),
    ({"action": "pause", "name": "order-2", "seconds": "5"}, 400),
    ({"action": "pause", "name": "order-2", "seconds": 5}, 409),
])
def test_faults_refuse_what_they_cannot_do(tmp_path: Path, req: dict[str, Any], code: int) -> None:
    said: list[str] = []
    faults = Faults(ClusterConfig(data_dir=str(tmp_path)), said.append)
    with pytest.raises(control.ControlError) as refused:
        faults.handle(req)
    assert refused.value.status == code
    assert said == [], "nothing was done, so nothing is reported"
