"""A real ``pygmy up --tls`` cluster: HTTPS for clients with the CA, mutual TLS between services with
each listener taking only the roles it serves, nothing in plain text on any port, and certificates
replaced on disk served without a restart (#38)."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from cryptography import x509
from harness import Cluster, http_answers, start_cluster, stop_checked

from pygmy.client.api import PygmyClient
from pygmy.cluster import certs
from pygmy.kit import tls
from pygmy.kit.config import ClusterConfig
from pygmy.replication.transport import PUSH_CHANNEL, RAFT_CHANNEL, RAFT_PORT_OFFSET, FrameClient, FrameError


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = start_cluster(tmp_path_factory.mktemp("tls"), "--tls", "--catalog-replicas", "2", "--order-replicas", "2")
    yield c
    stop_checked(c)


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA of another cluster, with certificates of every role."""
    folder = tmp_path_factory.mktemp("other-ca")
    certs.ensure(ClusterConfig(catalog_replicas=2, order_replicas=2), folder)
    return folder


def own(c: Cluster) -> Path:
    return c.data_dir / "certs"


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (a frontend worker's push listener has a port of its own)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = fd.readlink().as_posix()
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def push_ports(c: Cluster) -> set[int]:
    """Every frontend worker's push listener (its listening ports other than the HTTP one)."""
    group = c.process_groups()["frontend-1"]
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int(stat.parent.name)
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == group:  # its process group
                out |= listening_ports(pid)
    out.discard(c.port_base)
    return out


def replica_ports(c: Cluster) -> list[int]:
    config = c.cluster_config()
    return [int(url.rsplit(":", 1)[1]) for tier in ("catalog", "order") for url in config.peers(tier).values()]


def plain_answer(port: int) -> bytes:
    """What a listener answers a plain-text request with (b"": it closed or reset the connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n\x00\x00\x00\x10{\"hello\": \"x\"}")
        try:
            return s.recv(200)
        except ConnectionResetError:
            return b""


def test_a_client_with_the_ca_looks_up_and_buys_over_https(cluster: Cluster) -> None:
    assert cluster.url.startswith("https://")
    with PygmyClient(cluster.url, verify=str(own(cluster) / "ca.pem")) as client:
        book = client.lookup(1)
        order = client.buy(1)
        assert order["item_number"] == 1 and client.lookup(1)["stock"] == book["stock"] - 1
    status = requests.get(cluster.url + "/status", verify=str(own(cluster) / "ca.pem"), timeout=5).json()
    assert status["frontend"]["lease"]["valid"], "the frontend holds no cache lease: its subscription failed"
    with pytest.raises(requests.exceptions.SSLError):  # without the CA the certificate is not trusted
        requests.get(cluster.url + "/lookup/1", timeout=5)


def test_the_event_loop_answers_kept_alive_https_requests(cluster: Cluster) -> None:
    """The worker's shortcut reads what TLS decrypted on a kept-alive connection: buys answered by
    the event loop carry no ``Server`` header (Gunicorn's route adds one)."""
    paths = set()
    with requests.Session() as s:
        for _ in range(12):
            r = s.post(cluster.url + "/buy/4", verify=str(own(cluster) / "ca.pem"), timeout=5)
            assert r.status_code == 200, r.text
            paths.add("route" if "Server" in r.headers else "event loop")
    assert "event loop" in paths


def test_pipelined_https_requests_are_answered_in_order(cluster: Cluster) -> None:
    """Over TLS too (#39): requests pipelined on one connection, the first to a pool thread (a
    connection's first request always is, for its handshake), the rest read with it and decrypted
    before it was answered, are each answered, in order."""
    ctx = ssl.create_default_context(cafile=str(own(cluster) / "ca.pem"))
    paths = ["/lookup/1", "/lookup/2", "/search/distributed%20systems", "/lookup/3", "/lookup/1"]
    with socket.create_connection(("127.0.0.1", cluster.port_base), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        s.sendall(b"".join(f"GET {p} HTTP/1.1\r\nHost: t\r\nX-Request-Id: tp-{i}\r\n\r\n".encode()
                           for i, p in enumerate(paths)))
        got = http_answers(s, len(paths))
    for i, (path, (status, headers, body)) in enumerate(zip(paths, got, strict=True)):
        assert status == 200 and headers["x-request-id"] == f"tp-{i}", (path, status)
        if path.startswith("/lookup/"):
            assert json.loads(body)["item_number"] == int(path.rsplit("/", 1)[1])


def test_plain_text_is_refused_on_every_port(cluster: Cluster) -> None:
    pushes = push_ports(cluster)
    assert len(pushes) == 2, f"expected a push listener per frontend worker, found {pushes}"
    replicas = replica_ports(cluster)
    ports = [cluster.port_base, *replicas, *(p + RAFT_PORT_OFFSET for p in replicas), *pushes]
    for port in ports:
        answer = plain_answer(port)
        assert not answer.startswith(b"HTTP/") and b"ok" not in answer, (port, answer)
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(f"http://127.0.0.1:{cluster.port_base}/lookup/1", timeout=5)


def cert_of(folder: Path, holder: str) -> tuple[str, str]:
    return str(folder / f"{holder}.pem"), str(folder / f"{holder}-key.pem")


def test_replica_http_takes_only_the_roles_it_serves_from_its_own_ca(cluster: Cluster, other_ca: Path) -> None:
    url = cluster.replica_url("catalog-1") + "/status"
    ca = str(own(cluster) / "ca.pem")
    assert requests.get(url, verify=ca, cert=cert_of(own(cluster), "admin"), timeout=5).status_code == 200
    assert requests.get(url, verify=ca, cert=cert_of(own(cluster), "order-1"), timeout=5).status_code == 200
    for refused in (cert_of(own(cluster), "client"),  # a role the tier's API does not serve
                    cert_of(other_ca, "admin"),       # the right role from another CA
                    None):                            # no certificate
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(url, verify=ca, cert=refused, timeout=5)
    order = cluster.replica_url("order-1") + "/status"
    with pytest.raises(requests.exceptions.ConnectionError):  # the order tier's API does not serve the catalog
        requests.get(order, verify=ca, cert=cert_of(own(cluster), "catalog-1"), timeout=5)


@pytest.mark.parametrize(("replica", "method", "path", "allowed", "refused"), [
    # The operator's endpoints: the admin certificate alone. Probes that change nothing if let in
    # (an unknown member's removal is 404, a member without a URL 400, on the leader or a follower).
    ("catalog-1", "GET", "/members", "admin", ("frontend-1", "order-1", "catalog-2")),
    ("catalog-1", "POST", "/members", "admin", ("frontend-1", "order-1")),
    ("order-1", "DELETE", "/members/order-9", "admin", ("frontend-1", "order-2")),
    ("catalog-1", "GET", "/verify", "admin", ("frontend-1", "order-1")),
    ("order-1", "GET", "/backup?probe=1", "admin", ("frontend-1",)),
    # Raft's read index: a replica of the tier only.
    ("catalog-1", "GET", "/raft/read_index", "catalog-2", ("frontend-1", "order-1", "admin")),
    # Each tier's calls: the decrements and their keys from the order tier, updates from a frontend.
    ("catalog-1", "POST", "/books/decrements", "order-1", ("frontend-1", "admin")),
    ("catalog-1", "GET", "/keys?after=0&limit=1", "order-1", ("frontend-1", "admin")),
    ("catalog-1", "POST", "/books/1/update", "frontend-1", ("order-1", "admin")),
    ("order-1", "POST", "/buys", "frontend-1", ("admin", "order-2")),
    ("order-1", "GET", "/orders?limit=1", "admin", ("order-2",)),
    # Reads of books: every role the catalog's listener takes.
    ("catalog-1", "GET", "/books/1", "frontend-1", ()),
])
def test_each_replica_endpoint_takes_only_the_roles_that_call_it(
        cluster: Cluster, replica: str, method: str, path: str, allowed: str, refused: tuple[str, ...]) -> None:
    """A listener takes every role any of its endpoints serves (a frontend's certificate reaches a
    catalog replica for its reads), so each endpoint judges the rest: with the internal secret, a
    frontend's certificate may neither change a tier's members nor read a whole state."""
    url, ca = cluster.replica_url(replica) + path, str(own(cluster) / "ca.pem")
    auth = {"Authorization": f"Bearer {cluster.secret()}"}
    body = {} if method == "POST" else None
    for holder in refused:
        r = requests.request(method, url, json=body, headers=auth, verify=ca, cert=cert_of(own(cluster), holder), timeout=10)
        assert r.status_code == 403, (holder, r.status_code, r.text)
        assert "may not call this endpoint" in r.json()["error"]["message"], r.text
    r = requests.request(method, url, json=body, headers=auth, verify=ca, cert=cert_of(own(cluster), allowed), timeout=10)
    assert r.status_code not in (401, 403), (allowed, r.status_code, r.text[:300])  # 421/503 off the leader
    # The secret is still asked of an allowed certificate.
    r = requests.request(method, url, json=body, verify=ca, cert=cert_of(own(cluster), allowed), timeout=10)
    assert r.status_code == 401, (allowed, r.status_code, r.text[:300])


def frames(cluster: Cluster, folder: Path, holder: str, port: int, channel: str, name: str) -> FrameClient:
    client = FrameClient(("127.0.0.1", port), cluster.secret(), name, channel, 2.0,
                         identity=tls.Identity.of(folder, holder))
    client.server_role = ""  # do not stop at our own check of the server: see what the server says
    return client


def test_every_replica_refuses_raft_from_another_tier_or_ca(cluster: Cluster, other_ca: Path) -> None:
    config = cluster.cluster_config()
    for tier, other in (("catalog", "order"), ("order", "catalog")):
        for name, url in config.peers(tier).items():
            port = int(url.rsplit(":", 1)[1]) + RAFT_PORT_OFFSET
            with pytest.raises(FrameError, match=f"role '{other}' may not use channel 'raft'"):
                frames(cluster, own(cluster), f"{other}-1", port, RAFT_CHANNEL, f"{other}-1").call({}, 2.0)
            with pytest.raises(FrameError, match="no welcome"):  # the handshake fails
                frames(cluster, other_ca, name, port, RAFT_CHANNEL, name).call({}, 2.0)


def test_every_frontend_worker_takes_pushes_only_from_the_catalog(cluster: Cluster, other_ca: Path) -> None:
    for port in push_ports(cluster):
        with pytest.raises(FrameError, match="role 'order' may not use channel 'push'"):
            frames(cluster, own(cluster), "order-1", port, PUSH_CHANNEL, "order-1").call({}, 2.0)
        with pytest.raises(FrameError, match="no welcome"):
            frames(cluster, other_ca, "catalog-1", port, PUSH_CHANNEL, "catalog-1").call({}, 2.0)


def test_the_frontend_refuses_a_client_certificate_of_another_ca(cluster: Cluster, other_ca: Path) -> None:
    ca = str(own(cluster) / "ca.pem")
    assert requests.get(cluster.url + "/health", verify=ca, cert=cert_of(own(cluster), "client"), timeout=5).ok
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(cluster.url + "/health", verify=ca, cert=cert_of(other_ca, "client"), timeout=5)


def served_serial(port: int, ca: Path, cert: tuple[str, str] | None = None) -> int:
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert:
        ctx.load_cert_chain(*cert)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        der = s.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_certificates_replaced_on_disk_are_served_without_a_restart(cluster: Cluster) -> None:
    folder, ca = own(cluster), own(cluster) / "ca.pem"
    admin = cert_of(folder, "admin")
    replica = int(cluster.replica_url("catalog-1").rsplit(":", 1)[1])
    targets = {"frontend-1": (cluster.port_base, None), "catalog-1": (replica, admin),
               "catalog-1 frames": (replica + RAFT_PORT_OFFSET, admin)}
    before = {what: served_serial(port, ca, cert) for what, (port, cert) in targets.items()}
    groups = cluster.process_groups()
    certs.issue(folder, "frontend-1", "frontend", ["127.0.0.1"])
    certs.issue(folder, "catalog-1", "catalog", ["127.0.0.1"])
    deadline = time.monotonic() + 10
    for what, (port, cert) in targets.items():
        while served_serial(port, ca, cert) == before[what]:
            assert time.monotonic() < deadline, f"{what} still serves its old certificate"
            time.sleep(0.2)
    assert cluster.process_groups() == groups  # nothing restarted
    with PygmyClient(cluster.url, verify=str(ca)) as client:  # and the cluster still works across every hop
        client.buy(2)
        assert client.lookup(2)["item_number"] == 2


def test_a_plain_cluster_restarted_with_tls_keeps_its_state(tmp_path: Path) -> None:
    """TLS turned on for an existing data dir: members recorded as http:// (cluster.json, the tiers'
    logs) are reached at the same host and port over https."""
    plain = start_cluster(tmp_path, "--catalog-replicas", "1", "--order-replicas", "1")
    try:
        with plain.client() as client:
            order = client.buy(3)
    finally:
        plain.stop()
    again = Cluster(plain.data_dir, plain.port_base, ["--tls"]).start()
    try:
        assert again.url.startswith("https://")
        with again.client() as client:
            assert client.order(order["order_number"])["item_number"] == 3
            client.buy(3)
    finally:
        again.stop()


def test_the_container_healthcheck_speaks_tls_with_the_services_own_certificate(cluster: Cluster,
                                                                                tmp_path: Path) -> None:
    """scripts/healthcheck.py as a TLS container runs it: only the CA and its own pair at hand."""
    import shutil
    import subprocess
    import sys

    from pygmy.cluster.local import ROOT

    for f in ("ca.pem", "catalog-1.pem", "catalog-1-key.pem"):
        shutil.copy(own(cluster) / f, tmp_path / f)
    port = cluster.replica_url("catalog-1").rsplit(":", 1)[1]

    def check(**env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "healthcheck.py")], capture_output=True,
                              text=True, timeout=30, env={"PYGMY_PORT": port, "PYGMY_CERTS_DIR": str(tmp_path),
                                                          "PYGMY_PROBE_MARK": str(tmp_path / "ready-once"), **env})

    # Asked again for a while, as Docker's retries do: before it has once been ready the check asks
    # /readyz, which a replica may fail for a moment on a loaded machine (a lease or a leader lost
    # and found again; seen once under the whole suite). One that never gets ready still fails.
    deadline = time.monotonic() + 30
    while (ok := check(PYGMY_TLS="1")).returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ok.returncode == 0, ok.stderr
    plain = check()  # plain text to a TLS port: refused
    assert plain.returncode == 1 and plain.stderr.strip(), plain
