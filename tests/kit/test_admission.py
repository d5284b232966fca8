"""Admission control (pygmy/kit/admission.py): the excess of a class is refused at once, control
traffic never is, and a request's time budget is read from its header."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace
from typing import Any

import pytest

from pygmy.kit import admission
from pygmy.kit.admission import (
    DEADLINE_HEADER,
    ENVIRON_KEY,
    SHED,
    Admission,
    Board,
    Deferred,
    Gate,
    classify,
    deadline_of,
    timeout_header,
)


class Inner:
    """A WSGI app that answers 200 and records the environs it saw; its body is released on close."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        self.seen.append(environ)
        start_response("200 OK", [("Content-Type", "application/json")])
        return [b"{}"]


def call(app: Admission, method: str, path: str, headers: dict[str, str] | None = None) -> tuple[str, dict[str, str], Any]:
    environ: dict[str, Any] = {"REQUEST_METHOD": method, "PATH_INFO": path}
    for k, v in (headers or {}).items():
        environ["HTTP_" + k.upper().replace("-", "_")] = v
    got: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        got["status"], got["headers"] = status, dict(headers)

    body = app(environ, start_response)
    return got["status"], got["headers"], body


def test_the_excess_of_a_class_is_refused_at_once_and_admitted_again_once_one_finishes() -> None:
    inner = Inner()
    app = Admission(inner, "svc-a", {"write": 2, "read": 1})
    before = SHED.labels("svc-a", "write")._value.get()
    open_bodies = [call(app, "POST", "/buy/1")[2] for _ in range(2)]  # in flight until closed
    status, headers, body = call(app, "POST", "/buy/2")
    assert status.startswith("503") and headers["Retry-After"] == "1"
    error = json.loads(b"".join(body))["error"]
    assert error["code"] == 503 and error["overloaded"] is True
    assert len(inner.seen) == 2, "a shed request must not reach the app"
    assert SHED.labels("svc-a", "write")._value.get() == before + 1
    # Another class has its own cap: reads are served while writes are full.
    assert call(app, "GET", "/lookup/1")[0].startswith("200")
    # Control traffic is never shed.
    for path in ("/health", "/status", "/metrics", "/raft/read_index"):
        assert call(app, "GET", path)[0].startswith("200")
    open_bodies[0].close()
    assert call(app, "POST", "/buy/3")[0].startswith("200")
    assert app.gates["write"].in_flight == 2


