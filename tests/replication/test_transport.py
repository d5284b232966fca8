"""The framed transport on real sockets: authentication, replies, reconnection, limits, clean stop."""

from __future__ import annotations

import contextlib
import contextvars
import socket
import struct
import threading
import time
from typing import Any

import pytest

from pygmy.cluster.local import free_port, free_port_base
from pygmy.replication.transport import (
    Channel,
    FrameClient,
    FrameError,
    FrameServer,
    after_reply,
    encode,
    raft_address,
    read_frame,
)

SECRET = "s3cret"



@pytest.fixture
def echo():
    seen: list[tuple[str, Any]] = []

    def handle(peer: str, frame: Any) -> Any:
        seen.append((peer, frame))
        return {"echo": frame} if isinstance(frame, dict) and frame.get("want_reply") else None

    server = FrameServer("127.0.0.1", 0, SECRET, {"c": Channel(handle)}, name="test")
    server.start()
    try:
        yield server, seen
    finally:
        server.stop()


def wait_for(cond: Any, what: str, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def test_frames_arrive_in_order_with_the_senders_name_and_replies_come_back(echo) -> None:
    server, seen = echo
    client = FrameClient(server.address, SECRET, "alice", "c")
    for i in range(100):
        client.send({"n": i}, timeout=1)
    assert client.call({"want_reply": True, "n": 100}, timeout=1) == {"echo": {"want_reply": True, "n": 100}}
    assert [f["n"] for _, f in seen] == list(range(101)) and {p for p, _ in seen} == {"alice"}
    assert client.connects == 1  # one long-lived connection
    client.close()


def test_a_wrong_secret_is_refused_before_any_frame_is_read(echo) -> None:
    server, seen = echo
    client = FrameClient(server.address, "wrong", "mallory", "c")
    with pytest.raises(OSError):
        client.send({"n": 1}, timeout=1)  # refused at the hello: nothing is sent
    for hello in ({"hello": "mallory", "channel": "c"}, {"hello": "mallory", "secret": SECRET, "channel": "nope"}):
        with socket.create_connection(server.address, timeout=2) as s:
            s.sendall(encode(hello) + encode({"n": 1}))
            assert read_frame(s.makefile("rb"))["error"]["code"] == 403
    assert seen == []


def test_a_members_only_channel_refuses_other_names() -> None:
    got: list[Any] = []
    server = FrameServer("127.0.0.1", 0, SECRET, {"raft": Channel(lambda p, f: got.append(p), frozenset({"a"}))},
                         name="t")
    server.start()
    try:
        with pytest.raises(FrameError, match="not a member"):
            FrameClient(server.address, SECRET, "b", "raft").send(1, timeout=1)
        member = FrameClient(server.address, SECRET, "a", "raft")
        member.send(1, timeout=1)
        wait_for(lambda: got == ["a"], "the member's frame")
        member.close()
    finally:
        server.stop()


def test_an_oversized_or_garbled_frame_closes_the_connection_and_nothing_else(echo) -> None:
    server, seen = echo
    for junk in (struct.pack(">I", (1 << 30) + 1), struct.pack(">I", 3) + b"{{{"):
        with socket.create_connection(server.address, timeout=2) as s:
            s.sendall(encode({"hello": "bob", "secret": SECRET, "channel": "c"}) + junk)
            stream = s.makefile("rb")
            assert read_frame(stream) == {"ok": True}
            assert stream.read(1) == b""  # closed
    client = FrameClient(server.address, SECRET, "carol", "c")
    assert client.call({"want_reply": True}, timeout=1) == {"echo": {"want_reply": True}}
    client.close()
    assert seen == [("carol", {"want_reply": True})]


def test_a_client_reconnects_after_the_server_restarts_on_the_same_port() -> None:
    port = free_port()
    got: list[Any] = []
    server = FrameServer("127.0.0.1", port, SECRET, {"c": Channel(lambda p, f: got.append(f))}, name="a")
    server.start()
    client = FrameClient(("127.0.0.1", port), SECRET, "x", "c")
    client.send(1, timeout=1)
    wait_for(lambda: got == [1], "the first frame")
    server.stop()
    with pytest.raises(OSError):  # the first send may still be buffered; the next finds the close
        for _ in range(50):
            client.send(2, timeout=1)
            time.sleep(0.01)
    server = FrameServer("127.0.0.1", port, SECRET, {"c": Channel(lambda p, f: got.append(f))}, name="b")
    server.start()
    try:
        client.send(3, timeout=1)
        wait_for(lambda: got[-1:] == [3], "a frame after the restart")
        assert client.connects == 2
    finally:
        client.close()
        server.stop()


def test_a_call_times_out_on_a_silent_server_and_a_connect_on_nothing_fails_fast() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog) but never answers
        client = FrameClient(silent.getsockname()[:2], SECRET, "x", "c")
        # A condition, not a timing: the call gives up by its own timeout ("timed out") while the
        # silent server is still there, never closed, so nothing but the timeout could end it.
        with pytest.raises(OSError, match="timed out"):
            client.call({"want_reply": True}, timeout=0.2)
        assert silent.fileno() != -1
        client.close()
    with pytest.raises(OSError):
        FrameClient(("127.0.0.1", free_port()), SECRET, "x", "c").send(1, timeout=0.5)


