"""Framed transport between services: long-lived TCP connections carrying length-prefixed JSON.

Why not HTTP: a Raft round or a cache hold over Flask + Requests cost about a millisecond of CPU per
message on each side (Werkzeug parsing, Requests' session machinery, a thread hand-off per request),
and a buy made a dozen such hops; an idle cluster spent half a core on heartbeats and lease renewals.
A frame on an open connection costs an encode (``pygmy.kit.codec``, orjson) and one ``sendall``.

Wire format: each frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON. A client
opens with a hello frame ``{"hello": <its name>, "secret": <the cluster secret>, "channel": <c>}``;
the server checks the secret in constant time, that it serves channel ``c`` and, if the channel is
for members only (Raft's: a replica of the tier; a replica also says its ``url``), that the name is
one; it answers ``{"ok": true}``, or an error frame and
closes the connection, so without the secret nothing is read past the hello (the same secret guards
the HTTP endpoints). Then the client sends frames and the channel's handler may answer any frame
with one of its own, in order, on the same connection.

With TLS (``pygmy up --tls``, ``pygmy/kit/tls.py``) every connection is mutual TLS first: the
server takes a client only with a certificate of the cluster's CA whose role the channel serves
(``Channel.roles``: Raft's, its own tier; pushes, the catalog's; ...) and whose names include the
name it says hello as, and the client takes a server only with the role that serves the channel
(``SERVER_ROLE``). The secret in the hello is still checked, now encrypted: a second factor.

A connection that fails in any way is closed and the frames on it are lost: both users tolerate
that (Raft retransmits; a cache hold that is not acknowledged is waited out).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import hmac
import logging
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pygmy.kit import codec, tls

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
#: Largest frame accepted: appends of thousands of batched commands (snapshots go in 1 MiB chunks).
MAX_FRAME = 1 << 30
#: A new connection must say hello within this long.
HELLO_TIMEOUT = 2.0
#: The largest hello a server reads: it comes before the secret is checked.
MAX_HELLO = 1 << 16
#: How long the accept loop waits after a failed ``accept`` (out of descriptors) before the next.
ACCEPT_RETRY = 0.05
#: Connections not welcomed yet (no valid hello so far) that a server holds at once, from one
#: address and in all. Each holds a thread and a timer for up to HELLO_TIMEOUT, before anyone is
#: authenticated: past a cap, the oldest such connection of that address (past the cap in all, of
#: the address that holds the most) is closed to make room, so that a flood of silent connections
#: costs a few hundred threads, not all the process can have, and a peer, which holds few and says
#: its hello within a round trip of connecting, is not the one closed unless its own address floods.
#: A replica or frontend opens a few at a time (a whole local cluster, all on 127.0.0.1, a few
#: dozen at its start).
MAX_UNWELCOMED_PER_HOST = 64
MAX_UNWELCOMED = 512
#: At most one warning per this many seconds about connections closed over those caps.
CAP_WARN_EVERY = 10.0
#: A connection that sent nothing, and has not acknowledged what it was sent, for this long
#: (seconds) is dead: its host went away without a FIN. TCP keepalive then ends the thread that
#: reads it. Far above any round trip a link of this project's may have.
DEAD_AFTER = 30
#: The longest a client's connect budget grows to (``FrameClient``): two round trips of the slowest
#: link the timers follow, within the server's wait for the hello.
MAX_CONNECT = 2.0


class _AfterReply:
    """What a frame handler left for after its reply, on the connection's own thread only (a
    ``contextvars`` copy that reaches another thread must not add to it: ``after_reply`` checks)."""

    __slots__ = ("owner", "fns")

    def __init__(self) -> None:
        self.owner = threading.get_ident()
        self.fns: list[Callable[[], None]] = []

    def run(self) -> None:
        fns, self.fns = self.fns, []
        for fn in fns:
            try:
                fn()
            except Exception:
                log.exception("work left for after a reply failed")


_AFTER_REPLY: contextvars.ContextVar[_AfterReply | None] = contextvars.ContextVar("pygmy_after_reply", default=None)


def after_reply(fn: Callable[[], None]) -> bool:
    """Run ``fn`` once the reply of the frame being handled on this thread has been written (or right
    after the handler, if it writes none): a caller's wait should not include work its answer does
    not need, such as log lines and cache pushes nobody waits for. Outside a frame handler's thread,
    ``fn`` runs now. True if it was left for later. An error in it is logged; the connection goes on."""
    pending = _AFTER_REPLY.get()
    if pending is None or pending.owner != threading.get_ident():
        fn()
        return False
    pending.fns.append(fn)
    return True
#: Channels (what a connection carries): Raft between the replicas of a tier (members only); cache
#: lease renewals from frontend workers to the catalog leader; holds and releases from the catalog
#: leader to each frontend worker's own listener; a frontend worker's buys to the order leader, and its
#: decrements from there to the catalog leader (``ReplicaRuntime.serve_frames``).
RAFT_CHANNEL, SUBSCRIBE_CHANNEL, PUSH_CHANNEL = "raft", "subscribe", "push"
BUYS_CHANNEL, DECREMENTS_CHANNEL = "buys", "decrements"
#: Where a replica listens for its peers: its HTTP port plus this (catalog-1 on 8101 listens on 8151).
RAFT_PORT_OFFSET = 50
#: With TLS, the role a client wants of the server it dials on each channel (Raft's: its own).
SERVER_ROLE = {SUBSCRIBE_CHANNEL: "catalog", DECREMENTS_CHANNEL: "catalog", BUYS_CHANNEL: "order",
               PUSH_CHANNEL: "frontend"}
#: With TLS, the roles a server takes on each channel (Raft's: the server's own tier, ``Channel.roles``).
CLIENT_ROLES = {SUBSCRIBE_CHANNEL: frozenset({"frontend"}), DECREMENTS_CHANNEL: frozenset({"order"}),
                BUYS_CHANNEL: frozenset({"frontend"}), PUSH_CHANNEL: frozenset({"catalog"})}

Handler = Callable[[str, Any], Any]


@dataclass(frozen=True)
class Channel:
    """What a server does with the frames of one kind of connection: ``handle(peer_name, frame)``
    runs on the connection's reader thread, and a non-None result goes back as the reply frame."""

    handle: Handler
    #: The only names a client may say hello as on this channel (None: any name), or a test of the
    #: name and the hello frame (Raft's members change while the server runs).
    members: frozenset[str] | Callable[[str, dict[str, Any]], bool] | None = None
    #: ``hello(peer_name, hello_frame)`` once a connection is welcomed: a replica learns from it
    #: where a peer it does not know yet serves (``url``), to answer it.
    hello: Callable[[str, dict[str, Any]], None] | None = None
    #: With TLS, the roles whose certificates may use the channel (None: any of the cluster's CA).
    roles: frozenset[str] | None = None

    def admits(self, name: str, hello: dict[str, Any]) -> bool:
        members = self.members
        return members is None or (members(name, hello) if callable(members) else name in members)


