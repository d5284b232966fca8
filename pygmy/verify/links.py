"""WAN links for a local cluster: every directed link through a Toxiproxy proxy of its own, with
latency and jitter each way and packet loss, so one tier's replicas can be put "on different
machines" while everything runs on one host (issue 37; this kernel has no netem).

Layout, for replica links (``ClusterLinks``)::

    replica i ──lossy loopback hop──▶ proxy "i>j" (Toxiproxy: latency ± jitter, both streams) ──▶ replica j

``ClusterConfig.peer_addresses`` (``PYGMY_PEER_ADDRESSES``, what ``ClusterLinks.env()`` gives) makes
replica i dial proxy "i>j" for its Raft link to j, so each of the six directed links of a tier has a
proxy, and a shape of its own. ``routers=`` also routes a frontend's or an order replica's routers
through proxies (``router_urls``: an HTTP proxy and a frame proxy 50 ports above it per replica).

**Delay.** A Toxiproxy ``latency`` toxic on both streams of a proxy: the one-way latency each way
(the link's round trip is twice it), plus or minus a uniform jitter per chunk. A connection's bytes
stay in order, as TCP keeps them on a real link, so jitter delays but never reorders. Toxics change
on live connections. ``Links.shape(..., reset=True)`` also cuts every connection through the
changed proxies once (disable, enable), so that connections have to be made again across the new
link, as on a network that was always like that: reconnecting is where fixed LAN timeouts fail.

**Loss, and why it is not simply iptables on the proxy's port.** Toxiproxy terminates TCP: each
hop (replica to proxy, proxy to replica) is a loopback TCP connection whose own round trip is a few
microseconds; the link's delay happens inside the proxy, where TCP does not see it. A segment
dropped on such a hop is repaired by

- the retransmission timer, RTO = srtt + max(4 rttvar, rto_min): rto_min = 200 ms on loopback,
  where a real link of round trip r waits about r + 200 ms (plus 4 rttvar under jitter);
- a tail loss probe (TLP) after 2 srtt plus 2 ms (plus rto_min for a lone segment): a couple of
  milliseconds on loopback; on a real link 2 r + 2 ms, or the RTO for a lone segment (the probe
  is never later than the RTO);
- fast retransmit (RACK, duplicate ACKs) when more segments follow it: within microseconds on
  loopback, about one round trip r on a real link;
- a lost SYN: the initial RTO of 1 s, on loopback as on a real link.

So a drop on the proxy's hop costs a lone segment 200 ms, not r + 200 ms: at 300 ms the loss would
be half as costly as on the link it stands for (in the earlier investigation, 5% loss this way
left the commit p95 unchanged). What this module does instead: the drops (iptables ``statistic``,
both directions) are on the hop between the *calling* replica and its proxy; the namespace's
rto_min is raised to the round trip of the link plus 200 ms (``net.ipv4.tcp_rto_min_us``, which
a socket takes when it is made: hence the reset) and tail loss probes are off
(``net.ipv4.tcp_early_retrans=0``). A lost lone segment, which is what a heartbeat or an append on
a Raft link at modest load is, then waits r + 200 ms before its retransmission leaves, and the
retransmission crosses the proxy's delay like any byte: what it costs on the real link (measured
through one link of 200 ms, 25% loss: most stalled round trips take 600-670 ms, as they would; a
few, about one in fifteen, only about 420 ms, repaired after about loopback's 200 ms for a reason
not found). A lost tail of several segments waits r + 200 ms too, where a real link's probe would
take 2 r. What it gets wrong, and so flatters the system: a segment lost in the middle of a burst
is repaired in microseconds instead of about one round trip; a pure ACK lost on the hop costs
nothing; the hop from the proxy to the called replica loses nothing.
Other choices: Toxiproxy's ``timeout``, ``limit_data`` and ``slicer`` toxics cut or fragment a
connection and do not lose packets (a loss would become a reset, which is a different fault); a
packet-level delayer on NFQUEUE would let the kernel's TCP see the real round trip and get bursts
right too (``nfnetlink_queue`` is in this kernel; nothing here drives it yet).

The sysctl and the rules belong to a network namespace, so ``Links`` refuses loss unless the
process runs in a namespace of its own: ``isolated(argv)`` runs a command in a fresh namespace
with only its loopback, then kills whatever was left in it and deletes it, rules and all.
Delay alone needs no namespace (a proxy on loopback). ``python -m pygmy.verify.links --one-way 150
--jitter 50 --loss 0.1`` measures one shaped link to an echo server, in a namespace of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pygmy.cluster import local
from pygmy.kit.config import ClusterConfig, parse_name
from pygmy.replication.transport import RAFT_PORT_OFFSET, raft_address
from pygmy.verify import nemesis

#: Set (to the namespace's name) in the environment of what ``isolated`` runs.
ISOLATED_ENV = "PYGMY_LINKS_NETNS"
#: Namespaces ``namespace`` makes are named this and six hex digits.
NS_PREFIX = "pw"
#: Every namespace this process made (``namespace``), for tests: each gone once its block ended.
CREATED: list[str] = []
#: Our iptables chain (filter table, jumped to from OUTPUT on lo).
CHAIN = "PYGMY-WAN"
RTO_MIN = Path("/proc/sys/net/ipv4/tcp_rto_min_us")
#: Tail loss probes (and early retransmit), off while links lose: see the module's docstring.
EARLY_RETRANS = Path("/proc/sys/net/ipv4/tcp_early_retrans")
#: Linux's minimum retransmission timeout (``TCP_RTO_MIN``), what a real link adds to its round trip.
LINUX_RTO_MIN_MS = 200
#: Ports of one ``Links``: link i listens on base + i (a router link's frames on base + 50 + i), the API on base + 49.
BLOCK = 100
MAX_LINKS = 49


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return nemesis.sh(*cmd, check=check)


# -- namespaces ---------------------------------------------------------------------------------------
def own_namespace() -> bool:
    """Whether this process runs in the network namespace ``isolated`` made for it (named in its
    environment, and the one it is in: the rules and sysctls it changes die with it)."""
    ns = os.environ.get(ISOLATED_ENV)
    try:
        return bool(ns) and os.stat(f"/run/netns/{ns}").st_ino == os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return False


def missing_tools() -> list[str]:
    """What ``isolated`` and loss need and the machine lacks (delay alone needs only Toxiproxy)."""
    return nemesis.missing_tools() + ([] if RTO_MIN.exists() else ["net.ipv4.tcp_rto_min_us (Linux 6.11+)"])


def made_namespaces() -> set[str]:
    """The network namespaces ``namespace`` made that exist now (for tests: none left behind)."""
    return set(re.findall(rf"^({NS_PREFIX}[0-9a-f]{{6}})\b", sh("ip", "netns", "list").stdout, re.M))


def namespace_pids(ns: str) -> list[int]:
    out = sh("ip", "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process still in ``ns`` (all of them started by what ran there), wait for them."""
    deadline = time.monotonic() + 10
    while (pids := namespace_pids(ns)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


@contextlib.contextmanager
def namespace() -> Iterator[str]:
    """A fresh network namespace with its loopback up; on exit every process left in it is killed and
    it is deleted (its iptables rules and sysctls go with it)."""
    ns = f"{NS_PREFIX}{random.randrange(16 ** 6):06x}"
    sh("ip", "netns", "add", ns)
    CREATED.append(ns)
    try:
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield ns
    finally:
        _kill_namespace(ns)
        sh("ip", "netns", "del", ns, check=False)


def isolated(argv: Sequence[str], timeout: float | None = None, env: dict[str, str] | None = None,
             **kw: Any) -> subprocess.CompletedProcess[Any]:
    """Run ``argv`` in a fresh network namespace (root), which is deleted afterwards with whatever
    was left running in it. ``timeout``: SIGTERM, then SIGKILL, after that many seconds. ``kw`` go to
    ``subprocess.Popen`` (e.g. ``stdout=subprocess.PIPE, text=True``)."""
    if os.environ.get(ISOLATED_ENV):
        raise RuntimeError(f"already in an isolated namespace ({os.environ[ISOLATED_ENV]}): not nesting another")
    # The namespace has only its loopback: what must be fetched (Toxiproxy's Go module, on a fresh
    # clone) is built here first, where the package registries are reachable.
    nemesis.build_toxiproxy()
    with namespace() as ns:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv],
                                env={**os.environ, **(env or {}), ISOLATED_ENV: ns}, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:  # a timeout, or ^C: stop it, then the namespace goes
            proc.terminate()
            try:
                proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# -- ports --------------------------------------------------------------------------------------------