def test_a_failing_app_releases_its_place() -> None:
    def broken(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        raise RuntimeError("boom")

    app = Admission(broken, "svc-b", {"write": 1})
    for _ in range(3):
        with pytest.raises(RuntimeError):
            call(app, "POST", "/buy/1")
    assert app.gates["write"].in_flight == 0


@pytest.mark.parametrize(("raw", "code"), [("abc", "400"), ("-5", "400"), ("1.5", "400"), ("9999999999", "400"),
                                           ("600001", "400"), ("0", "504")])
def test_a_bad_or_spent_budget_is_refused_before_the_app(raw: str, code: str) -> None:
    inner = Inner()
    status, _, body = call(Admission(inner, "svc-c", {"write": 4}), "POST", "/buy/1", {DEADLINE_HEADER: raw})
    assert status.startswith(code)
    assert json.loads(b"".join(body))["error"]["message"]
    assert inner.seen == []


def test_the_budget_becomes_a_deadline_no_later_than_the_services_own() -> None:
    inner = Inner()
    app = Admission(inner, "svc-d", {})
    t0 = time.monotonic()
    assert call(app, "POST", "/buy/1", {DEADLINE_HEADER: "1500"})[0].startswith("200")
    given = inner.seen[-1][ENVIRON_KEY]
    assert t0 + 1.4 < given <= time.monotonic() + 1.5
    assert deadline_of(inner.seen[-1], 60.0) == given  # the caller's is sooner
    assert deadline_of(inner.seen[-1], 0.1) < given  # ours is sooner
    assert deadline_of({}, 2.0) <= time.monotonic() + 2.0
    # Passed on reduced: never more than is left, never negative.
    assert 0 <= int(timeout_header(given)[DEADLINE_HEADER]) <= 1500
    assert timeout_header(time.monotonic() - 5)[DEADLINE_HEADER] == "0"


def test_classes() -> None:
    assert classify("POST", "/buy/3") == "write"
    assert classify("POST", "/books/decrements") == "write"
    assert classify("GET", "/lookup/3") == "read"
    assert classify("GET", "/orders/3") == "read"
    assert classify("GET", "/status") is None
    assert classify("POST", "/raft/read_index") is None
    with pytest.raises(ValueError):
        Gate(0)


class EarlyInner(Inner):
    """An app that would answer any GET early, recording what it was asked."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[str, str, str, bytes | None]] = []
        self.started: list[Any] = []

    def early(self, method: str, path: str, query: str, headers: dict[bytes, bytes],
              body: bytes = b"") -> bytes | Deferred | None:
        self.asked.append((method, path, query, headers.get(b"x-request-id")))
        if method == "POST" and body == b"later":
            return Deferred(self.started.append)
        return b"early" if method == "GET" else None


def test_early_answers_refuse_a_full_class_and_leave_what_they_cannot_judge() -> None:
    """``Admission.early`` (what Gunicorn's event loop asks, pygmy/cluster/worker.py) judges a raw
    request line as ``__call__`` judges its environ, or leaves it (None)."""
    inner = EarlyInner()
    app = Admission(inner, "svc-e", {"write": 1, "read": 4})
    open_body = call(app, "POST", "/buy/1")[2]  # the one write place taken
    assert app.answers_early()
    refusal = app.early("POST", "/buy/2", {})
    assert refusal is not None and refusal.startswith(b"HTTP/1.1 503 ") and b"\r\nRetry-After: 1\r\n" in refusal
    assert json.loads(refusal.split(b"\r\n\r\n", 1)[1])["error"]["overloaded"] is True
    # Percent-encoding is decoded before classifying, as Gunicorn decodes PATH_INFO: control traffic passes.
    assert app.early("POST", "/%73tatus", {}) is None
    for target in ("http://host/buy/2", "//buy/2", "/buy/2#x"):
        assert app.early("POST", target, {}) is None, target
    for bad in (b"soon", b"0"):  # malformed, or spent: __call__ answers 400 or 504
        assert app.early("POST", "/buy/2", {b"x-request-timeout-ms": bad}) is None
    # A class with room goes on to the app's own early answer, with the decoded path and the query.
    assert app.early("GET", "/search/a%20b?limit=2", {b"x-request-id": b"r1"}) == b"early"
    assert inner.asked[-1] == ("GET", "/search/a b", "limit=2", b"r1")
    open_body.close()
    assert app.early("POST", "/buy/3", {}) is None and inner.asked[-1][0] == "POST"


def test_a_deferred_answer_holds_a_place_of_its_class_until_delivered_or_cancelled() -> None:
    inner = EarlyInner()
    app = Admission(inner, "svc-f", {"write": 2})
    gate = app.gates["write"]
    first = app.early("POST", "/buy/1", {}, b"later")
    assert isinstance(first, Deferred) and gate.in_flight == 1 and inner.started == []
    delivered: list[bytes] = []
    first.start(delivered.append)  # the worker has read the request off its socket
    (deliver,) = inner.started
    second = app.early("POST", "/buy/2", {}, b"later")
    assert isinstance(second, Deferred) and gate.in_flight == 2
    refused = app.early("POST", "/buy/3", {}, b"later")
    assert isinstance(refused, bytes) and refused.startswith(b"HTTP/1.1 503 "), "the class is full"
    deliver(b"answer")
    deliver(b"again")  # a second call would be a bug; it must not give back a place twice
    assert gate.in_flight == 1 and delivered == [b"answer", b"again"]
    second.cancel()  # never started: its place goes back, and nothing ran
    second.cancel()
    assert gate.in_flight == 0 and len(inner.started) == 1


def test_workers_on_one_board_share_its_caps_however_their_requests_are_split() -> None:
    """A frontend's caps are the frontend's: a worker handed most of the connections may take
    every place, and none beyond it (the other worker's requests count too)."""
    board = Board(["write", "read"], slots=4)
    a, b = Admission(Inner(), "svc-g", {"write": 3, "read": 2}), Admission(Inner(), "svc-g", {"write": 3, "read": 2})
    a.share(board, 0)
    b.share(board, 1)
    held = [call(a, "POST", f"/buy/{n}")[2] for n in range(3)]  # all three places, on one worker
    assert call(b, "POST", "/buy/9")[0].startswith("503") and call(a, "POST", "/buy/9")[0].startswith("503")
    assert b.early("POST", "/buy/9", {}) is not None, "the other worker's event loop refuses too"
    assert a.snapshot()["write"] == b.snapshot()["write"] == {"limit": 3, "in_flight": 3}
    status, _, read = call(b, "GET", "/lookup/1")
    assert status.startswith("200"), "reads have their own shared cap"
    assert board.total("read") == 1
    read.close()
    held.pop().close()
    moved = call(b, "POST", "/buy/8")[2]
    assert call(a, "POST", "/buy/7")[0].startswith("503")
    assert (a.gates["write"].in_flight, b.gates["write"].in_flight, board.total("write")) == (2, 1, 3)
    for body in (*held, moved):
        body.close()
    assert board.total("write") == 0 and board.total("read") == 0


def test_a_board_is_shared_with_the_processes_forked_after_it() -> None:
    board = Board(["write"], slots=2)
    here = Admission(Inner(), "svc-h", {"write": 2})
    here.share(board, 0)
    ready, go = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a worker holding two places until told to leave
        try:
            child = Admission(Inner(), "svc-h", {"write": 2})
            child.share(board, 1)
            bodies = [call(child, "POST", "/buy/1")[2] for _ in range(2)]
            os.write(ready[1], b"x")
            os.read(go[0], 1)
            for body in bodies:
                body.close()
        finally:
            os._exit(0)
    try:
        os.read(ready[0], 1)
        assert board.total("write") == 2
        assert call(here, "POST", "/buy/2")[0].startswith("503"), "the child's places count here"
        os.write(go[1], b"x")
    finally:
        os.waitpid(pid, 0)
        for fd in (*ready, *go):
            os.close(fd)
    assert board.total("write") == 0 and call(here, "POST", "/buy/2")[0].startswith("200")


def test_the_master_gives_each_worker_a_free_slot_and_frees_a_dead_workers_places() -> None:
    """Gunicorn's hooks: ``assign`` before a fork, ``release`` once a worker has exited (a SIGKILLed
    worker cannot give its places back itself)."""
    board = Board(["write", "read"], slots=3)
    server = SimpleNamespace(WORKERS={})
    workers = []
    for pid in (101, 102, 103):
        worker = SimpleNamespace()
        board.assign(server, worker)
        server.WORKERS[pid] = worker
        workers.append(worker)
    assert [w.pygmy_slot for w in workers] == [0, 1, 2] and all(w.pygmy_board is board for w in workers)
    board.put("write", 1, 5)  # worker 102 holds five places ...
    board.put("read", 1, 2)
    board.put("write", 2, 1)
    del server.WORKERS[102]  # ... and is killed: the master reaps it
    board.release(server, workers[1])
    assert board.total("write") == 1 and board.total("read") == 0
    spare = SimpleNamespace()
    server.WORKERS[104] = spare  # its replacement takes the freed slot
    board.assign(server, spare)
    assert spare.pygmy_slot == 1
    extra = SimpleNamespace()
    board.assign(server, extra)  # no slot left: the worker caps alone, and no live slot is touched
    assert not hasattr(extra, "pygmy_slot") and board.total("write") == 1


class Failing(Inner):
    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("500 INTERNAL SERVER ERROR", [("Content-Type", "application/json")])
        return [b"{}"]


def test_a_following_cap_is_fed_the_latency_of_each_success_once_on_either_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The event loop's deferred buys and the routes' requests feed ``LatencyLimit`` one sample each
    when answered with success; a cancelled, failed or crashed one feeds none (a fast failure must
    not teach the cap that buys are fast)."""
    clock = [100.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock[0])
    inner = EarlyInner()
    app = Admission(inner, "svc-m", {"write": 8}, tolerances={"write": 2.0})
    gate = app.gates["write"]
    assert gate.adaptive is not None
    seen: list[float] = []
    monkeypatch.setattr(gate.adaptive, "observe", lambda now, latency: seen.append(latency))

    def deferred(answer: bytes) -> None:
        work = app.early("POST", "/buy/1", {}, b"later")
        assert isinstance(work, Deferred)
        work.start(lambda out: None)
        clock[0] += 0.25
        inner.started[-1](answer)
        inner.started[-1](answer)  # a second delivery is a bug, and must not count twice

    deferred(b"HTTP/1.1 200 OK\r\n\r\n{}")
    deferred(b"HTTP/1.1 503 Service Unavailable\r\n\r\n{}")
    cancelled = app.early("POST", "/buy/2", {}, b"later")
    assert isinstance(cancelled, Deferred)
    cancelled.cancel()
    assert seen == [0.25] and gate.in_flight == 0

    body = call(app, "POST", "/buy/3")[2]
    clock[0] += 0.5
    body.close()
    assert seen == [0.25, 0.5]
    failing = Admission(Failing(), "svc-m2", {"write": 8}, tolerances={"write": 2.0})
    monkeypatch.setattr(failing.gates["write"].adaptive, "observe", lambda now, latency: seen.append(latency))
    call(failing, "POST", "/buy/4")[2].close()
    assert seen == [0.25, 0.5] and failing.gates["write"].in_flight == 0


def test_taking_the_last_place_or_being_refused_marks_the_cap_reached() -> None:
    app = Admission(EarlyInner(), "svc-n", {"write": 2}, tolerances={"write": 2.0})
    adaptive = app.gates["write"].adaptive
    assert adaptive is not None
    first = call(app, "POST", "/buy/1")[2]
    assert not adaptive._reached
    second = call(app, "POST", "/buy/2")[2]
    assert adaptive._reached, "the last place taken"
    adaptive._reached = False
    assert isinstance(app.early("POST", "/buy/3", {}), bytes)
    assert adaptive._reached, "refused by the event loop's look"
    adaptive._reached = False
    assert call(app, "POST", "/buy/4")[0].startswith("503") and adaptive._reached, "refused by the middleware"
    first.close()
    second.close()


def two_workers_on_a_board(monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], Board, Admission, Admission]:
    """A clock the test moves, and two workers' ``Admission`` of one write class (an adaptive cap
    of 40) sharing one board: (clock, board, first, second)."""
    clock = [100.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock[0])
    board = Board(["write"], slots=2)
    a, b = (Admission(Inner(), "svc-o", {"write": 40}, tolerances={"write": 2.0}) for _ in range(2))
    a.share(board, 0)
    b.share(board, 1)
    return clock, board, a, b


def test_workers_on_one_board_share_one_following_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cap one worker's slow buys cut is the other's too, and the other's fast buys grow it back:
    no worker keeps refusing on a cap of its own that nothing of its own moves."""
    clock, board, a, b = two_workers_on_a_board(monkeypatch)
    assert board.cap("write") == 40

    def rounds(app: Admission, latency: float, windows: int, at_cap: bool) -> None:
        for _ in range(windows):
            gate = app.gates["write"]
            if at_cap:
                gate.adaptive._reached = True  # type: ignore[union-attr]
            for _ in range(4):
                body = call(app, "POST", "/buy/1")[2]
                clock[0] += latency
                body.close()
            clock[0] += 0.05

    rounds(a, 0.01, 2, False)
    rounds(b, 0.01, 2, False)
    rounds(a, 0.2, 5, True)
    cut = a.snapshot()["write"]["limit"]
    assert 10 <= cut <= 30 and b.snapshot()["write"]["limit"] == cut, "one cap, cut by the first worker's buys"
    held = [call(b, "POST", "/buy/2")[2] for _ in range(cut)]
    assert b.gates["write"].full() and call(b, "POST", "/buy/2")[0].startswith("503"), "the other worker admits by it"
    for body in held:
        body.close()
    rounds(b, 0.01, 60, False)
    assert a.snapshot()["write"]["limit"] == 40, "the other worker's fast buys grew the shared cap back"


def test_a_worker_writes_the_shared_cap_only_when_its_own_window_moves_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another worker's step that lands while this one finishes a request (its thread paused
    between reading the cap and writing it back) is kept: a request that closes no window of
    this worker's writes nothing (every request wrote the cap it had read back, undoing the step)."""
    clock, board, a, b = two_workers_on_a_board(monkeypatch)
    adaptive = a.gates["write"].adaptive
    assert adaptive is not None
    observe = adaptive.observe

    def meanwhile(now: float, latency: float) -> None:
        board.set_cap("write", 23.0)  # the other worker's window cut it, right now
        observe(now, latency)

    monkeypatch.setattr(adaptive, "observe", meanwhile)
    body = call(a, "POST", "/buy/1")[2]
    clock[0] += 0.01
    body.close()  # one sample: no window of this worker's closes
    assert board.cap("write") == 23.0 and b.snapshot()["write"]["limit"] == 23
