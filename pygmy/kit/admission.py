"""Admission control and request deadlines, for the frontend and every replica (issue #19).

Under overload what hurts is work in flight: each request admitted beyond capacity holds a thread,
waits in a queue and is finished long after its client left, so goodput collapses while the
queues grow. Each service therefore caps the requests it works on at once, per class, and refuses
the excess at once (503 and ``Retry-After``) in a WSGI middleware, before Flask, a proposal or a
call to another tier costs anything. Classes are capped apart so that reads are served while buys
saturate the write path. Control traffic (health, status, metrics, the peers' read-index requests)
is never shed; Raft itself runs on its own transport (``pygmy/replication/transport.py``), not through
here, so heartbeats never wait behind client load.

A request also carries what is left of its time: ``X-Request-Timeout-Ms``, from the client (or a
default) and passed on, reduced, by every hop (``pygmy/replication/router.py``). No tier starts work on a
request whose time is up; past that point only its outcome is kept (docs/replication.md).
"""

from __future__ import annotations

import json
import logging
import mmap
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote_to_bytes

from prometheus_client import Counter
from werkzeug.wsgi import ClosingIterator

from pygmy.kit.logs import HEADER as REQUEST_ID_HEADER
from pygmy.kit.logs import valid_request_id
from pygmy.kit.metrics import RequestMetrics
from pygmy.kit.retry import DEADLINE_HEADER

_DEADLINE_ENVIRON = "HTTP_" + DEADLINE_HEADER.upper().replace("-", "_")
_ID_ENVIRON = "HTTP_" + REQUEST_ID_HEADER.upper().replace("-", "_")
_ID_NAME = REQUEST_ID_HEADER.lower().encode()
#: The route that answers given here (refusals, spent budgets, malformed deadlines) are counted under
#: in ``pygmy_http_requests_total``: they are refused before any route is matched.
ROUTE = "admission"
#: The longest budget a caller may give (ten minutes): bigger values are refused as malformed.
MAX_TIMEOUT_MS = 600_000
#: Where a request's absolute deadline (``time.monotonic()``) is kept for the handlers.
ENVIRON_KEY = "pygmy.deadline"
#: Seconds a shed client is told to wait before trying again.
RETRY_AFTER = 1
#: Paths never shed: probes, status, metrics, and the replicas' internal read-index requests.
CONTROL = ("/health", "/livez", "/readyz", "/status", "/metrics", "/verify", "/openapi.json", "/raft/")

SHED = Counter("pygmy_shed_total", "Requests refused at once (503 + Retry-After) because their class was at "
               "its cap of requests in flight", ["service", "cls"])
EXPIRED = Counter("pygmy_deadline_expired_total", "Requests refused because their time budget "
                  f"({DEADLINE_HEADER}) was spent before work began", ["service"])


def classify(method: str, path: str) -> str | None:
    """``write`` (a POST: buy, update, decrement), ``read``, or None for control traffic."""
    if path.startswith(CONTROL):
        return None
    return "write" if method in ("POST", "PUT", "PATCH", "DELETE") else "read"


def parse_timeout_ms(raw: str) -> int:
    """The header's value: a whole number of milliseconds, 0 to ``MAX_TIMEOUT_MS``; ValueError otherwise."""
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9):
        raise ValueError(f"{DEADLINE_HEADER} must be a whole number of milliseconds")
    value = int(raw)
    if value > MAX_TIMEOUT_MS:
        raise ValueError(f"{DEADLINE_HEADER} must be at most {MAX_TIMEOUT_MS}")
    return value


def deadline_of(environ: dict[str, Any], default: float) -> float:
    """The monotonic time by which a request must be answered: its caller's budget if it gave one,
    and never later than ``default`` seconds from now."""
    own = time.monotonic() + default
    given = environ.get(ENVIRON_KEY)
    return own if given is None else min(given, own)


def timeout_header(deadline: float) -> dict[str, str]:
    """The header that passes on what is left of ``deadline`` to the next hop."""
    return {DEADLINE_HEADER: str(max(0, int((deadline - time.monotonic()) * 1000)))}