def test_stop_ends_every_thread_it_started() -> None:
    before = threading.active_count()
    server = FrameServer("127.0.0.1", 0, SECRET, {"c": Channel(lambda p, f: None)}, name="t")
    server.start()
    clients = [FrameClient(server.address, SECRET, f"c{i}", "c") for i in range(3)]
    for c in clients:
        c.send({"hi": 1}, timeout=1)
    wait_for(lambda: threading.active_count() >= before + 4, "a reader per connection")
    server.stop()
    for c in clients:
        c.close()
    wait_for(lambda: threading.active_count() == before, "every thread gone")


def test_work_left_for_after_a_reply_runs_once_the_reply_is_written() -> None:
    """``after_reply`` work waits for the reply: here it waits until the client has the reply, which
    would never come if the work ran first. An error in it is logged, and the connection goes on.
    Outside a frame handler, and on another thread with a copy of the handler's context, the work
    runs at once."""
    got_reply = threading.Event()
    ran: list[str] = []
    elsewhere: list[bool] = []

    def handle(peer: str, frame: Any) -> Any:
        if frame == "fail":
            assert after_reply(lambda: 1 / 0)
            return "failed later"
        assert after_reply(lambda: ran.append("waited" if got_reply.wait(5) else "ran before the reply"))
        ctx = contextvars.copy_context()
        thread = threading.Thread(target=lambda: elsewhere.append(ctx.run(after_reply, lambda: ran.append("at once"))))
        thread.start()
        thread.join()
        return "reply"

    server = FrameServer("127.0.0.1", 0, SECRET, {"c": Channel(handle)}, name="after")
    server.start()
    client = FrameClient(server.address, SECRET, "alice", "c")
    try:
        assert client.call("first", 5) == "reply"
        got_reply.set()
        wait_for(lambda: ran == ["at once", "waited"], "the work left for after the reply")
        assert elsewhere == [False]
        assert client.call("fail", 5) == "failed later"
        got_reply.clear()
        assert client.call("again", 5) == "reply"  # the same connection: the error ended nothing
        assert client.connects == 1
        got_reply.set()
        wait_for(lambda: ran == ["at once", "waited", "at once", "waited"], "the second call's work")
    finally:
        client.close()
        server.stop()
    now: list[int] = []
    assert after_reply(lambda: now.append(1)) is False and now == [1]  # outside a handler: run at once


def test_raft_address_derives_from_the_http_url() -> None:
    assert raft_address("http://127.0.0.1:8101") == ("127.0.0.1", 8151)
    assert raft_address("http://catalog-2:8000/") == ("catalog-2", 8050)
    with pytest.raises(ValueError):
        raft_address("http://catalog-2")


def test_frame_errors_are_os_errors() -> None:
    assert issubclass(FrameError, OSError)


