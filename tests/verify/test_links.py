"""WAN links (``pygmy.verify.links``): a shaped link is as slow as it says, loss costs a retransmission
scaled to the link's round trip, nothing is left behind, and replicas dial the addresses they are
given (``peer_addresses``), so a tier whose every link goes through a proxy still elects and commits.

Timings are only asserted as lower bounds ("at least the delay"). Loss needs root and a namespace of
its own (the tests make one and check it is gone).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from pygmy.client.api import PygmyError
from pygmy.cluster.local import LocalCluster, free_port_base
from pygmy.kit.config import ClusterConfig
from pygmy.verify import links, nemesis

pytestmark = pytest.mark.skipif(not nemesis.TOXIPROXY.exists() and shutil.which("go") is None
                                and not os.access("/usr/local/go/bin/go", os.X_OK),
                                reason="needs Toxiproxy (build/toxiproxy) or Go to build it")


def toxiproxies(marker: bytes = b"") -> set[int]:
    """Pids of the Toxiproxy servers running now whose command line holds ``marker`` (other tests may
    run Toxiproxies of their own)."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                if b"toxiproxy-server" in cmdline and marker in cmdline.replace(b"\0", b" "):
                    out.add(int(entry))
            except OSError:
                continue
    return out


def isolated_toxiproxies(ns: str) -> set[int]:
    """Those started under ``links.isolated`` in namespace ``ns`` (their environment names it)."""
    out = set()
    for pid in toxiproxies():
        try:
            if f"{links.ISOLATED_ENV}={ns}\0".encode() in Path(f"/proc/{pid}/environ").read_bytes():
                out.add(pid)
        except OSError:
            continue
    return out


@pytest.fixture
def echo() -> tuple[str, int]:
    server, stop = links._echo_server()
    yield server.getsockname()[:2]
    stop.set()
    server.close()


def test_a_shaped_link_is_at_least_as_slow_as_its_shape_and_leaves_no_proxy(echo: tuple[str, int]) -> None:
    net = links.Links()
    ours = f"-port {net.base + links.MAX_LINKS}".encode()
    assert toxiproxies(ours) == {net.proxy.proc.pid}
    try:
        link = net.add("probe", "probe", echo)
        assert min(links.round_trips((net.host, link.listen), 0.3)) < 0.1  # no toxic yet
        net.shape(links.Shape(one_way_ms=60, jitter_ms=10))
        rtts = links.round_trips((net.host, link.listen), 1.0)
        assert len(rtts) >= 3 and min(rtts) >= 2 * (60 - 10) / 1000  # each way, less the jitter
        if not links.own_namespace():  # loss is refused outside a namespace of its own
            with pytest.raises(RuntimeError, match="namespace of its own"):
                net.shape(links.Shape(loss=0.1))
        net.shape(links.LOOPBACK)
        assert min(links.round_trips((net.host, link.listen), 0.3)) < 0.1
        pid = net.proxy.proc.pid
    finally:
        net.close()
        net.close()  # twice is fine
    assert net.proxy.proc.poll() is not None and pid not in toxiproxies() and not toxiproxies(ours)
    assert net.rules() == []


