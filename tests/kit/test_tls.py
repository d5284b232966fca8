"""TLS plumbing (pygmy/kit/tls.py) on real sockets: who a peer is, refusals, and reloads from disk."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pygmy.cluster import certs
from pygmy.kit import tls
from pygmy.kit.config import ClusterConfig


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("certs")
    certs.ensure(ClusterConfig(catalog_replicas=1, order_replicas=1), folder)
    return folder


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("other")
    certs.ensure(ClusterConfig(catalog_replicas=1, order_replicas=1), folder)
    return folder


def serve_once(ctx: ssl.SSLContext, then: Callable[[ssl.SSLSocket], Any]) -> tuple[int, list[Any], threading.Thread]:
    """A listener that takes one connection through ``ctx`` and hands it to ``then``."""
    listener = socket.create_server(("127.0.0.1", 0))
    out: list[Any] = []

    def run() -> None:
        with listener:
            conn, _ = listener.accept()
            conn.settimeout(5)
            try:
                with ctx.wrap_socket(conn, server_side=True) as s:
                    out.append(then(s))
            except (OSError, tls.PeerRefused) as exc:
                out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return listener.getsockname()[1], out, thread


def dial(identity: tls.Identity, port: int) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    return identity.client_context().wrap_socket(raw, server_hostname="127.0.0.1")


def test_the_certificate_says_the_role_and_the_names(ca: Path) -> None:
    server = tls.Identity.of(ca, "catalog-1")
    port, seen, thread = serve_once(server.server_context(), lambda s: tls.peer_of(s))
    with dial(tls.Identity.of(ca, "order-1"), port) as s:
        assert tls.peer_of(s) == tls.Peer("catalog", frozenset({"catalog-1", "localhost", "127.0.0.1"}))
    thread.join(5)
    assert seen[0].role == "order" and seen[0].named("order-1") and seen[0].named("order-1/123")
    assert not seen[0].named("order-2")


def test_a_role_not_served_is_refused(ca: Path) -> None:
    port, seen, thread = serve_once(tls.Identity.of(ca, "catalog-1").server_context(),
                                    lambda s: tls.check(s, {"catalog"}))
    with dial(tls.Identity.of(ca, "frontend-1"), port):
        thread.join(5)
    assert isinstance(seen[0], tls.PeerRefused) and "'frontend'" in str(seen[0])


def test_an_endpoint_judges_the_role_of_the_requests_certificate(ca: Path) -> None:
    """With TLS, a request whose certificate's role the endpoint does not take is refused 403, and
    one without a known role too (closed, not open, when a worker did not say it); ``OWN_TIER`` is
    this process's tier. Without TLS the internal secret alone judges."""
    assert tls.role_refusal({}, tls.OPERATOR) is None  # no identity here: plain text
    tls.use(tls.Identity.of(ca, "catalog-1"))
    try:
        assert tls.role_refusal({tls.PEER_ROLE: "admin"}, tls.OPERATOR) is None
        assert tls.role_refusal({tls.PEER_ROLE: "frontend"}, None) is None  # any its listener takes
        code, message = tls.role_refusal({tls.PEER_ROLE: "frontend"}, tls.OPERATOR) or (0, "")
        assert code == 403 and "'frontend'" in message and "admin" in message
        assert tls.role_refusal({}, tls.OPERATOR) is not None
        assert tls.role_refusal({tls.PEER_ROLE: "catalog"}, (tls.OWN_TIER,)) is None
        assert tls.role_refusal({tls.PEER_ROLE: "order"}, (tls.OWN_TIER,)) is not None
    finally:
        tls.use(None)


def test_another_cas_certificate_is_refused_both_ways(ca: Path, other_ca: Path) -> None:
    port, seen, thread = serve_once(tls.Identity.of(ca, "catalog-1").server_context(), tls.peer_of)
    with pytest.raises(ssl.SSLError):
        dial(tls.Identity.of(other_ca, "catalog-2" if (other_ca / "catalog-2.pem").exists() else "catalog-1"), port)
    thread.join(5)
    assert isinstance(seen[0], ssl.SSLError)