class Abandoned(OSError):
    """A ``call`` gave up waiting because its ``stalled`` check said the answer is no longer
    worth waiting for (the connection is closed; the peer may still act on the frame)."""

    def __init__(self, message: str, reason: Any = None) -> None:
        super().__init__(message)
        self.reason = reason


class FrameError(OSError):
    """The peer broke the framing (too long, not JSON) or refused us: the connection is unusable."""


def raft_address(url: str) -> tuple[str, int]:
    """The peer transport address of the replica serving HTTP at ``url``."""
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"a peer URL needs a host and a port: {url!r}")
    return parts.hostname, parts.port + RAFT_PORT_OFFSET


def subscriber_address(url: str) -> tuple[str, int]:
    """``tcp://host:port`` (where a frontend worker takes cache pushes) as an address."""
    parts = urlsplit(url)
    if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
        raise ValueError(f"expected tcp://host:port, got {url!r}")
    return parts.hostname, parts.port


def encode(obj: Any) -> bytes:
    data = codec.dumps(obj)
    return _HEADER.pack(len(data)) + data


_WELCOME = encode({"ok": True})


def read_frame(stream: Any, limit: int = MAX_FRAME) -> Any:
    """The next frame from a buffered socket reader; None at a clean end of stream. A frame over
    ``limit`` bytes is refused before it is read."""
    header = stream.read(_HEADER.size)
    if not header:
        return None
    if len(header) < _HEADER.size:
        raise FrameError("connection closed inside a frame header")
    (length,) = _HEADER.unpack(header)
    if length > limit:
        raise FrameError(f"frame of {length} bytes is over the limit")
    data = stream.read(length)
    if len(data) < length:
        raise FrameError("connection closed inside a frame")
    try:
        return codec.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep for ``json``
        raise FrameError(f"frame is not JSON: {exc}") from None


