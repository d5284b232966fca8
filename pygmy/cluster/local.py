"""Drive a whole local Pygmy cluster from Python the way a user does: ``pygmy up``, ``kill``, ``start``.

The tests and the experiments both use it. Everything started here is stopped here:
``LocalCluster.stop`` sends SIGTERM to ``pygmy up`` (which stops its services), then SIGKILLs any
process group still named in a pid file. Ports come from ``free_port_base``, never fixed ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import requests

from pygmy.client.api import PygmyClient
from pygmy.cluster import launcher
from pygmy.kit.config import ClusterConfig

ROOT = Path(__file__).resolve().parents[2]  # the checkout: where the pygmy package is


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


#: Where port bases are picked: below Linux's ephemeral range (32768 and up), see ``free_port_base``.
PORT_RANGE = (20000, 32768)


def _port_slice() -> tuple[int, int]:
    """This process's share of ``PORT_RANGE``: all of it, or slice ``i`` of ``n`` when
    ``PYGMY_PORT_SLICE=i/n`` says several processes pick port bases at once (the test suite's xdist
    workers): a base that is free when checked may be taken before its services bind it, but never
    by a process of another slice."""
    low, high = PORT_RANGE
    given = os.environ.get("PYGMY_PORT_SLICE", "")
    index, _, count = given.partition("/")
    if index.isdigit() and count.isdigit() and 0 <= int(index) < int(count):
        width = (high - low) // int(count)
        low += int(index) * width
        high = low + width
    return low, high


def free_port_base(replicas: int = 5, frontends: int = 2) -> int:
    """A port base B whose frontend, catalog and order ports are all free right now. Below Linux's
    ephemeral range (32768 and up): a port there can be free when checked and then taken as the
    source port of some outgoing connection before the service binds it."""
    low, high = _port_slice()
    for _ in range(200):
        base = random.randrange(low, high - 300, 10)
        ports = [base + i for i in range(frontends)]
        # Replicas: HTTP and the peer transport (pygmy.replication.transport.RAFT_PORT_OFFSET above it).
        ports += [base + off + k for off in (100, 150, 200, 250) for k in range(1, replicas + 1)]
        if all(_port_free(p) for p in ports):
            return base
    raise RuntimeError("no free port base found")


def free_port() -> int:
    """One port free right now, for a server started a moment later: picked as ``free_port_base``
    picks its bases (below the ephemeral range, in this process's slice), not by binding port 0,
    which hands out ephemeral ports that an outgoing connection may take before the server binds
    (seen once in a full run: ``Address already in use``)."""
    low, high = _port_slice()
    for _ in range(200):
        port = random.randrange(low, high)
        if port not in _handed_out and _port_free(port):
            _handed_out.add(port)  # several taken before any is bound must differ
            return port
    raise RuntimeError("no free port found")


#: Ports ``free_port`` gave this process: each once (a server may not have bound it yet).
_handed_out: set[int] = set()


def cli_module(root: Path) -> str:
    """The command line's module in checkout ``root``: versions before the one package had it at the top."""
    return "pygmy.cluster.cli" if (root / "pygmy" / "cluster" / "cli.py").exists() else "cluster.cli"


def pygmy(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
          root: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run the ``pygmy`` command line as a user would (that of the checkout ``root``)."""
    return subprocess.run([sys.executable, "-m", cli_module(root), *args], cwd=root, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


class LocalCluster:
    def __init__(self, data_dir: Path, port_base: int, args: list[str], env: dict[str, str] | None = None,
                 root: Path = ROOT, command: tuple[str, ...] = ("up",)) -> None:
        """``env`` is added to the environment of every process started here (tests' fault hooks);
        ``root`` is the checkout whose code the services run (another version, for ``pygmy.experiments.ab``);
        ``command`` what runs the cluster in the foreground (``("restore", ARCHIVE)``: one built from a backup)."""
        self.data_dir, self.port_base, self.args, self.root = data_dir, port_base, args, root
        self.command = command
        self.env = dict(env or {})
        if root != ROOT:
            self.env["PYTHONPATH"] = str(root)  # its packages, not this checkout's installed ones
        self.url = f"http://127.0.0.1:{port_base}"
        self.proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        self.stamped: list[tuple[float, str]] = []  # (time.monotonic() it came at, line): the output, timed

    # -- life cycle -----------------------------------------------------------------------------
    def start(self, reset: bool = False, timeout: float = 60) -> LocalCluster:
        cmd = [sys.executable, "-m", cli_module(self.root), *self.command, "--port-base", str(self.port_base),
               "--data-dir", str(self.data_dir), *self.args] + (["--reset"] if reset else [])
        self.proc = subprocess.Popen(cmd, cwd=self.root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **self.env})
        threading.Thread(target=self._pump, args=(self.proc,), daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if line.startswith("ready "):
                self.url = line.split()[1]  # 127.0.0.1 unless each service has its own address (--netns)
                return self
        self.stop()
        raise RuntimeError(f"cluster did not start: {''.join(self.output)[-2000:]}\n{self.logs_tail()}")

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.output.append(line)
            self.stamped.append((time.monotonic(), line))
            self._lines.put(line)

    def stop(self, timeout: float = 30) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.kill_all()

    def kill_all(self, forget: bool = True) -> None:
        """SIGKILL every service group a pid file names that really runs that service here (never a
        program that reused a stale pid); ``forget`` deletes the pid files too."""
        run = self.data_dir / "run"
        config = ClusterConfig(data_dir=str(self.data_dir))
        for pid_file in run.glob("*.pid") if run.exists() else []:
            with contextlib.suppress(ValueError, ProcessLookupError, PermissionError):
                pid = launcher.running(config, pid_file.stem)
                if pid:
                    os.killpg(pid, signal.SIGKILL)
            if forget:
                pid_file.unlink(missing_ok=True)

    def crash(self) -> None:
        """SIGKILL ``pygmy up`` and every service: nothing gets to shut down cleanly, and the pid
        files stay behind, as after a real crash."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.kill_all(forget=False)

    # -- fault injection as a user does it ------------------------------------------------------
    def kill(self, name: str) -> None:
        r = pygmy("kill", name, "--data-dir", str(self.data_dir), env=self.env, root=self.root)
        assert r.returncode == 0, r.stderr

    def restart(self, name: str) -> None:
        r = pygmy("start", name, "--data-dir", str(self.data_dir), env=self.env, root=self.root)
        assert r.returncode == 0, r.stderr + self.logs_tail(name)

    # -- looking at it from outside --------------------------------------------------------------
    def client(self, frontend: int = 1, **kw: Any) -> PygmyClient:
        config = self.cluster_config()
        return PygmyClient(config.frontend_url(frontend), token=self.admin_token(),
                           verify=config.tool_tls("client").get("verify", True), **kw)

    def secret(self) -> str:
        """The internal secret: what replicas and frontends show each other (``D/secret``)."""
        return (self.data_dir / "secret").read_text().strip()

    def admin_token(self) -> str:
        """The admin token for ``POST /update`` (``D/admin-token``)."""
        return (self.data_dir / "admin-token").read_text().strip()

    def config(self) -> dict[str, Any]:
        return json.loads((self.data_dir / "run" / "cluster.json").read_text())

    def cluster_config(self) -> ClusterConfig:
        return ClusterConfig.load(str(self.data_dir))

    def replica_url(self, name: str) -> str:
        return self.cluster_config().peers(name.rsplit("-", 1)[0])[name]

    def replica_get(self, name: str, path: str, timeout: float = 2.0) -> requests.Response:
        return requests.get(self.replica_url(name) + path, timeout=timeout,
                            headers={"Authorization": f"Bearer {self.secret()}"},
                            **self.cluster_config().tool_tls())

    def process_groups(self) -> dict[str, int]:
        """``{service: process group}`` of every service with a pid file."""
        out = {}
        for pid_file in sorted((self.data_dir / "run").glob("*.pid")):
            try:
                out[pid_file.stem] = int(pid_file.read_text())
            except ValueError:
                continue
        return out

    def loop_faults(self, timeout: float = 1.0) -> dict[str, dict[str, int]]:
        """``{replica: loop_faults}`` of every replica that answers ``/status`` now (a stopped or
        killed one does not: its faults show in its log, see ``logged_tracebacks``)."""
        out: dict[str, dict[str, int]] = {}
        try:
            config = self.cluster_config()
        except (OSError, ValueError):
            return out
        for name in config.names():
            if name.startswith("frontend-"):
                continue
            try:
                out[name] = self.replica_get(name, "/status", timeout).json()["loop_faults"]
            except (requests.RequestException, ValueError, KeyError, TypeError):
                continue
        return out

    def logged_tracebacks(self) -> list[str]:
        """Every traceback in the services' logs, each as ``"<service>: <what was logged> | <the
        exception>"``: a service that logs one hid an error from its clients (a replica's supervised
        loop, a request that failed inside a worker, a thread that died). Log lines are JSON with the
        traceback in ``exception`` (``pygmy.kit.logs``); what bypasses logging comes as plain text."""
        found = []
        for path in sorted((self.data_dir / "logs").glob("*.log")) if (self.data_dir / "logs").exists() else []:
            lines = path.read_text(errors="replace").splitlines()
            for i, line in enumerate(lines):
                if line.startswith("{") and '"exception"' in line:
                    with contextlib.suppress(ValueError, AttributeError):
                        record = json.loads(line)
                        last = str(record.get("exception", "")).strip().splitlines() or ["?"]
                        found.append(f"{path.stem}: {record.get('message')} | {last[-1]}")
                elif line.startswith("Traceback (most recent call last):"):
                    j = i + 1
                    while j < len(lines) and (lines[j].startswith((" ", "\t")) or not lines[j].strip()):
                        j += 1
                    found.append(f"{path.stem}: {lines[i - 1] if i else '?'} | {lines[j] if j < len(lines) else '?'}")
        return found

    def logs_tail(self, name: str | None = None, lines: int = 30) -> str:
        logs = self.data_dir / "logs"
        files = [logs / f"{name}.log"] if name else sorted(logs.glob("*.log")) if logs.exists() else []
        out = []
        for f in files:
            if f.exists():
                out.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)


def start_cluster(tmp: Path, *args: str, reset: bool = True, env: dict[str, str] | None = None) -> LocalCluster:
    return LocalCluster(tmp / "data", free_port_base(), list(args), env).start(reset=reset)