@pytest.mark.skipif(bool(links.missing_tools()), reason=f"needs {links.missing_tools()}")
def test_loss_costs_a_retransmission_of_the_links_round_trip_and_is_undone(tmp_path: Path) -> None:
    # 100 ms each way, 15% loss: measured in a namespace the command makes for itself and deletes.
    # About a quarter of the round trips stall; a chain of losses, each retransmission backed off,
    # long enough to outlast the 30 s read is vanishingly rare (at 25% a loaded run once had one).
    proc = subprocess.run([sys.executable, "-m", "pygmy.verify.links", "--one-way", "100", "--loss", "0.15",
                           "--seconds", "6", "--every", "0.05"], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["rtt_ms"]["min"] >= 200
    during, after = out["during"], out["after"]
    assert len([r for r in during["rules"] if "statistic" in r]) == 2  # the caller's hop, both ways
    assert during["rto_min_us"] == str((200 + 200) * 1000)  # the link's round trip + Linux's 200 ms
    assert during["early_retrans"] == "0" and after["early_retrans"] != "0"  # tail loss probes off, then back
    # A lost segment waits for the retransmission timer of a 200 ms link (400 ms), not loopback's
    # (200 ms): a stalled round trip takes 200 + 400 ms or more (with loopback's timer, about 400 ms;
    # a few still do, see the module's docstring: the median is what is asserted).
    assert out["stalled"] > 0 and statistics.median(out["stall_ms"]) >= 500, out
    assert after["rules"] == [] and after["rto_min_us"] == "200000" and after["toxiproxy_exit"] is not None
    # The namespace is gone, and no Toxiproxy outlived it.
    assert out["namespace"] and out["namespace"] not in links.made_namespaces()
    assert not isolated_toxiproxies(out["namespace"])


def test_the_link_settings_are_checked_and_name_whom_to_dial() -> None:
    config = ClusterConfig(port_base=9000, peer_addresses={"catalog-1": {"catalog-2": "127.0.0.1:7001"}},
                           router_urls={"order-2": {"catalog-3": "http://127.0.0.1:7003"}})
    assert config.check_links() == []
    assert config.peer_address("catalog-1", "catalog-2") == ("127.0.0.1", 7001)
    assert config.peer_address("catalog-2", "catalog-1") is None  # the URL's: its port + 50
    assert config.peers_for("order-2", "catalog")["catalog-3"] == "http://127.0.0.1:7003"
    assert config.peers_for("order-1", "catalog") == config.peers("catalog")
    bad = ClusterConfig(peer_addresses={"catalog-1": {"order-2": "127.0.0.1:1", "catalog-2": "nowhere"}},
                        router_urls={"frontend-1": {"frontend-1": "http://x:1"}, "order-1": {"catalog-1": "x"}})
    assert len(bad.check_links()) == 4
    r = subprocess.run([sys.executable, "-m", "pygmy.cluster.cli", "up", "--data-dir", "/nonexistent/pygmy"],
                       capture_output=True, text=True, timeout=30, env={**os.environ, "PYGMY_PEER_ADDRESSES": "[1]"},
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode != 0 and "PYGMY_PEER_ADDRESSES" in r.stderr


def _catalog_leader(c: LocalCluster) -> str | None:
    for name in c.cluster_config().peers("catalog"):
        try:
            st = c.replica_get(name, "/status", timeout=1).json()
        except (requests.RequestException, ValueError):
            continue
        if st.get("role") == "leader" and st.get("leader_lease"):
            return name
    return None


def _updated(c: LocalCluster) -> bool:
    try:
        c.client(timeout=2).update(1, stock_delta=1)
        return True
    except PygmyError:
        return False


def _until(cond, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_replicas_dial_the_given_addresses_and_a_proxied_tier_elects_and_commits(tmp_path: Path) -> None:
    base = free_port_base()
    with links.ClusterLinks(ClusterConfig(port_base=base), tiers=("catalog",), routers=["frontend-1"]) as net:
        assert len(net.peer_addresses()) == 3 and all(len(v) == 2 for v in net.peer_addresses().values())
        assert len(net.router_urls()["frontend-1"]) == 6  # to every catalog and order replica
        c = LocalCluster(tmp_path / "data", base, [], env=net.env())
        c.start(reset=True)
        try:
            with c.client(timeout=10) as cl:
                assert cl.update(1, stock_delta=1)["stock"] > 0  # elected and committed through the proxies
                net.shape(links.Shape(one_way_ms=40), "catalog")
                assert _until(lambda: _catalog_leader(c) is not None, 15)
                t = time.monotonic()
                cl.update(1, stock_delta=1)
                assert time.monotonic() - t >= 0.08  # a commit waits for a follower across a link and back
                # Every catalog link is its proxy: with them all off, the tier has no leader with a lease...
                for link in net.select("catalog"):
                    net.proxy.enable(link.name, False)
                assert _until(lambda: _catalog_leader(c) is None, 10)
                # ...and once they are back, it elects and commits again.
                for link in net.select("catalog"):
                    net.proxy.enable(link.name, True)
                net.shape(links.LOOPBACK, "catalog")
                assert _until(lambda: _catalog_leader(c) is not None, 15)
                assert cl.update(1, stock_delta=1)["stock"] > 0
                # The frontend's routers to the catalog go through theirs: off, no update gets through.
                for link in net.select("frontend-1>catalog"):
                    net.proxy.enable(link.name, False)
                with pytest.raises(PygmyError):
                    c.client(timeout=3).update(1, stock_delta=1)
                for link in net.select("frontend-1>catalog"):
                    net.proxy.enable(link.name, True)
                assert _until(lambda: _updated(c), 15)
                # The replicas' peer connections are open to the proxies.
                ss = nemesis.sh("ss", "-tnH", "state", "established").stdout
                remotes = {line.split()[-1] for line in ss.splitlines() if line.split()}
                assert remotes & {net.address(link.name) for link in net.select("catalog")}
        finally:
            c.stop()
    assert not _port_open(net.base + links.MAX_LINKS)  # the proxy's API is gone with it


def test_windows_stretched_by_a_slow_link_come_back_down_once_it_is_fast_again(tmp_path: Path) -> None:
    """Over 150 ms links the timers stretch the election window and lease; once the links are
    loopback again (and the lower timing has been asked for as long as ``timing_hold_s``), every
    replica's window comes back to the configured one. It stayed stretched for good: the leader was
    told the lower timing once and lowered only as far as the leases it had given allowed then, and
    the stretched window is durable and taken over by the next leader, so failovers stayed slow."""
    base = free_port_base()
    with links.ClusterLinks(ClusterConfig(port_base=base), tiers=("catalog",)) as net:
        c = LocalCluster(tmp_path / "data", base, [], env={**net.env(), "PYGMY_RAFT_TIMING_HOLD_S": "3"})
        c.start(reset=True)
        try:
            names = list(c.cluster_config().peers("catalog"))

            def windows() -> list[float]:
                return [c.replica_get(n, "/status", timeout=2).json()["timers"]["election_ms"] for n in names]

            assert _until(lambda: _catalog_leader(c) is not None, 15)
            configured = max(windows())
            net.shape(links.Shape(one_way_ms=150), "catalog")
            assert _until(lambda: min(windows()) >= 4 * configured and _catalog_leader(c) is not None, 90), windows()
            stretched = min(windows())
            net.shape(links.LOOPBACK, "catalog")
            # Down to what loopback's round trips ask for: the configured window on a quiet machine
            # (700 ms in a CI run on a loaded one, whose tails are tens of ms), far below the stretched.
            assert _until(lambda: max(windows()) <= max(configured, stretched / 2), 60), (windows(), stretched)
            with c.client(timeout=10) as cl:
                assert cl.update(1, stock_delta=1)["stock"] > 0
        finally:
            c.stop()


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_leader_back_from_a_pause_longer_than_its_stretched_lease_serves_no_stale_read(tmp_path: Path) -> None:
    """The simulator's stalled leader (``test_raft_timing.py``) on real processes: over 150 ms links
    the timers stretch the lease to seconds, longer than what a replica back from a pause counts
    of the time it missed. The catalog leader is stopped (SIGSTOP) and cut off, the others elect
    a leader and commit an update, and the old one is let go on: still cut off, it must not serve
    a read, which could only be of the state before the update."""
    base = free_port_base()
    with links.ClusterLinks(ClusterConfig(port_base=base), tiers=("catalog",)) as net:
        c = LocalCluster(tmp_path / "data", base, [], env=net.env())
        c.start(reset=True)
        stopped: int | None = None
        try:
            net.shape(links.Shape(one_way_ms=150), "catalog")

            def stretched() -> bool:
                leases = [c.replica_get(n, "/status", timeout=2).json()["timers"]["lease_ms"]
                          for n in c.cluster_config().peers("catalog")]
                return min(leases) >= 2000 and _catalog_leader(c) is not None

            assert _until(stretched, 90), "the timers never stretched the lease to 2 s"
            old = _catalog_leader(c)
            assert old is not None
            # Writes in flight when it stops: the leader heartbeats at its busy pace, so the ticks up
            # to its next timer are few, and what it counts back is well short of its lease.
            writing = threading.Event()
            writer = threading.Thread(target=_write_until, args=(c, writing), daemon=True)
            writer.start()
            time.sleep(1.0)
            stopped = c.process_groups()[old]
            os.killpg(stopped, signal.SIGSTOP)
            for link in net.select("catalog"):
                if old in link.name.split(">"):
                    net.proxy.enable(link.name, False)
            assert _until(lambda: _catalog_leader(c) not in (None, old), 60), "no other leader was elected"
            writing.set()
            writer.join(30)
            after = _update_once_the_frontend_finds_the_leader(c)
            os.killpg(stopped, signal.SIGCONT)
            stopped = None
            r = c.replica_get(old, "/books/1", timeout=10)
            assert r.status_code != 200, f"the paused leader served a stale read: stock {r.json()['stock']}, not {after}"
            # Checked. The updates the old leader still holds (sent to it around its pause) each run
            # to their 5 s deadline, cut off as it is (its links back, it steps down, and they still
            # do), and the stop below (Gunicorn finishes requests in flight) waited ~5 s for them:
            # SIGKILLed now. (A fault it hid is in its log, which the end of the test still reads.)
            os.killpg(c.process_groups()[old], signal.SIGKILL)
        finally:
            if stopped is not None:
                os.killpg(stopped, signal.SIGCONT)
            c.stop()


def _update_once_the_frontend_finds_the_leader(c: LocalCluster) -> int:
    """One update's new stock. A 503 with Retry-After says "retry" (docs/api.md): over 150 ms links
    on a loaded machine the frontend's router can take longer than one client budget (10 s) to
    leave the stopped leader for the new one (make test saw "catalog tier unavailable" once).
    (The test reads the stock only to name it in its message: a retried update applied twice does
    not change what it checks.)"""
    deadline = time.monotonic() + 60
    with c.client(timeout=10) as cl:
        while True:
            try:
                return int(cl.update(1, stock_delta=5)["stock"])
            except PygmyError as exc:
                if exc.status != 503 or exc.retry_after is None or time.monotonic() > deadline:
                    raise
                time.sleep(exc.retry_after)


def _write_until(c: LocalCluster, done: threading.Event) -> None:
    """Updates one after another until ``done`` (each may fail while the tier changes leader)."""
    with c.client(timeout=5) as cl:
        while not done.is_set():
            with contextlib.suppress(PygmyError):
                cl.update(2, stock_delta=1)