def _keep_alive(sock: socket.socket) -> None:
    """TCP keepalive and a user timeout of DEAD_AFTER, where the platform has them: a long-lived
    connection whose peer vanished (host down, partition) ends instead of blocking a reader, or a
    writer, for good."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", DEAD_AFTER // 3), ("TCP_KEEPINTVL", DEAD_AFTER // 6),
                          ("TCP_KEEPCNT", 4), ("TCP_USER_TIMEOUT", DEAD_AFTER * 1000)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it
    sock.close()


class _Unwelcomed:
    """A connection that has not said its hello yet: the socket to close it by (the TLS one once
    wrapped), where it came from, and whether it was closed to make room for a newer one."""

    __slots__ = ("sock", "host", "evicted")

    def __init__(self, sock: socket.socket, host: str) -> None:
        self.sock, self.host, self.evicted = sock, host, False


class FrameServer:
    """Accepts authenticated connections on its ``channels`` (more may be added before ``start``).
    ``stop()`` closes the listening socket and every connection and joins every thread it started."""

    def __init__(self, host: str, port: int, secret: str, channels: Mapping[str, Channel], *, name: str,
                 identity: tls.Identity | None = None) -> None:
        """``identity``: whose certificate to serve with (mutual TLS); default the process's (``tls.active``)."""
        self.name = name
        self.identity = identity or tls.active()
        self.channels = dict(channels)
        self._expected = secret.encode()
        self._sock = socket.create_server((host, port), backlog=128)  # SO_REUSEADDR: rebinds after a crash
        self.address = self._sock.getsockname()[:2]
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        #: Connections not welcomed yet, oldest first, and how many per address (``MAX_UNWELCOMED``).
        self._unwelcomed: dict[_Unwelcomed, None] = {}
        self._unwelcomed_from: collections.Counter[str] = collections.Counter()
        #: Connections closed over those caps, and when that was last logged.
        self.over_cap = 0
        self._over_cap_told = (0, -CAP_WARN_EVERY)
        self._stopping = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"frames-accept-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            conns = list(self._conns.items())
        _close(self._sock)
        self._thread.join(timeout=5)
        for sock, thread in conns:
            _close(sock)
            thread.join(timeout=5)

    def _accept_loop(self) -> None:
        """Until ``stop``: any other error (out of descriptors, a connection reset before it was
        taken) costs that connection, never the listener."""
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError as exc:
                if self._stopping:
                    return  # the listening socket was closed by stop()
                log.warning("%s: accepting a connection failed: %s", self.name, exc)
                time.sleep(ACCEPT_RETRY)  # e.g. out of descriptors: let some close first
                continue
            pending = _Unwelcomed(conn, str(addr[0]))
            thread = threading.Thread(target=self._serve, args=(conn, pending), name=f"frames-conn-{self.name}",
                                      daemon=True)
            with self._lock:
                if self._stopping:
                    conn.close()
                    return
                evicted = self._make_room(pending.host)
                self._unwelcomed[pending] = None
                self._unwelcomed_from[pending.host] += 1
                self._conns[conn] = thread
            if evicted:
                self._close_evicted(evicted, pending.host)
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _keep_alive(conn)
                thread.start()
            except (OSError, RuntimeError) as exc:  # reset already, or no thread to be had
                log.warning("%s: a connection could not be served: %s", self.name, exc)
                with self._lock:
                    self._conns.pop(conn, None)
                self._welcomed(pending)
                _close(conn)

    def _make_room(self, host: str) -> list[_Unwelcomed]:
        """With the lock held, before a connection from ``host`` is counted: the oldest connections
        not welcomed yet that must go for it to fit under the caps, no longer counted."""
        out = []
        if self._unwelcomed_from[host] >= MAX_UNWELCOMED_PER_HOST:
            out.append(self._forget(next(p for p in self._unwelcomed if p.host == host)))
        if len(self._unwelcomed) >= MAX_UNWELCOMED:  # the oldest of the address that holds the most
            busiest = self._unwelcomed_from.most_common(1)[0][0]
            out.append(self._forget(next(p for p in self._unwelcomed if p.host == busiest)))
        for p in out:
            p.evicted = True
        return out

    def _forget(self, pending: _Unwelcomed) -> _Unwelcomed:
        """With the lock held: ``pending`` is no longer counted as waiting for its hello."""
        del self._unwelcomed[pending]
        self._unwelcomed_from[pending.host] -= 1
        if self._unwelcomed_from[pending.host] <= 0:
            del self._unwelcomed_from[pending.host]
        return pending

    def _close_evicted(self, evicted: list[_Unwelcomed], newcomer: str) -> None:
        """Close connections made room for (their threads end on it); say so now and then, not each time."""
        with self._lock:
            socks = [p.sock for p in evicted]  # the current one: a TLS wrap after this sees ``evicted``
            self.over_cap += len(evicted)
        for sock in socks:
            _close(sock)
        told, at = self._over_cap_told
        now = time.monotonic()
        if now - at >= CAP_WARN_EVERY:
            log.warning("%s: closed %d connection(s) that had not said hello, the oldest first, to make room for "
                        "newer ones (the latest from %s): more than %d from one address or %d in all were waiting",
                        self.name, self.over_cap - told, newcomer, MAX_UNWELCOMED_PER_HOST, MAX_UNWELCOMED)
            self._over_cap_told = (self.over_cap, now)

    def _welcomed(self, pending: _Unwelcomed) -> None:
        """``pending`` no longer waits for its hello (welcomed, refused, gone or made room for)."""
        with self._lock:
            if pending in self._unwelcomed:
                self._forget(pending)

    def _serve(self, conn: socket.socket, pending: _Unwelcomed) -> None:
        cert: tls.Peer | None = None
        # The handshake and the hello within HELLO_TIMEOUT in all, however slowly they trickle in
        # (the socket's timeout bounds each read only): then the connection is closed under them.
        overdue = threading.Timer(HELLO_TIMEOUT, lambda: _close(pending.sock))
        overdue.daemon = True
        try:
            overdue.start()
            conn.settimeout(HELLO_TIMEOUT)
            if self.identity is not None:
                raw = conn
                conn = self.identity.server_context().wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
                with self._lock:  # stop() must close the TLS socket now: ``raw`` is detached from its descriptor
                    self._conns[conn] = self._conns.pop(raw)
                    pending.sock = conn  # (and so must a timer or an eviction)
                    if self._stopping or pending.evicted:
                        return
                conn.do_handshake()  # plain text, another CA, no certificate: an SSLError here
                cert = tls.peer_of(conn)
            stream = conn.makefile("rb")
            hello = read_frame(stream, MAX_HELLO)
            if hello is None:  # closed before its hello: a client whose connect budget ran out
                log.debug("%s: a connection closed before its hello", self.name)
                return
            hello = hello if isinstance(hello, dict) else {}
            name = hello.get("channel")
            given, peer, channel = hello.get("secret"), hello.get("hello"), self.channels.get(
                name if isinstance(name, str) else "")
            refusal = None
            if not isinstance(given, str) or not isinstance(peer, str) or not hmac.compare_digest(
                    given.encode("utf-8", "replace"), self._expected):
                refusal = "wrong internal secret"
            elif channel is None:
                refusal = f"no channel {hello.get('channel')!r} here"
            elif cert is not None and channel.roles is not None and cert.role not in channel.roles:
                refusal = f"a certificate with role {cert.role!r} may not use channel {hello.get('channel')!r}"
            elif cert is not None and not cert.named(peer):
                refusal = f"{peer!r} is not a name of its certificate"
            elif not channel.admits(peer, hello):
                refusal = f"{peer!r} is not a member"
            if refusal is not None:
                log.warning("%s: refused a connection: %s", self.name, refusal)
                conn.sendall(encode({"error": {"code": 403, "message": refusal}}))
                return
            assert channel is not None
            overdue.cancel()  # (if it is firing at this very moment, the write below fails: the hello took 2 s)
            self._welcomed(pending)
            conn.sendall(_WELCOME)
            if channel.hello is not None:
                channel.hello(peer, hello)
            conn.settimeout(None)  # a quiet peer is not a dead one; a new connection replaces it
            later = _AfterReply()
            _AFTER_REPLY.set(later)  # this thread serves only this connection
            while True:
                frame = read_frame(stream)
                if frame is None:
                    return
                try:
                    reply = channel.handle(peer, frame)
                    if reply is not None:
                        conn.sendall(encode(reply))
                finally:
                    later.run()
        except (OSError, ValueError, AttributeError) as exc:
            log.debug("%s: connection ended: %s", self.name, exc)
        except Exception:
            log.exception("%s: frame handler failed; closing the connection", self.name)
        finally:
            overdue.cancel()
            # Closed for every context copied from this thread too (they share the object): a
            # later thread given this id must not add to a list nobody runs.
            closing = _AFTER_REPLY.get()
            if closing is not None:
                closing.owner = 0
            self._welcomed(pending)
            with self._lock:
                self._conns.pop(conn, None)
            _close(conn)