def free_block(size: int = BLOCK, avoid: Iterable[int] = ()) -> int:
    """A base B with ports B..B+size-1 free and none in ``avoid`` (below the ephemeral range, in this
    process's slice of it, as ``pygmy.cluster.local.free_port_base``)."""
    low, high = local._port_slice()
    avoid = set(avoid)
    for _ in range(200):
        base = random.randrange(low, high - size, 10)
        ports = range(base, base + size)
        if not avoid.intersection(ports) and all(local._port_free(p) for p in ports):
            return base
    raise RuntimeError("no free block of ports")


def cluster_ports(config: ClusterConfig) -> set[int]:
    """Every port a cluster of ``config`` listens on (its services' and their peer transports')."""
    out = set()
    for name in config.names():
        tier, k = parse_name(name)
        port = config.local_port(tier, k)
        out |= {port} if tier == "frontend" else {port, port + RAFT_PORT_OFFSET}
    return out


# -- shapes and links ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """What a link does to its traffic: ``one_way_ms`` each way, plus or minus ``jitter_ms``
    (uniform), and ``loss`` (a fraction of the packets on the caller's hop, both ways)."""

    one_way_ms: int = 0
    jitter_ms: int = 0
    loss: float = 0.0

    @property
    def rtt_ms(self) -> int:
        return 2 * self.one_way_ms

    def label(self) -> str:
        jitter = f" ±{self.jitter_ms}" if self.jitter_ms else ""
        return f"{self.one_way_ms}{jitter} ms each way, {self.loss:.0%} loss"


LOOPBACK = Shape()


@dataclass
class Link:
    name: str  # the proxy's name, e.g. "catalog-1>catalog-2", "frontend-1>order-2.frames"
    group: str  # what ``Links.shape`` selects by: a tier for replica links, "caller>tier" for routers
    listen: int
    upstream: tuple[str, int]
    shape: Shape = field(default=LOOPBACK)


class LinkProxy(nemesis.Toxiproxy):
    """A Toxiproxy server (ours: started here, stopped in ``stop``) with the calls ``Links`` needs."""

    def latency(self, name: str, ms: int, jitter: int) -> None:  # type: ignore[override]
        """Each way: ``ms`` ± ``jitter`` on both streams of proxy ``name`` (0 and 0: none)."""
        for stream in ("upstream", "downstream"):
            toxic = f"lat-{stream}"
            if not ms and not jitter:
                r = self.s.delete(f"{self.api}/proxies/{name}/toxics/{toxic}", timeout=5)
                if r.status_code not in (200, 204, 404):
                    r.raise_for_status()
                continue
            attributes = {"latency": int(ms), "jitter": int(jitter)}
            r = self.s.post(f"{self.api}/proxies/{name}/toxics/{toxic}", json={"attributes": attributes}, timeout=5)
            if r.status_code == 404:
                r = self.s.post(f"{self.api}/proxies/{name}/toxics", timeout=5, json={
                    "name": toxic, "type": "latency", "stream": stream, "attributes": attributes})
            r.raise_for_status()

    def enable(self, name: str, on: bool) -> None:
        """Disabling a proxy closes its listener and every connection through it."""
        self.s.post(f"{self.api}/proxies/{name}", json={"enabled": on}, timeout=5).raise_for_status()

    def toxics(self, name: str) -> list[dict[str, Any]]:
        r = self.s.get(f"{self.api}/proxies/{name}/toxics", timeout=5)
        r.raise_for_status()
        return list(r.json())


class Links:
    """Named links, each a Toxiproxy proxy on ``host`` of our own server, shaped by groups.

    Owns the server, our iptables chain and the namespace's ``tcp_rto_min_us`` (loss only): ``close``
    (or leaving the ``with`` block) stops and restores them all, and is safe to call twice.
    """

    def __init__(self, host: str = "127.0.0.1", log: Path | None = None, avoid: Iterable[int] = ()) -> None:
        self.host = host
        self.base = free_block(BLOCK, avoid)
        self.links: dict[str, Link] = {}
        self._rto_min: tuple[str, str] | None = None  # the namespace's own values, while we changed them
        self._chain = False
        self.proxy = LinkProxy(host, log or Path(os.devnull), api_port=self.base + MAX_LINKS)

    def __enter__(self) -> Links:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, name: str, group: str, upstream: tuple[str, int], listen: int | None = None) -> Link:
        if listen is None:
            i = len([x for x in self.links.values() if x.listen < self.base + MAX_LINKS])
            if i >= MAX_LINKS:
                raise RuntimeError(f"at most {MAX_LINKS} links")
            listen = self.base + i
        link = Link(name, group, listen, upstream)
        self.proxy.proxy(name, listen, f"{upstream[0]}:{upstream[1]}")
        self.links[name] = link
        return link

    def address(self, name: str) -> str:
        return f"{self.host}:{self.links[name].listen}"

    def select(self, groups: str | Iterable[str] | None = None) -> list[Link]:
        if groups is None:
            return list(self.links.values())
        wanted = {groups} if isinstance(groups, str) else set(groups)
        return [x for x in self.links.values() if x.group in wanted]

    def shape(self, shape: Shape, groups: str | Iterable[str] | None = None, reset: bool = True) -> None:
        """Give the links of ``groups`` (None: every link) this shape; ``reset``: then cut each
        connection through them once (they reconnect across the new link, with its rto_min)."""
        chosen = self.select(groups)
        if shape.loss and not own_namespace():
            raise RuntimeError("loss changes iptables and net.ipv4.tcp_rto_min_us: run in a network namespace of "
                               "its own (pygmy.verify.links.isolated)")
        for link in chosen:
            self.proxy.latency(link.name, shape.one_way_ms, shape.jitter_ms)
            link.shape = shape
        self._apply_loss()
        if reset:
            self.reset(groups)

    def reset(self, groups: str | Iterable[str] | None = None) -> None:
        for link in self.select(groups):
            self.proxy.enable(link.name, False)
            self.proxy.enable(link.name, True)

    def _apply_loss(self) -> None:
        lossy = [x for x in self.links.values() if x.shape.loss > 0]
        if not lossy and not self._chain:
            return
        if not self._chain:
            sh("iptables", "-N", CHAIN)
            self._chain = True
            sh("iptables", "-I", "OUTPUT", "-o", "lo", "-j", CHAIN)
        cmds = [["iptables", "-F", CHAIN]]
        for link in lossy:
            for way in ("--dport", "--sport"):  # the caller's packets to the proxy, and the proxy's back
                cmds.append(["iptables", "-A", CHAIN, "-p", "tcp", way, str(link.listen), "-m", "statistic",
                             "--mode", "random", "--probability", f"{link.shape.loss:.4f}", "-j", "DROP"])
        sh("sh", "-c", " && ".join(" ".join(c) for c in cmds))
        # One value per namespace: the longest lossy link's (sockets of links that lose nothing never wait on it).
        longest = max((x.shape.rtt_ms for x in lossy), default=None)
        if longest is None:
            self._restore_rto_min()
        else:
            if self._rto_min is None:
                self._rto_min = (RTO_MIN.read_text().strip(), EARLY_RETRANS.read_text().strip())
            RTO_MIN.write_text(str((LINUX_RTO_MIN_MS + longest) * 1000))
            EARLY_RETRANS.write_text("0")

    def _restore_rto_min(self) -> None:
        if self._rto_min is not None:
            RTO_MIN.write_text(self._rto_min[0])
            EARLY_RETRANS.write_text(self._rto_min[1])
            self._rto_min = None

    def rules(self) -> list[str]:
        """Our iptables rules now (for tests: none once closed)."""
        out = sh("iptables", "-S", check=False).stdout.splitlines()
        return [r for r in out if CHAIN in r]

    def close(self) -> None:
        try:
            if self._chain:
                sh("iptables", "-D", "OUTPUT", "-o", "lo", "-j", CHAIN, check=False)
                sh("iptables", "-F", CHAIN, check=False)
                sh("iptables", "-X", CHAIN, check=False)
                self._chain = False
            self._restore_rto_min()
        finally:
            self.proxy.stop()


