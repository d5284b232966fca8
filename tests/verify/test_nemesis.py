"""The nemesis' network faults do what they say, between real namespaces, and leave nothing behind.

Needs root, iproute2 and iptables (``.ci/run`` installs them); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pygmy.cluster.local import free_port
from pygmy.kit.config import ClusterConfig
from pygmy.verify import nemesis

pytestmark = pytest.mark.skipif(bool(nemesis.missing_tools()), reason=f"needs {nemesis.missing_tools()}")

CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.5).close()"
LISTEN = "import socket, sys, time; s = socket.create_server((sys.argv[1], int(sys.argv[2]))); time.sleep(120)"


@pytest.fixture
def net(tmp_path: Path) -> Iterator[nemesis.Network]:
    prefix, subnet = nemesis.fresh_addressing("t")
    config = ClusterConfig(port_base=9000, catalog_replicas=2, order_replicas=1, frontends=1,
                           netns=prefix, netns_subnet=subnet)
    servers = []
    with nemesis.Network(config, tmp_path) as n:
        for name in n.names:  # something listening on every service's address and port
            servers.append(subprocess.Popen(["ip", "netns", "exec", n.ns(name), sys.executable, "-c", LISTEN,
                                             config.address(name), str(n.port(name))]))
        try:
            for name in n.names:
                assert wait_reachable(n, n.names[0] if name != n.names[0] else n.names[1], name)
            yield n
        finally:
            for p in servers:
                p.kill()
                p.wait()
    assert nemesis.sh("ip", "netns", "list").stdout.count(config.netns) == 0
    assert config.netns not in nemesis.sh("ip", "link").stdout


def reaches(n: nemesis.Network, src: str, dst: str) -> bool:
    """Whether ``src`` can open a TCP connection to ``dst``'s service port (within 0.5 s)."""
    return subprocess.run(["ip", "netns", "exec", n.ns(src), sys.executable, "-c", CONNECT,
                           n.address(dst), str(n.port(dst))], capture_output=True, timeout=30).returncode == 0


def wait_reachable(n: nemesis.Network, src: str, dst: str) -> bool:
    return any(reaches(n, src, dst) for _ in range(20))


def test_a_cut_stops_both_directions_and_only_that_link(net: nemesis.Network) -> None:
    a, b, c = "catalog-1", "catalog-2", "order-1"
    assert reaches(net, a, b) and reaches(net, b, a)
    net.cut(a, b)
    assert not reaches(net, a, b) and not reaches(net, b, a)
    assert reaches(net, a, c) and reaches(net, c, b) and reaches(net, "frontend-1", a)
    net.heal()
    assert reaches(net, a, b) and reaches(net, b, a)


def test_a_one_way_cut_stops_only_requests_from_one_side(net: nemesis.Network) -> None:
    a, b = "catalog-1", "catalog-2"
    net.cut_one_way(a, b)
    assert not reaches(net, a, b)
    assert reaches(net, b, a)  # b's connection to a, and a's replies on it, go through
    net.heal()
    assert reaches(net, a, b)


@pytest.mark.parametrize("everything", [False, True])
def test_total_loss_on_a_replica_spares_the_host_unless_everything(net: nemesis.Network, everything: bool) -> None:
    """Plain loss spares the host's namespace (clients, the nemesis' probes); a slow host's loss
    (``everything``) takes its hops to Toxiproxy on the gateway too."""
    a = "order-1"
    net.lossy(a, 1.0, everything=everything)
    assert not reaches(net, "catalog-1", a) and not reaches(net, a, "frontend-1")
    probe = subprocess.run([sys.executable, "-c", CONNECT, net.address(a), str(net.port(a))], timeout=30)
    assert (probe.returncode != 0) == everything
    net.heal()
    assert reaches(net, "catalog-1", a)


def test_heal_is_idempotent_and_removes_every_rule(net: nemesis.Network) -> None:
    net.cut("catalog-1", "order-1")
    net.cut_one_way("frontend-1", "catalog-2")
    net.lossy("catalog-2", 0.5)
    net.heal()
    net.heal()
    for name in net.names:
        rules = nemesis.sh("ip", "netns", "exec", net.ns(name), "iptables", "-S").stdout
        assert "DROP" not in rules, (name, rules)


def test_an_isolated_host_reaches_nothing_and_nothing_reaches_it(net: nemesis.Network) -> None:
    a = "catalog-1"
    net.isolate(a)
    assert not reaches(net, a, "catalog-2") and not reaches(net, "order-1", a) and not reaches(net, "frontend-1", a)
    probe = subprocess.run([sys.executable, "-c", CONNECT, net.address(a), str(net.port(a))], timeout=30)
    assert probe.returncode != 0, "the host's namespace (clients, probes, pygmy member) is cut off too"
    assert reaches(net, "catalog-2", "order-1")  # the others still reach each other
    net.heal()
    assert reaches(net, "frontend-1", a) and reaches(net, a, "catalog-2")


def test_hosts_added_later_are_on_the_bridge_and_leave_nothing_behind(net: nemesis.Network) -> None:
    """A new host gets an address of its own and takes faults like the first ones; one removed
    leaves no namespace, and one still there when the network closes goes with it (the fixture)."""
    servers = []
    try:
        for name in ("catalog-3", "catalog-4"):
            address = net.add_host(name, net.port("catalog-2"))  # a new machine: the same port as the old
            assert address not in {net.address(n) for n in net.names if n != name}
            servers.append(subprocess.Popen(["ip", "netns", "exec", net.ns(name), sys.executable, "-c", LISTEN,
                                             address, str(net.port(name))]))
            assert wait_reachable(net, "catalog-1", name) and wait_reachable(net, name, "catalog-2")
        assert net.replicas("catalog") == ["catalog-1", "catalog-2", "catalog-3", "catalog-4"]
        net.cut("catalog-3", "catalog-1")
        assert not reaches(net, "catalog-1", "catalog-3") and reaches(net, "catalog-1", "catalog-4")
        net.heal()
        net.remove_host("catalog-3")
        assert "catalog-3" not in net.replicas()
        assert net.ns("catalog-3") not in nemesis.sh("ip", "netns", "list").stdout
        assert reaches(net, "catalog-1", "catalog-4") and reaches(net, "catalog-4", "catalog-2")
    finally:
        for p in servers:
            p.kill()
            p.wait()


def test_each_toxiproxy_call_takes_a_connection_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Toxiproxy's server closes a kept-alive connection that has sent nothing for its read timeout,
    and a call sent on it as it closes fails with nothing done: a fault's undo was lost so once, under
    the whole suite. So no call reuses a connection (each shows in the server's log from a client
    port of its own)."""
    log = tmp_path / "toxiproxy.log"
    monkeypatch.setenv("LOG_LEVEL", "debug")  # Toxiproxy logs each API call at debug, its default level
    proxy = nemesis.Toxiproxy("127.0.0.1", log, api_port=free_port())  # not the nemesis' (a chaos run may hold it)
    try:
        proxy.proxy("p", 0, "127.0.0.1:9")
        proxy.latency("p", 20, 0)
        proxy.clear("p")
        proxy.delete("p")
    finally:
        proxy.stop()
    calls = [json.loads(line) for line in log.read_text().splitlines() if '"handler"' in line]
    assert [c["method"] for c in calls if c["method"] != "GET"] == ["POST"] * 3 + ["DELETE"] * 3, calls
    assert len({c["client"] for c in calls}) == len(calls), [c["client"] for c in calls]
