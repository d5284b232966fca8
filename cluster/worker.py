"""Gunicorn's threaded worker, answering from its event loop what needs no thread: a refusal, a cache hit.

Under a surge most requests are refused (``cluster/admission.py``). Refused in the WSGI middleware,
each still cost what Gunicorn spends on any request: the hand-off of its connection from the
worker's event loop to a pool thread, the parse of its request into a WSGI environ, the answer's
headers, and the trip back; 374 us of the worker's CPU, against 34 us here
(``experiments/refusal.py``). A cached lookup, a few microseconds of work, paid the same, and under
load waited for the worker's GIL at each hand-off between threads.

So the event loop looks at each request that arrives (``MSG_PEEK``: nothing is read unless it is
answered here) while the app could answer one at once: while one of its classes is at its cap, or
always if it has a shortcut (the frontend's cached lookups, ``cluster/web.py`` ``Edge.early``). A
complete request that ``Admission.early`` answers is read off the socket and answered here, and its
connection goes back to waiting for the next request; anything else (a class with room, a cache
miss, control traffic, a request not yet wholly arrived, a chunked body, a malformed or expired
deadline header, bytes the parser already holds) goes to a pool thread as before, so the
middleware and the app stay the authority and this is only a cheaper way to give their answers.
"""

from __future__ import annotations

import re
import selectors
import socket
from functools import partial
from typing import Any

from gunicorn.workers.gthread import TConn, ThreadWorker

from cluster.admission import Admission

#: The most of a request the event loop looks at: refusals are small requests (a buy is ~300 bytes).
PEEK = 8192
#: What Gunicorn's parser accepts without a word (RFC 9110 tokens for the method and header names,
#: header values without control bytes): anything else is left to it, so that a request it would
#: refuse with 400 is never answered here.
_METHOD = re.compile(rb"[A-Z]{3,20}")
_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def _request_head(data: bytes) -> tuple[bytes, bytes, dict[bytes, bytes], int] | None:
    """``(method, target, headers, length)`` of the first request in ``data`` if it has wholly
    arrived (its body too) and is plain, well-formed HTTP/1.1 with a ``Content-Length`` body or
    none, each header named once; else None (Gunicorn's parser then judges it)."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = data[:end].split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[2] != b"HTTP/1.1" or not _METHOD.fullmatch(parts[0]) or _BAD_VALUE.search(parts[1]):
        return None
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _NAME.fullmatch(name) or _BAD_VALUE.search(value):
            return None
        name = name.lower()
        if name in headers:
            return None
        headers[name] = value.strip(b" \t")
    if b"transfer-encoding" in headers:
        return None
    raw = headers.get(b"content-length", b"0")
    if not raw.isdigit():
        return None
    length = end + 4 + int(raw)
    if length > len(data):
        return None
    return parts[0], parts[1], headers, length


class AdmissionWorker(ThreadWorker):
    """``gthread`` with the answers that need no thread given by the event loop (module docstring)."""

    admission: Admission | None = None

    def load_wsgi(self) -> None:
        super().load_wsgi()
        found = getattr(self.wsgi, "wsgi_app", None)  # a Flask app made by cluster.web.create_base_app
        self.admission = found if isinstance(found, Admission) else None

    def on_client_socket_readable(self, conn: TConn, client: Any) -> None:
        admission = self.admission
        if admission is None or not admission.answers_early() or not self._answered_early(conn, admission):
            super().on_client_socket_readable(conn, client)

    def _answered_early(self, conn: TConn, admission: Admission) -> bool:
        """Answer the request waiting on ``conn`` here if ``admission.early`` can; True if so."""
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
        answer = admission.early(method.decode("latin-1"), target.decode("latin-1"), headers)
        if answer is None:
            return False
        with self._lock:
            self.poller.unregister(conn.sock)
            if conn.initialized:
                try:
                    self._keep.remove(conn)
                except ValueError:
                    return True  # a keep-alive timeout closed it meanwhile
        closing = headers.get(b"connection", b"").lower() == b"close"
        try:
            got = 0
            while got < length:  # the bytes are there (peeked): this does not block
                chunk = conn.sock.recv(length - got, socket.MSG_DONTWAIT)
                if not chunk:
                    raise ConnectionError("closed while being read")
                got += len(chunk)
            conn.sock.sendall(answer)  # a few hundred bytes into an idle socket's buffer
        except OSError:
            closing = True
        if closing or not self.alive:
            self.nr_conns -= 1
            conn.close()
            return True
        conn.initialized = True  # so that the next readable event takes it out of _keep first
        conn.set_timeout()
        with self._lock:
            self._keep.append(conn)
            self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.on_client_socket_readable, conn))
        return True
