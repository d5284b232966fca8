"""The framed transport over mutual TLS: a channel takes only the roles it serves, names must be the
certificate's, another CA and plain text are refused, and the client checks the server's role."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pygmy.cluster import certs
from pygmy.kit import tls
from pygmy.kit.config import ClusterConfig
from pygmy.replication.transport import (
    BUYS_CHANNEL,
    PUSH_CHANNEL,
    RAFT_CHANNEL,
    Channel,
    FrameClient,
    FrameError,
    FrameServer,
)

SECRET = "s3cret"


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("certs")
    certs.ensure(ClusterConfig(catalog_replicas=2, order_replicas=1), folder)
    return folder


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("other")
    certs.ensure(ClusterConfig(catalog_replicas=2, order_replicas=1), folder)
    return folder


def me(folder: Path, holder: str) -> tls.Identity:
    return tls.Identity.of(folder, holder)


@pytest.fixture
def catalog_1(ca: Path) -> Iterator[FrameServer]:
    def handle(peer: str, frame: Any) -> Any:
        return {"from": peer, "echo": frame}

    server = FrameServer("127.0.0.1", 0, SECRET, {
        RAFT_CHANNEL: Channel(handle, roles=frozenset({"catalog"})),
        "decrements": Channel(handle, roles=frozenset({"order"})),
    }, name="catalog-1", identity=me(ca, "catalog-1"))
    server.start()
    yield server
    server.stop()


def test_a_replica_of_the_tier_speaks_raft(catalog_1: FrameServer, ca: Path) -> None:
    client = FrameClient(catalog_1.address, SECRET, "catalog-2", RAFT_CHANNEL, 1.0, identity=me(ca, "catalog-2"))
    assert client.call({"x": 1}, 2.0) == {"from": "catalog-2", "echo": {"x": 1}}
    assert client.call({"x": 2}, 2.0)["echo"] == {"x": 2} and client.connects == 1  # one connection, kept
    client.close()


def test_another_tiers_role_is_refused_on_raft(catalog_1: FrameServer, ca: Path) -> None:
    client = FrameClient(catalog_1.address, SECRET, "order-1", RAFT_CHANNEL, 1.0, identity=me(ca, "order-1"))
    client.server_role = "catalog"  # it must reach the server's check, not stop at its own
    with pytest.raises(FrameError, match="role 'order' may not use channel 'raft'"):
        client.call({"x": 1}, 2.0)
    order = FrameClient(catalog_1.address, SECRET, "order-1", "decrements", 1.0, identity=me(ca, "order-1"))
    assert order.call({"x": 1}, 2.0)["from"] == "order-1"  # where its role is served, it is taken
    order.close()


def test_a_name_not_in_the_certificate_is_refused(catalog_1: FrameServer, ca: Path) -> None:
    client = FrameClient(catalog_1.address, SECRET, "catalog-3", RAFT_CHANNEL, 1.0, identity=me(ca, "catalog-2"))
    with pytest.raises(FrameError, match="not a name of its certificate"):
        client.call({"x": 1}, 2.0)


def test_a_replica_of_the_tier_is_not_taken_for_another(ca: Path) -> None:
    """A client that dials a replica by name takes only that replica's certificate: another of the
    same tier listening at its address (a stolen address, a misconfigured host) is refused, though
    its role would do."""
    impostor = FrameServer("127.0.0.1", 0, SECRET, {RAFT_CHANNEL: Channel(lambda p, f: f, roles=frozenset({"catalog"}))},
                           name="catalog-2", identity=me(ca, "catalog-2"))
    impostor.start()
    try:
        client = FrameClient(impostor.address, SECRET, "catalog-1", RAFT_CHANNEL, 1.0, identity=me(ca, "catalog-1"),
                             server="catalog-3")
        with pytest.raises(FrameError, match="we dialled catalog-3, and its certificate names"):
            client.call({"x": 1}, 2.0)
        right = FrameClient(impostor.address, SECRET, "catalog-1", RAFT_CHANNEL, 1.0, identity=me(ca, "catalog-1"),
                            server="catalog-2")
        assert right.call({"x": 1}, 2.0) == {"x": 1}
        right.close()
    finally:
        impostor.stop()


def test_another_cas_replica_is_refused(catalog_1: FrameServer, other_ca: Path) -> None:
    client = FrameClient(catalog_1.address, SECRET, "catalog-2", RAFT_CHANNEL, 1.0, identity=me(other_ca, "catalog-2"))
    with pytest.raises(FrameError):
        client.call({"x": 1}, 2.0)


def test_plain_text_gets_no_welcome(catalog_1: FrameServer) -> None:
    plain = FrameClient(catalog_1.address, SECRET, "catalog-2", RAFT_CHANNEL, 1.0)
    plain.identity = None
    with pytest.raises(FrameError):
        plain.call({"x": 1}, 2.0)
    with socket.create_connection(catalog_1.address, timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        with contextlib.suppress(ConnectionResetError):
            assert not s.recv(100).startswith(b"HTTP/")


def test_the_client_wants_the_channels_server_role(ca: Path) -> None:
    """A frontend worker's listener shows a frontend certificate: a buyer dialling it as if it
    were the order tier refuses it (what a misrouted or spoofed address would give)."""
    server = FrameServer("127.0.0.1", 0, SECRET, {BUYS_CHANNEL: Channel(lambda p, f: f),
                                                   PUSH_CHANNEL: Channel(lambda p, f: f, roles=frozenset({"catalog"}))},
                         name="frontend-1", identity=me(ca, "frontend-1"))
    server.start()
    try:
        buyer = FrameClient(server.address, SECRET, "frontend-1/1", BUYS_CHANNEL, 1.0, identity=me(ca, "frontend-1"))
        with pytest.raises(FrameError, match="role 'frontend' may not connect here"):
            buyer.call({"x": 1}, 2.0)
        pusher = FrameClient(server.address, SECRET, "catalog-1", PUSH_CHANNEL, 1.0, identity=me(ca, "catalog-1"))
        assert pusher.call({"x": 1}, 2.0) == {"x": 1}
        pusher.close()
        wrong = FrameClient(server.address, SECRET, "order-1", PUSH_CHANNEL, 1.0, identity=me(ca, "order-1"))
        with pytest.raises(FrameError, match="role 'order' may not use channel 'push'"):
            wrong.call({"x": 1}, 2.0)
    finally:
        server.stop()


def test_send_nowait_goes_out_over_tls(catalog_1: FrameServer, ca: Path) -> None:
    client = FrameClient(catalog_1.address, SECRET, "catalog-2", RAFT_CHANNEL, 1.0, identity=me(ca, "catalog-2"))
    assert client.call({"first": True}, 2.0)["echo"] == {"first": True}
    assert client.send_nowait({"n": 1})  # the server answers it too: read by the next call, in order
    assert client.call({"n": 2}, 2.0)["echo"] == {"n": 1}
    client.close()
