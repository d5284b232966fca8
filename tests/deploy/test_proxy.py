"""The reverse proxy (``deploy/proxy/nginx.conf``, #39) in front of two frontends of a real cluster,
on loopback: nginx from Debian, run with the shipped configuration (only its upstream addresses,
port and paths changed). Pipelined requests through it are answered in order; every answer has an
``X-Request-Id`` (the client's, or one the proxy made and the frontend echoes); both frontends
serve, and each gets its cache pushes; with one frontend killed, lookups and buys go on; with none,
the proxy's own answer is a JSON 503 with an id."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests
from harness import Cluster, free_port_base, http_answers, pygmy, start_cluster, wait_for

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "deploy" / "proxy" / "nginx.conf"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
pytestmark = pytest.mark.skipif(not Path(NGINX).exists(), reason="nginx is not installed (.ci/run installs nginx-light)")


def load_render():
    spec = importlib.util.spec_from_file_location("proxy_render", ROOT / "deploy" / "proxy" / "render.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def proxy_conf(text: str, frontends: list[str], port: int, run: Path, certs: Path | None = None) -> str:
    """The shipped configuration with loopback upstreams, a port and paths of the test's own, as the
    proxy's image renders it (``deploy/proxy/render.py``); with ``certs``, TLS on both sides."""
    return load_render().render(text, [urlsplit(u).netloc for u in frontends], f"127.0.0.1:{port}", str(run),
                                as_root=os.geteuid() == 0, certs=str(certs) if certs else None)


def test_render_names_other_frontends_and_keeps_their_parameters() -> None:
    text = CONF.read_text()
    out = load_render().render(text, ["frontend:8000"], None)
    assert "server frontend:8000 max_fails=1 fail_timeout=2s;" in out
    assert "frontend-1" not in out and "frontend-2" not in out
    assert load_render().render(text) == text
    with pytest.raises(ValueError):
        load_render().render(text, ["not an address"])


