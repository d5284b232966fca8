"""TLS between every Pygmy hop (``pygmy up --tls``): the contexts, who a peer is, and certificate reloads.

One module for every tier, so that each listener and each caller judges certificates the same way:

* **Identity.** A certificate of the cluster's CA (``pygmy certs``, ``pygmy/cluster/certs.py``) says
  its holder's *role* in a URI subject alternative name ``pygmy://role/<role>`` (``catalog``,
  ``order``, ``frontend``, ``client``, ``admin``; the subject's OU says it too, for people) and its
  *name* (``catalog-2``) as a DNS name beside its host names and addresses. A listener asks for the
  roles it serves (``Peer.role``), not for the internal secret: a catalog replica takes Raft frames
  only from catalog replicas, a frontend worker takes pushes only from the catalog.
* **Reloads.** An ``Identity`` makes every context it hands out itself and keeps them: before each
  new connection (``ReloadingContext.wrap_socket``, at most once a second) it looks at its files,
  and a changed certificate, key or CA is loaded into the live contexts
  (``SSLContext.load_cert_chain`` holds for the handshakes after it). A half-written pair (a key
  that does not match the certificate yet) keeps the old one until the next look; no thread, no restart.
* **Cost.** The contexts are made once per process and reused, so urllib3 pools and the framed
  transport keep their connections (one handshake per connection, not per request) and TLS 1.3
  session tickets resume the next connection.

A process has at most one identity (``use``), set by ``pygmy serve`` before Gunicorn forks; code
that dials a peer asks ``active()`` for it (None: plain text, as without ``--tls``).
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: The roles a certificate can carry: the three tiers, the two kinds of outside callers, and the
#: reverse proxy's own certificate, which it shows to clients (deploy/proxy/render.py; to the
#: frontends it shows ``client``'s): no listener of Pygmy takes that role.
ROLES = ("catalog", "order", "frontend", "client", "admin", "proxy")
ROLE_URI = "pygmy://role/"
#: How often, at most, an identity looks at its files for a replaced certificate (seconds).
RELOAD_EVERY = 1.0
#: Longest a TLS handshake may take on a listener before the connection is dropped (seconds).
HANDSHAKE_TIMEOUT = 5.0

#: Who may connect to each kind of port: ``{tier: roles}`` for a tier's HTTP API (its replicas talk
#: to each other over it too; ``admin`` is the operator's tools: ``pygmy member``, ``backup``, ``verify``).
HTTP_CLIENTS: dict[str, frozenset[str]] = {
    "catalog": frozenset({"catalog", "order", "frontend", "admin"}),
    "order": frozenset({"order", "frontend", "admin"}),
}


#: Who may call a replica's endpoints beyond what its listener takes (``HTTP_CLIENTS``), by the
#: certificate's role: the operator's tools alone change a tier's members or read a whole state
#: (``/members``, ``/backup``, ``/verify``); ``OWN_TIER`` stands for the replica's own tier.
OWN_TIER = "own tier"
OPERATOR = frozenset({"admin"})
#: The WSGI environ key under which a service's HTTP worker gives the role of the request's
#: certificate (``pygmy/cluster/worker.py``): what ``role_refusal`` reads.
PEER_ROLE = "pygmy.peer_role"


class PeerRefused(ConnectionError):
    """The peer's certificate is valid but does not carry a role (or name) this endpoint serves."""


@dataclass(frozen=True)
class Peer:
    """What a verified certificate says of its holder."""

    role: str | None
    names: frozenset[str]

    def named(self, name: str) -> bool:
        """Whether ``name`` (``frontend-1/4242``: a worker of ``frontend-1``) is one of the certificate's names."""
        return name.partition("/")[0] in self.names


def peer_of(sock: ssl.SSLSocket) -> Peer:
    """The role and names of ``sock``'s peer, from its certificate (verified by the handshake)."""
    cert = sock.getpeercert() or {}
    role, names = None, set()
    for kind, value in cert.get("subjectAltName", ()):
        if kind == "URI" and value.startswith(ROLE_URI):
            role = value[len(ROLE_URI):]
        elif kind in ("DNS", "IP Address"):
            names.add(value)
    return Peer(role if role in ROLES else None, frozenset(names))


