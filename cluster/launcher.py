"""Start, stop, kill and restart Pygmy services as local processes (``pygmy up|start|kill``).

Every service runs as ``pygmy serve`` in its own session, so its Gunicorn master is a process group
leader and ``pygmy kill`` can SIGKILL master and workers at once. Pid files name those leaders.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from cluster.config import ClusterConfig, parse_name

START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0


class LaunchError(Exception):
    pass


def group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_pid(config: ClusterConfig, name: str) -> int | None:
    try:
        return int(config.pid_file(name).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def running(config: ClusterConfig, name: str) -> int | None:
    pid = read_pid(config, name)
    return pid if pid and group_alive(pid) else None


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def service_url(config: ClusterConfig, name: str) -> str:
    tier, k = parse_name(name)
    return config.frontend_url(k) if tier == "frontend" else config.peers(tier)[name]


def spawn(config: ClusterConfig, name: str) -> subprocess.Popen[bytes]:
    """Start one service in the background, in its own process group, logging to ``D/logs/<name>.log``."""
    tier, k = parse_name(name)
    if running(config, name):
        raise LaunchError(f"{name} is already running (pid file {config.pid_file(name)})")
    port = config.listen_port(tier, k)
    namespace = config.namespace(name)
    if namespace is None and not port_free(config.bind, port):
        raise LaunchError(f"port {port} for {name} is in use: stop what uses it or pick --port-base")
    config.log_dir().mkdir(parents=True, exist_ok=True)
    config.run_dir().mkdir(parents=True, exist_ok=True)
    # `ip netns exec` execs the command in place: the pid (and process group) stay the service's.
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    with open(config.log_dir() / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "cluster.cli", "serve", tier, "--id", str(k), "--data-dir", str(config.root)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            cwd=str(Path(__file__).resolve().parent.parent),
        )
    config.pid_file(name).write_text(f"{proc.pid}\n")
    return proc


def wait_healthy(config: ClusterConfig, names: list[str], timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    pending = list(names)
    with requests.Session() as s:
        while pending:
            name = pending[0]
            try:
                if s.get(service_url(config, name) + "/health", timeout=(0.5, 2)).status_code == 200:
                    pending.pop(0)
                    continue
            except requests.RequestException:
                pass
            pid = read_pid(config, name)
            if pid is None or not group_alive(pid):
                raise LaunchError(f"{name} exited during start-up; see {config.log_dir() / (name + '.log')}")
            if time.monotonic() > deadline:
                raise LaunchError(f"{name} did not become healthy in {timeout:.0f} s; see its log")
            time.sleep(0.1)


def wait_leaders(config: ClusterConfig, timeout: float = START_TIMEOUT) -> None:
    """Ready means reads and writes work: each replicated tier has a leader."""
    deadline = time.monotonic() + timeout
    with requests.Session() as s:
        while True:
            try:
                st = s.get(config.frontend_url(1) + "/status", timeout=(0.5, 3)).json()
                if st["catalog"]["leader"] and st["order"]["leader"]:
                    return
            except (requests.RequestException, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise LaunchError(f"no leader elected in {timeout:.0f} s; see the logs in {config.log_dir()}")
            time.sleep(0.1)


def kill(config: ClusterConfig, name: str, sig: int = signal.SIGKILL) -> int:
    parse_name(name)
    pid = running(config, name)
    if pid is None:
        raise LaunchError(f"{name} is not running")
    os.killpg(pid, sig)
    if sig == signal.SIGKILL:
        config.pid_file(name).unlink(missing_ok=True)
    return pid


def start(config: ClusterConfig, name: str) -> int:
    proc = spawn(config, name)
    wait_healthy(config, [name])
    return proc.pid


def stop_all(config: ClusterConfig, names: list[str]) -> None:
    """SIGTERM every service group (Gunicorn finishes requests in flight), SIGKILL what is left."""
    pids = {n: p for n in names if (p := running(config, n))}
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    while time.monotonic() < deadline and any(group_alive(p) for p in pids.values()):
        _reap()
        time.sleep(0.05)
    for pid in pids.values():
        if group_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    _reap()
    for n in names:
        config.pid_file(n).unlink(missing_ok=True)


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def reset(config: ClusterConfig) -> None:
    """Forget all state in the data dir (replica databases, logs, run files; the secret stays)."""
    for name in config.names():
        shutil.rmtree(config.replica_dir(name), ignore_errors=True)
    shutil.rmtree(config.run_dir(), ignore_errors=True)
    shutil.rmtree(config.log_dir(), ignore_errors=True)


def up(config: ClusterConfig, reset_state: bool = False, out: object = sys.stdout) -> int:
    """Run the whole cluster in the foreground until SIGINT/SIGTERM; print ``ready <url>`` when usable."""
    names = config.names()
    busy = [n for n in names if running(config, n)]
    if busy:
        raise LaunchError(f"already running in {config.root}: {', '.join(busy)} (stop it first)")
    if reset_state:
        reset(config)
    config.secret(create=True)
    config.save()

    def on_signal(signum: int, frame: object) -> None:
        # Ignore further signals first: a second SIGTERM must not cut the orderly stop short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise _Stop(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for name in names:
            spawn(config, name)
        wait_healthy(config, names)
        wait_leaders(config)
        print(f"ready {config.frontend_url(1)}", file=out, flush=True)  # type: ignore[call-overload]
        while True:
            _reap()  # services killed for fault injection must not linger as zombies
            time.sleep(0.2)
    except _Stop:
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_all(config, names)


class _Stop(Exception):
    """SIGINT or SIGTERM reached ``pygmy up``."""
