"""What one refusal and one shortcut answer (a cache hit) cost a Gunicorn worker: the event loop's
(``pygmy/cluster/worker.py``) against gthread's, or against another checkout's event loop.

A one-worker server (``create_base_app`` with a write cap of 1) has its only write place held by a
request that waits for a file; then 8 clients on keep-alive connections send ``POST /buy`` as fast
as they are answered, every answer a 503. The worker's CPU time over the number refused is the cost
of a refusal, free of everything else a surge brings. ``GET /hit`` is answered by the app's
shortcut (as the frontend answers a cached lookup), from the event loop with Pygmy's worker.
``python -m pygmy.experiments.refusal [--rounds 2]`` prints one line per worker class, kind and round,
alternating the classes; ``--against DIR`` alternates instead between the worker of the checkout
``DIR`` (e.g. ``git worktree add /tmp/before HEAD~1``) and this one's, both with this server, each on
its own checkout's modules, named as its layout names them (``LAYOUTS``: before #41 they were
top-level, ``cluster.worker``); the server stops at once if the worker it loads is not ``DIR``'s.

``serve_gated`` is also what ``tests/cluster/test_worker.py`` runs its real-Gunicorn checks on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from multiprocessing import Pool
from pathlib import Path
from typing import Any

import requests

from pygmy.cluster.local import ROOT, free_port_base
from pygmy.experiments import harness as h

SERVER = """
import importlib, json, sys, time
from pathlib import Path
from flask import jsonify

port, gate_dir, worker_class, root = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
modules = json.loads(sys.argv[5])
worker = importlib.import_module(modules["worker"])
if not Path(worker.__file__).resolve().is_relative_to(root.resolve()):  # e.g. the installed pygmy's
    sys.exit(f"the worker came from {worker.__file__}, not from {root}")
serve, web = importlib.import_module(modules["serve"]), importlib.import_module(modules["web"])

def create():
    app = web.create_base_app("early-test", limits={"write": 1, "read": 8})

    @app.post("/hold")
    def hold():
        (gate_dir / "entered").touch()
        end = time.monotonic() + 60
        while not (gate_dir / "release").exists() and time.monotonic() < end:
            time.sleep(0.01)
        return jsonify({"held": True})

    @app.post("/buy")
    def buy():
        return jsonify({"bought": True})

    @app.get("/read")
    def read():
        return jsonify({"read": True})

    hit = (b'{"item_number": 1, "title": "a cached book", "stock": 5, "cost": 1.0}')

    def shortcut(environ):
        if environ.get("PATH_INFO") == "/broken":  # a shortcut's bug, for the worker to survive
            raise RuntimeError("a broken shortcut")
        return ("/hit", hit, []) if environ.get("PATH_INFO") == "/hit" else None

    app.extensions["pygmy_edge"].shortcut = shortcut
    return app