class FrameClient:
    """One long-lived connection to a ``FrameServer``, opened on first use and again after any error.

    Opening takes two round trips (TCP's handshake, then the hello and its welcome) within the
    connect budget: ``connect_timeout`` on a LAN, stretched to what the link needs. A budget that
    ran out doubles for the next try (up to ``MAX_CONNECT``), so a link slower than any budget set
    in advance still reconnects; one that succeeded sets the next to twice what it took, and a
    measured round trip (``expect_rtt``) to three of them.

    Thread-safe: one caller at a time sends (and, for ``call``, reads the reply)."""

    def __init__(self, address: tuple[str, int], secret: str, name: str, channel: str,
                 connect_timeout: float = 0.2, extra: Mapping[str, Any] | None = None,
                 identity: tls.Identity | None = None, server: str | None = None) -> None:
        """``extra``: more fields of the hello (a replica's ``url``); ``identity``: the certificate
        to show (mutual TLS), default the process's (``tls.active``); ``server``: with TLS, the name
        the server's certificate must carry besides its role (a replica we dial by name: another
        replica of its tier must not stand in for it)."""
        self.address, self.name, self.server = address, name, server
        self.identity = identity or tls.active()
        #: With TLS, the role the server must have: the channel's, or (Raft) the caller's own tier.
        self.server_role = SERVER_ROLE.get(channel, self.identity.role if self.identity else "")
        self._hello = encode({**(extra or {}), "hello": name, "secret": secret, "channel": channel})
        self.connect_timeout = connect_timeout
        #: The budget of the next connection attempt (>= ``connect_timeout``).
        self.connect_budget = connect_timeout
        self._learned = connect_timeout  # what the link showed it needs: successes and round trips
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._stream: Any = None
        self._partial = b""  # the rest of a frame ``send_nowait`` could not finish: goes out first
        self._owed = 0  # replies nobody waits for (``send_nowait(owed=True)``): read and dropped before the next
        self.connects = 0

    def is_open(self) -> bool:
        """Whether a connection is open now (a call would not have to connect first)."""
        return self._sock is not None

    def expect_rtt(self, rtt: float) -> None:
        """A round trip measured to this peer (seconds): the next connection gets three."""
        self._learned = max(self.connect_timeout, min(MAX_CONNECT, 3 * rtt))
        self.connect_budget = max(self.connect_budget, self._learned)

    def _connection(self, within: float | None = None) -> socket.socket:
        """The open connection, or a new one within the connect budget (and ``within`` seconds, the
        caller's time left: a budget cut short by it is not doubled when it runs out)."""
        if self._sock is None:
            budget = self.connect_budget if within is None else max(0.001, min(self.connect_budget, within))
            learning = budget == self.connect_budget  # a timeout says the link is slower than the budget
            started = time.monotonic()
            try:
                sock = socket.create_connection(self.address, timeout=budget)
            except TimeoutError:
                if learning:
                    self.connect_budget = min(MAX_CONNECT, 2 * budget)
                raise
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _keep_alive(sock)
                sock.settimeout(max(0.001, budget - (time.monotonic() - started)))
                if self.identity is not None:  # one more round trip, within the same budget
                    sock = self.identity.client_context(hostnames=not self.server_role).wrap_socket(
                        sock, server_hostname=self.address[0])
                    if self.server_role:  # the server's role, not its host name (``Identity.client_context``)
                        peer = tls.check(sock, (self.server_role,))
                        if self.server is not None and not peer.named(self.server):
                            raise tls.PeerRefused(f"we dialled {self.server}, and its certificate names "
                                                  f"{', '.join(sorted(peer.names))}")
                sock.sendall(self._hello)
                stream = sock.makefile("rb")
                answer = read_frame(stream)  # within the connect budget: a stopped peer is found here
            except tls.PeerRefused as exc:  # not a missing answer: the wrong peer answered
                sock.close()
                raise FrameError(f"{self.address}: {exc}") from None
            except (OSError, ValueError) as exc:
                sock.close()
                if isinstance(exc, TimeoutError) and learning:
                    self.connect_budget = min(MAX_CONNECT, 2 * budget)
                raise FrameError(f"{self.address}: no welcome within {budget:.2f} s: {exc}") from None
            if answer != {"ok": True}:
                sock.close()
                raise FrameError(f"{self.address} refused us: {answer}")
            self._sock, self._stream = sock, stream
            self.connects += 1
            took = time.monotonic() - started
            self.connect_budget = max(self._learned, min(MAX_CONNECT, 2 * took))
        return self._sock

    def _write(self, data: bytes, timeout: float, connect_within: float | None = None) -> None:
        """Under the lock: whatever ``send_nowait`` left of a frame, then ``data``."""
        sock = self._connection(connect_within)
        sock.settimeout(timeout)
        if self._partial:
            sock.sendall(self._partial)
            self._partial = b""
        sock.sendall(data)

    def send(self, obj: Any, timeout: float) -> None:
        """Send one frame; raises OSError (the connection is closed, the frame maybe lost)."""
        data = encode(obj)
        with self._lock:
            try:
                self._write(data, timeout)
            except BaseException:  # part of a frame may be out: the next one would not parse
                self._reset()
                raise

    def send_nowait(self, obj: Any, owed: bool = False) -> bool:
        """Send one frame now if that cannot block: the connection is open and idle and the kernel
        takes at least part of it (the rest goes out before the next frame). False: nothing was
        sent; use ``send`` from a thread that may wait. Saves a thread hand-off per message.
        ``owed``: the server answers it, and nobody waits for that reply: the next ``call`` reads
        it first and drops it."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            sock = self._sock
            if sock is None or self._partial:
                return False
            data = encode(obj)
            try:
                sock.settimeout(0.0)
                sent = sock.send(data)
            except BlockingIOError:
                return False
            except ssl.SSLWantWriteError:  # TLS took the frame and must be given the same bytes again
                self._partial = data
                self._owed += owed
                return True
            except OSError:
                self._reset()
                return False
            self._partial = data[sent:]
            self._owed += owed
            return True
        finally:
            self._lock.release()

    def start_call(self, obj: Any, timeout: float) -> Callable[[], Any]:
        """``call`` in two halves, for a caller that asks several servers at once: sends now, and
        returns the function that reads the reply (by ``timeout`` after the frame went out; it
        raises as ``call`` does). The connection is the caller's until that function has run,
        which it must."""
        data = encode(obj)
        self._lock.acquire()
        try:
            self._write(data, timeout)
        except BaseException:  # part of a frame may be out: the next one would not parse
            self._reset()
            self._lock.release()
            raise
        end = time.monotonic() + timeout

        def reply() -> Any:
            try:
                if self._sock is None:
                    raise FrameError("connection closed before the reply")
                self._sock.settimeout(max(0.001, end - time.monotonic()))
                return self._read_reply()
            finally:
                self._lock.release()

        return reply

    def _read_reply(self) -> Any:
        """Under the lock, once a request went out: the replies nobody waits for (dropped), then its
        own. Any failure closes the connection."""
        try:
            while True:
                reply = read_frame(self._stream)
                if reply is None:
                    raise FrameError("connection closed before the reply")
                if not self._owed:
                    return reply
                self._owed -= 1
        except ValueError as exc:
            self._reset()
            raise FrameError(str(exc)) from None
        except BaseException:  # any interruption leaves the reply unread: never let a later call take it
            self._reset()
            raise

    def call(self, obj: Any, timeout: float, stalled: Callable[[], Any] | None = None,
             first_check: float = 0.25, check_every: float = 0.1, connect_within: float | None = None) -> Any:
        """Send one frame and return the server's reply frame; raises OSError on any failure.

        ``stalled``: asked once no reply has begun for ``first_check`` seconds, then every
        ``check_every`` seconds until one does; a true answer
        abandons the wait (``Abandoned`` carrying it). A stopped peer keeps its connection open and
        never answers, and only a look elsewhere (has another replica taken over?) can tell that
        from a peer that is slow at its work. ``connect_within``: if a connection must be opened
        first, at most this long for it (what is left of the caller's deadline)."""
        data = encode(obj)
        with self._lock:
            try:
                self._write(data, timeout, connect_within)
                if stalled is not None:
                    self._await_reply(timeout, stalled, first_check, check_every)
            except BaseException:  # (``stalled`` too may raise) its reply must not go to the next call
                self._reset()
                raise
            return self._read_reply()

    def _await_reply(self, timeout: float, stalled: Callable[[], Any], first_check: float,
                     check_every: float) -> None:
        """Under the lock, after a request went out: until its reply starts to arrive, by ``timeout``
        (``TimeoutError``), or until ``stalled()`` gives a reason to stop waiting (``Abandoned``).
        Replies come one per request, so no bytes of another frame sit in the stream's buffer
        (unless one nobody waits for does: then the reply is simply read, by ``timeout``)."""
        assert self._sock is not None
        if self._owed:
            return
        if isinstance(self._sock, ssl.SSLSocket) and self._sock.pending():
            return  # TLS holds decrypted bytes already: the socket itself may never be readable again
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        end = time.monotonic() + timeout
        wait = first_check
        while not poller.poll(max(0.0, min(wait, end - time.monotonic())) * 1000):
            wait = check_every
            if time.monotonic() >= end:
                raise TimeoutError(f"{self.address}: no reply in {timeout:.2f} s")
            reason = stalled()
            if reason:
                raise Abandoned(f"{self.address}: stopped waiting for a reply: {reason}", reason)

    def _reset(self) -> None:
        if self._sock is not None:
            _close(self._sock)
        self._sock = self._stream = None
        self._partial = b""
        self._owed = 0

    def close(self) -> None:
        with self._lock:
            self._reset()
