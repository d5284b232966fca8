"""``scripts/healthcheck.py``, the container health check: ``/readyz`` until the service has once
been ready (a startup probe), then ``/livez`` only; a restarted container (another start time of
its first process) starts over."""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "healthcheck.py"


class Service:
    """A stand-in answering ``/readyz`` and ``/livez`` with the codes set here, recording the paths asked."""

    def __init__(self) -> None:
        self.codes = {"/readyz": 503, "/livez": 200}
        self.asked: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.asked.append(self.path)
                code = outer.codes.get(self.path, 404)
                self.send_response(code)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def service() -> Iterator[Service]:
    s = Service()
    yield s
    s.close()


def load(monkeypatch: pytest.MonkeyPatch, port: int, mark: Path, boot: str):
    spec = importlib.util.spec_from_file_location("healthcheck", SCRIPT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setenv("PYGMY_PORT", str(port))
    monkeypatch.setenv("PYGMY_PROBE_MARK", str(mark))
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "started_at", lambda: boot)
    return mod


def test_readiness_until_first_ready_then_liveness_only(service: Service, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    mark = tmp_path / "ready-once"
    hc = load(monkeypatch, service.port, mark, "1234")
    assert hc.main() == 1 and service.asked == ["/readyz"]   # starting: not yet ready
    service.codes["/readyz"] = 200
    assert hc.main() == 0 and mark.read_text() == "1234"
    service.codes["/readyz"] = 503                           # its tier elects: not ready, but live
    assert hc.main() == 0 and service.asked[-1] == "/livez"
    service.codes["/livez"] = 503                            # a stuck process: unhealthy
    assert hc.main() == 1 and service.asked[-1] == "/livez"
    # A restarted container (another start time): readiness first again.
    hc = load(monkeypatch, service.port, mark, "5678")
    assert hc.main() == 1 and service.asked[-1] == "/readyz"


def test_nothing_listening_is_unhealthy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hc = load(monkeypatch, port, tmp_path / "mark", "1")
    assert hc.main() == 1


def test_live_mode_asks_livez_from_the_start(service: Service, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``healthcheck.py live``, the replicas' check under Compose and Swarm: never /readyz, since
    Swarm would keep a replica that is not yet healthy out of DNS, where its peers look for it."""
    hc = load(monkeypatch, service.port, tmp_path / "mark", "1")
    monkeypatch.setattr("sys.argv", ["healthcheck.py", "live"])
    assert hc.main() == 0 and service.asked == ["/livez"]
