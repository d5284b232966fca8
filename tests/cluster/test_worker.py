"""The Gunicorn worker's early refusal (pygmy/cluster/worker.py), against a real Gunicorn: while a class is
full, a complete request of it is answered 503 from the event loop and its connection stays open
for the next; everything the event loop cannot judge still reaches the middleware, which answers
as before."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from harness import http_answer

from pygmy.cluster.worker import _Reader, _request_head, asks_to_close, said_closing
from pygmy.experiments.refusal import serve_gated


@pytest.fixture
def full_writes(tmp_path: Path) -> Iterator[tuple[str, int, Path]]:
    """A one-worker server whose single write place is held until ``release`` is touched."""
    with serve_gated(tmp_path) as (port, _, release):
        yield "127.0.0.1", port, release


def buy_request(extra: str = "", body: bytes = b"{}") -> bytes:
    return (f"POST /buy HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def test_a_full_class_is_refused_by_the_event_loop_and_the_connection_kept(full_writes: tuple[str, int, Path]) -> None:
    host, port, release = full_writes
    with socket.create_connection((host, port), timeout=5) as sock:
        # In one segment, as a request arrives whole (http.client sends its body in a second one,
        # which the event loop may see missing: that case is the next test's).
        sock.sendall(buy_request())
        status, headers, body, rest = http_answer(sock)
        error = json.loads(body)["error"]
        assert status == 503 and headers["retry-after"] == "1" and rest == b""
        assert error["code"] == 503 and error["overloaded"] is True
        # Gunicorn names itself in every answer it writes; the event loop's refusal is ours alone.
        assert "server" not in headers, "refused by a pool thread, not by the event loop"
        sock.sendall(b"GET /read HTTP/1.1\r\nHost: t\r\n\r\n")  # the same connection, a class with room
        status, _, body, _ = http_answer(sock)
        assert status == 200 and json.loads(body) == {"read": True}
        # A malformed deadline is the middleware's to refuse, with its 400.
        sock.sendall(buy_request("X-Request-Timeout-Ms: soon\r\n"))
        status, _, body, _ = http_answer(sock)
        assert status == 400 and "X-Request-Timeout-Ms" in json.loads(body)["error"]["message"]
    release.touch()
    deadline = time.monotonic() + 10
    while (r := requests.post(f"http://{host}:{port}/buy", json={}, timeout=5)).status_code == 503:
        assert time.monotonic() < deadline, "the write class never had room again"
        time.sleep(0.05)
    assert r.status_code == 200 and r.json() == {"bought": True}


def test_pipelined_partial_and_closing_requests_are_each_answered_once(full_writes: tuple[str, int, Path]) -> None:
    host, port, _ = full_writes
    with socket.create_connection((host, port), timeout=5) as sock:
        # Two requests in one segment: both refused, in order, nothing left over.
        sock.sendall(buy_request() + buy_request('X-Request-Id: second\r\n'))
        first = http_answer(sock)
        assert first[0] == 503
        second = http_answer(sock, first[3])
        assert second[0] == 503 and second[3] == b""
        # A body still on its way is not waited for by the event loop; the middleware refuses it.
        whole = buy_request(body=b'{"quantity": 1}')
        sock.sendall(whole[:-5])
        time.sleep(0.3)
        sock.sendall(whole[-5:])
        status, headers, _, rest = http_answer(sock)
        assert status == 503 and headers.get("server", "").startswith("gunicorn") and rest == b""
        # And the connection still serves.
        sock.sendall(b"GET /read HTTP/1.1\r\nHost: t\r\n\r\n")
        assert http_answer(sock)[0] == 200
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(buy_request("Connection: close\r\n"))
        status, headers, _, rest = http_answer(sock)
        assert status == 503 and rest == b""
        assert headers.get("connection") == "close", "the answer did not say the connection closes"
        assert "server" not in headers, "refused by a pool thread, not by the event loop"
        assert sock.recv(100) == b"", "a refused request that asked to close left its connection open"


def test_a_body_left_unread_by_an_answer_is_never_taken_for_a_request(full_writes: tuple[str, int, Path]) -> None:
    """A pool thread answers a request (here the middleware's refusal) before its body came; the body, when it comes,
    is the parser's to drain, not a request for the event loop, however much it looks like one (a
    refused buy, here): were it answered, the request after it would be drained as its body."""
    host, port, _ = full_writes
    smuggled = buy_request(body=b"{}")
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(f"POST /nope HTTP/1.1\r\nHost: t\r\nContent-Length: {len(smuggled)}\r\n\r\n".encode())
        status, headers, _, rest = http_answer(sock)
        assert status == 503 and headers.get("server", "").startswith("gunicorn") and rest == b""
        sock.sendall(smuggled)  # the refused request's body
        time.sleep(0.3)  # the event loop has seen it by now
        sock.sendall(b"GET /read HTTP/1.1\r\nHost: t\r\n\r\n")
        status, _, body, rest = http_answer(sock)
        assert (status, json.loads(body), rest) == (200, {"read": True}, b""), "the body was answered as a request"


@pytest.mark.parametrize(("head", "status"), [
    (b"GET /" + b"a" * 64 * 1024, 414),  # a request line with no end in sight
    (b"GET /read HTTP/1.1\r\n" + b"X-Pad: p\r\n" * 12_000, 431),  # headers with no end in sight
])
def test_a_request_head_that_never_ends_is_refused_once_past_the_limits(
        full_writes: tuple[str, int, Path], head: bytes, status: int) -> None:
    """Gunicorn is told no limit on the request line and 32 MB of headers (so that the app's own
    414 and 431 answer in JSON); it buffers either whole, copying the buffer at each read. The
    worker reads no more than a little past the app's limits, and answers as the app would."""
    host, port, _ = full_writes
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(head)  # and nothing more: no end of line, or of headers
        got, headers, body, _ = http_answer(sock)
    assert got == status and json.loads(body)["error"]["code"] == status, body
    assert headers.get("connection") == "close"