def test_a_channel_router_finds_the_leader_and_follows_its_name() -> None:
    """Three fake replicas on the subscribe channel: two answer 421 naming the third, which answers."""
    from pygmy.replication.router import ChannelRouter, TierUnavailable

    calls: list[str] = []

    def replica(me: str) -> Any:
        def handle(peer: str, frame: Any) -> Any:
            calls.append(me)
            if me != "t-3":
                return {"status": 421, "body": {"error": {"code": 421, "message": "no", "leader": "t-3"}}}
            return {"status": 200, "body": {"you": peer, "sent": frame}}
        return handle

    # Laid out as a tier's replicas are (frames 50 above the HTTP port), from one checked port base.
    base = free_port_base(replicas=3, frontends=0)
    ports = [base + 101 + k for k in range(3)]
    servers = [FrameServer("127.0.0.1", p + 50, SECRET, {"sub": Channel(replica(f"t-{i}"))}, name=f"t-{i}")
               for i, p in enumerate(ports, start=1)]
    for s in servers:
        s.start()
    router = ChannelRouter("t", {f"t-{i}": f"http://127.0.0.1:{p}" for i, p in enumerate(ports, start=1)},
                           SECRET, "frontend-1/7", "sub")
    try:
        reply = router.call({"x": 1}, deadline=time.monotonic() + 2)
        assert (reply.status, reply.replica, reply.body) == (200, "t-3", {"you": "frontend-1/7", "sent": {"x": 1}})
        assert calls == ["t-1", "t-3"]  # straight to the leader it named
        router.call({"x": 2}, deadline=time.monotonic() + 2)
        assert calls[-1] == "t-3" and len(calls) == 3  # the hint is kept
        servers[2].stop()
        with pytest.raises(TierUnavailable):
            router.call({"x": 3}, deadline=time.monotonic() + 0.3)
    finally:
        router.close()
        for s in servers:
            s.stop()


def test_send_nowait_never_blocks_and_keeps_frames_whole() -> None:
    """Against a peer that stops reading, ``send_nowait`` fills the kernel buffer and then refuses at
    once; the part of a frame it left behind goes out first when the peer reads again."""
    got: list[Any] = []
    gate = threading.Event()

    def slow(peer: str, frame: Any) -> None:
        gate.wait(60)
        got.append(frame["n"])

    server = FrameServer("127.0.0.1", 0, SECRET, {"c": Channel(slow)}, name="slow")
    server.start()
    client = FrameClient(server.address, SECRET, "x", "c")
    try:
        assert client.send_nowait({"n": -1}) is False  # not connected yet: the caller's thread connects
        client.send({"n": 0, "pad": ""}, timeout=1)
        accepted = []
        for n in range(1, 10_000):
            if not client.send_nowait({"n": n, "pad": "x" * 4000}):
                break
            accepted.append(n)
        # Refused once the buffers filled, and never blocked: all of that happened while the peer,
        # stuck on the first frame until the gate opens, read nothing (a blocking send would wait
        # for it, here or in the refusal).
        assert 0 < len(accepted) < 9_999 and got == [] and not gate.is_set()
        gate.set()
        client.send({"n": 10_000}, timeout=5)
        wait_for(lambda: got[-1:] == [10_000], "every frame, in order", timeout=10)
        assert got == [0, *accepted, 10_000]
    finally:
        client.close()
        server.stop()


def test_a_reply_nobody_waits_for_is_dropped_before_the_next_calls_own(echo) -> None:
    """``send_nowait(owed=True)``: the server answers, and the next ``call`` (or ``start_call``)
    reads that answer first and drops it, then returns its own; a reset forgets what was owed."""
    server, _seen = echo
    client = FrameClient(server.address, SECRET, "alice", "c")
    try:
        assert client.call({"want_reply": True, "n": 0}, timeout=1) == {"echo": {"want_reply": True, "n": 0}}
        assert client.send_nowait({"want_reply": True, "n": 1}, owed=True)
        assert client.send_nowait({"want_reply": True, "n": 2}, owed=True)
        assert client.call({"want_reply": True, "n": 3}, timeout=1, stalled=lambda: False) == {
            "echo": {"want_reply": True, "n": 3}}
        assert client.send_nowait({"want_reply": True, "n": 4}, owed=True)
        reply = client.start_call({"want_reply": True, "n": 5}, timeout=1)
        assert reply() == {"echo": {"want_reply": True, "n": 5}}
        assert client.send_nowait({"want_reply": True, "n": 6}, owed=True)
        client.close()  # the owed answer is lost with the connection, not read as the next reply
        assert client.call({"want_reply": True, "n": 7}, timeout=1) == {"echo": {"want_reply": True, "n": 7}}
        assert client.connects == 2
    finally:
        client.close()


