"""Test-side names for the local cluster driver (``pygmy.cluster.local``), and the test-only hooks."""

import contextlib
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from werkzeug.serving import make_server

from pygmy.cluster.local import LocalCluster as Cluster
from pygmy.cluster.local import free_port_base, pygmy, start_cluster
from pygmy.verify import chaos_check, lincheck
from pygmy.verify.chaos import ChaosWorkload, final_state

__all__ = ["CHECKED", "FAULTS_AT_STOP", "MUTATIONS", "BackgroundLoad", "Cluster", "FakeLeadership", "StandIn", "cluster_env",
           "free_port_base", "hidden_faults", "http_answer", "http_answers", "judge_from_outside", "pygmy", "read_answer", "send_whole_buys", "start_cluster", "stop_checked",
           "wait_for"]

#: Test-only faults and mutations (``tests/mutations/sitecustomize.py``), for the processes of a cluster.
MUTATIONS = Path(__file__).resolve().parent / "mutations"


#: Every live replica's ``loop_faults`` just before a cluster of the tests stopped (recorded by the
#: wrapper of ``Cluster.stop`` in tests/conftest.py); a stopped or killed replica is not in it (its
#: faults show in its log).
FAULTS_AT_STOP: dict[Cluster, dict[str, dict[str, int]]] = {}
#: Clusters whose faults were checked when they stopped (``stop_checked``), not per test.
CHECKED: set[Cluster] = set()


def hidden_faults(cluster: Cluster, kinds: tuple[str, ...] = (), logs: tuple[str, ...] = ()) -> list[str]:
    """What a stopped cluster's services hid from their clients, less what the test allowed."""
    found = [f"{name}: {count} loop fault(s) of kind {kind!r}"
             for name, faults in sorted(FAULTS_AT_STOP.get(cluster, {}).items())
             for kind, count in sorted(faults.items()) if count and kind not in kinds]
    found += [t for t in cluster.logged_tracebacks() if not any(re.search(p, t) for p in logs)]
    return found


def stop_checked(cluster: Cluster) -> None:
    """Stop a cluster shared by several tests (a session's or a package's) and fail if its services
    hid a fault: the per-test check (tests/conftest.py) sees only clusters its own test stopped."""
    CHECKED.add(cluster)
    cluster.stop()
    problems = hidden_faults(cluster)
    assert not problems, "faults hidden from clients in a shared cluster:\n" + "\n".join(problems[:20])