class Board:
    """The in-flight counts of all the worker processes of one service, in memory they share, so that
    a frontend's caps hold for the frontend and not for each worker.

    With a cap per worker, a worker that the kernel handed more than its share of keep-alive
    connections refused buys while the other had room: 32 buyers on two workers of 24 write places
    got 705 answers 503 in the round that put 25 connections on one worker (docs/performance.md).
    Gunicorn's master makes the board (an anonymous shared mapping) before it forks, gives each
    worker a slot of its own as it forks it (``assign``, its ``pre_fork`` hook) and clears the slot
    when the worker has exited (``release``, ``child_exit``), so the places of a killed worker are
    not lost. A worker writes only its own slot, under its own lock; the sum is read without a
    lock, so two workers admitting at the same instant may overshoot a cap by at most one request
    each, never more.

    A cap that follows latency is kept here too, one per class (``cap``, ``set_cap``; 0 until a
    worker sets it): every worker judges the count against the same cap and moves it with its own
    requests' latency. A worker writes the cap only when a window of its own moves it, so two
    workers moving it at the same instant may lose one step of it, and nothing else does."""

    def __init__(self, classes: Iterable[str], slots: int) -> None:
        self.classes = list(classes)
        self.slots = slots
        n = max(1, len(self.classes))
        self._memory = mmap.mmap(-1, 8 * slots * n + 8 * n)  # MAP_SHARED: kept over fork
        self._counts = memoryview(self._memory)[:8 * slots * n].cast("q")
        self._caps = memoryview(self._memory)[8 * slots * n:].cast("d")
        self._ranges = {cls: slice(k * slots, (k + 1) * slots) for k, cls in enumerate(self.classes)}
        self._cap_at = {cls: k for k, cls in enumerate(self.classes)}

    def cap(self, cls: str) -> float:
        """The shared cap of ``cls`` that follows latency; 0 if no worker has set it yet."""
        return self._caps[self._cap_at[cls]]

    def set_cap(self, cls: str, value: float) -> None:
        self._caps[self._cap_at[cls]] = value

    def total(self, cls: str) -> int:
        """Requests of ``cls`` in flight in all the service's workers."""
        return sum(self._counts[self._ranges[cls]])

    def put(self, cls: str, slot: int, count: int) -> None:
        self._counts[self._ranges[cls].start + slot] = count

    def clear(self, slot: int) -> None:
        for cls in self.classes:
            self.put(cls, slot, 0)

    def assign(self, server: Any, worker: Any) -> None:
        """Gunicorn's ``pre_fork`` (in the master): the lowest slot no live worker holds, cleared."""
        taken = {getattr(w, "pygmy_slot", None) for w in server.WORKERS.values()}
        slot = next((i for i in range(self.slots) if i not in taken), None)
        if slot is None:  # more workers than slots (many TTIN signals): this one caps alone
            logging.getLogger(__name__).warning("no free admission slot: a worker caps its own requests")
            return
        self.clear(slot)
        worker.pygmy_board, worker.pygmy_slot = self, slot

    def release(self, server: Any, worker: Any) -> None:
        """Gunicorn's ``child_exit`` (in the master): the places a dead worker held are free again."""
        slot = getattr(worker, "pygmy_slot", None)
        if slot is not None:
            self.clear(slot)


#: The least latency a ``LatencyLimit`` takes a window's median to be (s): a coarse clock's zero
#: must not make every later window look infinitely slow.
MIN_LATENCY = 1e-4


