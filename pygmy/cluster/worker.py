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

With TLS (``pygmy up --tls``) gthread wraps each connection in TLS as it first hands it to a
thread; ``handle`` finishes the handshake there (within ``tls.HANDSHAKE_TIMEOUT``) and, on a
replica, takes the connection only from a certificate with a role the tier's API serves
(``tls.HTTP_CLIENTS``). A peek at the kernel's bytes would see ciphertext, so on a kept-alive TLS
connection the event loop *reads* what TLS has decrypted instead (non-blocking, ``_read_tls``):
a request it answers is gone from the connection as with the peek; anything else is handed back
to Gunicorn's parser (``unreader.unread``) before the connection goes to a pool thread, which
reads it from there as if from the socket. A connection's first request (its handshake) always
goes to a pool thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import socket
import ssl
import threading
import time
from functools import partial
from typing import Any

import httptools
from gunicorn import util as gunicorn_util
from gunicorn.http.body import ChunkedReader, LengthReader
from gunicorn.http.errors import LimitRequestLine
from gunicorn.http.message import Request
from gunicorn.http.parser import RequestParser
from gunicorn.workers.gthread import TConn, ThreadWorker

from pygmy.kit import tls
from pygmy.kit.admission import Admission, Board, Deferred
from pygmy.kit.logs import HEADER as REQUEST_ID_HEADER
from pygmy.kit.logs import valid_request_id
from pygmy.kit.web import MAX_HEADERS, MAX_URL, URL_TOO_LONG

log = logging.getLogger(__name__)

#: The most of a request the event loop looks at: refusals are small requests (a buy is ~300 bytes).
PEEK = 8192
#: ``recv`` flags as plain ints: ``socket.MSG_*`` are enum flags, and ``|`` on them goes through
#: the enum machinery on every call (a microsecond, most of what reading the request costs).
_PEEK_NOW = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)
_NOW = int(socket.MSG_DONTWAIT)


#: How a request line that the event loop may answer ends, after its method and target.
_HTTP11 = b" HTTP/1.1\r\n"


class _Reader:
    """Reads the first request of peeked bytes with httptools (llhttp, strict): it refuses what
    Gunicorn refuses with 400 (control bytes, bare line feeds, folded or malformed headers, bad
    methods, duplicate lengths), so a request the event loop answers is one Gunicorn would have
    taken too. This is the parser's callback protocol, keeping what the first request says; what
    follows it (a pipelined request) is read on a later turn, so its callbacks are ignored, and so
    are the parser's method and keep-alive once the feed is over: they are the last request's.

    One parser serves request after request while each feed ends exactly where a request ends that
    llhttp keeps the connection open after: llhttp then waits for the next message as on any
    kept-alive connection, so it is as new. After anything else (an error, a request not yet whole,
    bytes of a next one, a connection that closes) it is replaced: making a parser costs a quarter
    of what parsing a small request does. One reader per event loop: it is not for several threads."""

    __slots__ = ("_parser", "body", "headers", "keep_alive", "method", "named_twice", "target", "whole")

    def __init__(self) -> None:
        self._parser = httptools.HttpRequestParser(self)

    def read(self, data: bytes) -> tuple[bytes, bytes, dict[bytes, bytes], int, bytes] | None:
        """``(method, target, headers, length, body)`` of the first request in ``data`` if it has
        wholly arrived (its body too) and is plain, well-formed HTTP/1.1 with a ``Content-Length``
        body or none, each header named once; else None (Gunicorn's parser then judges it)."""
        self.method = self.target = self.body = b""
        self.headers: dict[bytes, bytes] = {}
        self.named_twice = self.keep_alive = self.whole = False
        try:
            self._parser.feed_data(data)
            clean = True
        except httptools.HttpParserError:  # if the first request is whole, only what follows is
            clean = False                    # malformed: a later turn's to judge
        except httptools.HttpParserUpgrade:  # not an HttpParserError (uncaught, it stopped the event
            self._parser = httptools.HttpRequestParser(self)  # loop): Upgrade or CONNECT, Gunicorn's
            return None
        headers = self.headers
        # The request line must be exactly what llhttp read, as Gunicorn takes it: at the first byte
        # (llhttp skips empty lines before it), single spaces (llhttp allows runs), HTTP/1.1.
        plain = (self.whole and not self.named_twice and b"transfer-encoding" not in headers
                 and data.startswith(b"%s %s%s" % (self.method, self.target, _HTTP11)))
        length = data.find(b"\r\n\r\n") + 4 + len(self.body)
        if not (clean and plain and self.keep_alive and length == len(data)):
            self._parser = httptools.HttpRequestParser(self)
        return (self.method, self.target, headers, length, self.body) if plain else None

    def on_url(self, url: bytes) -> None:
        if not self.whole:
            self.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.whole:
            return
        name = name.lower()
        if name in self.headers:
            self.named_twice = True
        self.headers[name] = value.rstrip(b" \t")  # llhttp skips the leading blanks, not the trailing

    def on_headers_complete(self) -> None:
        if not self.whole:
            self.method = self._parser.get_method()
            self.keep_alive = self._parser.should_keep_alive()  # llhttp forgets it once the request is whole

    def on_body(self, body: bytes) -> None:
        if not self.whole:
            self.body += body

    def on_message_complete(self) -> None:
        self.whole = True