def test_without_a_client_certificate_mutual_tls_refuses(ca: Path) -> None:
    port, seen, thread = serve_once(tls.Identity.of(ca, "catalog-1").server_context(), tls.peer_of)
    ctx = ssl.create_default_context(cafile=str(ca / "ca.pem"))
    with pytest.raises((ssl.SSLError, ConnectionError)), ctx.wrap_socket(
            socket.create_connection(("127.0.0.1", port), timeout=5), server_hostname="127.0.0.1") as s:
        s.recv(1)  # TLS 1.3: the server's refusal arrives after the client's handshake ends
    thread.join(5)
    assert isinstance(seen[0], ssl.SSLError)


def plain_answer(port: int, data: bytes = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n") -> bytes:
    """What a listener answers a plain-text request with: b"" when it closes or resets the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        try:
            return s.recv(100)
        except ConnectionResetError:
            return b""


def test_plain_text_is_refused(ca: Path) -> None:
    port, seen, thread = serve_once(tls.Identity.of(ca, "catalog-1").server_context(), tls.peer_of)
    assert not plain_answer(port).startswith(b"HTTP/")
    thread.join(5)
    assert isinstance(seen[0], ssl.SSLError)


@pytest.fixture
def own_ca(tmp_path: Path) -> Iterator[Path]:
    certs.ensure(ClusterConfig(catalog_replicas=1, order_replicas=1), tmp_path)
    yield tmp_path


def serial(s: ssl.SSLSocket) -> int:
    der = s.getpeercert(binary_form=True)
    assert der is not None
    from cryptography import x509
    return x509.load_der_x509_certificate(der).serial_number


def test_a_certificate_replaced_on_disk_is_served_without_a_restart(own_ca: Path) -> None:
    server = tls.Identity.of(own_ca, "catalog-1")
    client = tls.Identity.of(own_ca, "order-1")
    ctx = server.server_context()
    port, _, thread = serve_once(ctx, lambda s: None)
    with dial(client, port) as s:
        before = serial(s)
    thread.join(5)
    certs.issue(own_ca, "catalog-1", "catalog")
    os.utime(own_ca / "catalog-1.pem", ns=(time.time_ns() + 10**9,) * 2)  # a new stamp even within one tick
    assert server.refresh(force=True) and server.reloads == 1
    port, _, thread = serve_once(ctx, lambda s: None)  # the same live context
    with dial(client, port) as s:
        assert serial(s) != before
    thread.join(5)


def test_a_half_written_pair_keeps_the_old_one(own_ca: Path) -> None:
    server = tls.Identity.of(own_ca, "catalog-1")
    server.server_context()
    (own_ca / "catalog-1-key.pem").write_bytes((own_ca / "order-1-key.pem").read_bytes())  # not this cert's key
    assert not server.refresh(force=True) and server.reloads == 0
    certs.issue(own_ca, "catalog-1", "catalog")
    assert server.refresh(force=True)


def test_reloads_are_looked_for_at_most_once_a_second(own_ca: Path) -> None:
    server = tls.Identity.of(own_ca, "catalog-1")
    server.server_context()
    server.refresh(force=True)
    certs.issue(own_ca, "catalog-1", "catalog")
    assert not server.refresh()  # looked just now
    server._looked -= tls.RELOAD_EVERY
    assert server.refresh()


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="pygmy certs"):
        tls.Identity.of(tmp_path, "catalog-1")


def test_requests_and_pool_options() -> None:
    assert tls.requests_options(None) == {}
    opts = tls.requests_options("/c")
    assert opts == {"verify": "/c/ca.pem", "cert": ("/c/admin.pem", "/c/admin-key.pem")}
    assert tls.pool_options() == {}  # no identity in this process


def test_urls_take_this_runs_scheme(ca: Path) -> None:
    assert tls.fit("https://h:1") == "http://h:1" and tls.fit("tcp://h:1") == "tcp://h:1"
    tls.use(tls.Identity.of(ca, "catalog-1"))
    try:
        assert tls.fit("http://h:1") == "https://h:1"
        assert "ssl_context" in tls.pool_options()
    finally:
        tls.use(None)
    config = ClusterConfig(tls=True, members={"catalog": {"catalog-1": "http://10.0.0.1:8101"}})
    assert config.peers("catalog") == {"catalog-1": "https://10.0.0.1:8101"}
    assert config.urls("order")[0].startswith("https://") and config.frontend_url().startswith("https://")
