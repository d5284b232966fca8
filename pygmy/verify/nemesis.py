"""Real faults for a live local cluster: network namespaces, iptables, Toxiproxy, signals, tmpfs.

``Network`` gives every service of a cluster started with ``--netns`` its own network namespace and
address, joined by veth pairs to one bridge in the host's namespace (which also carries the clients'
traffic to the frontends). Faults are rules inside the namespaces: a cut is an ``iptables`` DROP of
everything to an address, a one-way cut drops only new requests towards a peer's port (replies to
requests the peer makes still flow), loss is a ``statistic`` match, and delay sends a replica's
incoming connections through a Toxiproxy proxy (this kernel has no netem). Deleting the namespaces
and the bridge removes every rule, so ``close()`` leaves nothing behind even after a crash mid-fault.

``Nemesis`` applies faults from ``KINDS`` in seeded shuffled rounds (every kind equally often) and
records each fault window; ``tmpfs`` helpers give replicas small data disks that can be filled.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shlex
import shutil
import signal
import sqlite3
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from pygmy import ROOT
from pygmy.cluster import launcher
from pygmy.kit.config import ClusterConfig, parse_name
from pygmy.replication.transport import RAFT_PORT_OFFSET
from pygmy.verify import hosts
from pygmy.verify.hosts import Operator

TOXIPROXY = ROOT / "build" / "toxiproxy" / "toxiproxy-server"
TOXIPROXY_MODULE = "github.com/Shopify/toxiproxy/v2/cmd/server@v2.5.0"
TOXIPROXY_API_PORT = 8474


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """One administrative command (ip, iptables, ss, mount), with a timeout like every call here."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def missing_tools() -> list[str]:
    """What this module needs and the machine lacks: root, iproute2, iptables."""
    out = [] if os.geteuid() == 0 else ["root"]
    return out + [tool for tool in ("ip", "iptables", "ss") if shutil.which(tool) is None]


def fresh_addressing(letter: str) -> tuple[str, str]:
    """A namespace prefix and a /24 (first three octets) that no interface here uses yet."""
    used = sh("ip", "-4", "-o", "addr").stdout + sh("ip", "netns", "list").stdout + sh("ip", "link").stdout
    rng = random.Random()
    while True:
        prefix, subnet = f"p{letter}{rng.randrange(16 ** 5):05x}", f"10.{rng.randrange(200, 250)}.{rng.randrange(250)}"
        if f" {subnet}." not in used and prefix not in used:
            return prefix, subnet


