"""Gunicorn's threaded worker, answering from its event loop what needs no thread: a refusal, a cache
hit, and a buy, which waits on the order tier without holding a thread.

Under a surge most requests are refused (``pygmy/kit/admission.py``). Refused in the WSGI middleware,
each still cost what Gunicorn spends on any request: the hand-off of its connection from the
worker's event loop to a pool thread, the parse of its request into a WSGI environ, the answer's
headers, and the trip back; 374 us of the worker's CPU, against 34 us here
(``experiments/refusal.py``). A cached lookup, a few microseconds of work, paid the same, and under
load waited for the worker's GIL at each hand-off between threads.

So the event loop looks at each request that arrives (``MSG_PEEK``: nothing is read unless it is
answered here) while the app could answer one at once: while one of its classes is at its cap, or
always if it has a shortcut (the frontend's cached lookups, ``pygmy/kit/web.py`` ``Edge.early``). A
complete request that ``Admission.early`` answers is read off the socket and answered here, and its
connection goes back to waiting for the next request; anything else (a class with room, a cache
miss, control traffic, a request not yet wholly arrived, a chunked body, a malformed or expired
deadline header, bytes the parser already holds) goes to a pool thread as before, so the
middleware and the app stay the authority and this is only a cheaper way to give their answers.

A buy that arrives whole is taken the same way but answered later (a ``Deferred`` answer): it
joins the worker's batch to the order leader (``pygmy/replication/batching.py`` ``Combiner.submit``),
its connection waits out of the poller, and the thread its batch returns on writes the answer and
hands the connection back. So the buys in flight are bounded by the write cap, not by the pool's
threads, and a surge of buys does not fill the pool that lookups and refusals need.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import threading
import time
from functools import partial
from typing import Any

import httptools
from gunicorn.workers.gthread import TConn, ThreadWorker

from pygmy.kit.admission import Admission, Board, Deferred

#: The most of a request the event loop looks at: refusals are small requests (a buy is ~300 bytes).
PEEK = 8192


class _Head:
    """What httptools' parser hands over of the first request in the bytes it is fed (its callback
    protocol); what follows that request (a pipelined one) is read on a later turn, so its
    callbacks are ignored. Raising to stop the parser would cost more than they do."""

    __slots__ = ("headers", "named_twice", "target", "whole")

    def __init__(self) -> None:
        self.target = b""
        self.headers: dict[bytes, bytes] = {}
        self.named_twice = False
        self.whole = False

    def on_url(self, url: bytes) -> None:
        if not self.whole:
            self.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.whole:
            return
        name = name.lower()
        if name in self.headers:
            self.named_twice = True
        self.headers[name] = value.strip(b" \t")

    def on_message_complete(self) -> None:
        self.whole = True


def _request_head(data: bytes) -> tuple[bytes, bytes, dict[bytes, bytes], int] | None:
    """``(method, target, headers, length)`` of the first request in ``data`` if it has wholly
    arrived (its body too) and is plain, well-formed HTTP/1.1 with a ``Content-Length`` body or
    none, each header named once; else None (Gunicorn's parser then judges it).

    Parsed by httptools (llhttp, strict): it refuses what Gunicorn refuses with 400 (control bytes,
    bare line feeds, folded or malformed headers, bad methods, duplicate lengths), so a request the
    event loop answers is one Gunicorn would have taken too."""
    head = _Head()
    parser = httptools.HttpRequestParser(head)
    try:
        parser.feed_data(data)
    except httptools.HttpParserError:
        if not head.whole:  # else only what follows the first request is malformed: a later turn's
            return None
    if (not head.whole or head.named_twice or parser.get_http_version() != "1.1"
            or b"transfer-encoding" in head.headers):
        return None
    length = data.find(b"\r\n\r\n") + 4 + int(head.headers.get(b"content-length", b"0"))
    return parser.get_method(), head.target, head.headers, length


def asks_to_close(headers: dict[bytes, bytes]) -> bool:
    """Whether the request's ``Connection`` header lists ``close`` (a list of tokens, any case)."""
    value = headers.get(b"connection")  # absent from most requests: nothing to split then
    return value is not None and b"close" in (token.strip() for token in value.lower().split(b","))


def said_closing(answer: bytes) -> bytes:
    """``answer`` with ``Connection: close`` after its status line, as Gunicorn writes it when it
    closes after an answer: without it an HTTP/1.1 client takes the connection for kept alive and
    may send its next request into the close (requests with ``Connection: close`` failed 1 in 50
    with a reset before this said so)."""
    line, sep, rest = answer.partition(b"\r\n")
    return line + sep + b"Connection: close\r\n" + rest


class AdmissionWorker(ThreadWorker):
    """``gthread`` with the answers that need no thread given by the event loop (module docstring)."""

    admission: Admission | None = None
    pygmy_board: Board | None = None  # the service's in-flight counts, and this worker's slot on it
    pygmy_slot: int = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deferred = 0  # answers owed to connections out of the poller (``_answered_early``)
        self._drained: threading.Condition | None = None  # on Gunicorn's lock, made in ``run``

    def load_wsgi(self) -> None:
        super().load_wsgi()
        found = getattr(self.wsgi, "wsgi_app", None)  # a Flask app made by pygmy.kit.web.create_base_app
        self.admission = found if isinstance(found, Admission) else None
        board = getattr(self, "pygmy_board", None)  # set by the master as it forked this worker
        if self.admission is not None and board is not None:
            self.admission.share(board, self.pygmy_slot)

    def on_client_socket_readable(self, conn: TConn, client: Any) -> None:
        admission = self.admission
        if admission is None or not admission.answers_early() or not self._answered_early(conn, admission):
            super().on_client_socket_readable(conn, client)

    def _answered_early(self, conn: TConn, admission: Admission) -> bool:
        """Answer the request waiting on ``conn`` here if ``admission.early`` can, now or later
        (a ``Deferred`` answer: the connection waits out of the poller until it is delivered,
        from whichever thread finishes the work); True if so."""
        parser = conn.parser
        if parser is not None and parser.unreader.buf.getbuffer().nbytes:
            return False  # the parser holds bytes of the next request: let it read them
        try:
            data = conn.sock.recv(PEEK, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:
            return False
        head = _request_head(data)
        if head is None:
            return False
        method, target, headers, length = head
        body = data[data.find(b"\r\n\r\n") + 4:length]
        answer = admission.early(method.decode("latin-1"), target.decode("latin-1"), headers, body)
        if answer is None:
            return False
        with self._lock:
            self.poller.unregister(conn.sock)
            if conn.initialized:
                try:
                    self._keep.remove(conn)
                except ValueError:  # a keep-alive timeout closed it meanwhile
                    if isinstance(answer, Deferred):
                        answer.cancel()
                    return True
        closing = asks_to_close(headers)
        try:
            got = 0
            while got < length:  # the bytes are there (peeked): this does not block
                chunk = conn.sock.recv(length - got, socket.MSG_DONTWAIT)
                if not chunk:
                    raise ConnectionError("closed while being read")
                got += len(chunk)
        except OSError:
            if isinstance(answer, Deferred):
                answer.cancel()
            self._done(conn, True)
            return True
        conn.initialized = True  # so that the next readable event takes it out of _keep first
        if isinstance(answer, Deferred):
            with self._lock:
                self._deferred += 1
            answer.start(partial(self._deliver, conn, closing))
        else:
            self._deliver(conn, closing, answer, deferred=False)
        return True

    def _deliver(self, conn: TConn, closing: bool, answer: bytes, deferred: bool = True) -> None:
        """Send ``answer`` on ``conn`` and give the connection back to the poller for its next
        request (or close it). Any thread; a deferred answer's count goes down here."""
        closing = closing or not self.alive  # ``_done`` closes it then: a stopping worker keeps nothing
        if closing:
            answer = said_closing(answer)
        try:
            conn.sock.sendall(answer)  # a few hundred bytes into an idle socket's buffer
        except OSError:
            closing = True
        self._done(conn, closing)
        if deferred:
            with self._lock:
                self._deferred -= 1
                if not self._deferred and self._drained is not None:
                    self._drained.notify_all()

    def _done(self, conn: TConn, closing: bool) -> None:
        with self._lock:
            if not closing and self.alive:
                conn.set_timeout()
                self._keep.append(conn)
                try:
                    self.poller.register(conn.sock, selectors.EVENT_READ,
                                         partial(self.on_client_socket_readable, conn))
                    return
                except (ValueError, KeyError, OSError):  # the poller closed as the worker stopped
                    self._keep.remove(conn)
            self.nr_conns -= 1
        conn.close()

    def _signalled(self, _: Any) -> None:
        """Empty the wakeup pipe (non-blocking: an empty pipe raises); the handler already ran."""
        with contextlib.suppress(OSError):
            while os.read(self.PIPE[0], 4096):
                pass

    def run(self) -> None:
        """Gunicorn's loop; then, as it waits for the requests its threads still serve, wait for
        the deferred answers still owed (their work may finish within the graceful timeout)."""
        self._drained = threading.Condition(self._lock)
        # A stop signal wakes the loop at once. Gunicorn has every signal write a byte to PIPE
        # (``signal.set_wakeup_fd``), but gthread's poller does not watch it: a worker saw its
        # SIGTERM only when its poll's one-second timeout ran out, so each service took a second
        # or more to stop (every test cluster's teardown, every graceful restart).
        self.poller.register(self.PIPE[0], selectors.EVENT_READ, self._signalled)
        try:
            super().run()
        finally:
            deadline = time.monotonic() + self.cfg.graceful_timeout
            with self._drained:
                while self._deferred and time.monotonic() < deadline:
                    self._drained.wait(deadline - time.monotonic())