HIT = b"GET /hit HTTP/1.1\r\nHost: t\r\n\r\n"  # the app's shortcut: answered by the event loop when it takes it


def assert_hit_from_the_event_loop(host: str, port: int) -> None:
    """A cache hit on a new connection is answered, and by the event loop (no ``Server`` header):
    the worker still serves, and its parser still takes a plain request."""
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(HIT)
        status, headers, body, rest = http_answer(sock)
    assert status == 200 and json.loads(body)["title"] == "a cached book" and rest == b""
    assert "server" not in headers, "a plain cache hit went to a pool thread"


def test_pipelined_requests_are_each_judged_by_their_own_method(full_writes: tuple[str, int, Path]) -> None:
    """Each of two requests in one segment is judged as what it is. The method was once read after
    the whole segment, the second request's: a hit followed by a buy was refused as a write, and a
    buy followed by a hit was let through as a read (to be refused by a pool thread, with the hit
    behind it left unanswered: gthread answers no request already read off the socket until more
    bytes come)."""
    host, port, _ = full_writes
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(HIT + buy_request())
        status, headers, body, rest = http_answer(sock)
        assert status == 200 and json.loads(body)["title"] == "a cached book", f"the hit got {status}"
        assert "server" not in headers
        status, headers, body, rest = http_answer(sock, rest)
        assert status == 503 and json.loads(body)["error"]["overloaded"] is True and rest == b""
        assert "server" not in headers, "refused by a pool thread, not by the event loop"
        sock.sendall(buy_request() + HIT)
        status, headers, _, rest = http_answer(sock)
        assert status == 503 and "server" not in headers, "the buy was not refused by the event loop"
        status, headers, body, rest = http_answer(sock, rest)
        assert status == 200 and json.loads(body)["title"] == "a cached book" and rest == b""
        assert "server" not in headers