def test_start_call_sends_now_and_holds_the_connection_until_its_reply_is_read() -> None:
    """Two servers asked at once from one thread: both frames are out before either reply is read."""
    got: list[str] = []
    answered = threading.Event()

    def slow(peer: str, frame: Any) -> Any:
        got.append(frame["to"])
        if frame["to"] == "a":
            answered.wait(5)
        return {"ok": frame["to"]}

    servers = [FrameServer("127.0.0.1", 0, SECRET, {"c": Channel(slow)}, name=n) for n in "ab"]
    clients = []
    try:
        for srv in servers:
            srv.start()
            clients.append(FrameClient(srv.address, SECRET, "x", "c"))
        replies = [c.start_call({"to": n}, timeout=5) for c, n in zip(clients, "ab", strict=True)]
        wait_for(lambda: sorted(got) == ["a", "b"], "both frames, while a's handler still waits")
        assert not clients[0]._lock.acquire(blocking=False), "the connection is the caller's until it reads"
        answered.set()
        assert [r() for r in replies] == [{"ok": "a"}, {"ok": "b"}]
        assert clients[0].call({"to": "b"}, timeout=1) == {"ok": "b"}, "given back once read"
        nobody = FrameClient(("127.0.0.1", free_port()), SECRET, "x", "c")  # nobody listens there
        with pytest.raises(OSError):
            nobody.start_call({"to": "c"}, timeout=0.5)
        assert nobody._lock.acquire(blocking=False), "a failed start gives the connection back"
    finally:
        for c in clients:
            c.close()
        for srv in servers:
            srv.stop()


def test_a_call_stops_waiting_when_its_stall_check_says_so_and_not_before() -> None:
    """A peer that never answers (as a SIGSTOPped one): the wait ends once ``stalled`` gives a reason,
    and the connection is replaced; a slow peer whose check says nothing is waited for."""
    from pygmy.replication.transport import Abandoned

    gate, slow_gate = threading.Event(), threading.Event()

    def handle(peer: str, frame: Any) -> Any:
        if frame.get("hang"):
            (slow_gate if frame["n"] == 3 else gate).wait(30)
        return {"n": frame["n"]}

    server = FrameServer("127.0.0.1", 0, SECRET, {"c": Channel(handle)}, name="hangs")
    server.start()
    client = FrameClient(server.address, SECRET, "x", "c")
    asked: list[int] = []

    def stalled() -> str | None:
        asked.append(1)
        return "someone else leads" if len(asked) >= 3 else None

    try:
        with pytest.raises(Abandoned) as info:
            client.call({"hang": True, "n": 1}, timeout=20, stalled=stalled, first_check=0.02, check_every=0.02)
        assert info.value.reason == "someone else leads" and len(asked) == 3
        assert client.call({"n": 2}, timeout=5, stalled=stalled) == {"n": 2}  # a fresh connection
        assert client.connects == 2
        asked.clear()
        threading.Timer(0.2, slow_gate.set).start()
        slow = FrameClient(server.address, SECRET, "y", "c")
        assert slow.call({"hang": True, "n": 3}, timeout=20, stalled=lambda: None, first_check=0.02, check_every=0.02) == {"n": 3}
        slow.close()
        with pytest.raises(TimeoutError):
            client.call({"hang": True, "n": 4}, timeout=0.1, stalled=lambda: None, first_check=0.02, check_every=0.02)
    finally:
        gate.set()
        client.close()
        server.stop()