def _request_head(data: bytes) -> tuple[bytes, bytes, dict[bytes, bytes], int] | None:
    """``(method, target, headers, length)`` of the first request in ``data``, as ``_Reader.read``
    reads it, with a reader of its own (for the tests)."""
    read = _Reader().read(data)
    return None if read is None else read[:4]


def _take(sock: socket.socket, length: int) -> None:
    """Read ``length`` bytes off ``sock``: they are there (peeked), so this does not block."""
    got = 0
    while got < length:
        chunk = sock.recv(length - got, _NOW)
        if not chunk:
            raise ConnectionError("closed while being read")
        got += len(chunk)


def _read_tls(sock: ssl.SSLSocket) -> bytes:
    """What TLS has decrypted on ``sock`` now (up to ``PEEK`` bytes; b"": nothing whole yet, or
    the connection closing). ``sock`` is non-blocking, as gthread leaves a kept-alive connection."""
    chunks: list[bytes] = []
    size = 0
    while size < PEEK:
        try:
            chunk = sock.recv(PEEK - size)
        except OSError:  # SSLWantReadError: no whole record more; others: the pool thread's to see
            break
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


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


def _owes_body(parser: Any) -> bool:
    """Whether the last request ``parser`` read still has body bytes to come: an answer given
    without reading it (a 404, a refusal) leaves them for the parser to drain before the next
    request. The event loop must not take them for one (a request smuggled in a body)."""
    mesg = parser.mesg
    if mesg is None or mesg.body is None:
        return False
    reader = mesg.body.reader
    done = (isinstance(reader, LengthReader) and reader.length == 0) or (
        isinstance(reader, ChunkedReader) and reader.parser is None and reader.buf.tell() == 0)
    return mesg.body.buf.tell() > 0 or not done


def _more_read(conn: TConn) -> bool:
    """Whether bytes of a next request were already read off ``conn``'s socket: in its parser's
    buffer, or decrypted and waiting in its TLS object."""
    parser = conn.parser
    if parser is not None and parser.unreader.buf.getbuffer().nbytes:
        return True
    sock = conn.sock
    return isinstance(sock, ssl.SSLSocket) and sock.pending() > 0


#: The route that Gunicorn's own error answers (a malformed request, a crash outside the app) are
#: counted under in ``pygmy_http_requests_total``.
SERVER_ROUTE = "server"


#: The request (or None) and the service's metrics (or None) that Gunicorn's ``handle_error`` is
#: answering on this thread: its ``util.write_error`` is told only the status and message.
_failing = threading.local()
#: The role of the certificate of the connection whose request this pool thread is handing to the
#: app (``tls.PEER_ROLE`` in its environ), or None.
_peer = threading.local()


class _WithPeerRole:
    """``app``, told the role of the request's certificate in its environ (``tls.role_refusal``);
    anything else asked of it is the app's (the worker's exit hook finds its ``extensions``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        environ[tls.PEER_ROLE] = getattr(_peer, "role", None)
        return self.app(environ, start_response)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)


#: The most of a request line and of a header block Gunicorn reads before it refuses the request:
#: past the app's own limits (``web.MAX_URL``, ``web.MAX_HEADERS``: 414 and 431, in JSON), and far
#: below Gunicorn's own when set to allow them (an unlimited line; 1,000 fields of 32 KiB, 32 MB),
#: which it buffers whole, copying the buffer at each 8 KiB read (a 4 MiB line cost 1.4 s of CPU).
MAX_LINE = MAX_URL + 256
MAX_HEAD = 4 * MAX_HEADERS


class _BoundedRequest(Request):
    """Gunicorn's request, read with ``MAX_LINE`` and ``MAX_HEAD`` (Gunicorn caps a configured line
    limit at 8190 bytes, under ``MAX_URL``'s request line, and takes 0 for none at all)."""

    def parse(self, unreader: Any) -> Any:
        self.limit_request_line, self.max_buffer_headers = MAX_LINE, MAX_HEAD
        return super().parse(unreader)