def test_http_1_0_is_gunicorns_and_the_http_1_1_after_it_the_event_loops(full_writes: tuple[str, int, Path]) -> None:
    host, port, _ = full_writes
    http10 = b"GET /hit HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
    with socket.create_connection((host, port), timeout=5) as sock:
        # Alone: Gunicorn answers it (as HTTP/1.0 with keep-alive), and the next request on the same
        # connection, plain HTTP/1.1, is the event loop's again.
        sock.sendall(http10)
        status, headers, _, rest = http_answer(sock)
        assert status == 200 and rest == b"" and headers.get("connection") == "keep-alive"
        assert headers.get("server", "").startswith("gunicorn"), "HTTP/1.0 answered by the event loop"
        sock.sendall(HIT)
        status, headers, _, rest = http_answer(sock)
        assert status == 200 and "server" not in headers and rest == b""
    with socket.create_connection((host, port), timeout=5) as sock:
        # Followed by HTTP/1.1 in one segment: the version was once read after the whole segment,
        # the second request's, and the HTTP/1.0 one was answered by the event loop as HTTP/1.1.
        sock.sendall(http10 + HIT)
        status, headers, _, _ = http_answer(sock)
        assert status == 200
        assert headers.get("server", "").startswith("gunicorn"), "HTTP/1.0 answered by the event loop"


@pytest.mark.parametrize("request_line", [
    b"\r\nGET /hit HTTP/1.1",    # an empty line first (llhttp skips it; Gunicorn does not)
    b"GET  /hit HTTP/1.1",        # two spaces after the method (llhttp takes runs of them)
    b"GET /hit  HTTP/1.1",        # and before the version
])
def test_a_request_line_gunicorn_refuses_is_refused_with_400(full_writes: tuple[str, int, Path],
                                                             request_line: bytes) -> None:
    host, port, _ = full_writes
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(request_line + b"\r\nHost: t\r\n\r\n")
        status, headers, body, rest = http_answer(sock)
        assert status == 400, f"{request_line!r} was answered {status}, not refused as Gunicorn refuses it"
        assert json.loads(body)["error"]["message"].startswith("Invalid")  # Gunicorn's reason, as JSON
        assert headers.get("connection") == "close" and rest == b"" and sock.recv(100) == b""
    assert_hit_from_the_event_loop(host, port)  # and the parser was not left broken by it


@pytest.mark.parametrize("data", [
    b"GET /read HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    b"CONNECT t:443 HTTP/1.1\r\nHost: t:443\r\n\r\n",
])
def test_upgrade_and_connect_go_to_gunicorn_and_the_worker_serves_on(full_writes: tuple[str, int, Path],
                                                                     data: bytes) -> None:
    """httptools raises HttpParserUpgrade for these, which is not an HttpParserError: once uncaught,
    it stopped the event loop, and every later request waited for an answer that never came."""
    host, port, _ = full_writes
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(data)
        status, headers, _, _ = http_answer(sock)  # whatever Gunicorn and the app make of it
        assert 200 <= status < 600 and headers.get("server", "").startswith("gunicorn")
    assert_hit_from_the_event_loop(host, port)