class ClusterLinks(Links):
    """A proxy for every directed replica link of ``tiers`` of a cluster not started yet (so that it
    can start with ``env()``), and with ``routers`` (callers: ``frontend-1``, ``order-2``, ...) one
    for each caller's link to each replica it routes to (HTTP, and frames 50 ports above it).
    Groups: the tier for its replica links, ``"<caller>><tier>"`` for a router's."""

    def __init__(self, config: ClusterConfig, tiers: Sequence[str] = ("catalog", "order"),
                 routers: Sequence[str] = (), log: Path | None = None) -> None:
        if config.netns:
            raise ValueError("ClusterLinks proxies on loopback: not for a cluster with --netns")
        super().__init__(config.address(config.names()[0]), log, avoid=cluster_ports(config))
        self.config = config
        try:
            for tier in tiers:
                peers = config.peers(tier)
                for a in peers:
                    for b, url in peers.items():
                        if a != b:
                            self.add(f"{a}>{b}", tier, raft_address(url))
            for caller in routers:
                for tier in self.routes(caller):
                    for name, url in config.peers(tier).items():
                        frames = raft_address(url)
                        http = self.add(f"{caller}>{name}", f"{caller}>{tier}",
                                        (frames[0], frames[1] - RAFT_PORT_OFFSET))
                        self.add(f"{caller}>{name}.frames", f"{caller}>{tier}", frames,
                                 listen=http.listen + RAFT_PORT_OFFSET)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def routes(caller: str) -> list[str]:
        """The tiers ``caller``'s routers reach."""
        tier, _ = parse_name(caller)
        return {"frontend": ["catalog", "order"], "order": ["catalog"]}.get(tier, [])

    def peer_addresses(self) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for link in self.links.values():
            a, _, b = link.name.partition(">")
            if link.group == parse_name(a)[0]:
                out.setdefault(a, {})[b] = self.address(link.name)
        return out

    def router_urls(self) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for link in self.links.values():
            a, _, b = link.name.partition(">")
            if link.group != parse_name(a)[0] and not b.endswith(".frames"):
                out.setdefault(a, {})[b] = f"http://{self.address(link.name)}"
        return out

    def env(self) -> dict[str, str]:
        """The settings that send the cluster's links through these proxies (``pygmy up``'s environment)."""
        out = {"PYGMY_PEER_ADDRESSES": json.dumps(self.peer_addresses())}
        if any(link.group.count(">") for link in self.links.values()):
            out["PYGMY_ROUTER_URLS"] = json.dumps(self.router_urls())
        return out