def write_json_error(sock: Any, status_int: int, reason: str, mesg: str) -> None:
    """Gunicorn's answer to a request it refuses itself (malformed, over its limits) or to an error
    that escaped the app, as every other answer of the service is: a JSON body, the request's
    ``X-Request-Id`` (if it got as far as its headers), counted (route ``server``). Gunicorn writes
    these as HTML pages, with no id, counted nowhere; ``AdmissionWorker`` puts this in their place."""
    req, metrics = getattr(_failing, "req", None), getattr(_failing, "metrics", None)
    if isinstance(getattr(_failing, "exc", None), LimitRequestLine):  # Gunicorn's 400: the app's 414, as for a shorter one
        status_int, reason, mesg = 414, "URI Too Long", URL_TOO_LONG
    given = next((v for k, v in getattr(req, "headers", None) or () if k.upper() == REQUEST_ID_HEADER.upper()), None)
    rid = valid_request_id(given)
    if metrics is not None:
        metrics.count(SERVER_ROUTE, str(getattr(req, "method", None) or "-"), status_int)
    body = json.dumps({"error": {"code": status_int, "message": mesg or reason}}).encode()
    head = (f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{REQUEST_ID_HEADER}: {rid}\r\n\r\n").encode("latin-1")
    gunicorn_util.write_nonblock(sock, head + body)


class AdmissionWorker(ThreadWorker):
    """``gthread`` with the answers that need no thread given by the event loop (module docstring)."""

    admission: Admission | None = None
    pygmy_board: Board | None = None  # the service's in-flight counts, and this worker's slot on it
    pygmy_slot: int = 0
    #: With TLS, the roles a connection's certificate must carry (None: any, or none at all: the
    #: frontend's clients). Set by ``pygmy serve`` before Gunicorn forks its workers.
    peer_roles: frozenset[str] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deferred = 0  # answers owed to connections out of the poller (``_answered_early``)
        self._drained: threading.Condition | None = None  # on Gunicorn's lock, made in ``run``
        self._read = _Reader().read  # the event loop's alone

    def load_wsgi(self) -> None:
        gunicorn_util.write_error = write_json_error  # Gunicorn's workers look it up at call time
        RequestParser.mesg_class = _BoundedRequest  # what each connection's parser reads (this process's)
        super().load_wsgi()
        found = getattr(self.wsgi, "wsgi_app", None)  # a Flask app made by pygmy.kit.web.create_base_app
        self.admission = found if isinstance(found, Admission) else None
        board = getattr(self, "pygmy_board", None)  # set by the master as it forked this worker
        if self.admission is not None and board is not None:
            self.admission.share(board, self.pygmy_slot)
        if self.cfg.is_ssl:
            self.wsgi = _WithPeerRole(self.wsgi)

    def handle_request(self, req: Any, conn: TConn) -> bool:
        """gthread's, with the role of the connection's certificate (checked at its handshake)
        where the app's guards read it."""
        peer = getattr(conn, "pygmy_peer", None)
        _peer.role = peer.role if isinstance(peer, tls.Peer) else None
        try:
            return super().handle_request(req, conn)
        finally:
            _peer.role = None

    def handle(self, conn: TConn) -> tuple[bool, TConn]:
        """gthread's, after (with TLS) the handshake and the check of the peer's role, once per
        connection; then the requests that arrived pipelined behind it, in order, on this thread.
        Their bytes are already in the connection's parser (or decrypted in its TLS object), not in
        its socket, so the poller would never wake for them: their client waited out its timeout."""
        if self.cfg.is_ssl and not getattr(conn, "pygmy_peer", None):
            try:
                tls.handshake(conn.sock)
                conn.pygmy_peer = tls.check(conn.sock, self.peer_roles) if self.peer_roles else True
                if not conn.sock.pending():
                    # Gunicorn handed the connection to this thread for its handshake, before any
                    # request came: its first request is awaited in the poller, as a plain one's is
                    # (and as every later one's is), not on this thread (one that said nothing after
                    # its handshake held it for good); Gunicorn closes it after the keep-alive timeout.
                    return True, conn
            except tls.PeerRefused as exc:
                self.log.warning("refused a connection from %s: %s", conn.client, exc)
                return False, conn
            except OSError as exc:  # plain text, another CA, a wrong certificate, a client gone
                self.log.info("TLS handshake with %s failed: %s", conn.client, exc)
                return False, conn
        while True:
            keepalive, conn = super().handle(conn)
            if not (keepalive and self.alive and _more_read(conn)):
                return keepalive, conn

    def handle_error(self, req: Any, client: Any, addr: Any, exc: BaseException) -> None:
        """Gunicorn's, answering with ``write_json_error``, which it is told the request and metrics of."""
        _failing.req = req
        _failing.metrics = self.admission.metrics if self.admission is not None else None
        _failing.exc = exc
        try:
            super().handle_error(req, client, addr, exc)
        finally:
            _failing.req = _failing.metrics = _failing.exc = None

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
        if parser is not None and _owes_body(parser):
            return False  # what arrives is the rest of the last request's body, not a request
        sock = conn.sock
        encrypted = isinstance(sock, ssl.SSLSocket)
        if self.cfg.is_ssl and (not encrypted or parser is None):
            return False  # a new connection: its handshake (and role check) is a pool thread's
        if encrypted:
            data = _read_tls(sock)  # read, not peeked: what is not answered here goes back to the parser
            if not data:
                return False
        else:
            try:
                data = sock.recv(PEEK, _PEEK_NOW)
            except OSError:
                return False
        read = self._read(data)
        answer = None
        if read is not None and not (encrypted and read[3] != len(data)):  # TLS: exactly one request
            method, target, headers, length, body = read
            try:
                answer = admission.early(method.decode("latin-1"), target.decode("latin-1"), headers, body)
            except Exception:  # a bug in a shortcut must cost this request a pool thread, never the worker
                log.exception("an answer from the event loop failed; the request goes to a pool thread")
                answer = None
        if answer is None:
            if encrypted:
                parser.unreader.unread(data)
            return False
        if encrypted:
            length = 0  # already read off the connection
        with self._lock:
            if conn.initialized:
                try:
                    self._keep.remove(conn)
                except ValueError:  # a keep-alive timeout closed it meanwhile
                    if isinstance(answer, Deferred):
                        answer.cancel()
                    return True
            if isinstance(answer, Deferred):
                self.poller.unregister(sock)  # it waits for its answer out of the poller
        if isinstance(answer, Deferred):
            self._answer_later(conn, answer, length, asks_to_close(headers))
        else:
            self._answer_now(conn, answer, length, asks_to_close(headers))
        return True

    def _answer_later(self, conn: TConn, answer: Deferred, length: int, closing: bool) -> None:
        """Take the request off ``conn`` (out of the poller) and start the work of its answer, which
        ``_deliver`` sends from the thread that finishes it."""
        try:
            _take(conn.sock, length)
        except OSError:
            answer.cancel()
            self._done(conn, True)
            return
        conn.initialized = True  # so that the next readable event takes it out of _keep first
        with self._lock:
            self._deferred += 1
        try:
            answer.start(partial(self._deliver, conn, closing))
        except Exception:  # its request is taken off the connection already: close it, keep the worker
            log.exception("a deferred answer could not start; closing its connection")
            with self._lock:
                self._deferred -= 1
                if not self._deferred and self._drained is not None:
                    self._drained.notify_all()
            self._done(conn, True)

    def _answer_now(self, conn: TConn, answer: bytes, length: int, closing: bool) -> None:
        """Take the request (``length`` bytes) off ``conn`` and send ``answer``, in the event loop,
        and keep the connection for its next request (or close it). Its socket stays registered
        with the poller throughout: unregistering it and registering it again, as a pool thread's
        turn needs, cost two ``epoll_ctl`` calls and the selector's bookkeeping (~5 us, a tenth of
        a cache hit). Only its place among the kept-alive moves, to the back, with a new timeout."""
        sock = conn.sock
        closing = closing or not self.alive  # a stopping worker keeps nothing
        try:
            _take(sock, length)
            sock.sendall(said_closing(answer) if closing else answer)  # a few hundred bytes: no wait
        except OSError:
            closing = True
        with self._lock:
            if not closing:
                conn.initialized = True  # so that the next readable event takes it out of _keep first
                conn.set_timeout()
                self._keep.append(conn)
                return
            with contextlib.suppress(ValueError, KeyError, OSError):  # the poller closed: the worker stopped
                self.poller.unregister(sock)
            self.nr_conns -= 1
        conn.close()

    def _deliver(self, conn: TConn, closing: bool, answer: bytes) -> None:
        """Send a deferred ``answer`` on ``conn`` and give the connection back to the poller for its
        next request (or close it); the count of deferred answers goes down. Any thread."""
        closing = closing or not self.alive  # ``_done`` closes it then: a stopping worker keeps nothing
        if closing:
            answer = said_closing(answer)
        try:
            conn.sock.sendall(answer)  # a few hundred bytes into an idle socket's buffer
        except OSError:
            closing = True
        self._done(conn, closing)
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