def test_the_event_loops_parser_serves_on_after_a_close_an_error_and_a_partial_request(
        full_writes: tuple[str, int, Path]) -> None:
    """The event loop keeps one parser from request to request; whatever leaves it unable to take a
    new request as new (a request that closes its connection, an error, a request not wholly
    there) must not leave the next connection's requests to Gunicorn."""
    host, port, _ = full_writes
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(b"GET /hit HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        status, headers, _, rest = http_answer(sock)
        assert status == 200 and "server" not in headers and headers.get("connection") == "close"
        assert rest == b"" and sock.recv(100) == b""
    assert_hit_from_the_event_loop(host, port)
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(b"GET /hit HTTP/1.1\r\nX-Nul: a\x00b\r\n\r\n")
        assert http_answer(sock)[0] == 400
    assert_hit_from_the_event_loop(host, port)
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(HIT[:-2])  # the headers not yet ended: the event loop leaves it
        time.sleep(0.3)
        sock.sendall(HIT[-2:])
        status, _, _, _ = http_answer(sock)
        assert status == 200
        sock.sendall(HIT)  # the same connection's next request
        status, headers, _, _ = http_answer(sock)
        assert status == 200 and "server" not in headers
    assert_hit_from_the_event_loop(host, port)


PLAIN = b"GET /lookup/1?x=2 HTTP/1.1\r\nHost: t\r\n\r\n"


@pytest.mark.parametrize("before", [
    PLAIN,                                                            # kept: llhttp waits as new
    buy_request(),
    b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",      # llhttp takes nothing after it
    b"GET / HTTP/1.0\r\n\r\n",                                        # nor after HTTP/1.0 without keep-alive
    b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: t\r\n",                                 # unfinished: it would go on with the next
    buy_request()[:-1],
    b"GET / HTTP/1.1\r\n\r\nGET /b HT",                               # a pipelined request begun
    PLAIN + PLAIN,
    b"GET / HTTP/1.1\r\nX-Nul: a\x00b\r\n\r\n",                      # an error: llhttp stops for good
    b"GET / HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    b"CONNECT t:443 HTTP/1.1\r\nHost: t\r\n\r\n",
    b"\r\nGET / HTTP/1.1\r\n\r\n",
])
def test_one_reader_reads_each_next_request_as_new(before: bytes) -> None:
    reader = _Reader()
    reader.read(before)
    for _ in range(2):
        assert reader.read(PLAIN) == (b"GET", b"/lookup/1?x=2", {b"host": b"t"}, len(PLAIN), b"")
        buy = buy_request(body=b'{"n": 1}')
        assert reader.read(buy) == (b"POST", b"/buy", {b"host": b"t", b"content-type": b"application/json",
                                                      b"content-length": b"8"}, len(buy), b'{"n": 1}')


@pytest.mark.parametrize(("data", "expected"), [
    (buy_request(), ("POST", "/buy", 84)),
    (b"GET /books/7?x=1 HTTP/1.1\r\nHost: t\r\n\r\nGET", ("GET", "/books/7?x=1", 38)),
    (buy_request()[:-1], None),                                    # the body has not wholly arrived
    (b"GET / HTTP/1.1\r\nHost: t\r\n", None),                      # nor the headers
    (b"GET / HTTP/1.0\r\n\r\n", None),                             # HTTP/1.0: left to Gunicorn
    (b"POST /buy HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", None),
    (b"POST /buy HTTP/1.1\r\nContent-Length: -1\r\n\r\n", None),
    (b"POST /buy HTTP/1.1\r\nno colon\r\n\r\n", None),
    # What Gunicorn refuses with 400 is never answered by the event loop (the lookup of a cached book
    # with a NUL in a header was answered 200 here).
    (b"GET /lookup/1 HTTP/1.1\r\nX-Nul: a\x00b\r\n\r\n", None),
    (b"GET /lookup/1 HTTP/1.1\r\nBad Header Name: x\r\n\r\n", None),
    (b"GET /lookup/1 HTTP/1.1\r\nHost : t\r\n\r\n", None),          # a space before the colon
    (b"GET /lookup/1 HTTP/1.1\r\nX-A: a\nb\r\n\r\n", None),        # a bare line feed
    (b"get /lookup/1 HTTP/1.1\r\n\r\n", None),                      # a method Gunicorn refuses
    (b"GET /lookup/\x001 HTTP/1.1\r\n\r\n", None),
    (b"POST /buy HTTP/1.1\r\nContent-Length: 0\r\nContent-Length: 5\r\n\r\nhello", None),
    (b"GET /lookup/1 HTTP/1.1\r\nX-Tab:\ta\tb \r\n\r\n", ("GET", "/lookup/1", 39)),
    # Pipelined: the first request is whole; what follows is judged on its own turn.
    (b"GET /a HTTP/1.1\r\nHost: t\r\n\r\nGET /b HTTP/1.1\r\nHost: u\r\n\r\n", ("GET", "/a", 28)),
    (b"GET /a HTTP/1.1\r\n\r\nget /b HTTP/1.1\r\n\r\n", ("GET", "/a", 19)),
])
def test_request_head(data: bytes, expected: tuple[str, str, int] | None) -> None:
    head = _request_head(data)
    if expected is None:
        assert head is None
    else:
        assert head is not None
        method, target, headers, length = head
        assert (method.decode(), target.decode(), length) == expected
        assert b"host" not in headers or headers[b"host"] == b"t"  # never a later request's


@pytest.mark.parametrize(("value", "closing"), [
    (None, False), (b"keep-alive", False), (b"close", True), (b"Close", True), (b"TE, close", True),
    (b"closed", False), (b"keep-alive,close ", True),
])
def test_a_connection_header_asks_to_close_when_it_lists_close(value: bytes | None, closing: bool) -> None:
    assert asks_to_close({} if value is None else {b"connection": value}) is closing


def test_an_answer_that_closes_says_so_after_its_status_line() -> None:
    assert said_closing(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}") == (
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}")