# -- measuring one link -------------------------------------------------------------------------------
def _echo_server() -> tuple[socket.socket, threading.Event]:
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while not stop.is_set():
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server, stop


def round_trips(address: tuple[str, int], seconds: float, every: float = 0.1, size: int = 64,
                timeout: float = 10.0) -> list[float]:
    """Round trips (s) of ``size``-byte messages, one every ``every`` s (a quiet Raft link's
    heartbeats), over one connection to an echo server at ``address``."""
    out: list[float] = []
    msg = b"x" * size
    end = time.monotonic() + seconds
    with socket.create_connection(address, timeout=timeout) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while time.monotonic() < end:
            t = time.monotonic()
            s.sendall(msg)
            got = 0
            while got < size:
                chunk = s.recv(size - got)
                if not chunk:
                    raise ConnectionError("the echo server closed the connection")
                got += len(chunk)
            out.append(time.monotonic() - t)
            time.sleep(max(0.0, t + every - time.monotonic()))
    return out


def measure(shape: Shape, seconds: float = 5.0, every: float = 0.1, log: Path | None = None) -> dict[str, Any]:
    """One link shaped ``shape`` to an echo server: its round trips, and what is left after close."""
    server, stop = _echo_server()
    links = Links(log=log)
    try:
        links.add("probe", "probe", server.getsockname()[:2])
        links.shape(shape)
        rtts = round_trips((links.host, links.links["probe"].listen), seconds, every, timeout=30)
        rules = links.rules()
        rto_min = RTO_MIN.read_text().strip() if RTO_MIN.exists() else None
        early = EARLY_RETRANS.read_text().strip()
    finally:
        links.close()
        stop.set()
        server.close()
    ms = sorted(x * 1000 for x in rtts)
    # A round trip that waited for a retransmission: beyond the link's worst round trip by 100 ms.
    slow = shape.rtt_ms + 2 * shape.jitter_ms + 100
    return {"namespace": os.environ.get(ISOLATED_ENV) if own_namespace() else None,
            "shape": {"one_way_ms": shape.one_way_ms, "jitter_ms": shape.jitter_ms, "loss": shape.loss},
            "round_trips": len(ms), "rtt_ms": {"min": ms[0], "p50": statistics.median(ms),
                                               "p99": ms[min(len(ms) - 1, int(len(ms) * 0.99))], "max": ms[-1]},
            "stalled": sum(x > slow for x in ms), "stall_ms": [round(x) for x in ms if x > slow],
            "during": {"rules": rules, "rto_min_us": rto_min, "early_retrans": early},
            "after": {"rules": links.rules(),
                      "rto_min_us": RTO_MIN.read_text().strip() if RTO_MIN.exists() else None,
                      "early_retrans": EARLY_RETRANS.read_text().strip(),
                      "toxiproxy_exit": links.proxy.proc.poll()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pygmy.verify.links",
                                description="measure one shaped link (a proxy to an echo server): round trips, "
                                            "and the stalls that losses cost; with loss, in a namespace of its own")
    p.add_argument("--one-way", type=int, default=150, help="latency each way, ms (default 150)")
    p.add_argument("--jitter", type=int, default=0, help="± ms each way (default 0)")
    p.add_argument("--loss", type=float, default=0.0, help="fraction of packets lost (default 0)")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--every", type=float, default=0.1, help="seconds between messages (default 0.1)")
    a = p.parse_args(argv)
    if a.loss and not own_namespace():
        args = sys.argv[1:] if argv is None else list(argv)
        return isolated([sys.executable, "-m", "pygmy.verify.links", *args], timeout=a.seconds + 60).returncode
    shape = Shape(a.one_way, a.jitter, a.loss)
    print(json.dumps(measure(shape, a.seconds, a.every), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