def _status_server(body: dict[str, Any], port: int) -> Any:
    """A replica's /status alone, on ``port``, in a thread (stopped by ``.shutdown()``)."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Status(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", port), Status)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.mark.parametrize("old_leader_answers_status", [False, True])
def test_a_router_leaves_a_stopped_leader_for_the_one_that_took_over(
        old_leader_answers_status: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """t-1 was leader and stopped answering frames. If it answers /status no more (stopped) while t-2
    says it leads, the router asks t-2 long before its own timeout; if t-1 still says it leads in the
    newest term, it is only slow, and the router waits for it."""
    from pygmy.replication import router as rt

    monkeypatch.setattr(rt, "READ_TIMEOUT", 30.0)  # without the look, t-1 would hold the call until the deadline
    gate = threading.Event()
    calls: list[str] = []

    def replica(me: str) -> Any:
        def handle(peer: str, frame: Any) -> Any:
            calls.append(me)
            if me == "t-1":
                gate.wait(30)
            if me == "t-3":
                return {"status": 421, "body": {"error": {"code": 421, "message": "no", "leader": "t-2"}}}
            return {"status": 200, "body": {"from": me}}
        return handle

    statuses = {"t-2": {"role": "leader", "term": 5}, "t-3": {"role": "follower", "term": 5}}
    if old_leader_answers_status:
        statuses["t-1"] = {"role": "leader", "term": 6}
    # One port base for the three, laid out as a tier's replicas are (HTTP at base + 101..103, frames
    # 50 above): picked one by one, one replica's frame port could be another's HTTP port.
    base = free_port_base(replicas=3, frontends=0)
    ports = {n: base + 101 + k for k, n in enumerate(("t-1", "t-2", "t-3"))}
    # t-1 has no /status when it is stopped: nothing listens on its HTTP port.
    https = {n: _status_server(b, ports[n]) for n, b in statuses.items()}
    servers = [FrameServer("127.0.0.1", ports[n] + 50, SECRET, {"buys": Channel(replica(n))}, name=n)
               for n in ("t-1", "t-2", "t-3")]
    for s in servers:
        s.start()
    peers = {n: f"http://127.0.0.1:{ports[n]}" for n in ("t-1", "t-2", "t-3")}
    sightings = rt.Sightings()
    router = rt.ChannelRouter("t", peers, SECRET, "frontend-1/7", "buys", sightings=sightings)
    reads = rt.TierRouter("t", peers, SECRET, sightings=sightings)  # the same process's HTTP router to the tier
    router.leader_hint = "t-1"
    try:
        if old_leader_answers_status:
            threading.Timer(0.8, gate.set).start()
        reply = router.call({"x": 1}, deadline=time.monotonic() + 20)
        want = "t-1" if old_leader_answers_status else "t-2"
        assert (reply.status, reply.body, router.leader_hint) == (200, {"from": want}, want)
        assert calls[0] == "t-1" and (old_leader_answers_status or not gate.is_set())
        # Reads of the same process ask a stopped replica last, until it answers again.
        assert sightings.silent("t-1") is not old_leader_answers_status
        if not old_leader_answers_status:
            assert [reads._read_order()[-1] for _ in range(3)] == ["t-1"] * 3  # every rotation
    finally:
        gate.set()
        reads.close()
        router.close()
        for s in servers:
            s.stop()
        for h in https.values():
            h.shutdown()
            h.server_close()


def test_a_link_slower_than_the_connect_budget_still_connects() -> None:
    """The welcome comes 0.3 s after the hello (a link of 150 ms each way): a try runs out of its
    0.2 s budget, the next ones have twice as much until one connects; after that the budget stays
    above what opening took, so reconnecting costs no failed try. Before, every try ran out: a link
    like this never reconnected."""
    welcome_after = 0.3
    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.1)
        conns: list[socket.socket] = []

        def welcome(conn: socket.socket) -> None:
            read_frame(conn.makefile("rb"))  # the hello
            time.sleep(welcome_after)
            with contextlib.suppress(OSError):  # the client gave up: it closed before the welcome
                conn.sendall(encode({"ok": True}))

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                conns.append(conn)
                threading.Thread(target=welcome, args=(conn,), daemon=True).start()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        client = FrameClient(server.getsockname()[:2], SECRET, "x", "c", connect_timeout=0.2)
        try:
            failures = []
            for n in range(6):
                try:
                    client.send({"n": n}, timeout=1)
                    break
                except FrameError as exc:
                    failures.append(str(exc))
            assert failures and "no welcome within 0.20 s" in failures[0]
            assert client.connects == 1 and client.connect_budget > welcome_after
            client.close()
            client.send({"n": 9}, timeout=1)
            assert client.connects == 2
        finally:
            client.close()
            stop.set()
            thread.join(5)
            for conn in conns:
                conn.close()


class _FailingOnce:
    """A listening socket whose next ``accept`` fails as when the process is out of descriptors."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock, self.failed = sock, False

    def accept(self) -> Any:
        if not self.failed:
            self.failed = True
            raise OSError(24, "Too many open files")
        return self._sock.accept()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def test_a_failed_accept_costs_that_connection_not_the_listener() -> None:
    server = FrameServer("127.0.0.1", 0, SECRET, {"c": Channel(lambda p, f: {"echo": f})}, name="emfile")
    flaky = _FailingOnce(server._sock)
    server._sock = flaky  # type: ignore[assignment]
    server.start()
    client = FrameClient(server.address, SECRET, "x", "c", connect_timeout=0.5)
    try:
        assert client.call({"n": 1}, timeout=2) == {"echo": {"n": 1}}
        assert flaky.failed and server._thread.is_alive()
    finally:
        client.close()
        server.stop()
    assert not server._thread.is_alive()