def requests_counted(host: str, port: int) -> dict[tuple[str, str], float]:
    """``pygmy_http_requests_total`` by (route, status), from the server's ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"http://{host}:{port}/metrics", timeout=5).text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "pygmy_http_requests":
            for s in family.samples:
                if s.name.endswith("_total"):
                    key = (s.labels["route"], s.labels["status"])
                    out[key] = out.get(key, 0) + s.value
    return out


def test_every_answer_has_a_request_id_and_is_counted(full_writes: tuple[str, int, Path]) -> None:
    """Refusals of a full class (by the event loop and by the middleware), a spent budget, a
    malformed deadline and Gunicorn's own 400: each answer carries the caller's id (or a new one)
    and is counted in ``pygmy_http_requests_total`` (routes ``admission`` and ``server``)."""
    host, port, _ = full_writes
    before = requests_counted(host, port)
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(buy_request("X-Request-Id: shed-1\r\n"))         # the event loop's 503
        status, headers, _, _ = http_answer(sock)
        assert status == 503 and "server" not in headers and headers["x-request-id"] == "shed-1"
        whole = buy_request("X-Request-Id: shed-2\r\n", body=b'{"quantity": 1}')
        sock.sendall(whole[:-5])                                       # the middleware's 503
        time.sleep(0.3)
        sock.sendall(whole[-5:])
        status, headers, _, _ = http_answer(sock)
        assert status == 503 and headers.get("server", "").startswith("gunicorn")
        assert headers["x-request-id"] == "shed-2"
        sock.sendall(b"GET /read HTTP/1.1\r\nHost: t\r\nX-Request-Timeout-Ms: 0\r\n\r\n")  # spent: 504
        status, headers, _, _ = http_answer(sock)
        assert status == 504 and headers["x-request-id"]
        sock.sendall(b"GET /read HTTP/1.1\r\nHost: t\r\nX-Request-Timeout-Ms: soon\r\n\r\n")  # malformed: 400
        status, headers, _, _ = http_answer(sock)
        assert status == 400 and headers["x-request-id"]
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(b"GET  /read HTTP/1.1\r\nHost: t\r\n\r\n")  # Gunicorn's parser refuses it
        status, headers, body, _ = http_answer(sock)
        assert status == 400 and headers["x-request-id"] and json.loads(body)["error"]["code"] == 400
    after = requests_counted(host, port)

    def more(route: str, status: str) -> float:
        return after.get((route, status), 0) - before.get((route, status), 0)

    assert more("admission", "503") == 2 and more("admission", "504") == 1 and more("admission", "400") == 1
    assert more("server", "400") == 1


def test_pipelined_requests_behind_a_pool_threads_answer_are_answered_in_order(
        full_writes: tuple[str, int, Path]) -> None:
    """Three reads in one segment, none of which the event loop answers (``/read`` has no shortcut):
    a pool thread's parser reads all three off the socket; the two behind the first were never
    answered (the poller waits on the socket, which is empty)."""
    host, port, _ = full_writes
    with socket.create_connection((host, port), timeout=5) as sock:
        reqs = b"".join(b"GET /read HTTP/1.1\r\nHost: t\r\nX-Request-Id: p-%d\r\n\r\n" % i for i in range(3))
        sock.sendall(reqs)
        rest = b""
        for i in range(3):
            status, headers, body, rest = http_answer(sock, rest)
            assert status == 200 and headers["x-request-id"] == f"p-{i}" and json.loads(body) == {"read": True}
        assert rest == b""
        # A hit, a miss and a hit: answered in order, whichever takes each.
        sock.sendall(HIT + b"GET /read HTTP/1.1\r\nHost: t\r\n\r\n" + HIT)
        rest = b""
        bodies = []
        for _ in range(3):
            status, _, body, rest = http_answer(sock, rest)
            assert status == 200
            bodies.append(json.loads(body))
        assert bodies[1] == {"read": True} and bodies[0] == bodies[2] != bodies[1]


def test_an_answer_from_the_event_loop_that_raises_costs_that_request_a_pool_thread_not_the_worker(
        tmp_path: Path) -> None:
    """A bug in a shortcut (such as a body nested too deep for its JSON reader) must not escape the
    event loop, which would end the worker and every connection and deferred answer on it."""
    with serve_gated(tmp_path) as (port, worker, _):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET /broken HTTP/1.1\r\nHost: t\r\n\r\n")
            status, _, _, _ = http_answer(sock)
            assert status == 500  # from a pool thread, where the shortcut raised again
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET /hit HTTP/1.1\r\nHost: t\r\n\r\n")  # and the event loop serves on
            status, headers, _, _ = http_answer(sock)
            assert status == 200 and "server" not in headers
        os.kill(worker, 0)  # the same worker process, alive


def test_a_tls_connection_that_says_nothing_after_its_handshake_holds_no_thread(tmp_path: Path) -> None:
    """Gunicorn gives a TLS connection to a pool thread for its handshake, before any request: once
    it is done the connection goes back to the poller to wait for its first request (kept alive),
    rather than hold the thread while a client that completed it says nothing."""
    import logging
    import ssl
    import threading

    from gunicorn.config import Config
    from gunicorn.workers.gthread import TConn

    from pygmy.cluster import certs, worker
    from pygmy.kit import tls

    certs.make_ca(tmp_path)
    certs.issue(tmp_path, "frontend-1", "frontend")
    identity = tls.Identity.of(tmp_path, "frontend-1")
    cfg = Config()
    cfg.set("certfile", str(tmp_path / "frontend-1.pem"))
    cfg.set("keyfile", str(tmp_path / "frontend-1-key.pem"))
    cfg.set("do_handshake_on_connect", False)
    cfg.set("ssl_context", lambda conf, default: identity.server_context(ssl.CERT_OPTIONAL))
    w = object.__new__(worker.AdmissionWorker)
    w.cfg, w.log, w.alive = cfg, logging.getLogger("test-worker"), True
    ours, theirs = socket.socketpair()
    conn = TConn(cfg, ours, ("127.0.0.1", 1), None)
    conn.init()
    client = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    client.check_hostname = False
    quiet = threading.Event()

    def silent() -> None:
        with client.wrap_socket(theirs, server_hostname="frontend-1"):  # the handshake, then nothing
            quiet.wait(10)

    threading.Thread(target=silent, daemon=True).start()
    answered: list[tuple[bool, object]] = []
    handler = threading.Thread(target=lambda: answered.append(w.handle(conn)), daemon=True)
    handler.start()
    handler.join(3)
    quiet.set()
    assert not handler.is_alive(), "the pool thread is still held by a connection that said nothing"
    assert answered and answered[0][0] is True and conn.pygmy_peer  # kept alive: back to the poller
    conn.close()


def test_the_worker_exit_hook_stops_the_app_the_peer_role_is_given_to() -> None:
    """With TLS the worker hands the app the connection's role through a wrapper; the exit hook
    must still find the app's runtime and owners through it (a plain function in their place hid
    them, and a TLS cluster's graceful stop skipped its drain, its stops and its databases' close)."""
    from types import SimpleNamespace

    from flask import Flask

    from pygmy.cluster import serve
    from pygmy.cluster.worker import _WithPeerRole
    from pygmy.kit import tls

    calls: list[str] = []
    runtime = SimpleNamespace(drain=lambda: calls.append("drain") or 0, stop=lambda: calls.append("stop"),
                              sm=SimpleNamespace(close_all=lambda: calls.append("close")))
    app = Flask("t")
    app.extensions["pygmy_runtime"] = runtime
    seen: list[object] = []
    app.wsgi_app = lambda environ, start: seen.append(environ.get(tls.PEER_ROLE)) or []  # type: ignore[method-assign]
    wrapped = _WithPeerRole(app)
    wrapped({}, lambda *a: None)
    assert seen == [None] and wrapped.extensions is app.extensions
    serve._worker_exit(None, SimpleNamespace(wsgi=wrapped, pid=-1))
    assert calls == ["drain", "stop", "close"]
