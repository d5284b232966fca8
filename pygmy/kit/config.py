"""Cluster settings: names, ports, URLs, data locations, the internal secret and the admin token.

One ``ClusterConfig`` describes the whole topology. ``pygmy up`` writes it to ``D/run/cluster.json``
so that ``pygmy start NAME`` restarts a single service with exactly the same settings. ``pygmy member``
records there the replicas of each tier as its changes leave them (``members``), so that a replica
added on a new port or host is started, and a removed one left out, like any other.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pygmy.kit import tls

TIERS = ("frontend", "catalog", "order")
TIER_OFFSET = {"catalog": 100, "order": 200}
#: The shortest key window: longer than any buy's own time budget and retries across a failover.
MIN_KEY_WINDOW = 10.0


#: Settings of one service run by hand (``serve``, as in a container): ``up`` ignores them and does not
#: pass them on, or every service it starts would take the same port or the same peers.
SERVE_ONLY_ENV = frozenset({"PYGMY_PORT", "PYGMY_CATALOG_URLS", "PYGMY_ORDER_URLS", "PYGMY_ADVERTISE_HOST",
                            "PYGMY_CATALOG_LEARNERS", "PYGMY_ORDER_LEARNERS"})


@dataclass
class ClusterConfig:
    port_base: int = 8000
    bind: str = "127.0.0.1"
    data_dir: str = "data"
    catalog_replicas: int = 3
    order_replicas: int = 3
    frontends: int = 1
    frontend_workers: int = 2
    cache: bool = True
    cache_size: int = 10_000
    #: Where the frontend sends reads it cannot answer from its cache: ``leader`` first (its read
    #: index is local: one request less) or ``any`` replica in turn (spreads read load across
    #: machines; a follower asks the leader for the read index). Both are linearizable.
    read_from: str = "leader"
    books: str | None = None
    restock_every: float = 0.0
    restock_amount: int = 0
    #: Scheduled backups by ``pygmy up`` (``pygmy.cluster.backup.Scheduled``): every this many
    #: seconds (0: off) an archive into ``backup_dir`` (empty: ``D/backups``), the newest
    #: ``backup_keep`` kept.
    backup_every: float = 0.0
    backup_dir: str = ""
    backup_keep: int = 7
    #: Explicit peer URLs (containers address peers by service name); empty means derive from ports.
    catalog_urls: list[str] = field(default_factory=list)
    order_urls: list[str] = field(default_factory=list)
    #: Hostname other services use to reach this one (containers: the service name).
    advertise_host: str | None = None
    #: Overrides the derived port of the one service ``pygmy serve`` runs (containers: all on 8000).
    port: int | None = None
    #: Run each service in its own network namespace ``<netns>-<name>`` at its own address
    #: ``<netns_subnet>.<10+i>`` on one bridge, so that links between services can be cut, delayed
    #: and made lossy (``pygmy/verify/nemesis.py`` creates and owns the network). Empty: loopback.
    netns: str = ""
    netns_subnet: str = "10.213.0"
    replica_threads: int = 32
    #: Admission control (pygmy/kit/admission.py): requests worked on at once per frontend (all its
    #: workers together) and per replica, by class; more are refused at once with 503 and Retry-After.
    frontend_write_limit: int = 48
    frontend_read_limit: int = 64
    replica_write_limit: int = 64
    replica_read_limit: int = 48
    #: Over 1: the frontend's write cap follows latency (``pygmy.kit.admission.LatencyLimit``), cut
    #: while its buys take more than this many times their latency with the cap not reached, and the
    #: cap was reached; ``frontend_write_limit`` is its most, a quarter of it its least. 0 (the
    #: default): a fixed cap, which served more buys at a surge here with reads as fast
    #: (docs/performance.md, "Overload").
    frontend_write_tolerance: float = 0.0
    #: Seconds a frontend worker's next batch of buys waits for more while the batch before carried
    #: two or more (``pygmy.replication.batching.Combiner``'s linger; 0: never). A batch costs
    #: several ms of CPU over the seven processes whatever it carries, and on this project's
    #: 2-core machine two buyers already fill the cores, so there fewer, larger batches leave the
    #: CPU to everything else; a buyer alone (each batch of one) never waits. Where a few buyers
    #: do not fill the machine, the wait is added to their buys: measure, and lower it.
    #: docs/performance.md, "Buys that wait for company".
    frontend_buy_linger: float = 0.02
    #: How long the frontend keeps retrying a buy (same idempotency key) across a failover.
    buy_deadline: float = 5.0
    #: Seconds an idempotency key is remembered (buys, and the catalog's decrements and updates):
    #: a retry within it returns the first answer; after it, the key is forgotten and a retry is a
    #: new request. Never while the buy that used it is unfinished (``pygmy.order.app.KeyExpirer``).
    key_window: float = 86_400.0
    #: Per-link addresses, so that each link can go through a proxy of its own (``pygmy/verify/links.py``
    #: delays each replica link and makes it lossy apart from the others): ``{replica: {peer:
    #: "host:port"}}``, where ``replica`` dials the peer transport (Raft) of ``peer``, a replica of its
    #: own tier. Links not named dial the address the peer's URL gives (its port + 50).
    peer_addresses: dict[str, dict[str, str]] = field(default_factory=dict)
    #: The same for the services that route to a tier (a frontend to catalog and order, an order
    #: replica to the catalog): ``{caller: {replica: url}}``, the URL ``caller`` uses for ``replica``:
    #: its HTTP at the URL, its frames at the URL's port + 50. Replicas not named: ``urls(tier)``.
    router_urls: dict[str, dict[str, str]] = field(default_factory=dict)
    #: The replicas of a tier as ``pygmy member`` left them, ``{tier: {name: url}}``; a tier not
    #: here has replicas 1..N (``catalog_replicas``) at their derived URLs. The truth is the
    #: configuration in the tier's log: this is where a replica starting with an empty log begins,
    #: and how the launcher finds the replicas it runs.
    members: dict[str, dict[str, str]] = field(default_factory=dict)
    #: Of ``members``, the learners (not yet promoted): a new replica starts as one of the group.
    tier_learners: dict[str, list[str]] = field(default_factory=dict)
    #: Every hop over TLS, mutual between services (``pygmy up --tls``, ``pygmy/kit/tls.py``): URLs
    #: are ``https://``, and each listener takes only certificates of the cluster's CA with a role it serves.
    tls: bool = False
    #: Where the certificates are (``pygmy certs``); empty: ``D/certs``.
    certs_dir: str = ""

    # -- naming and addressing ----------------------------------------------------------------
    def limits(self, tier: str) -> dict[str, int]:
        """Admission limits of one service of ``tier``: ``{"write": n, "read": n}``."""
        if tier == "frontend":
            return {"write": self.frontend_write_limit, "read": self.frontend_read_limit}
        return {"write": self.replica_write_limit, "read": self.replica_read_limit}

    def tolerances(self, tier: str) -> dict[str, float]:
        """The classes of ``tier`` whose cap follows latency, with their tolerance (``LatencyLimit``)."""
        return {"write": self.frontend_write_tolerance} if tier == "frontend" and self.frontend_write_tolerance else {}

    def threads(self, tier: str) -> int:
        """Gunicorn threads per worker: room for both capped classes at once (a frontend's caps are
        shared by its workers, and one worker may be holding all the places), plus control traffic
        and the answers that shed the excess (which must never wait behind admitted work)."""
        base = 16 if tier == "frontend" else self.replica_threads
        return max(base, sum(self.limits(tier).values()) + 8)

    def replicas(self, tier: str) -> int:
        """How many replicas a tier has (for a replicated tier, its members now)."""
        if tier in self.members:
            return len(self.members[tier])
        return {"catalog": self.catalog_replicas, "order": self.order_replicas, "frontend": self.frontends}[tier]

    def names(self) -> list[str]:
        """Every service name, in start order (replicas before the frontends that route to them)."""
        return [*self.peers("catalog"), *self.peers("order"), *(f"frontend-{k}" for k in range(1, self.frontends + 1))]

    def _first_names(self) -> list[str]:
        """The services as ``pygmy up`` first laid them out (what ``--netns`` addresses go by)."""
        return [f"{tier}-{k}" for tier, n in (("catalog", self.catalog_replicas), ("order", self.order_replicas),
                                              ("frontend", self.frontends)) for k in range(1, n + 1)]

    def learners(self, tier: str) -> list[str]:
        return list(self.tier_learners.get(tier, []))

    def local_port(self, tier: str, k: int) -> int:
        if tier == "frontend":
            return self.port_base + k - 1
        return self.port_base + TIER_OFFSET[tier] + k

    def namespace(self, name: str) -> str | None:
        """The network namespace a service runs in, or None (the host's network)."""
        return f"{self.netns}-{name}" if self.netns else None

    def address(self, name: str) -> str:
        """The address ``name`` listens on and others reach it at (one per service with ``netns``)."""
        if self.netns:
            first = self._first_names()
            if name not in first:  # added by ``pygmy member``: where its URL says
                return urlsplit(self.peers(name.rpartition("-")[0])[name]).hostname or ""
            return f"{self.netns_subnet}.{10 + first.index(name)}"
        return "127.0.0.1" if self.bind in ("0.0.0.0", "::", "") else self.bind

    def bind_address(self, name: str) -> str:
        """Where ``name`` listens: its own address with ``netns``; a replica added by ``pygmy member``
        at an IP address of its own (another loopback address, a host's) on that address, unless
        ``bind`` is a wildcard; else ``bind``."""
        if self.netns:
            return self.address(name)
        tier = name.rpartition("-")[0]
        url = self.members.get(tier, {}).get(name)
        host = urlsplit(url).hostname if url else None
        if host and self.bind not in ("0.0.0.0", "::", "") and _is_ip(host):
            return host
        return self.bind

    def _schemed(self, url: str) -> str:
        """``url`` with this run's scheme: members recorded before ``--tls`` was turned on (or off)
        keep their host and port."""
        return tls.with_scheme(url, self.tls)

    def urls(self, tier: str) -> list[str]:
        if tier in self.members:
            return [self._schemed(u) for u in self.members[tier].values()]
        explicit = {"catalog": self.catalog_urls, "order": self.order_urls}.get(tier)
        if explicit:
            return [self._schemed(u) for u in explicit]
        return [f"{self.scheme}://{self.address(f'{tier}-{k}')}:{self.local_port(tier, k)}"
                for k in range(1, self.replicas(tier) + 1)]

    def peers(self, tier: str) -> dict[str, str]:
        """``{name: url}`` of one replicated tier, ordered by replica number."""
        if tier in self.members:
            return dict(sorted(((n, self._schemed(u)) for n, u in self.members[tier].items()),
                               key=lambda kv: parse_name(kv[0])[1]))
        return {f"{tier}-{k}": url for k, url in enumerate(self.urls(tier), start=1)}

    def peer_address(self, name: str, peer: str) -> tuple[str, int] | None:
        """Where replica ``name`` dials ``peer``'s peer transport, if ``peer_addresses`` says; else None
        (the address ``peer``'s URL gives)."""
        given = self.peer_addresses.get(name, {}).get(peer)
        return None if given is None else host_port(given)

    def peers_now(self, caller: str, tier: str) -> dict[str, str]:
        """``peers_for`` as ``cluster.json`` says now (``pygmy member`` keeps it in step with the
        tier's changes), or nothing where there is none (a container's peers are its environment's)."""
        try:
            now = ClusterConfig.load(self.data_dir)
        except (RuntimeError, OSError, ValueError, TypeError):
            return {}
        return now.peers_for(caller, tier)

    def peers_for(self, caller: str, tier: str) -> dict[str, str]:
        """``peers(tier)`` as ``caller`` reaches them: ``router_urls`` where it names a replica."""
        given = self.router_urls.get(caller, {})
        return {name: self._schemed(given.get(name, url)) for name, url in self.peers(tier).items()}

    def check_links(self) -> list[str]:
        """What is wrong in ``peer_addresses`` and ``router_urls`` (nothing: an empty list)."""
        names, out = set(self.names()), []
        for name, links in self.peer_addresses.items():
            for peer, address in links.items():
                where = f"peer_addresses[{name!r}][{peer!r}]"
                if name not in names or peer not in names or name == peer or name.startswith("frontend-") \
                        or name.rpartition("-")[0] != peer.rpartition("-")[0]:
                    out.append(f"{where}: not a link between two replicas of one tier of this cluster")
                try:
                    host_port(address)
                except ValueError as exc:
                    out.append(f"{where}: {exc}")
        for caller, urls in self.router_urls.items():
            for replica, url in urls.items():
                where = f"router_urls[{caller!r}][{replica!r}]"
                if caller not in names or replica not in names or replica.startswith("frontend-") \
                        or caller.rpartition("-")[0] == replica.rpartition("-")[0]:
                    out.append(f"{where}: not a link from a service to a replica of another tier of this cluster")
                if not isinstance(url, str) or not url.startswith(("http://", "https://")) or _url_port(url) is None:
                    out.append(f"{where}: {url!r} is not an http://host:port URL")
        return out

    def frontend_url(self, k: int = 1) -> str:
        host = self.advertise_host or self.address(f"frontend-{k}")
        return f"{self.scheme}://{host}:{self.local_port('frontend', k)}"

    def listen_port(self, tier: str, k: int) -> int:
        if self.port is not None:
            return self.port
        url = self.members.get(tier, {}).get(f"{tier}-{k}")
        port = urlsplit(url).port if url else None
        return port if port is not None else self.local_port(tier, k)

    @property
    def scheme(self) -> str:
        """``https`` with TLS, else ``http``: how every service's URL begins."""
        return "https" if self.tls else "http"

    # -- files ----------------------------------------------------------------------------------
    @property
    def root(self) -> Path:
        return Path(self.data_dir).resolve()

    def run_dir(self) -> Path:
        return self.root / "run"

    def log_dir(self) -> Path:
        return self.root / "logs"

    def replica_dir(self, name: str) -> Path:
        return self.root / name

    def seed_file(self) -> Path:
        """The catalogue a new catalog replica starts from, built once by ``pygmy up --books``
        (``pygmy.catalog.books.build_seed``): a replica copies it rather than parse the JSON itself."""
        return self.root / "seed" / "catalog.db"

    def certs_path(self) -> Path:
        """The folder of the cluster's certificates (``pygmy certs``): ``certs_dir`` or ``D/certs``."""
        return Path(self.certs_dir).resolve() if self.certs_dir else self.root / "certs"

    def tool_tls(self, holder: str = "admin") -> dict[str, Any]:
        """Requests' ``verify`` and ``cert`` for the operator's tools (``holder``'s certificate) with
        TLS; nothing without."""
        return tls.requests_options(self.certs_path() if self.tls else None, holder)

    def pid_file(self, name: str) -> Path:
        return self.run_dir() / f"{name}.pid"

    def cluster_file(self) -> Path:
        return self.run_dir() / "cluster.json"

    def restored_file(self) -> Path:
        """Written by ``pygmy restore`` (unfinished first, its checks last); ``pygmy up`` checks the
        replicas against it, then removes it (``pygmy/cluster/backup.py``)."""
        return self.run_dir() / "restored.json"

    def unfinished_restore(self) -> bool:
        """Whether a restore into this data dir was cut short: no replica may run on it. Here, not
        in the backup module, so that ``pygmy serve`` asks without importing it (and Requests,
        Flask and prometheus_client before its metrics folder is set)."""
        try:
            return bool(json.loads(self.restored_file().read_text()).get("unfinished"))
        except FileNotFoundError:
            return False
        except ValueError:  # cut short while it was written: as unfinished as can be
            return True

    def secret(self, create: bool = False) -> str:
        """The internal secret between services (replication, leases, invalidation pushes, every
        replica endpoint): ``PYGMY_SECRET`` if set, else ``D/secret`` (made when ``create``)."""
        return self._credential("PYGMY_SECRET", "secret", "internal secret", create)

    def admin_token(self, create: bool = False) -> str:
        """The admin token for ``POST /update``: ``PYGMY_ADMIN_TOKEN`` if set, else ``D/admin-token``
        (made when ``create``). A setting of its own, and refused if it equals the internal secret,
        so that whoever may restock and reprice cannot also speak to replicas as one of them."""
        token = self._credential("PYGMY_ADMIN_TOKEN", "admin-token", "admin token", create)
        internal = os.environ.get("PYGMY_SECRET") or _read(self.root / "secret")
        if internal and secrets.compare_digest(token, internal):
            raise RuntimeError("the admin token must differ from the internal secret (PYGMY_SECRET or "
                               f"{self.root / 'secret'}): set PYGMY_ADMIN_TOKEN to another value")
        return token

    def _credential(self, env: str, filename: str, what: str, create: bool) -> str:
        value = os.environ.get(env)
        if value:
            return value
        path = self.root / filename
        if not path.exists():
            if not create:
                raise RuntimeError(f"no {what}: set {env} or run 'pygmy up' to create {path}")
            path.parent.mkdir(parents=True, exist_ok=True)
            # Created 0600 from the start: never readable by others, not even for a moment.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(24))
        value = path.read_text().strip()
        if not value:
            raise RuntimeError(f"{path} is empty: delete it (pygmy up makes a new {what}) or set {env}")
        return value

    # -- persistence ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self) -> None:
        self.run_dir().mkdir(parents=True, exist_ok=True)
        tmp = self.cluster_file().with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2))
        tmp.replace(self.cluster_file())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def load(cls, data_dir: str) -> ClusterConfig:
        path = Path(data_dir) / "run" / "cluster.json"
        if not path.exists():
            raise RuntimeError(f"{path} not found: start the cluster with 'pygmy up --data-dir {data_dir}' first")
        return cls.from_dict(json.loads(path.read_text()))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None


def host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` (``"[::1]:port"``) as ``(host, port)``; ValueError if it is not one."""
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port")
    return host, int(port)


def _url_port(url: str) -> int | None:
    try:
        parts = urlsplit(url)
        return parts.port if parts.hostname else None
    except ValueError:
        return None


def link_map(value: str | Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, str]]:
    """``peer_addresses`` or ``router_urls`` from JSON (a setting's text) or a mapping: an object of
    objects of strings, ``{from: {to: address}}``; ValueError otherwise."""
    data = json.loads(value) if isinstance(value, str) else value
    if not isinstance(data, Mapping) or not all(
            isinstance(links, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in links.items())
            for links in data.values()):
        raise ValueError('expected a JSON object of objects of strings, {"from": {"to": "address"}}')
    return {str(src): dict(links) for src, links in data.items()}


def parse_name(name: str) -> tuple[str, int]:
    """``catalog-2`` -> ``("catalog", 2)``; raises ValueError on anything else."""
    tier, _, k = name.rpartition("-")
    if tier not in TIERS or not k.isdigit() or int(k) < 1:
        raise ValueError(f"unknown service name {name!r} (expected e.g. frontend-1, catalog-2, order-3)")
    return tier, int(k)