def check(sock: ssl.SSLSocket, roles: Collection[str]) -> Peer:
    """``sock``'s peer if its certificate carries one of ``roles``; else ``PeerRefused``."""
    peer = peer_of(sock)
    if peer.role not in roles:
        raise PeerRefused(f"a peer with role {peer.role!r} may not connect here (only {', '.join(sorted(roles))})")
    return peer


def role_refusal(environ: dict[str, Any], roles: Collection[str] | None) -> tuple[int, str] | None:
    """Why this request may not call an endpoint that only ``roles`` may (``OWN_TIER``: this
    process's tier), or None. A listener takes every role any of its endpoints serves, so a
    frontend's certificate reaches a replica's port: the endpoint judges the rest. Without TLS
    (no identity here) nothing is checked: the internal secret is then the only credential."""
    identity = active()
    if roles is None or identity is None:
        return None
    allowed = {identity.role if r == OWN_TIER else r for r in roles}
    role = environ.get(PEER_ROLE)
    if role in allowed:
        return None
    return 403, f"a certificate with role {role!r} may not call this endpoint (only {', '.join(sorted(allowed))})"


class ReloadingContext(ssl.SSLContext):
    """An ``SSLContext`` that has its identity look for replaced files before each new connection."""

    identity: Identity | None = None

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:  # type: ignore[override]
        if self.identity is not None:
            self.identity.refresh()
        return super().wrap_socket(*args, **kwargs)


