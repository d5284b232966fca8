"""Start, stop, kill and restart Pygmy services as local processes (``pygmy up|start|kill``).

Every service runs as ``pygmy serve`` in its own session, so its Gunicorn master is a process group
leader and ``pygmy kill`` can SIGKILL master and workers at once. Pid files name those leaders.

A pid file outlives its process after a crash or a reboot, and the pid may by then belong to a
zombie, to a process still exiting from SIGKILL, or to some other program. So a pid file counts only
if ``/proc`` shows a live member of that process group that is this very service of this data dir
(``running``); anything else is stale and ``pygmy up`` starts over it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests

from pygmy.catalog.books import load as load_books
from pygmy.catalog.state import build_seed
from pygmy.kit import control
from pygmy.kit.config import SERVE_ONLY_ENV, ClusterConfig, parse_name

if TYPE_CHECKING:
    from pygmy.cluster.backup import Scheduled

START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
#: How long ``up`` waits, once the services are stopped, for a scheduled backup under way to end.
COPY_WAIT = 10.0


class LaunchError(RuntimeError):
    """A service would not start, or a command on one failed: ``pygmy`` says why and exits 1."""


PROC = Path("/proc")
#: ``PF_EXITING`` in the flags of ``/proc/<pid>/stat``: the process is already in ``do_exit``.
PF_EXITING = 0x4
SIGKILL_BIT = 1 << (signal.SIGKILL - 1)
ZOMBIE = ("Z", "X", "x")  # zombie, dead


@dataclass(frozen=True)
class Proc:
    pid: int
    pgrp: int
    state: str
    flags: int
    cpu_ticks: int = 0  # user + system CPU so far, in clock ticks
    rss_pages: int = 0  # resident memory, in pages


def _proc(pid: int, stat: Path | None = None) -> Proc | None:
    """One process as ``/proc/<pid>/stat`` shows it (or one of its threads, ``stat`` being that
    thread's file), or None once it is gone."""
    try:
        raw = (stat or PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    rest = raw[raw.rfind(")") + 2:].split()
    if len(rest) < 22:
        return None
    return Proc(pid, int(rest[2]), rest[0], int(rest[6]), int(rest[11]) + int(rest[12]), int(rest[21]))


def _groups(pgids: Iterable[int]) -> dict[int, list[Proc]]:
    """Every process of these process groups, zombies included, from one pass over ``/proc``."""
    out: dict[int, list[Proc]] = {g: [] for g in pgids}
    for entry in os.listdir(PROC):
        if entry.isdigit() and (p := _proc(int(entry))) is not None and p.pgrp in out:
            out[p.pgrp].append(p)
    return out


def _group(pgid: int) -> list[Proc]:
    return _groups([pgid])[pgid]


def group_members(pgids: Iterable[int]) -> list[Proc]:
    """The live (not zombie) processes of these process groups: a service's Gunicorn master and
    workers, for the CPU and memory figures of the experiments."""
    return [p for procs in _groups(pgids).values() for p in procs if p.state not in ZOMBIE]


def _dying(p: Proc) -> bool:
    """A zombie, or on its way to be one: exiting, or with SIGKILL pending (it never runs again)."""
    if p.state in ZOMBIE or p.flags & PF_EXITING:
        return True
    try:
        status = (PROC / str(p.pid) / "status").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return True
    pending = 0
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):
            pending |= int(line.split()[1], 16)
    return bool(pending & SIGKILL_BIT)


def alive_groups(pgids: Iterable[int]) -> set[int]:
    """Those of these process groups with a process alive and not dying (zombies and SIGKILLed
    processes do not count)."""
    return {g for g, procs in _groups(pgids).items() if any(not _dying(p) for p in procs)}


def group_alive(pid: int) -> bool:
    return bool(alive_groups([pid]))


def _running_threads(pids: Iterable[int]) -> list[int]:
    """The threads of these processes not yet stopped (SIGSTOP), nor dead."""
    out = []
    for pid in pids:
        try:
            tids = os.listdir(PROC / str(pid) / "task")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        for tid in tids:
            thread = _proc(int(tid), PROC / str(pid) / "task" / tid / "stat")
            if thread is not None and thread.state not in ("T", "t", *ZOMBIE):
                out.append(thread.pid)
    return out


def pause(pid: int, group: bool = True, timeout: float = STOP_TIMEOUT) -> None:
    """SIGSTOP process group ``pid`` (or the one process, without ``group``) and return once every
    thread of it has stopped. ``kill()`` returns before they do: the thread that takes the signal
    stops the others when it next runs, and on a busy machine they may run on meanwhile (a
    follower acknowledging an append sent after its "pause" made a minority leader look as if it
    committed). Raises TimeoutError if some thread is still running after ``timeout`` seconds (one
    stuck in the kernel, say)."""
    (os.killpg if group else os.kill)(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    # Read once: a group with a SIGSTOP pending forks no new member.
    pids = [p.pid for p in _group(pid)] if group else [pid]
    while running := _running_threads(pids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"threads {running[:5]} of {pid} still run {timeout:g} s after SIGSTOP")
        time.sleep(0.002)


def _is_service(pid: int, config: ClusterConfig, name: str) -> bool:
    """Whether process ``pid`` is ``pygmy serve`` of service ``name`` with this data dir.

    Gunicorn retitles its processes (``gunicorn: master [pygmy-NAME]``, cut short if the title does
    not fit) when setproctitle is installed, which hides the arguments; the service's stdout, its own
    log file in this data dir, still tells which service and data dir it is.
    """
    base = PROC / str(pid)
    tier, k = parse_name(name)
    try:
        args = (base / "cmdline").read_bytes().decode(errors="replace").split("\0")
        title = " ".join(a for a in args if a)
        is_serve = "serve" in args and tier in args and any(
            args[i] == "--id" and args[i + 1] == str(k) for i in range(len(args) - 1))
        retitled = title.startswith("gunicorn: ")
        if not (is_serve or retitled):
            return False
        data_dirs = [args[i + 1] for i in range(len(args) - 1) if args[i] == "--data-dir"]
        if data_dirs:
            return Path(data_dirs[-1]).resolve() == config.root
        stdout = os.readlink(base / "fd" / "1").removesuffix(" (deleted)")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    return Path(stdout) == config.log_dir() / f"{name}.log"


def read_pid(config: ClusterConfig, name: str) -> int | None:
    try:
        return int(config.pid_file(name).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def running(config: ClusterConfig, name: str) -> int | None:
    """The process group named in ``name``'s pid file if it really runs that service, else None.

    Really running: a member of the group is alive, not dying, and is ``pygmy serve`` of ``name``
    with this data dir. A pid that is gone, a zombie, still exiting, or reused by another program
    leaves only a stale pid file.
    """
    pid = read_pid(config, name)
    if not pid or pid < 1:
        return None
    return pid if any(not _dying(p) and _is_service(p.pid, config, name) for p in _group(pid)) else None


def _wait_exited(pids: list[int], timeout: float = STOP_TIMEOUT) -> None:
    """Wait until no process of these stale groups is still exiting (SIGKILLed processes release
    their ports only as they exit); those alive and well, such as a program that reused a pid, are
    left alone and not waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        groups = _groups(pids).values()
        if not any(_dying(p) and p.state not in ZOMBIE for procs in groups for p in procs):
            return
        time.sleep(0.02)


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
    if namespace is None and not port_free(config.bind_address(name), port):
        raise LaunchError(f"port {port} for {name} is in use: stop what uses it or pick --port-base")
    config.log_dir().mkdir(parents=True, exist_ok=True)
    config.run_dir().mkdir(parents=True, exist_ok=True)
    # `ip netns exec` execs the command in place: the pid (and process group) stay the service's.
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    with open(config.log_dir() / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "pygmy.cluster.cli", "serve", tier, "--id", str(k), "--data-dir", str(config.root)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            cwd=str(Path(__file__).resolve().parents[2]),  # where the pygmy package is
            env={k: v for k, v in os.environ.items() if k not in SERVE_ONLY_ENV},
        )
    config.pid_file(name).write_text(f"{proc.pid}\n")
    return proc


def wait_healthy(config: ClusterConfig, names: list[str], stall: float = START_TIMEOUT,
                 progress: Callable[[str], None] | None = None) -> None:
    """Until every service answers its health check, for as long as each makes progress: a service
    still loading a large catalogue uses CPU; one that used none for ``stall`` seconds, or exited,
    fails the start. Each service has its own stall clock, so one busy service does not hide
    another that hangs. ``progress`` hears of each service as it comes up."""
    started = time.monotonic()
    pending = list(names)
    used: dict[str, int] = {}
    last = dict.fromkeys(names, started)  # when each last used CPU
    with requests.Session() as s:
        while pending:
            for name in list(pending):
                try:
                    if s.get(service_url(config, name) + "/health", timeout=(0.5, 2),
                             **config.tool_tls()).status_code == 200:
                        pending.remove(name)
                        if progress:
                            progress(f"{name} up after {time.monotonic() - started:.1f} s")
                        continue
                except requests.RequestException:
                    pass
                pid = read_pid(config, name)
                if pid is None or not group_alive(pid):
                    raise LaunchError(f"{name} exited during start-up; see {config.log_dir() / (name + '.log')}")
                ticks = sum(p.cpu_ticks for p in _group(pid))  # a service's master and workers
                if ticks > used.get(name, -1):
                    used[name], last[name] = ticks, time.monotonic()
            stalled = [name for name in pending if time.monotonic() - last[name] > stall]
            if stalled:
                raise LaunchError(f"{', '.join(stalled)} did not become healthy and did no work for "
                                  f"{stall:.0f} s; see the logs in {config.log_dir()}")
            time.sleep(0.1)


def wait_leaders(config: ClusterConfig, timeout: float = START_TIMEOUT) -> None:
    """Ready means reads and writes work: each replicated tier has a leader."""
    deadline = time.monotonic() + timeout
    with requests.Session() as s:
        while True:
            try:
                st = s.get(config.frontend_url(1) + "/status", timeout=(0.5, 3), **config.tool_tls()).json()
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


def join(config: ClusterConfig, name: str, url: str) -> None:
    """Record replica ``name`` at ``url`` in ``cluster.json`` as a learner of its tier, so that it
    starts as one (a replica ``pygmy member add`` added on another machine, whose ``cluster.json``
    does not name it yet): it waits for the leader's log, never campaigning before that log says
    it votes. A name recorded at another URL is refused."""
    tier, _ = parse_name(name)
    if tier == "frontend":
        raise LaunchError("--url is for a replica joining its tier, not a frontend")
    url = url.rstrip("/")
    peers = config.peers(tier)
    if name in peers:
        if peers[name] != url:
            raise LaunchError(f"{name} is recorded at {peers[name]}, not {url}")
        return
    config.members = {**config.members, tier: {**peers, name: url}}
    config.tier_learners = {**config.tier_learners, tier: [*config.learners(tier), name]}
    config.save()


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
    while time.monotonic() < deadline and alive_groups(pids.values()):
        _reap()
        time.sleep(0.05)
    for pid in alive_groups(pids.values()):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    _reap()
    for n in names:
        config.pid_file(n).unlink(missing_ok=True)


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _is_service_name(name: str) -> bool:
    try:
        parse_name(name)
    except ValueError:
        return False
    return True


def keep_members(config: ClusterConfig) -> None:
    """The tiers' members as ``pygmy member`` left them in ``cluster.json``: on the state already in
    the data dir, the replicas to run are those of the configuration in their logs, not the ones
    the flags derive (their logs would outvote the flags anyway; a replica the flags would add is
    not a member, and one they would leave out is)."""
    try:
        previous = ClusterConfig.load(str(config.root))
    except (RuntimeError, ValueError, TypeError, OSError):
        return
    if previous.members:
        config.members, config.tier_learners = previous.members, previous.tier_learners


def service_names(config: ClusterConfig) -> list[str]:
    """The services of this data dir: those of the config, and every other one with a directory,
    a pid file (``pygmy member`` added and removed replicas too)."""
    names = set(config.names())
    if config.root.is_dir():
        names |= {p.name for p in config.root.iterdir() if p.is_dir() and _is_service_name(p.name)}
    if config.run_dir().is_dir():
        names |= {p.stem for p in config.run_dir().glob("*.pid") if _is_service_name(p.stem)}
    return sorted(names)


def reset(config: ClusterConfig) -> None:
    """Forget all state in the data dir (replica databases, logs, run files; secret and admin token
    stay): of every replica, those ``pygmy member`` added and removed too."""
    for name in service_names(config):
        shutil.rmtree(config.replica_dir(name), ignore_errors=True)
    shutil.rmtree(config.run_dir(), ignore_errors=True)
    shutil.rmtree(config.log_dir(), ignore_errors=True)
    shutil.rmtree(config.seed_file().parent, ignore_errors=True)


def check_books(path: str) -> list[dict[str, Any]]:
    """Read and check the catalogue file here, before any service starts: a bad file fails with the
    book at fault named on the terminal, not as a replica that exits with the reason in its log."""
    try:
        return load_books(path)
    except OSError as exc:
        raise LaunchError(f"cannot read the books file {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise LaunchError(f"the books file {path} is not JSON: {exc.msg} at line {exc.lineno}, "
                          f"column {exc.colno}") from None
    except ValueError as exc:
        raise LaunchError(f"the books file {path} has a bad book: {exc}") from None


def prepare_seed(config: ClusterConfig, books: list[dict[str, Any]] | None,
                 say: Callable[[str], None] = lambda line: None) -> None:
    """Build the catalogue every new catalog replica starts from (``ClusterConfig.seed_file``), once,
    here, from the file just checked (``books``; None: the seven built-in books): the replicas copy
    it instead of each parsing the JSON again.

    Only for a cluster whose catalog replicas hold no state yet: once they exist, the seed they
    began from stays, so that a replica started later from nothing (its data deleted) begins where
    they did, whatever file is named now. (A data dir begun before seeds has none: a replica started
    there from nothing reads the file named now, as every replica used to.)"""
    seed = config.seed_file()
    begun = [n for n in config.names() if n.startswith("catalog-") and (config.replica_dir(n) / "state.db").exists()]
    if begun:
        return
    if books is not None:
        say(f"building the catalogue of {len(books):,} books for the replicas")
    started = time.monotonic()
    build_seed(books if books is not None else load_books(None), seed,
               (lambda done, total: say(f"catalogue: {done:,} of {total:,} books")) if books else None)
    if books is not None:
        say(f"catalogue built in {time.monotonic() - started:.1f} s ({seed.stat().st_size / 2**20:.0f} MiB)")


class Faults:
    """What ``pygmy up`` does for the requests on its control socket (``pygmy/kit/control.py``): kill a
    service, pause it (SIGSTOP) for some seconds, start it again. Paused services are resumed when
    their time is up, and all of them before the launcher stops the cluster."""

    def __init__(self, config: ClusterConfig, say: Callable[[str], None] = lambda line: None) -> None:
        self.config, self.say = config, say
        self._paused: dict[str, tuple[int, float]] = {}  # name -> (process group, resume at)
        self._lock = threading.Lock()

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        action, name = req.get("action"), req.get("name")
        if action not in control.ACTIONS:
            raise control.ControlError(400, f"action must be one of {', '.join(control.ACTIONS)}")
        if not isinstance(name, str) or name not in self.config.names():
            raise control.ControlError(404, f"no service {name!r} in this cluster")
        try:
            if action == "kill":
                with self._lock:
                    self._paused.pop(name, None)
                message = f"killed {name} (process group {kill(self.config, name)})"
            elif action == "pause":
                seconds = req.get("seconds", 5)
                if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not (
                        0 < seconds <= control.MAX_PAUSE):
                    raise control.ControlError(400, f"seconds must be a number in (0, {control.MAX_PAUSE:g}]")
                pid = running(self.config, name)
                if pid is None:
                    raise LaunchError(f"{name} is not running")
                with self._lock:
                    self._paused[name] = (pid, time.monotonic() + seconds)  # resumed even if pause() raises
                pause(pid, timeout=3.0)  # "paused" once it is: every thread stopped (within the control call's time)
                message = f"paused {name} for {seconds:g} s"
            else:
                message = f"started {name} (pid {spawn(self.config, name).pid})"
        except (LaunchError, ProcessLookupError, TimeoutError) as exc:
            raise control.ControlError(409, str(exc) or f"{name} is not running") from None
        self.say(message + " (from a dashboard)")
        return {"ok": True, "message": message}

    def resume_due(self, everything: bool = False) -> None:
        """SIGCONT the paused services whose time is up (all of them with ``everything``)."""
        now = time.monotonic()
        with self._lock:
            due = [n for n, (_, at) in self._paused.items() if everything or now >= at]
            for name in due:
                pid, _ = self._paused.pop(name)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGCONT)
                self.say(f"resumed {name}")


def up(config: ClusterConfig, reset_state: bool = False, out: object = sys.stdout) -> int:
    """Run the whole cluster in the foreground until SIGINT/SIGTERM; print ``ready <url>`` when usable."""
    if not reset_state:
        # First: the replicas to check for, start and stop are the members ``pygmy member`` or a
        # restore recorded, not those the flags derive (they had started only the flags' ones).
        keep_members(config)
    names = config.names()

    def say(line: str) -> None:
        print(f"pygmy up: {line}", file=sys.stderr, flush=True)

    # Every service of the data dir, also one `pygmy member` added that ``--reset`` would delete.
    busy = {n: pid for n in service_names(config) if (pid := running(config, n))}
    if busy:
        listed = ", ".join(f"{n} (pid {pid})" for n, pid in busy.items())
        raise LaunchError(f"already running in {config.root}: {listed} (stop it first)")
    stale = [pid for n in names if (pid := read_pid(config, n))]
    _wait_exited(stale)
    for n in names:
        config.pid_file(n).unlink(missing_ok=True)
    books = check_books(config.books) if config.books else None
    from pygmy.replication.node import ReplicationConfig  # here: the launcher's other commands start faster

    try:  # every replica would refuse them at start, each in its own log
        ReplicationConfig.from_env()
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    from pygmy.cluster.backup import check_restored_files, refuse_unfinished  # here: it imports this module

    refuse_unfinished(config, reset_state)
    if reset_state:
        reset(config)
    else:
        check_restored_files(config, say)  # a restored data dir, before its replicas first run
    prepare_seed(config, books, say)
    del books
    config.secret(create=True)
    config.admin_token(create=True)
    if config.tls:
        from pygmy.cluster import certs  # here: it imports cryptography

        issued = certs.ensure(config, config.certs_path())
        if issued:
            say(f"made certificates in {config.certs_path()}: {', '.join(issued)}")
    config.save()

    def on_signal(signum: int, frame: object) -> None:
        # Ignore further signals first: a second SIGTERM must not cut the orderly stop short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise _Stop(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    faults = Faults(config, say)
    server: control.ControlServer | None = None
    scheduled: Scheduled | None = None
    try:
        for name in names:
            spawn(config, name)
        wait_healthy(config, names, progress=say)
        wait_leaders(config)
        from pygmy.cluster.backup import check_restored  # here: it imports this module

        check_restored(config, say)  # a restored data dir: its replicas hold the archive's state
        try:
            server = control.ControlServer(config.run_dir(), faults.handle, faults.resume_due)
            server.start()
        except (control.ControlError, OSError) as exc:
            say(f"no fault buttons on the dashboard: {exc}")
        print(f"ready {config.frontend_url(1)}", file=out, flush=True)  # type: ignore[call-overload]
        if config.backup_every > 0:
            from pygmy.cluster import backup  # here: it imports this module, and Flask

            scheduled = backup.Scheduled(config, say)
            scheduled.start()
        while True:
            _reap()  # services killed for fault injection must not linger as zombies
            time.sleep(0.2)
    except _Stop:
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if server is not None:
            server.close()
        if scheduled is not None:
            scheduled.stop()  # a backup under way ends at its next step, its copies deleted
        faults.resume_due(everything=True)  # a stopped process would not hear SIGTERM
        # And the replicas started meanwhile (``pygmy start`` of one ``pygmy member`` added).
        started = sorted(p.stem for p in config.run_dir().glob("*.pid") if _is_service_name(p.stem))
        stop_all(config, [*names, *(n for n in started if n not in names)])
        if scheduled is not None:
            scheduled.join(COPY_WAIT)  # a copy that was streaming ended with the services: its folder goes


class _Stop(Exception):
    """SIGINT or SIGTERM reached ``pygmy up``."""