options = serve.gunicorn_options(f"127.0.0.1:{port}", workers=1, threads=12, name="early-test")
options["loglevel"] = "warning"
options["worker_class"] = worker_class or modules["worker"] + ".AdmissionWorker"
serve.run_gunicorn(create, options)
"""
#: Where a checkout keeps the modules the server runs on, by the file that tells its layout apart:
#: one ``pygmy`` package since #41, top-level packages before it.
LAYOUTS = {
    "pygmy/cluster/worker.py": {"worker": "pygmy.cluster.worker", "serve": "pygmy.cluster.serve",
                                "web": "pygmy.kit.web"},
    "cluster/worker.py": {"worker": "cluster.worker", "serve": "cluster.serve", "web": "cluster.web"},
}


def modules_of(root: Path) -> dict[str, str]:
    """The module names of the worker, ``serve`` and ``web`` in the checkout ``root``, by its layout."""
    for marker, modules in LAYOUTS.items():
        if (root / marker).is_file():
            return modules
    raise ValueError(f"{root} is not a Pygmy checkout of a known layout (none of {', '.join(LAYOUTS)})")


BUY = b"POST /buy HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
HIT = b"GET /hit HTTP/1.1\r\nHost: t\r\nAccept: application/json\r\n\r\n"
#: What each kind of request sends and the status its answer must have.
KINDS = {"refusal": (BUY, b"HTTP/1.1 503"), "hit": (HIT, b"HTTP/1.1 200")}


@contextlib.contextmanager
def serve_gated(gate_dir: Path, worker_class: str = "", root: Path = ROOT) -> Iterator[tuple[int, int, Path]]:
    """The server above (default worker class: Pygmy's, that of the checkout ``root``), its write
    place held while the block runs: ``(port, worker pid, release file)``. Touching the release file
    frees the place; everything started is stopped on the way out."""
    port = free_port_base(1, 1)
    modules = json.dumps(modules_of(root))
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(gate_dir), worker_class, str(root),
                             modules], cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)},
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    release = gate_dir / "release"
    holder: threading.Thread | None = None
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(requests.RequestException):
                if requests.get(url + "/read", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None:
                said = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"the gated server stopped: {said[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("the gated server did not start")
            time.sleep(0.1)
        holder = threading.Thread(target=requests.post, args=(url + "/hold",), kwargs={"timeout": 90})
        holder.start()
        while not (gate_dir / "entered").exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the holding request did not arrive")
            time.sleep(0.01)
        worker = int(subprocess.check_output(["pgrep", "-P", str(proc.pid)]).split()[0])
        yield port, worker, release
    finally:
        release.touch()
        if holder is not None:
            holder.join(timeout=90)
        h.stop_group(proc)


def _answered(args: tuple[int, float, str]) -> int:
    """One client: requests of one kind on one keep-alive connection for ``seconds``; how many."""
    port, seconds, kind = args
    request, status = KINDS[kind]
    n, buf = 0, b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            sock.sendall(request)
            while True:
                head_end = buf.find(b"\r\n\r\n")
                if head_end >= 0:
                    length = int(buf[:head_end].lower().split(b"content-length:")[1].split(b"\r\n")[0])
                    if len(buf) >= head_end + 4 + length:
                        if not buf.startswith(status):
                            raise RuntimeError(f"expected {status!r}, got {buf[:40]!r}")
                        buf = buf[head_end + 4 + length:]
                        break
                chunk = sock.recv(65536)
                if not chunk:
                    raise RuntimeError("the server closed the connection")
                buf += chunk
            n += 1
    return n


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(worker_class: str, seconds: float = 5.0, clients: int = 8, kind: str = "refusal",
            root: Path = ROOT) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pygmy-refusal-") as d, \
            serve_gated(Path(d), worker_class, root) as (port, pid, _):
        cpu0, t0 = _cpu_s(pid), time.monotonic()
        with Pool(min(clients, 4)) as pool:
            n = sum(pool.map(_answered, [(port, seconds, kind)] * clients))
        wall, cpu = time.monotonic() - t0, _cpu_s(pid) - cpu0
    return {"worker": worker_class or "pygmy", "root": str(root), "kind": kind, "answered_per_s": round(n / wall),
            "worker_cpu_us_per_request": round(cpu / n * 1e6, 1), "worker_cores": round(cpu / wall, 2)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pygmy.experiments.refusal")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--against", type=Path, help="another checkout whose worker to alternate with this one's")
    a = p.parse_args(argv)
    for r in range(a.rounds):
        for kind in KINDS:
            if a.against:  # in turns which goes first (ABBA), so that drift favours neither
                for root in (a.against.resolve(), ROOT)[::1 if r % 2 == 0 else -1]:
                    print(json.dumps(measure("", kind=kind, root=root)), flush=True)
            else:
                for worker_class in ("gthread", ""):
                    print(json.dumps(measure(worker_class, kind=kind)), flush=True)


if __name__ == "__main__":
    main()