@dataclass(frozen=True)
class Files:
    """Where one holder's certificate, key and the cluster's CA certificate are."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def of(cls, certs_dir: str | Path, holder: str) -> Files:
        """The files of ``holder`` (a service name, ``client`` or ``admin``) in ``certs_dir``, as
        ``pygmy certs`` lays them out: ``ca.pem``, ``<holder>.pem``, ``<holder>-key.pem``."""
        d = Path(certs_dir)
        return cls(d / "ca.pem", d / f"{holder}.pem", d / f"{holder}-key.pem")

    def missing(self) -> list[Path]:
        return [p for p in (self.ca, self.cert, self.key) if not p.exists()]

    def stamp(self) -> tuple[tuple[int, int], ...]:
        out = []
        for p in (self.ca, self.cert, self.key):
            try:
                st = p.stat()
                out.append((st.st_mtime_ns, st.st_size))
            except FileNotFoundError:
                out.append((0, 0))
        return tuple(out)


class Identity:
    """One process's certificate and trust, and every context made from them (kept, and reloaded
    when the files change). Thread-safe."""

    def __init__(self, files: Files, role: str) -> None:
        missing = files.missing()
        if missing:
            raise RuntimeError(f"TLS: missing {', '.join(map(str, missing))} (make them with 'pygmy certs')")
        self.files, self.role = files, role
        self._lock = threading.Lock()
        self._contexts: list[ssl.SSLContext] = []
        self._server: dict[ssl.VerifyMode, ssl.SSLContext] = {}
        self._client: dict[bool, ssl.SSLContext] = {}
        self._stamp = files.stamp()
        self._looked = time.monotonic()
        self.reloads = 0

    @classmethod
    def of(cls, certs_dir: str | Path, holder: str) -> Identity:
        """``holder``'s identity from ``certs_dir`` (a service name: role = its tier)."""
        role = holder.rpartition("-")[0] if "-" in holder else holder
        return cls(Files.of(certs_dir, holder), role)

    def _new(self, purpose: int) -> ReloadingContext:
        ctx = ReloadingContext(purpose)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_verify_locations(cafile=str(self.files.ca))
        ctx.load_cert_chain(str(self.files.cert), str(self.files.key))
        ctx.identity = self
        self._contexts.append(ctx)
        return ctx

    def server_context(self, clients: ssl.VerifyMode = ssl.CERT_REQUIRED) -> ssl.SSLContext:
        """The context a listener wraps its connections with: ``CERT_REQUIRED`` between services
        (mutual TLS), ``CERT_OPTIONAL`` where outside clients come without one (the frontend's
        HTTP; a certificate shown there must still be of the cluster's CA)."""
        with self._lock:
            ctx = self._server.get(clients)
            if ctx is None:
                ctx = self._server[clients] = self._new(ssl.PROTOCOL_TLS_SERVER)
                ctx.verify_mode = clients
            return ctx

    def client_context(self, hostnames: bool = True) -> ssl.SSLContext:
        """The context every call to a peer is made with: it shows this identity's certificate
        and takes only servers with one of the cluster's CA, for the host dialled (``hostnames``;
        the framed transport checks the server's role instead: a frontend worker's listener may
        advertise an address its certificate does not name)."""
        with self._lock:
            ctx = self._client.get(hostnames)
            if ctx is None:
                ctx = self._client[hostnames] = self._new(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED
                ctx.check_hostname = hostnames
            return ctx

    def refresh(self, force: bool = False) -> bool:
        """Load replaced files into every live context (looked at once a ``RELOAD_EVERY`` at most);
        True if they were reloaded. A pair that does not load (half written) is tried again later."""
        now = time.monotonic()
        if not force and now - self._looked < RELOAD_EVERY:
            return False
        with self._lock:
            self._looked = now
            stamp = self.files.stamp()
            if stamp == self._stamp:
                return False
            try:
                for ctx in self._contexts:
                    ctx.load_cert_chain(str(self.files.cert), str(self.files.key))
                    if stamp[0] != self._stamp[0]:  # a new CA is trusted beside the old (rotation)
                        ctx.load_verify_locations(cafile=str(self.files.ca))
            except (OSError, ssl.SSLError) as exc:
                log.warning("TLS: %s not reloaded yet: %s", self.files.cert, exc)
                return False
            self._stamp = stamp
            self.reloads += 1
        log.info("TLS: reloaded %s", self.files.cert)
        return True


_active: Identity | None = None


def use(identity: Identity | None) -> None:
    """Make ``identity`` this process's (None: plain text): what ``active`` hands out."""
    global _active
    _active = identity


def active() -> Identity | None:
    """This process's identity, or None when the cluster runs without TLS."""
    return _active


def with_scheme(url: str, https: bool) -> str:
    """``url`` (``http`` or ``https``) with the scheme given; any other text unchanged. A tier's log
    keeps its members' URLs as they were when recorded, and a cluster may be restarted with or
    without ``--tls`` since: the host and port stay the truth, the scheme is this run's."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("http", "https"):
        return url
    return ("https://" if https else "http://") + rest


def fit(url: str) -> str:
    """``url`` with the scheme this process speaks: ``https`` with an identity, else ``http``."""
    return with_scheme(url, _active is not None)


def pool_options(identity: Identity | None = None) -> dict[str, Any]:
    """Keyword arguments for a urllib3 pool (``connection_from_url``, ``PoolManager``) to an
    ``https://`` URL: the identity's client context. Nothing without TLS."""
    identity = identity or _active
    return {} if identity is None else {"ssl_context": identity.client_context()}


def requests_options(certs_dir: str | Path | None, holder: str = "admin") -> dict[str, Any]:
    """Keyword arguments for Requests (``verify``, ``cert``) as ``holder``; nothing for ``None``
    (a cluster without TLS). Requests' session pools keep the connections (and their handshakes)."""
    if certs_dir is None:
        return {}
    files = Files.of(certs_dir, holder)
    return {"verify": str(files.ca), "cert": (str(files.cert), str(files.key))}


def handshake(sock: ssl.SSLSocket, timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """Finish a server-side handshake within ``timeout`` (a client that never speaks holds no thread)."""
    before = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        sock.do_handshake()
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(before)