# -- disks ------------------------------------------------------------------------------------------
def mount_tmpfs(path: Path, size: str = "64m") -> None:
    path.mkdir(parents=True, exist_ok=True)
    sh("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))


def fill(path: Path) -> None:
    """Checkpoint the replica's WALs down to nothing, then fill its filesystem to the last byte, so its
    next write needs space it cannot have (a WAL would otherwise reuse room it already holds)."""
    for db in ("raft.db", "state.db"):
        if (path / db).exists():
            with contextlib.closing(sqlite3.connect(path / db, timeout=10)) as conn:
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    with open(path / "filler", "wb", buffering=0) as f:  # unbuffered: nothing left to fail at close
        for chunk in (1 << 20, 4096, 512):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise


def integrity(dirs: dict[str, Path]) -> dict[str, str]:
    """``PRAGMA integrity_check`` of each replica's log and state (``{name: data dir}``), once stopped."""
    out = {}
    for name, path in dirs.items():
        for db in ("raft.db", "state.db"):
            if (path / db).exists():
                with contextlib.closing(sqlite3.connect(path / db, timeout=10)) as conn:
                    out[f"{name}/{db}"] = conn.execute("PRAGMA integrity_check").fetchone()[0]
    return out


def unfill(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (path / "filler").unlink()


# -- Toxiproxy --------------------------------------------------------------------------------------
def build_toxiproxy() -> Path:
    """``go install`` Toxiproxy's server into build/toxiproxy once (Go modules are reachable here)."""
    if TOXIPROXY.exists():
        return TOXIPROXY
    import fcntl
    import tempfile

    from pygmy.verify.gobuild import go_command

    TOXIPROXY.parent.mkdir(parents=True, exist_ok=True)
    # Several test processes may want it at once: one builds, the others wait and find it built.
    with open(TOXIPROXY.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if TOXIPROXY.exists():
            return TOXIPROXY
        with tempfile.TemporaryDirectory(dir=TOXIPROXY.parent) as out:
            proc = subprocess.run([go_command("Toxiproxy"), "install", TOXIPROXY_MODULE], env={**os.environ, "GOBIN": out},
                                  capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(f"building Toxiproxy failed:\n{proc.stderr}")
            os.replace(Path(out) / "server", TOXIPROXY)
    return TOXIPROXY


class Toxiproxy:
    """A Toxiproxy server in the host's namespace, driven through its REST API (a handful of calls;
    the Python client on PyPI is unmaintained)."""

    def __init__(self, host: str, log: Path, api_port: int = TOXIPROXY_API_PORT) -> None:
        self.api = f"http://127.0.0.1:{api_port}"
        self.host = host
        self._log = open(log, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([str(build_toxiproxy()), "-host", "127.0.0.1", "-port", str(api_port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.s = requests.Session()
        # A connection per call: its server closes a kept-alive one that sent nothing for its read
        # timeout, and a call sent on it as it closes fails with nothing done (RemoteDisconnected).
        self.s.headers["Connection"] = "close"
        deadline = time.monotonic() + 10
        while True:
            try:
                self.s.get(f"{self.api}/version", timeout=1).raise_for_status()
                break
            except requests.RequestException:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"Toxiproxy did not start (port {api_port} taken?); see {log}") from None
                time.sleep(0.1)

    def proxy(self, name: str, listen_port: int, upstream: str) -> None:
        r = self.s.post(f"{self.api}/proxies", json={"name": name, "listen": f"{self.host}:{listen_port}",
                                                     "upstream": upstream, "enabled": True}, timeout=5)
        r.raise_for_status()

    def latency(self, name: str, ms: int, jitter: int) -> None:
        for stream in ("upstream", "downstream"):  # half each way: the round trip gets `ms`
            r = self.s.post(f"{self.api}/proxies/{name}/toxics", timeout=5, json={
                "name": f"lat-{stream}", "type": "latency", "stream": stream,
                "attributes": {"latency": ms // 2, "jitter": jitter // 2}})
            r.raise_for_status()

    def delete(self, name: str) -> None:
        self.s.delete(f"{self.api}/proxies/{name}", timeout=5)

    def clear(self, name: str) -> None:
        for stream in ("upstream", "downstream"):
            self.s.delete(f"{self.api}/proxies/{name}/toxics/lat-{stream}", timeout=5)

    def stop(self) -> None:
        self.s.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


# -- the network ------------------------------------------------------------------------------------
class Network:
    """A bridge and one namespace per service of ``config`` (which must have ``netns`` set).

    Everything it makes is named after ``config.netns``; ``close()`` deletes it all and is safe to call
    twice. Use as a context manager.
    """

    def __init__(self, config: ClusterConfig, log_dir: Path) -> None:
        if not config.netns or len(config.netns) > 8:
            raise ValueError("config.netns must be a prefix of 1-8 characters (interface names are short)")
        self.config = config
        self.names = config.names()
        self.gateway = f"{config.netns_subnet}.1"
        self.bridge = f"{config.netns}br"
        #: Each service's host: its address and HTTP port (hosts added later get addresses of their own).
        self.hosts = {name: (config.address(name), self._derived_port(name)) for name in self.names}
        self._made: dict[str, str] = {}  # namespace -> our end of its veth pair
        self._veths = 0
        self._next_address = 10 + len(self.names)  # after those ``pygmy up --netns`` derives
        self._forward_rule: list[str] | None = None
        self._lock = threading.Lock()
        self._touched: defaultdict[str, set[str]] = defaultdict(set)  # service -> iptables tables with our rules
        self._delayed: set[str] = set()
        self._log_dir = log_dir
        self._toxiproxy: Toxiproxy | None = None
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        # Docker loads br_netfilter and sets FORWARD to DROP: bridged packets between our namespaces
        # would meet that policy. Accept them explicitly (removed in close()).
        if Path("/proc/sys/net/bridge/bridge-nf-call-iptables").exists():
            self._forward_rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
            sh("iptables", "-I", *self._forward_rule)
        for name in self.names:
            self._plug(name)

    def _plug(self, name: str) -> None:
        """``name``'s namespace, its address on the bridge, loopback up."""
        ns, veth = self.ns(name), f"{self.config.netns}v{self._veths}"
        self._veths += 1
        sh("ip", "netns", "add", ns)
        self._made[ns] = veth
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", veth, "master", self.bridge, "up")
        sh("ip", "-n", ns, "addr", "add", f"{self.hosts[name][0]}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _unplug(self, ns: str) -> None:
        # Deleting our end of the pair deletes both now; a namespace's own clean-up is deferred.
        sh("ip", "link", "del", self._made.pop(ns), check=False)
        sh("ip", "netns", "del", ns, check=False)  # and its rules with it

    def add_host(self, name: str, port: int) -> str:
        """A new machine for replica ``name`` (one ``pygmy member add`` will name): a namespace of
        its own at the next free address of the subnet, serving on ``port``. Returns its address."""
        if self._next_address > 254:
            raise RuntimeError(f"no address left in {self.config.netns_subnet}.0/24")
        address = f"{self.config.netns_subnet}.{self._next_address}"
        self._next_address += 1
        with self._lock:
            self.hosts[name] = (address, port)
            self.names.append(name)
        try:
            self._plug(name)
            if self._toxiproxy is not None:
                for p in self.ports(name):
                    self._toxiproxy.proxy(f"{name}-{p}", self.proxy_port(p), f"{address}:{p}")
        except BaseException:
            self.remove_host(name)
            raise
        return address

    def remove_host(self, name: str) -> None:
        """Host ``name`` is gone for good: its namespace, rules and proxies deleted (whatever still
        runs in it loses its network; the caller kills it)."""
        with self._lock:
            if name not in self.hosts:
                return
            ports = self.ports(name)
            self.names.remove(name)
            self._touched.pop(name, None)
            self._delayed.discard(name)
            self.hosts.pop(name)
        if self._toxiproxy is not None:
            for p in ports:
                self._toxiproxy.delete(f"{name}-{p}")
        if self.ns(name) in self._made:
            self._unplug(self.ns(name))

    @property
    def toxiproxy(self) -> Toxiproxy:
        """Started on the first delay, with one proxy per replica (listening on the gateway)."""
        if self._toxiproxy is None:
            self._toxiproxy = Toxiproxy(self.gateway, self._log_dir / "toxiproxy.log")
            for name in self.replicas():
                for port in self.ports(name):
                    self._toxiproxy.proxy(f"{name}-{port}", self.proxy_port(port), f"{self.address(name)}:{port}")
        return self._toxiproxy

    def close(self) -> None:
        if self._toxiproxy is not None:
            self._toxiproxy.stop()
            self._toxiproxy = None
        for ns in reversed(list(self._made)):
            self._unplug(ns)
        sh("ip", "link", "del", self.bridge, check=False)
        if self._forward_rule is not None:
            sh("iptables", "-D", *self._forward_rule, check=False)
            self._forward_rule = None

    # -- addressing -----------------------------------------------------------------------------------
    def replicas(self, tier: str | None = None) -> list[str]:
        return [n for n in self.names if not n.startswith("frontend") and (tier is None or n.startswith(tier))]

    def frontends(self) -> list[str]:
        return [n for n in self.names if n.startswith("frontend")]

    def _derived_port(self, name: str) -> int:
        tier, k = parse_name(name)
        return self.config.local_port(tier, k)

    def port(self, name: str) -> int:
        return self.hosts[name][1]

    def address(self, name: str) -> str:
        return self.hosts[name][0]

    def ports(self, name: str) -> list[int]:
        """Every port ``name`` listens on: HTTP, and a replica's peer transport."""
        port = self.port(name)
        return [port] if name.startswith("frontend") else [port, port + RAFT_PORT_OFFSET]

    def proxy_port(self, port: int) -> int:
        """Where Toxiproxy listens (on the gateway) for the delayed links into ``port``."""
        return 20000 + port % 10000

    def ns(self, name: str) -> str:
        ns = self.config.namespace(name)
        assert ns is not None
        return ns

    # -- rules ----------------------------------------------------------------------------------------
    def _run(self, commands: dict[str, list[list[str]]]) -> None:
        """Per namespace, its commands in one ``sh -c`` (forking the loaded Python process once per
        namespace, not once per rule, keeps a split's start and end sharp under load)."""
        with self._lock:
            for name, cmds in commands.items():
                script = " && ".join(shlex.join(c) + (" || true" if c[0] == "ss" else "") for c in cmds)
                sh("ip", "netns", "exec", self.ns(name), "sh", "-c", script)
                self._touched[name] |= {c[2] if c[1] == "-t" else "filter" for c in cmds if c[0] == "iptables"}

    def partition(self, side: list[str], rest: list[str]) -> None:
        """No packet between any of ``side`` and any of ``rest``, either way (both ends drop)."""
        def drop_to(names: list[str]) -> list[list[str]]:
            return [["iptables", "-A", "OUTPUT", "-d", ",".join(self.address(n) for n in names), "-j", "DROP"]]

        self._run({**{a: drop_to(rest) for a in side}, **{b: drop_to(side) for b in rest}})

    def cut(self, a: str, b: str) -> None:
        """No packet between ``a`` and ``b`` either way (both sides drop, so even replies are lost)."""
        self.partition([a], [b])

    def cut_one_way(self, a: str, b: str) -> None:
        """``a`` cannot send requests to ``b``; ``b``'s requests to ``a`` (and their replies) go through."""
        self._run({a: [["iptables", "-A", "OUTPUT", "-d", self.address(b), "-p", "tcp", "-m", "multiport",
                        "--dports", ",".join(map(str, self.ports(b))), "-j", "DROP"]]})

    def lossy(self, name: str, probability: float, everything: bool = False) -> None:
        """Drop this fraction of ``name``'s packets to and from other services (not the host's), or
        with ``everything`` of all its packets but loopback's: the host's too, which carries its
        delayed links (Toxiproxy listens on the gateway)."""
        others = f"{self.config.netns_subnet}.2-{self.config.netns_subnet}.254"

        def match(chain: str) -> list[str]:
            if everything:
                return ["!", "-i" if chain == "INPUT" else "-o", "lo"]
            return ["-m", "iprange", "--src-range" if chain == "INPUT" else "--dst-range", others]

        self._run({name: [["iptables", "-A", chain, *match(chain), "-m", "statistic", "--mode",
                           "random", "--probability", f"{probability:.3f}", "-j", "DROP"]
                          for chain in ("INPUT", "OUTPUT")]})

    def isolate(self, name: str) -> None:
        """Host ``name`` cut from everything but itself, both ways: peers, frontends, the host's
        namespace (the nemesis' probes, ``pygmy member``): as if its cable were pulled."""
        self._run({name: [["iptables", "-A", "INPUT", "!", "-i", "lo", "-j", "DROP"],
                          ["iptables", "-A", "OUTPUT", "!", "-o", "lo", "-j", "DROP"]]})

    def _through_proxies(self, target: str, callers: list[str]) -> dict[str, list[list[str]]]:
        """Rules that send ``callers``' connections to replica ``target`` through its proxies."""
        rules = []
        for port in self.ports(target):
            address = self.address(target)
            rules += [["iptables", "-t", "nat", "-A", "OUTPUT", "-d", address, "-p", "tcp", "--dport", str(port), "-j",
                       "DNAT", "--to-destination", f"{self.gateway}:{self.proxy_port(port)}"],
                      # NAT applies to new connections only: end the kept-alive ones so they reconnect.
                      ["ss", "-K", "dst", address, "dport", "=", str(port)]]
        return {caller: rules for caller in callers if caller != target}

    def delay(self, name: str, ms: int, jitter: int) -> None:
        """Every other service's connections to ``name`` go through Toxiproxy with this latency."""
        for port in self.ports(name):
            self.toxiproxy.latency(f"{name}-{port}", ms, jitter)
        self._delayed.add(name)
        self._run(self._through_proxies(name, self.names))

    def slow(self, name: str, ms: int, jitter: int) -> None:
        """Every link of host ``name`` delayed: ``ms`` ± ``jitter`` each way (the round trip twice
        that) on the connections others make to it and on those it makes to the other replicas
        (through their proxies, which only its connections take while this lasts)."""
        others = [r for r in self.replicas() if r != name]
        for target in (name, *others):
            for port in self.ports(target):
                self.toxiproxy.latency(f"{target}-{port}", 2 * ms, 2 * jitter)
            self._delayed.add(target)
        commands = self._through_proxies(name, self.names)
        for target in others:
            commands[name] = commands.get(name, []) + self._through_proxies(target, [name])[name]
        self._run(commands)

    def heal(self) -> None:
        """Remove every rule and toxic: the network is whole again. The namespaces hold only our
        rules, so flushing the tables we touched removes exactly those."""
        with self._lock:
            touched, self._touched = self._touched, defaultdict(set)
            for name, tables in touched.items():
                cmds = [["iptables", "-t", t, "-F"] for t in sorted(tables)]
                if cmds:
                    sh("ip", "netns", "exec", self.ns(name), "sh", "-c", "; ".join(shlex.join(c) for c in cmds),
                       check=False)
            for name in self._delayed:
                for port in self.ports(name):
                    self.toxiproxy.clear(f"{name}-{port}")
            self._delayed.clear()


# -- the nemesis ------------------------------------------------------------------------------------
KINDS = ("isolate-catalog-leader", "isolate-order-leader", "frontend-minority", "split", "one-way",
         "delay", "loss", "pause", "kill", "disk-full", "host-isolated", "host-slow", "host-lost")
#: The faults on a replica's host as a whole (docs/testing.md): ``make chaos KINDS=host``.
HOST_KINDS = tuple(k for k in KINDS if k.startswith("host-"))


#: Longest a ``stop`` waits for the nemesis: the rest of its first round, or a host being replaced.
STOP_WAIT = 300.0


@dataclass
class Window:
    kind: str
    detail: str
    start: int  # time.monotonic_ns(), the history's clock
    end: int | None = None
    #: What the fault did step by step, where it has steps (``host-lost``: the replacement's).
    steps: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Nemesis:
    """Applies one fault at a time, in seeded rounds that shuffle every kind of ``kinds`` once.

    ``leader(tier)`` names the current leader (or None); ``kill``/``restart`` act on a service;
    ``data_dir(name)`` is a replica's (tmpfs) data directory for ``disk-full``. ``host-lost`` needs
    ``operator`` (``pygmy member``) and ``disks`` (the new host's data disk is a tmpfs too).
    """

    net: Network
    leader: Callable[[str], str | None]
    kill: Callable[[str], None]
    restart: Callable[[str], None]
    pid: Callable[[str], int | None]
    data_dir: Callable[[str], Path]
    seed: int = 0
    kinds: tuple[str, ...] = KINDS
    hold: tuple[float, float] = (0.6, 1.6)  # long enough for an election (0.3-0.6 s) in most
    #: ``host-slow``'s: "a few seconds" of a slow, lossy host, several of its round trips.
    slow_hold: tuple[float, float] = (2.0, 4.0)
    gap: tuple[float, float] = (0.2, 0.6)
    #: Complete rounds before a ``stop`` takes effect: with 1, a short run still applies every kind,
    #: however long the host kinds took on a loaded machine.
    min_rounds: int = 1
    operator: Operator | None = None
    disks: Disks | None = None
    windows: list[Window] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        # Per tier, the highest replica number given so far: a new host never takes a lost one's name.
        self._serial = {tier: max((parse_name(n)[1] for n in self.net.replicas(tier)), default=0)
                        for tier in ("catalog", "order")}
        self._stop = threading.Event()  # stop now: cuts a hold or a gap short
        self._lock = threading.Lock()
        self._wanted = False  # stop asked for, due once the rounds are complete
        self._rounds = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nemesis", daemon=True)
        self._thread.start()

    def stop(self, now: bool = False) -> None:
        """Stop after the current fault, once ``min_rounds`` rounds are complete (``now``: at once),
        heal everything, and wait for it."""
        with self._lock:
            self._wanted = True
            if now or self._rounds >= self.min_rounds:
                self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(STOP_WAIT)
            if self._thread.is_alive() and "nemesis thread did not stop" not in self.errors:
                self.errors.append("nemesis thread did not stop")

    def _run(self) -> None:
        while not self._stop.is_set():
            kinds = list(self.kinds)
            self.rng.shuffle(kinds)
            for kind in kinds:
                gap = self.rng.uniform(*self.gap)
                if self._stop.wait(gap):
                    return
                try:
                    self.apply(kind)
                except Exception as exc:  # a fault that could not be applied is reported, not fatal
                    self.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
            with self._lock:
                self._rounds += 1
                if self._wanted and self._rounds >= self.min_rounds:
                    self._stop.set()

    def _new_name(self, tier: str) -> str:
        """A replica name never used in this run: a new host is a new member, never an old one back."""
        k = max(self._serial[tier], *(parse_name(n)[1] for n in self.net.replicas(tier))) + 1
        self._serial[tier] = k
        return f"{tier}-{k}"

    def _role(self, name: str) -> str:
        return " (leader)" if self.leader(parse_name(name)[0]) == name else ""

    def _lose_host(self, tier: str, old: str) -> tuple[str, Callable[[], None], list[dict[str, Any]]]:
        """SIGKILL ``old``, wipe its disk, delete its namespace; return the new host's name, the
        replacement (an operator's, to run once the loss has been held) and its steps as they go."""
        if self.operator is None or self.disks is None:
            raise RuntimeError("host-lost needs an operator and the disks")
        operator, disks = self.operator, self.disks
        port, pid = self.net.port(old), self.pid(old)
        if pid is None:
            raise RuntimeError(f"{old} has no pid")
        new = self._new_name(tier)  # while ``old`` is still a host: never its name again
        os.killpg(pid, signal.SIGKILL)  # the machine gone: every process of the replica at once
        disks.wipe(self.data_dir(old))
        self.net.remove_host(old)
        steps: list[dict[str, Any]] = [{"action": "lost", "name": old, "at": time.monotonic_ns()}]

        def replace() -> None:
            address = self.net.add_host(new, port)
            disks.add(self.data_dir(new))
            steps.append({"action": "new-host", "name": new, "address": address, "at": time.monotonic_ns()})
            url = f"http://{address}:{port}"
            hosts.replace(operator, tier, old, new, url, self.restart, steps=steps)

        return new, replace, steps

    def apply(self, kind: str) -> None:
        """Apply one fault of ``kind``, hold it, and undo it (always, even on error)."""
        undo: list[Callable[[], None]] = [self.net.heal]
        detail = ""
        rng = self.rng
        hold = self.hold
        steps: list[dict[str, Any]] = []
        try:
            if kind in ("isolate-catalog-leader", "isolate-order-leader"):
                tier = kind.split("-")[1]
                lead = self.leader(tier) or rng.choice(self.net.replicas(tier))
                self.net.partition([lead], [p for p in self.net.replicas(tier) if p != lead])
                detail = lead
            elif kind == "frontend-minority":
                front = rng.choice(self.net.frontends())
                cut = []
                for tier in ("catalog", "order"):
                    reps = self.net.replicas(tier)
                    cut += rng.sample(reps, len(reps) // 2 + 1)  # a majority out of reach
                self.net.partition([front], cut)
                detail = f"{front} reaches only {sorted(set(self.net.replicas()) - set(cut))}"
            elif kind == "split":
                side: list[str] = []
                for tier in ("catalog", "order"):
                    reps = self.net.replicas(tier)
                    side += rng.sample(reps, len(reps) // 2)
                side += rng.sample(self.net.frontends(), len(self.net.frontends()) // 2)
                rest = [n for n in self.net.names if n not in side]
                self.net.partition(side, rest)
                detail = f"{sorted(side)} | {sorted(rest)}"
            elif kind == "one-way":
                tier = rng.choice(("catalog", "order"))
                lead = self.leader(tier) or rng.choice(self.net.replicas(tier))
                other = rng.choice([r for r in self.net.replicas(tier) if r != lead])
                a, b = (lead, other) if rng.random() < 0.5 else (other, lead)
                self.net.cut_one_way(a, b)
                detail = f"{a} -/-> {b}"
            elif kind == "delay":
                name = rng.choice(self.net.replicas())
                ms, jitter = rng.randint(100, 300), rng.randint(20, 60)
                self.net.delay(name, ms, jitter)
                detail = f"{name} {ms}±{jitter} ms"
            elif kind == "loss":
                name = rng.choice(self.net.replicas())
                p = rng.uniform(0.05, 0.20)
                self.net.lossy(name, p)
                detail = f"{name} {p:.0%}"
            elif kind == "pause":
                name = rng.choice(self.net.replicas())
                pid = self.pid(name)
                if pid is None:
                    raise RuntimeError(f"{name} has no pid")
                undo.append(lambda: os.killpg(pid, signal.SIGCONT))  # first: pause() may raise once it has sent SIGSTOP
                launcher.pause(pid)
                detail = name
            elif kind == "kill":
                name = rng.choice(self.net.replicas())
                self.kill(name)
                undo.append(lambda: self.restart(name))
                detail = name
            elif kind == "disk-full":
                name = rng.choice(self.net.replicas())
                fill(self.data_dir(name))
                undo.append(lambda: unfill(self.data_dir(name)))
                detail = name
            elif kind == "host-isolated":
                name = rng.choice(self.net.replicas())
                detail = name + self._role(name)
                self.net.isolate(name)
            elif kind == "host-slow":
                name = rng.choice(self.net.replicas())
                ms, p = rng.randint(100, 200), rng.uniform(0.05, 0.10)
                self.net.slow(name, ms, 50)
                self.net.lossy(name, p, everything=True)
                detail = f"{name} {ms}±50 ms each way, {p:.0%} loss"
                hold = self.slow_hold
            elif kind == "host-lost":
                tier = rng.choice(("catalog", "order"))
                # Half the time its leader (when one is known), else any replica of the tier.
                lead = self.leader(tier)
                old = lead if lead is not None and rng.random() < 0.5 else rng.choice(self.net.replicas(tier))
                new, replace, steps = self._lose_host(tier, old)
                undo.append(replace)
                detail = f"{old}{' (leader)' if old == lead else ''} lost, replaced by {new}"
            else:
                raise ValueError(f"unknown fault kind {kind!r}")
            window = Window(kind, detail, time.monotonic_ns(), steps=steps)
            self.windows.append(window)
            self._stop.wait(rng.uniform(*hold))
        finally:
            for step in reversed(undo):
                try:
                    step()
                except Exception as exc:
                    self.errors.append(f"undo {kind}: {type(exc).__name__}: {exc}")
            if self.windows and self.windows[-1].end is None:
                self.windows[-1].end = time.monotonic_ns()


class Disks:
    """Small tmpfs data directories, one per replica, mounted as hosts come and unmounted as they go
    (lazily: a process may still hold a file); ``close()`` unmounts what is left."""

    def __init__(self, size: str = "64m") -> None:
        self.size = size
        self.mounted: list[Path] = []

    def add(self, path: Path) -> None:
        mount_tmpfs(path, self.size)
        self.mounted.append(path)

    def wipe(self, path: Path) -> None:
        """The disk is gone with its host: unmounted (its files with it) and the directory removed."""
        if path in self.mounted:
            self.mounted.remove(path)
            sh("umount", "-l", str(path), check=False)
        shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        for path in reversed(self.mounted):
            sh("umount", "-l", str(path), check=False)
        self.mounted.clear()


@contextlib.contextmanager
def tmpfs_disks(paths: list[Path], size: str = "64m") -> Iterator[Disks]:
    """Small tmpfs data directories (unmounted on exit, lazily: a process may still hold a file)."""
    disks = Disks(size)
    try:
        for path in paths:
            disks.add(path)
        yield disks
    finally:
        disks.close()


def describe_windows(windows: list[Window]) -> list[dict[str, Any]]:
    return [{"kind": w.kind, "detail": w.detail, "start": w.start, "end": w.end,
             **({"steps": w.steps} if w.steps else {})} for w in windows]