class LatencyLimit:
    """A cap on requests in flight that follows their measured latency: AIMD, as TCP's window follows loss.

    A fixed cap does not notice when the machine is full: under a surge every admitted buy holds a
    place for as long as the CPU it queues for makes it take, reads queue for the same CPU, and the
    cap is reached at the latency of a saturated machine. This one is cut by a tenth each window
    whose median latency is over ``tolerance`` times the ``baseline`` *and* in which the cap was
    reached (so that load the cap did not hold back, such as closed-loop clients, which cannot
    overload anything, is never shed for being slow), and grows by one each window at or under it,
    up to the configured cap (``ceiling``): it never admits more than the fixed cap would, nor
    fewer than a quarter of it (``floor``). A frontend uses one only if asked
    (``--frontend-write-tolerance``): on this project's machine it served fewer buys at a surge than
    the fixed cap, with reads no faster (docs/performance.md, "Overload").

    A cap only helps when the requests it admits are what makes them slow. When requests are still
    too slow after ``settle`` windows at the floor, something else is (on one machine: the refusals
    of a surge and the processes sending it, which take the CPU whatever the cap), and a low cap
    would only throw away the batching that makes the write path cheap: the cap goes back to its
    ceiling and the baseline becomes that latency. (Without this rule, a 3x surge in
    ``python -m pygmy.experiments.overload --quick`` kept the cap at its floor with buys as slow as
    ever: goodput 0.58x the closed-loop capacity against 1.58x with a fixed cap, cached lookups no
    faster, 1.37x their p50 before the surge against 1.46x.)

    ``baseline`` is the latency of the service with the cap not reached: it follows the windows in
    which the cap was not reached (falling at once, rising by a twentieth of the difference); while
    the cap is reached it only falls, so that a long surge cannot teach it its own latency, except
    when the rule above rebases it. A window left open longer than ``stale`` windows (no requests
    finished: an idle service) is dropped, so that old samples are not judged with new ones.

    Pure: no clock, threads or I/O. The caller gives each finished request's latency and the time
    (``observe``) and says when the cap was reached (``reached``); ``pygmy.kit.admission.Gate``
    does, under its lock, with ``time.monotonic``."""

    def __init__(self, ceiling: int, tolerance: float, *, floor: int | None = None, window: float = 0.05,
                 min_samples: int = 4, backoff: float = 0.9, follow: float = 0.05, settle: int = 3,
                 stale: int = 40) -> None:
        if tolerance <= 1:
            raise ValueError("a latency tolerance must be over 1 (times the baseline latency)")
        if ceiling < 1:
            raise ValueError("a cap on requests in flight must be at least 1")
        self.ceiling, self.tolerance = ceiling, tolerance
        self.floor = max(1, ceiling // 4 if floor is None else min(floor, ceiling))
        self.window, self.min_samples, self.backoff, self.follow = window, min_samples, backoff, follow
        self.settle, self.stale = settle, stale
        self.value = float(ceiling)
        self._slow_at_floor = 0  # windows in a row over the tolerance with the cap at its floor
        self.rebases = 0  # times the rule above put the cap back
        self.baseline: float | None = None
        self._samples: list[float] = []
        self._opened: float | None = None
        self._reached = False

    @property
    def limit(self) -> int:
        return self.limit_of(self.value)

    def limit_of(self, value: float) -> int:
        """The cap a value of this rule stands for (this one's, or another worker's on a board)."""
        return max(self.floor, min(self.ceiling, int(value)))

    def reached(self) -> None:
        """The cap was reached in this window (a request refused, or one admitted into the last place)."""
        self._reached = True

    def observe(self, now: float, latency: float) -> None:
        """One request finished at ``now`` after ``latency`` seconds; closes the window when due."""
        if self._opened is None or now - self._opened > self.stale * self.window:
            self._opened, self._samples = now, []  # a ``reached`` since stays: it is news
        self._samples.append(latency)
        if now - self._opened < self.window or len(self._samples) < self.min_samples:
            return
        samples, reached = sorted(self._samples), self._reached
        self._samples, self._opened, self._reached = [], None, False
        median = max(samples[len(samples) // 2], MIN_LATENCY)
        base = self.baseline
        if base is None or median < base:
            self.baseline = base = median
        elif not reached:
            self.baseline = base = base + (median - base) * self.follow
        if median <= self.tolerance * base:
            self._slow_at_floor = 0
            self.value = min(float(self.ceiling), self.value + 1)
        elif self.limit <= self.floor:
            self._slow_at_floor += 1
            if self._slow_at_floor >= self.settle:  # the cap is not what makes them slow
                self._slow_at_floor = 0
                self.baseline, self.value = median, float(self.ceiling)
                self.rebases += 1
        elif reached:
            self.value = max(float(self.floor), self.value * self.backoff)


class Gate:
    """A cap on requests in flight for one class: non-blocking, so the excess is refused, not queued.

    Alone it counts this process's requests; ``share`` makes it count those of every worker on a
    ``Board``. With a ``LatencyLimit`` the cap follows the latency of the requests: of this
    process's alone, or, shared, one cap on the board that each worker moves with its own."""

    def __init__(self, limit: int, tolerance: float = 0.0) -> None:
        if limit < 1:
            raise ValueError("a limit on requests in flight must be at least 1")
        self.ceiling = limit
        self.adaptive = LatencyLimit(limit, tolerance) if tolerance else None
        self.in_flight = 0  # this process's
        self._lock = threading.Lock()
        self._board: tuple[Board, str, int] | None = None

    def share(self, board: Board, cls: str, slot: int) -> None:
        with self._lock:
            self._board = (board, cls, slot)
            board.put(cls, slot, self.in_flight)
            if self.adaptive is not None and not board.cap(cls):  # the first worker; a replacement
                board.set_cap(cls, self.adaptive.value)                # takes the cap as it is

    @property
    def limit(self) -> int:
        """The cap in force: the configured one; or the one following latency, this process's or the
        board's (whichever worker moved it last; read without the lock: a hint, as ``total`` is)."""
        adaptive, shared = self.adaptive, self._board
        if adaptive is None:
            return self.ceiling
        if shared is None:
            return adaptive.limit
        return adaptive.limit_of(shared[0].cap(shared[1]))

    def total(self) -> int:
        """Requests in flight that the limit applies to: this process's, or all its workers'."""
        shared = self._board
        return self.in_flight if shared is None else shared[0].total(shared[1])

    def full(self) -> bool:
        return self.total() >= self.limit

    def _count(self, change: int) -> None:
        self.in_flight += change
        shared = self._board
        if shared is not None:
            shared[0].put(shared[1], shared[2], self.in_flight)

    def try_enter(self) -> bool:
        with self._lock:
            total, limit = self.total(), self.limit
            if total >= limit:
                if self.adaptive is not None:
                    self.adaptive.reached()
                return False
            if total + 1 >= limit and self.adaptive is not None:
                self.adaptive.reached()
            self._count(1)
            return True

    def refused(self) -> None:
        """A request of the class was refused on a look at ``full()``, without ``try_enter``."""
        if self.adaptive is not None:
            with self._lock:
                self.adaptive.reached()

    def leave(self, entered: float | None = None) -> None:
        """One request done; ``entered`` (its ``time.monotonic()`` at ``try_enter``, for a request
        answered in full; None for one cancelled or failed) feeds the latency limit."""
        with self._lock:
            self._count(-1)
            adaptive = self.adaptive
            if adaptive is None or entered is None:
                return
            shared = self._board
            if shared is not None:  # another worker may have moved the cap since
                adaptive.value = shared[0].cap(shared[1]) or adaptive.value
            now = time.monotonic()
            before = adaptive.value
            adaptive.observe(now, now - entered)
            if shared is not None and adaptive.value != before:  # a window closed and moved it
                shared[0].set_cap(shared[1], adaptive.value)


class Deferred:
    """An answer the app gives later, off the event loop that read its request (``pygmy/cluster/worker.py``):
    ``start(deliver)`` once the request has been taken off its socket, after which the work calls
    ``deliver(answer)`` exactly once, from any thread, with the whole HTTP answer; or ``cancel()``
    instead of ``start`` if it is not to begin after all. Nothing may be done before ``start``."""

    __slots__ = ("_start", "_cancel")

    def __init__(self, start: Callable[[Callable[[bytes], None]], None],
                 cancel: Callable[[], None] = lambda: None) -> None:
        self._start, self._cancel = start, cancel

    def start(self, deliver: Callable[[bytes], None]) -> None:
        self._start(deliver)

    def cancel(self) -> None:
        self._cancel()


def _json(start_response: Callable[..., Any], status: str, code: int, message: str, rid: str,
          extra_headers: list[tuple[str, str]] | None = None, **extra: Any) -> list[bytes]:
    body = json.dumps({"error": {"code": code, "message": message, **extra}}).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                            *(extra_headers or []), (REQUEST_ID_HEADER, rid)])
    return [body]


class Admission:
    """WSGI middleware: each request of a capped class enters its ``Gate`` or is refused at once.

    The refusal is prepared once and costs one counter increment: under a surge most requests are
    refused, and what a refusal costs is taken from the requests being served. (Requests in flight
    are in ``snapshot()``, for ``/status``, not in a metric: prometheus-client's multiprocess values
    share one lock per process, and two more writes per request made it a convoy under load.) Every
    answer given here has an ``X-Request-Id`` (the caller's, or a new one) and is counted in
    ``metrics`` (``pygmy_http_requests_total``, route ``admission``), as the ``Edge`` does for
    the answers behind it."""

    def __init__(self, app: Callable[..., Any], service: str, limits: dict[str, int],
                 metrics: RequestMetrics | None = None, tolerances: dict[str, float] | None = None) -> None:
        self.app, self.service = app, service
        self.metrics = metrics or RequestMetrics(service)
        self.gates = {cls: Gate(limit, (tolerances or {}).get(cls, 0.0)) for cls, limit in limits.items()}
        self._shed = {cls: SHED.labels(service, cls) for cls in limits}
        self._refusal = {cls: json.dumps({"error": {
            "code": 503, "message": f"{service} is overloaded ({cls}s in flight at their cap): retry after {RETRY_AFTER} s",
            "overloaded": True}}).encode() for cls in limits}
        self._expired = EXPIRED.labels(service)
        self._wire = {cls: (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\nRetry-After: %d\r\n%s: " % (len(body), RETRY_AFTER,
                                                                              REQUEST_ID_HEADER.encode()),
                            b"\r\n\r\n" + body) for cls, body in self._refusal.items()}

    def _shed_wire(self, cls: str, method: str, headers: dict[bytes, bytes]) -> bytes:
        """The whole 503 of a full class, with the request's id, counted."""
        self.gates[cls].refused()
        self._shed[cls].inc()
        self.metrics.count(ROUTE, method, 503)
        given = headers.get(_ID_NAME)
        rid = valid_request_id(given.decode("latin-1") if given is not None else None)
        head, tail = self._wire[cls]
        return head + rid.encode("latin-1") + tail

    def share(self, board: Board, slot: int) -> None:
        """Count each class's requests on ``board`` (slot ``slot``): the caps become the service's."""
        for cls, gate in self.gates.items():
            gate.share(board, cls, slot)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """``{class: {"limit", "in_flight"}}``: what the cap applies to (every worker's, if shared);
        for a cap that follows latency also ``ceiling`` (the configured cap) and ``baseline_ms``."""
        out: dict[str, dict[str, Any]] = {}
        for cls, g in self.gates.items():
            out[cls] = {"limit": g.limit, "in_flight": g.total()}
            if g.adaptive is not None:
                base = g.adaptive.baseline
                out[cls].update(ceiling=g.ceiling, baseline_ms=None if base is None else round(base * 1000, 2))
        return out

    def answers_early(self) -> bool:
        """Whether ``early`` may answer now: a class is at its cap, or the app has a shortcut."""
        return getattr(self.app, "shortcut", None) is not None or any(
            g.full() for g in self.gates.values())  # read without the locks: a hint

    def early(self, method: str, target: str, headers: dict[bytes, bytes], body: bytes = b"") -> bytes | Deferred | None:
        """The whole HTTP answer to a request not yet parsed, if it can be given at once, or a
        ``Deferred`` one; else None.

        For ``pygmy/cluster/worker.py``, which answers so from Gunicorn's event loop: the refusal of a
        request whose class is full, or the app's own early answer (``Edge.early``: a cached
        read, or a buy answered when its batch returns). A deferred answer holds a place of its
        class, as an admitted request does, until it is delivered. ``target`` is the request
        line's, ``headers`` have lower-case names; the path is decoded as Gunicorn decodes it into
        ``PATH_INFO``. Anything this cannot judge as ``__call__`` would (a target not in plain
        origin form, a deadline header to be refused as malformed or spent) is left to
        ``__call__``: None. A request let through here may still be refused there, since the
        count may change in between."""
        if not target.startswith("/") or target.startswith("//") or "#" in target:
            return None
        raw_path, _, query = target.partition("?")
        path = unquote_to_bytes(raw_path).decode("latin-1") if "%" in raw_path else raw_path
        timeout = headers.get(b"x-request-timeout-ms")
        if timeout is not None:
            try:
                if parse_timeout_ms(timeout.decode("latin-1").strip()) == 0:
                    return None
            except ValueError:
                return None
        cls = classify(method, path)
        gate = self.gates.get(cls) if cls else None
        if gate is not None and gate.full():
            return self._shed_wire(cls, method, headers)  # type: ignore[arg-type]
        early = getattr(self.app, "early", None)
        answer = early(method, path, query, headers, body) if early is not None else None
        if not isinstance(answer, Deferred):
            return answer
        if gate is None:
            return answer
        if not gate.try_enter():  # filled up since the look above: refused as it would be there
            return self._shed_wire(cls, method, headers)  # type: ignore[arg-type]
        work, left, entered = answer, threading.Lock(), time.monotonic()

        def leave(answered: bool = False) -> None:
            if left.acquire(blocking=False):  # once, whether delivered or cancelled
                gate.leave(entered if answered else None)  # the latency of successes only

        def start(deliver: Callable[[bytes], None]) -> None:
            def delivered(out: bytes) -> None:
                leave(out.startswith(b"HTTP/1.1 2"))
                deliver(out)

            try:
                work.start(delivered)
            except BaseException:
                leave()
                raise

        return Deferred(start, lambda: (leave(), work.cancel()))

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        raw = environ.get(_DEADLINE_ENVIRON)
        method = environ.get("REQUEST_METHOD", "GET")
        if raw is not None:
            try:
                budget = parse_timeout_ms(raw.strip())
            except ValueError as exc:
                return self._refuse(environ, start_response, method, "400 Bad Request", 400, str(exc))
            if budget == 0:
                self._expired.inc()
                return self._refuse(environ, start_response, method, "504 Gateway Timeout", 504,
                                    f"{self.service}: the request's time budget was spent before work began")
            environ[ENVIRON_KEY] = time.monotonic() + budget / 1000
        cls = classify(method, environ.get("PATH_INFO", ""))
        gate = self.gates.get(cls) if cls else None
        if gate is None:
            return self.app(environ, start_response)
        if not gate.try_enter():
            self._shed[cls].inc()
            body = self._refusal[cls]
            self.metrics.count(ROUTE, method, 503)
            start_response("503 Service Unavailable", [("Content-Type", "application/json"),
                                                       ("Content-Length", str(len(body))),
                                                       ("Retry-After", str(RETRY_AFTER)),
                                                       (REQUEST_ID_HEADER, valid_request_id(environ.get(_ID_ENVIRON)))])
            return [body]
        if gate.adaptive is None:  # a fixed cap: nothing to time
            try:
                return ClosingIterator(self.app(environ, start_response), gate.leave)
            except BaseException:
                gate.leave()
                raise
        entered, status, given = time.monotonic(), [""], start_response

        def timed_start_response(code: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            status[0] = code  # its latency counts if it succeeded
            return given(code, headers, exc_info) if exc_info is not None else given(code, headers)

        try:
            result = self.app(environ, timed_start_response)
        except BaseException:
            gate.leave()
            raise
        # Released when the server has sent the body: its latency includes the sending.
        return ClosingIterator(result, lambda: gate.leave(entered if status[0].startswith("2") else None))

    def _refuse(self, environ: dict[str, Any], start_response: Callable[..., Any], method: str, status: str,
                code: int, message: str) -> list[bytes]:
        self.metrics.count(ROUTE, method, code)
        return _json(start_response, status, code, message, valid_request_id(environ.get(_ID_ENVIRON)))