def cluster_env(**extra: str) -> dict[str, str]:
    """Environment that loads the test-only hooks into every service process."""
    path = os.pathsep.join(p for p in (str(MUTATIONS), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **extra}


class StandIn:
    """A WSGI app on a free loopback port, served from a thread until ``stop()``: a stand-in for a
    frontend or a replica in tests of the code that calls them."""

    def __init__(self, app: Any) -> None:
        self.http = make_server("127.0.0.1", 0, app, threaded=True)
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.http.shutdown()
        self.thread.join(5)


class FakeLeadership:
    """What ``pygmy.catalog.invalidation`` asks a replication node about its leadership, as the test sets it."""

    current_term = 1
    #: When this node became leader of ``current_term`` (None: not known, as in a race with its loop).
    leader_since: float | None = None
    #: Until when the leader lease holds (tests of the cap on grants set it).
    lease_until = float("inf")
    vote_quiet = 0.1

    def term(self) -> int:
        return self.current_term

    def leadership_start(self) -> float | None:
        return self.leader_since

    def leader_lease_until(self) -> float:
        return self.lease_until

    def vote_quiet_s(self) -> float:
        return self.vote_quiet


@contextlib.contextmanager
def held_decrements_cluster(tmp: Path, *args: str) -> Iterator[tuple[Cluster, Path]]:
    """A cluster (``args`` as ``pygmy up``'s) whose order leader holds every batch of decrements
    while the file it yields beside it exists (``PYGMY_TEST_HOLD_DECREMENTS``): buys stay in flight
    for as long as a test wants. Stopped, and the file removed, on exit."""
    flag = tmp / "hold-decrements"
    c = start_cluster(tmp, *args, env=cluster_env(PYGMY_TEST_HOLD_DECREMENTS=str(flag)))
    try:
        yield c, flag
    finally:
        flag.unlink(missing_ok=True)
        c.stop()


def read_answer(sock: socket.socket) -> bytes:
    """One whole HTTP answer with a ``Content-Length`` body, or what came before the connection closed."""
    data = b""
    while True:
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            length = int(next((line.split(b":", 1)[1] for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), b"0"))
            if len(body) >= length:
                return data
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:  # closed by a process that was killed: no (more) answer
            return data
        if not chunk:
            return data
        data += chunk


def send_whole_buys(url: str, keys: list[str], item: int) -> list[socket.socket]:
    """One connection per key, each buy sent in one segment, so that a worker's event loop takes it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = b'{"quantity": 1}'
    socks = []
    for key in keys:
        sock = socket.create_connection((host, int(port)), timeout=20)
        sock.sendall(f"POST /buy/{item} HTTP/1.1\r\nHost: t\r\nIdempotency-Key: {key}\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        socks.append(sock)
    return socks


def http_answer(sock: socket.socket, data: bytes = b"") -> tuple[int, dict[str, str], bytes, bytes]:
    """One HTTP answer with a ``Content-Length`` body, from ``data`` and then ``sock`` (plain or TLS):
    status, headers (lower-case names), body, and the bytes read after it."""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-answer after {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:length], rest[length:]


def http_answers(sock: socket.socket, n: int) -> list[tuple[int, dict[str, str], bytes]]:
    """``n`` answers read in order off ``sock`` (``http_answer``); nothing may follow the last."""
    out, data = [], b""
    for _ in range(n):
        status, headers, body, data = http_answer(sock, data)
        out.append((status, headers, body))
    assert data == b"", f"more than {n} answers: {data[:200]!r}"
    return out


def wait_for(what: str, predicate: Callable[[], object], timeout: float = 60) -> object:
    """``predicate()``'s first true value, asked until ``timeout`` s have passed (then the test fails)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)
    return value


class BackgroundLoad(ChaosWorkload):
    """The nemesis run's clients (lookups, updates, buys under keys, order reads; every operation
    recorded for Porcupine), on a thread of their own from ``start`` until ``finish``."""

    def start(self) -> None:
        self._failure: BaseException | None = None
        self.result: lincheck.History | None = None
        self._thread = threading.Thread(target=self._run, name="background-load")
        self._thread.start()

    def _run(self) -> None:
        try:
            self.result = self.run(3600)
        except BaseException as exc:  # re-raised by finish
            self._failure = exc

    def finish(self) -> lincheck.History:
        self.stop()
        self._thread.join(120)
        if self._failure is not None:
            raise self._failure
        assert self.result is not None, "the load did not stop"
        return self.result

    def buys_acked(self, more: int, timeout: float = 60) -> None:
        """Until ``more`` buys beyond those acknowledged now are acknowledged."""
        target = len(self.acked) + more
        wait_for(f"{target} buys acknowledged", lambda: len(self.acked) >= target or self._failure, timeout)
        assert self._failure is None, self._failure


def judge_from_outside(c: Cluster, run: Path, history: lincheck.History, windows: list[dict[str, Any]],
                       items: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``run`` written as a chaos run writes it (the history, the fault windows, the final state of
    every replica, updates of unknown outcome settled first) and judged by ``chaos_check``: every
    acknowledged buy an order on every order replica, none doubled, stock adding up, one index and
    digest per tier, Porcupine. Fails on any anomaly; returns the verdict and the final state."""
    run.mkdir()
    history.save(run / "history.json")
    (run / "nemesis.json").write_text(json.dumps({"windows": windows, "errors": []}))
    final = final_state(c.cluster_config(), c.secret(), items, history=history, admin_token=c.admin_token())
    (run / "final.json").write_text(json.dumps(final))
    result = chaos_check.check(run, timeout=120)
    assert result["ok"], chaos_check.summary(result)
    return result, final