@contextlib.contextmanager
def proxy_before(c: Cluster, run: Path, certs: Path | None = None, ready: str = "/livez") -> Iterator[str]:
    """nginx with the shipped configuration before ``c``'s two frontends, answering ``ready`` through
    them: its URL while the block runs. If it never does, the failure shows what nginx said."""
    run.mkdir()
    port = free_port_base(1, 1)
    conf = run / "nginx.conf"
    conf.write_text(proxy_conf(CONF.read_text(), [c.cluster_config().frontend_url(k) for k in (1, 2)], port, run,
                               certs))
    checked = subprocess.run([NGINX, "-t", "-q", "-c", str(conf), "-p", str(run)], capture_output=True, text=True,
                             timeout=30)
    assert checked.returncode == 0, checked.stderr
    said = run / "nginx.stderr"
    with said.open("wb") as err:
        proc = subprocess.Popen([NGINX, "-e", "stderr", "-c", str(conf), "-p", str(run), "-g", "daemon off;"],
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        url = f"{'https' if certs else 'http'}://127.0.0.1:{port}"
        verify: str | bool = str(certs / "ca.pem") if certs else True
        try:
            wait_for("the proxy", lambda: _ok(url + ready, verify=verify), 30)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; nginx said: {said.read_text(errors='replace')[-2000:]}") from exc
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@pytest.fixture
def proxied(tmp_path: Path) -> Iterator[tuple[Cluster, str]]:
    c = start_cluster(tmp_path, "--frontends", "2")
    try:
        with proxy_before(c, tmp_path / "proxy") as url:
            yield c, url
    finally:
        c.stop()


def _ok(url: str, verify: str | bool = True) -> bool:
    try:
        return requests.get(url, timeout=2, verify=verify).status_code == 200
    except requests.RequestException:
        return False


def test_through_the_proxy(proxied: tuple[Cluster, str]) -> None:
    c, url = proxied
    netloc = urlsplit(url)
    # Three pipelined lookups (misses: nothing is cached yet) and a search: answered in order.
    paths = ["/lookup/1", "/search/distributed%20systems", "/lookup/2", "/lookup/3"]
    with socket.create_connection((netloc.hostname, netloc.port), timeout=10) as sock:
        sock.sendall(b"".join(f"GET {p} HTTP/1.1\r\nHost: t\r\nX-Request-Id: px-{i}\r\n\r\n".encode()
                              for i, p in enumerate(paths)))
        got = http_answers(sock, len(paths))
    for i, (path, (status, headers, body)) in enumerate(zip(paths, got, strict=True)):
        assert status == 200 and headers["x-request-id"] == f"px-{i}", (path, status, headers)
        if path.startswith("/lookup/"):
            assert json.loads(body)["item_number"] == int(path.rsplit("/", 1)[1])
    # No id given: the proxy makes one, which the frontend echoes.
    r = requests.get(url + "/lookup/1", timeout=5)
    assert r.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", r.headers["X-Request-Id"])

    # Both frontends serve through it, and each gets its cache pushes: an update through the proxy
    # is seen at once by a lookup straight at either frontend (each cached book 4 before it).
    names = {requests.get(url + "/status", timeout=5).json()["frontend"]["name"] for _ in range(12)}
    assert names == {"frontend-1", "frontend-2"}, names
    direct = [c.cluster_config().frontend_url(k) for k in (1, 2)]
    for d in direct:
        requests.get(d + "/lookup/4", timeout=5).raise_for_status()
    before = requests.get(direct[0] + "/lookup/4", timeout=5).json()["stock"]
    token = {"Authorization": f"Bearer {c.admin_token()}"}
    r = requests.post(url + "/update/4", json={"stock_delta": 5}, headers=token, timeout=10)
    assert r.status_code == 200, r.text
    for d in direct:
        assert requests.get(d + "/lookup/4", timeout=5).json()["stock"] == before + 5, d

    # frontend-1 killed: lookups and buys go on through the proxy (a buy retried with its key).
    c.kill("frontend-1")
    for i in range(20):
        r = requests.get(url + f"/lookup/{1 + i % 7}", timeout=5)
        assert r.status_code == 200, (i, r.status_code, r.text)
    for _ in range(5):
        key = uuid.uuid4().hex
        deadline = time.monotonic() + 20
        while True:
            r = requests.post(url + "/buy/4", headers={"Idempotency-Key": key}, timeout=35)
            if r.status_code in (200, 409) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200, r.text

    # No frontend at all: the proxy's own answer, JSON with an id.
    c.kill("frontend-2")
    r = requests.get(url + "/lookup/1", headers={"X-Request-Id": "none-left"}, timeout=10)
    assert r.status_code == 503 and r.headers["X-Request-Id"] == "none-left"
    assert r.json()["error"]["code"] == 503 and r.headers["Retry-After"] == "1"


def test_through_the_proxy_over_tls(tmp_path: Path) -> None:
    """With ``--tls`` (#38): clients get HTTPS from the proxy (its own certificate, ``pygmy certs --only
    proxy``), plain HTTP on its port is refused as JSON, and the proxy reaches the frontends, which
    refuse plain text, over HTTPS verified against the cluster's CA."""
    c = start_cluster(tmp_path, "--tls", "--frontends", "2", "--catalog-replicas", "2", "--order-replicas", "2")
    try:
        certs = c.data_dir / "certs"
        made = pygmy("certs", "--data-dir", str(c.data_dir), "--only", "proxy", "--host", "localhost")
        assert made.returncode == 0 and (certs / "proxy.pem").exists(), made.stderr
        with proxy_before(c, tmp_path / "proxy", certs, ready="/readyz") as url:
            ca = str(certs / "ca.pem")
            r = requests.get(url + "/lookup/1", headers={"X-Request-Id": "tls-1"}, verify=ca, timeout=5)
            assert r.status_code == 200 and r.json()["item_number"] == 1 and r.headers["X-Request-Id"] == "tls-1"
            r = requests.post(url + "/buy/1", headers={"Idempotency-Key": uuid.uuid4().hex}, verify=ca, timeout=35)
            assert r.status_code == 200, r.text
            plain = requests.get(url.replace("https://", "http://") + "/lookup/1", timeout=5)
            assert plain.status_code == 400 and plain.json()["error"]["code"] == 400
            names = {requests.get(url + "/status", verify=ca, timeout=5).json()["frontend"]["name"] for _ in range(12)}
            assert names == {"frontend-1", "frontend-2"}, names
    finally:
        c.stop()