def test_a_call_interrupted_by_its_stall_check_leaves_no_reply_for_the_next() -> None:
    """``stalled`` may raise anything (a malformed status it looked at): the connection is dropped
    with the reply still owed to it, so the next call reads its own reply, not that one."""
    first = threading.Event()

    def handle(peer: str, frame: Any) -> Any:
        if frame["i"] == 1:
            first.wait(5)  # answered only once the caller has given up on it
        return {"i": frame["i"]}

    def broken() -> Any:
        first.set()
        time.sleep(0.1)  # the reply is on its way
        raise RuntimeError("a malformed status")

    server = FrameServer("127.0.0.1", 0, SECRET, {"c": Channel(handle)}, name="late")
    server.start()
    client = FrameClient(server.address, SECRET, "x", "c")
    try:
        with pytest.raises(RuntimeError):
            client.call({"i": 1}, timeout=2, stalled=broken, first_check=0.05)
        assert client.call({"i": 2}, timeout=2) == {"i": 2}
    finally:
        client.close()
        server.stop()


def test_a_hello_must_be_small_and_whole_within_the_hello_timeout(echo, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the secret is checked, nobody can make the server read a large frame or hold a thread
    by sending the hello a byte at a time; a channel name that is not a string is refused."""
    import pygmy.replication.transport as transport

    server, seen = echo
    with socket.create_connection(server.address, timeout=2) as s:
        s.sendall(struct.pack(">I", transport.MAX_HELLO + 1))
        assert s.makefile("rb").read(1) == b""  # closed without reading on
    monkeypatch.setattr(transport, "HELLO_TIMEOUT", 0.4)
    hello = encode({"hello": "slow", "secret": SECRET, "channel": "c"})
    with socket.create_connection(server.address, timeout=2) as s:
        started = time.monotonic()
        with contextlib.suppress(OSError):
            for byte in hello[:-1]:  # each byte well inside the per-read timeout
                s.sendall(bytes([byte]))
                time.sleep(0.05)
        assert s.makefile("rb").read(1) == b""
        assert time.monotonic() - started < 2.0  # closed at 0.4 s, not after len(hello) x 0.05 s
    with socket.create_connection(server.address, timeout=2) as s:
        s.sendall(encode({"hello": "x", "secret": SECRET, "channel": ["c"]}))
        assert read_frame(s.makefile("rb"))["error"]["code"] == 403
    assert seen == []


def test_both_ends_of_a_connection_find_a_vanished_peer_by_keepalive(echo) -> None:
    server, _ = echo
    client = FrameClient(server.address, SECRET, "x", "c")
    try:
        assert client.call({"want_reply": True}, timeout=2)
        assert client._sock is not None and client._sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        with server._lock:
            (accepted,) = server._conns
        assert accepted.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
    finally:
        client.close()


def test_a_connection_opened_for_a_call_takes_no_longer_than_the_caller_has_left() -> None:
    """A peer that takes the connection and never welcomes it: the call gives up when its caller's
    time is up (``connect_within``), not after the whole connect budget, and the budget learned for
    the link stays as it was (it was the caller's time that ran out, not the link's)."""
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    taking = threading.Thread(target=lambda: held.append(silent.accept()[0]), daemon=True)
    taking.start()
    client = FrameClient(silent.getsockname()[:2], SECRET, "x", "c", connect_timeout=0.2)
    client.connect_budget = 5.0  # as a slow link taught it
    try:
        started = time.monotonic()
        with pytest.raises(OSError):
            client.call({"n": 1}, timeout=5.0, connect_within=0.3)
        assert time.monotonic() - started < 3.0, "waited out the connect budget, past the caller's time"
        assert client.connect_budget == 5.0
    finally:
        client.close()
        taking.join(5)
        for s in held:
            s.close()
        silent.close()


def test_past_the_caps_the_oldest_silent_connection_makes_room_and_a_peer_always_gets_in(
        echo, monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections that have not said hello hold a thread each: past a cap per address, the oldest
    of that address is closed for the newcomer; past the cap in all, the oldest of the address that
    holds the most. So a flood costs a bounded number of threads, and a peer (which says its hello
    at once, and holds few) is not locked out by it, even from the flooding address."""
    import pygmy.replication.transport as transport

    server, seen = echo
    monkeypatch.setattr(transport, "MAX_UNWELCOMED_PER_HOST", 3)
    monkeypatch.setattr(transport, "MAX_UNWELCOMED", 5)

    def connect(source: str) -> socket.socket:
        return socket.create_connection(server.address, timeout=2, source_address=(source, 0))

    def welcomed(s: socket.socket) -> bool:
        s.sendall(encode({"hello": "x", "secret": SECRET, "channel": "c"}))
        s.sendall(encode({"want_reply": True, "n": 1}))
        stream = s.makefile("rb")
        welcome = read_frame(stream)
        return isinstance(welcome, dict) and "error" not in welcome and read_frame(stream) == {
            "echo": {"want_reply": True, "n": 1}}

    def closed_at_once(s: socket.socket) -> bool:
        started = time.monotonic()
        with contextlib.suppress(ConnectionResetError):
            if s.recv(1) != b"":
                return False
        return time.monotonic() - started < transport.HELLO_TIMEOUT / 2

    def still_open(s: socket.socket) -> bool:
        s.setblocking(False)
        try:
            return s.recv(1) != b""
        except BlockingIOError:
            return True
        except ConnectionResetError:
            return False
        finally:
            s.settimeout(2)

    def waiting() -> int:
        with server._lock:
            return len(server._unwelcomed)

    with contextlib.ExitStack() as stack:
        first = [stack.enter_context(connect("127.0.0.1")) for _ in range(3)]
        wait_for(lambda: waiting() == 3, "three silent connections held")
        with connect("127.0.0.1") as peer:  # its address is full of silent ones: the oldest makes room
            assert welcomed(peer)
        assert closed_at_once(first[0]) and still_open(first[1]) and still_open(first[2])
        more = [stack.enter_context(connect("127.0.0.2")) for _ in range(3)]
        wait_for(lambda: waiting() == 5, "five silent connections held")
        # The cap in all: the oldest of the address that holds the most makes room (not first[1],
        # older, from an address holding fewer: as a peer's would be).
        last = stack.enter_context(connect("127.0.0.3"))
        assert closed_at_once(more[0]) and still_open(first[1]) and still_open(first[2]) and still_open(last)
        assert all(still_open(s) for s in more[1:]) and server.over_cap == 2
        for s in [*first, *more, last]:
            s.close()
        wait_for(lambda: waiting() == 0 and not server._unwelcomed_from, "the silent connections' places given back")
        with connect("127.0.0.1") as again:
            assert welcomed(again)
    assert [frame["n"] for _, frame in seen] == [1, 1]
