"""Online backups of both tiers at one cut, their check, and a new cluster built from one.

``pygmy backup DEST`` asks one replica of the ORDER tier for a copy of its state (``GET /backup``: a
linearizable read, pinned and copied page by page), THEN one of the CATALOG, then the order tier
again. A buy is an intent (order), a decrement under its key (catalog), a confirm (order), so the
two copies may split a buy; each such buy is settled in the archive to the outcome its client may
have seen (docs/replication.md, "Backups: one cut across two tiers", says why):

- an intent pending in the order copy whose key has a result in the catalog copy is confirmed or
  failed by that result;
- one with no decrement in the catalog copy failed: no client saw it succeed before the cut;
- a decrement in the catalog copy whose key has no order in the order copy (a buy that began after
  the order cut, or one whose intent was lost with its leader and not yet recorded from the
  decrement; the catalog keeps each decrement's book and quantity beside its key, and for keys
  from before that the second order copy names them) is undone: its copies go back to stock and
  its key is forgotten.

Then, book by book, stock = initial (the seed) + what updates and restocks added (``stock_added``)
- the copies of confirmed orders. ``check`` proves that on every archive, before it is written,
with ``--verify``, and before a restore writes anything.

The archive is a tar: ``manifest.json`` (the cut, what was settled, each member's SHA-256),
``settings.json`` (``cluster.json`` without members), ``seed.db``, ``catalog.db``, ``order.db`` and,
with ``--with-secrets`` only, ``secret`` and ``admin-token``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import sqlite3
import tarfile
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import requests

from pygmy.catalog.books import load as load_books
from pygmy.catalog.state import CatalogState, build_seed
from pygmy.cluster import launcher
from pygmy.kit.config import ClusterConfig
from pygmy.order.state import CONFIRMED, FAILED, PENDING, OrderState, adoption, failure
from pygmy.replication.core import HardState, Membership
from pygmy.replication.log_store import LogStore
from pygmy.replication.service import Periodic

FORMAT = 1
#: The names the scheduled backups give their archives, and the only ones their pruning deletes.
SCHEDULED_NAME = re.compile(r"pygmy-\d{8}T\d{12}Z\.tar")
DBS = ("seed.db", "catalog.db", "order.db")
SECRETS = {"secret": "secret", "admin-token": "admin-token"}  # archive member -> file in the data dir
#: How long one tier's copy may take to get, across failovers (each attempt on another replica).
COPY_DEADLINE = 120.0
#: Per request to a replica: connecting, and the longest wait for a byte of the copy.
COPY_TIMEOUT = (2.0, 60.0)
#: How long a restored cluster's replicas have to show the archive's state before it is ready.
RESTORE_CHECK = 60.0
#: Settings that describe the machines of the cluster backed up, not its store: a restore derives them.
MACHINE_SETTINGS = {"data_dir": "data", "members": {}, "tier_learners": {}, "catalog_urls": [], "order_urls": [],
                    "advertise_host": None, "port": None, "peer_addresses": {}, "router_urls": {}, "netns": "",
                    "backup_dir": "", "bind": "127.0.0.1",
                    # The old machines' certificates: a restored cluster makes its own (``pygmy certs``
                    # there would otherwise rotate the old cluster's, in their folder).
                    "certs_dir": "",
                    # The books file the first cluster was built from: the archive's seed holds its
                    # catalogue, and on the machine restored to the file may not exist.
                    "books": None}
NOT_IN_BACKUP = "not in the backup this store was restored from: no stock was taken (buy again with a new key)"

Say = Callable[[str], None]


class BackupError(RuntimeError):
    """A backup, check or restore that cannot be made; ``pygmy`` says why and exits 1."""


# -- copies ------------------------------------------------------------------------------------------
def _candidates(config: ClusterConfig, tier: str) -> list[tuple[str, str]]:
    """The tier's replicas, followers first: a copy costs the leader nothing then."""
    def rank(item: tuple[str, str]) -> int:
        try:
            role = requests.get(f"{item[1]}/status", timeout=(0.5, 1.0), **config.tool_tls()).json().get("role")
        except (requests.RequestException, ValueError):
            return 2
        return 0 if role in ("follower", "learner") else 1
    return sorted(config.peers(tier).items(), key=rank)


def fetch_copy(config: ClusterConfig, tier: str, dest: Path, say: Say,
               stopping: threading.Event | None = None) -> dict[str, Any]:
    """One replica's state at an index at least the tier's commit index as of this call, into
    ``dest``: asked of each replica in turn (a dead one, a failover, a stream cut short or a copy
    whose hash differs: the next) until ``COPY_DEADLINE``, or until ``stopping`` is set."""
    auth = {"Authorization": f"Bearer {config.secret()}"}
    deadline = time.monotonic() + COPY_DEADLINE
    last = "no replica asked"
    stopping = stopping or threading.Event()
    while time.monotonic() < deadline:
        for name, url in _candidates(config, tier):
            if stopping.is_set():
                raise BackupError(f"stopped while copying the {tier} tier")
            started = time.monotonic()
            try:
                with requests.get(f"{url}/backup", headers=auth, stream=True, timeout=COPY_TIMEOUT,
                                  **config.tool_tls()) as r:
                    if r.status_code != 200:
                        raise BackupError(f"{r.status_code} {r.text[:200]}")
                    index, want = int(r.headers["X-Pygmy-Applied-Index"]), r.headers["X-Pygmy-Sha256"]
                    digest, size = hashlib.sha256(), 0
                    with dest.open("wb") as f:
                        for chunk in r.iter_content(1 << 20):
                            f.write(chunk)
                            digest.update(chunk)
                            size += len(chunk)
                if digest.hexdigest() != want:
                    raise BackupError(f"the copy arrived damaged ({size} bytes)")
            except (requests.RequestException, BackupError, KeyError, ValueError, OSError) as exc:
                last = f"{name}: {exc}"
                say(f"{tier}: no copy from {name} ({str(exc).strip()[:160]}); asking another replica")
                continue
            say(f"{tier}: copied {name} at index {index} ({size / 2**20:.1f} MiB in "
                f"{time.monotonic() - started:.1f} s)")
            return {"replica": name, "index": index, "bytes": size}
        stopping.wait(0.3)
    raise BackupError(f"no {tier} replica gave a copy within {COPY_DEADLINE:.0f} s (last: {last})")


def _closed(*states: CatalogState | OrderState) -> None:
    for s in states:
        s.close_all()


def _self_contained(path: Path) -> None:
    """One file, nothing beside it (the WAL folded in): what goes into a tar."""
    conn = sqlite3.connect(str(path))
    try:
        conn.execute("PRAGMA journal_mode=DELETE")
    finally:
        conn.close()


# -- settling the buys a cut splits -----------------------------------------------------------------------
def settle(order_db: Path, catalog_db: Path, order_after_db: Path, cut: float, key_window: float) -> dict[str, int]:
    """Settle, in the copies, every buy the two cuts split (the module's docstring says how); how
    many of each. ``cut``: when the catalog copy was asked for (Unix seconds)."""
    orders, catalog, after = OrderState(order_db), CatalogState(catalog_db), OrderState(order_after_db)
    try:
        remembered = catalog.remembered()
        decrements = catalog.decrements()
        pending = orders.pending()
        order_keys = {o["key"] for o in orders.all_orders() if o["key"] is not None}
        counts = Counter[str]()
        with orders.amend() as conn:
            for o in pending:
                seen = remembered.get(o["key"])
                if seen is None:
                    if datetime.fromisoformat(o["created_at"]).timestamp() < cut - key_window:
                        # Its key may have been forgotten by the catalog already: outcome unknown here.
                        raise BackupError(f"order {o['order_number']} has been pending for longer than the key "
                                          "window; finish it (the sweep does, once the catalog answers) and back up again")
                    orders.execute(conn, 0, failure(o["key"], 409, NOT_IN_BACKUP, cut))
                    counts["failed_not_in_catalog"] += 1
                    continue
                result, at = seen
                # The buy the catalog decided under the key (a request reusing the key for another
                # book may have made the pending order): it becomes the key's order.
                item, quantity = decrements.get(o["key"], (o["item_number"], o["quantity"]))
                if result.get("ok"):
                    orders.execute(conn, 0, adoption(o["key"], item, quantity, result["book"], at, o["created_at"]))
                    counts["confirmed"] += 1
                else:
                    err = result.get("error", {})
                    orders.execute(conn, 0, failure(o["key"], err.get("code", 409), err.get("message", ""),
                                                    at or None, item, quantity))
                    counts["failed"] += 1
        with catalog.amend() as conn:
            for key in sorted(set(remembered) - order_keys):
                if key in decrements:
                    item, quantity = decrements[key]
                else:  # a key from before the catalog kept a decrement's book and quantity with it
                    later = after.by_key(key)
                    if later is None:
                        continue  # not a buy's: an update's key
                    item, quantity = later["item_number"], later["quantity"]
                catalog.undo_decrement(conn, key, item, quantity)
                counts["undone" if remembered[key][0].get("ok") else "forgotten_refusals"] += 1
        return dict(counts)
    finally:
        _closed(orders, catalog, after)


# -- the invariants of an archive ----------------------------------------------------------------------------
def seed_stock(seed_db: Path) -> dict[int, int]:
    conn = sqlite3.connect(f"{seed_db.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return {int(r[0]): int(r[1]) for r in conn.execute("SELECT item_number, stock FROM books")}
    finally:
        conn.close()


def check(folder: Path) -> tuple[list[str], dict[str, Any]]:
    """Every invariant of a settled pair of copies in ``folder`` (``seed.db``, ``catalog.db``,
    ``order.db``): each database whole, each digest equal to its rows', no order pending, one order
    per key, each decrement's order of its outcome, and book by book stock = initial + added - sold.
    The problems found (none: a good archive) and what was counted."""
    problems: list[str] = []
    for db in DBS:
        conn = sqlite3.connect(f"{(folder / db).resolve().as_uri()}?mode=ro", uri=True)
        try:
            verdict = conn.execute("PRAGMA integrity_check").fetchone()[0]
        except sqlite3.DatabaseError as exc:
            verdict = str(exc)
        finally:
            conn.close()
        if verdict != "ok":
            problems.append(f"{db} is damaged: {verdict}")
    if problems:
        return problems, {}
    initial = seed_stock(folder / "seed.db")
    work = Path(tempfile.mkdtemp(dir=folder))  # opening a state may migrate it: on copies, never the archive's
    try:
        for db in ("catalog.db", "order.db"):
            shutil.copyfile(folder / db, work / db)
        catalog, orders = CatalogState(work / "catalog.db"), OrderState(work / "order.db")
        try:
            facts: dict[str, Any] = {}
            for tier, state in (("catalog", catalog), ("order", orders)):
                applied, kept, rows = state.full_digest()
                facts[tier] = {"index": applied, "digest": kept}
                if kept != rows:
                    problems.append(f"{tier}: its maintained digest {kept} is not its rows' {rows}")
            all_orders = orders.all_orders()
            keys = Counter(o["key"] for o in all_orders if o["key"] is not None)
            problems += [f"key {k!r} gives {n} orders" for k, n in keys.items() if n > 1]
            problems += [f"order {o['order_number']} is pending" for o in all_orders if o["status"] == PENDING]
            by_key = {o["key"]: o for o in all_orders if o["key"] is not None}
            for key, (result, _) in catalog.remembered().items():
                o = by_key.get(key)
                if o is not None and o["status"] != (CONFIRMED if result.get("ok") else FAILED):
                    problems.append(f"order {o['order_number']} is {o['status']} but its decrement "
                                    f"{'took' if result.get('ok') else 'refused'} the stock")
            sold = Counter[int]()
            for o in all_orders:
                if o["status"] == CONFIRMED:
                    sold[o["item_number"]] += o["quantity"]
            ledger = catalog.ledger()
            if set(ledger) != set(initial):
                problems.append(f"the catalogue's books differ from the seed's ({len(ledger)} against {len(initial)})")
            complete = catalog.ledger_complete()
            if complete:
                for item, (stock, added) in sorted(ledger.items()):
                    if item in initial and stock != initial[item] + added - sold[item]:
                        problems.append(f"book {item}: stock {stock}, but initial {initial[item]} + added {added} "
                                        f"- sold {sold[item]} = {initial[item] + added - sold[item]}")
            facts.update(books=len(ledger), orders=len(all_orders), confirmed=sum(
                o["status"] == CONFIRMED for o in all_orders), copies_sold=sum(sold.values()), stock_ledger=complete)
            return problems, facts
        finally:
            _closed(catalog, orders)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- archives ---------------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def backup(config: ClusterConfig, dest: Path, with_secrets: bool = False, say: Say = lambda line: None,
           stopping: threading.Event | None = None) -> dict[str, Any]:
    """Write an archive of the running cluster of ``config`` to ``dest`` (refused if it exists);
    its manifest. ``stopping``: when set, the copies end (BackupError), their folder deleted."""
    if dest.exists():
        raise BackupError(f"{dest} exists: name a new file")
    dest.parent.mkdir(parents=True, exist_ok=True)
    started, t0 = time.time(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".pygmy-backup-", dir=dest.parent) as tmp:
        work = Path(tmp)
        say("order: asking for a copy (1 of 3)")
        order = fetch_copy(config, "order", work / "order.db", say, stopping)
        say("catalog: asking for a copy (2 of 3)")
        cut = time.time()
        catalog = fetch_copy(config, "catalog", work / "catalog.db", say, stopping)
        say("order: asking for a copy again, for the books of buys begun after the first (3 of 3)")
        fetch_copy(config, "order", work / "order-after.db", say, stopping)
        if time.time() - started > config.key_window:
            raise BackupError(f"the copies took longer than the key window ({config.key_window:g} s): "
                              "keys may have been forgotten meanwhile; back up again")
        settled = settle(work / "order.db", work / "catalog.db", work / "order-after.db", cut, config.key_window)
        (work / "order-after.db").unlink()
        say("settled the buys the cut split: " + (", ".join(f"{v} {k.replace('_', ' ')}" for k, v in
                                                            sorted(settled.items())) or "none"))
        if config.seed_file().exists():
            shutil.copyfile(config.seed_file(), work / "seed.db")
        else:  # a data dir begun before seeds: the catalogue named now, as a replica started from nothing reads
            build_seed(load_books(config.books), work / "seed.db")
        manifest = write_archive(work, config, dest, {"order": order, "catalog": catalog}, settled, started, t0,
                                 with_secrets)
        facts = manifest["state"]
    say(f"wrote {dest} ({dest.stat().st_size / 2**20:.1f} MiB): {facts['books']} books, {facts['orders']} orders "
        f"({facts['confirmed']} confirmed), order index {order['index']}, catalog index {catalog['index']}, "
        f"in {time.monotonic() - t0:.1f} s")
    return manifest


def write_archive(work: Path, config: ClusterConfig, dest: Path, cut: dict[str, Any], settled: dict[str, int],
                  started: float, t0: float, with_secrets: bool = False) -> dict[str, Any]:
    """The archive ``dest`` of the settled copies in ``work`` (``seed.db``, ``catalog.db``,
    ``order.db``), once ``check`` finds them whole: with ``config``'s settings, the ``cut`` (each
    tier's replica, index and bytes) and what was ``settled``; its manifest. ``started``: when the
    copies were begun (Unix seconds; ``t0`` the same on ``time.monotonic``'s clock)."""
    for db in DBS:
        _self_contained(work / db)
    problems, facts = check(work)
    if problems:
        raise BackupError("the settled copies break an invariant (a bug; nothing written): " + "; ".join(problems[:5]))
    settings = {k: v for k, v in config.to_dict().items() if k not in MACHINE_SETTINGS}
    settings.update(catalog_replicas=config.replicas("catalog"), order_replicas=config.replicas("order"))
    (work / "settings.json").write_text(json.dumps(settings, indent=1))
    members = ["settings.json", *DBS]
    if with_secrets:
        for member, value in (("secret", config.secret()), ("admin-token", config.admin_token())):
            (work / member).write_text(value)
            (work / member).chmod(0o600)
            members.append(member)
    manifest = {
        "format": FORMAT, "started_at": datetime.fromtimestamp(started, UTC).isoformat(timespec="milliseconds"),
        "seconds": round(time.monotonic() - t0, 3), "cut": cut, "settled": settled, "state": facts,
        "with_secrets": with_secrets, "sha256": {m: _sha256(work / m) for m in members},
    }
    (work / "manifest.json").write_text(json.dumps(manifest, indent=1))
    partial = work / "archive.tar"
    with partial.open("wb") as f:
        os.chmod(partial, 0o600)  # (it may hold the secret and the admin token) before a byte is in it
        with tarfile.open(fileobj=f, mode="w") as tar:
            for m in ["manifest.json", *members]:
                tar.add(work / m, arcname=m)
        f.flush()
        os.fsync(f.fileno())  # whole on disk before it takes the name: a power cut leaves the old one
    os.replace(partial, dest)
    _sync_dir(dest.parent)
    return manifest


def _sync_dir(folder: Path) -> None:
    """The rename into ``folder`` made durable, where the file system can (some refuse to sync a
    folder: the archive is whole and named all the same)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def opened(archive: Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """The archive's members in a temporary folder, each checked against the manifest's hash."""
    with tempfile.TemporaryDirectory(prefix=".pygmy-archive-") as tmp:
        folder = Path(tmp)
        try:
            with tarfile.open(archive, "r") as tar:
                names = tar.getnames()
                if "manifest.json" not in names:
                    raise BackupError(f"{archive} has no manifest.json: not a pygmy backup")
                tar.extractall(folder, filter="data")
            manifest = json.loads((folder / "manifest.json").read_text())
        except tarfile.TarError:
            raise BackupError(f"{archive} is not a pygmy backup: not a tar archive, or a damaged one") from None
        except (OSError, ValueError) as exc:
            raise BackupError(f"cannot read {archive} as a pygmy backup: {exc}") from None
        if manifest.get("format") != FORMAT:
            raise BackupError(f"{archive} is of format {manifest.get('format')!r}; this version reads {FORMAT}")
        hashes = manifest.get("sha256", {})
        for member in ["settings.json", *DBS]:
            if member not in hashes or member not in names:
                raise BackupError(f"{archive} lacks {member}")
        for member, want in hashes.items():
            if member not in names or _sha256(folder / member) != want:
                raise BackupError(f"{archive}: {member} is not what was written (its SHA-256 differs)")
        unlisted = sorted(set(names) - set(hashes) - {"manifest.json"})
        if unlisted:  # added since: nothing vouches for them (a restore would install a "secret")
            raise BackupError(f"{archive} holds members its manifest does not list: {', '.join(unlisted)}")
        yield folder, manifest


def verify(archive: Path, say: Say = lambda line: None) -> dict[str, Any]:
    """``pygmy backup --verify``: the archive's hashes and every invariant (``check``); what it holds."""
    with opened(archive) as (folder, manifest):
        problems, facts = check(folder)
        for tier in ("catalog", "order"):
            if facts and facts[tier]["index"] != manifest["cut"][tier]["index"]:
                problems.append(f"{tier}: at index {facts[tier]['index']}, the manifest says {manifest['cut'][tier]['index']}")
    if problems:
        raise BackupError(f"{archive} fails its checks: " + "; ".join(problems[:10]))
    if not facts["stock_ledger"]:
        say("note: the catalogue predates the stock ledger; the stock equation was not checked")
    say(f"{archive}: ok: {facts['books']} books, {facts['orders']} orders ({facts['confirmed']} confirmed, "
        f"{facts['copies_sold']} copies), order index {facts['order']['index']}, catalog index {facts['catalog']['index']}")
    return facts


# -- restore ------------------------------------------------------------------------------------------------
def holds_store(config: ClusterConfig) -> list[str]:
    """What in the data dir belongs to a store already (replica state, run files, the seed)."""
    root = config.root
    if not root.is_dir():
        return []
    found = [p.name for p in root.iterdir() if p.is_dir() and ((p / "state.db").exists() or (p / "raft.db").exists())]
    found += [str(p.relative_to(root)) for p in (config.cluster_file(), config.seed_file()) if p.exists()]
    return sorted(found)


def restore_settings(settings: dict[str, Any], overrides: dict[str, Any], data_dir: str) -> ClusterConfig:
    """The archive's settings, less what described its machines, with the flags given."""
    base = {**ClusterConfig().to_dict(), **settings, **MACHINE_SETTINGS, **overrides, "data_dir": data_dir}
    return ClusterConfig.from_dict(base)


def restore(archive: Path, config: ClusterConfig, force: bool = False, say: Say = lambda line: None) -> dict[str, Any]:
    """Write the data dir of a new cluster from ``archive``: each replica of ``config`` (any number
    per tier) as after a snapshot install (its state at the archive's index, an empty log from
    there, the new members as its configuration), the seed, ``cluster.json`` and, if the archive has
    them, the credentials. Refused, before anything is written, if the archive fails its checks or
    the data dir holds a store (unless ``force``: then that store is deleted). What ``pygmy up``
    must find before it says ready (``check_restored``)."""
    facts = verify(archive, say)
    live = [n for n in launcher.service_names(config) if launcher.running(config, n)]
    if live:
        raise BackupError(f"services of {config.root} are running ({', '.join(live[:5])}): stop them first")
    existing = holds_store(config)
    if existing and not force:
        raise BackupError(f"{config.root} holds a store already ({', '.join(existing[:5])}): restore into an "
                          "empty directory, or add --force to delete it")
    with opened(archive) as (folder, manifest):
        if existing:
            say(f"--force: deleting the store in {config.root}")
            launcher.reset(config)
            config.cluster_file().unlink(missing_ok=True)
        config.root.mkdir(parents=True, exist_ok=True)
        # First of all, a marker that says the restore is not finished: a restore cut short (^C, a
        # full disk) leaves a data dir that ``pygmy up`` refuses, not half a store it would start.
        marker = restored_marker(config)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"unfinished": True}))
        config.seed_file().parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder / "seed.db", config.seed_file())
        config.members = {tier: config.peers(tier) for tier in ("catalog", "order")}
        config.tier_learners = {}
        for tier in ("catalog", "order"):
            peers = config.peers(tier)
            index = facts[tier]["index"]
            for name in peers:
                d = config.replica_dir(name)
                d.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(folder / f"{tier}.db", d / "state.db")
                store = LogStore(d / "raft.db")
                try:  # what a snapshot install leaves: the log begins after the state's index
                    store.save(hard_state=HardState(1, None, index, 0), snapshot=(index, 1),
                               membership=Membership(frozenset(peers), urls=dict(peers)))
                finally:
                    store.close()
            say(f"{tier}: {len(peers)} replicas at index {index} ({', '.join(peers)})")
        for member, filename in SECRETS.items() if manifest.get("with_secrets") else ():
            if (folder / member).exists():
                # 0600 from the start, as ``ClusterConfig`` makes them: never readable by others.
                fd = os.open(config.root / filename, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.fchmod(fd, 0o600)  # (a file left by --force's reset keeps its old mode otherwise)
                with os.fdopen(fd, "w") as f:
                    f.write((folder / member).read_text())
        config.save()
        expected = {tier: facts[tier] for tier in ("catalog", "order")}
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(json.dumps(expected))
        os.replace(tmp, marker)  # finished: what ``pygmy up`` checks the replicas against
    return expected


def restored_marker(config: ClusterConfig) -> Path:
    """Written by a restore; ``pygmy up`` checks the replicas against it, then removes it."""
    return config.restored_file()


def refuse_unfinished(config: ClusterConfig, reset_state: bool) -> None:
    """Before ``pygmy up`` starts anything: a restore that did not finish left its marker saying so,
    and its data dir is refused (``--reset``, which deletes the store, forgets it)."""
    marker = restored_marker(config)
    if not marker.exists():
        return
    if reset_state:
        marker.unlink()
        return
    if config.unfinished_restore():
        raise launcher.LaunchError(f"a restore into {config.root} did not finish: run it again with --force "
                                   "(or start afresh with --reset)")


def _restored_expectation(config: ClusterConfig) -> tuple[dict[str, Any], bool] | None:
    """What a restore left for ``pygmy up`` to check (index and digest per tier), and whether its
    files were checked already (then replicas have run on them since); None if nothing."""
    marker = restored_marker(config)
    if not marker.exists():
        return None
    facts = json.loads(marker.read_text())
    return {tier: facts[tier] for tier in ("catalog", "order")}, bool(facts.get("files_checked"))


def check_restored_files(config: ClusterConfig, say: Say) -> None:
    """Before a restored cluster first starts: every replica's state file holds exactly the
    archive's state (its index, and its digest, maintained and recomputed from its rows). Checked on
    the files, not on the running replicas: once they run, writes may come at once (a client's buy,
    key expiry, a restock), and the state moves on from the archive's. Once passed, the marker says
    so before any replica runs: a start cut short after that (^C before ``ready``) is checked by
    ``check_restored`` alone next time, its replicas' state having moved on."""
    expected = _restored_expectation(config)
    if expected is None or expected[1]:
        return
    for tier, want in expected[0].items():
        kind = CatalogState if tier == "catalog" else OrderState
        for name in config.peers(tier):
            path = config.replica_dir(name) / "state.db"
            if not path.exists():
                raise launcher.LaunchError(f"{name} has no state file ({path}): restore again with --force")
            state: CatalogState | OrderState | None = None
            try:  # opened as its replica will open it (a database of an older version migrated alike)
                state = kind(path)
                applied, kept, rows = state.full_digest()
            except (sqlite3.Error, OSError) as exc:
                raise launcher.LaunchError(f"{name}'s state file {path} cannot be read: {exc}") from None
            finally:
                if state is not None:
                    _closed(state)
            if (applied, kept, rows) != (want["index"], want["digest"], want["digest"]):
                raise launcher.LaunchError(
                    f"{name} does not hold the restored state: index {applied}, digest {kept}, rows {rows}; "
                    f"expected index {want['index']} and digest {want['digest']}")
        say(f"{tier}: every replica's state file holds the restored state (digest {want['digest']})")
    marker = restored_marker(config)
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps({**expected[0], "files_checked": True}))
    os.replace(tmp, marker)


def check_restored(config: ClusterConfig, say: Say) -> None:
    """Before a restored cluster is called ready: every replica of each tier runs from the
    archive's state (whose files ``check_restored_files`` checked before they first ran): it is up,
    not failed, at the archive's index or later. Then the marker goes. Raises
    ``launcher.LaunchError`` after ``RESTORE_CHECK`` seconds otherwise."""
    expected = _restored_expectation(config)
    if expected is None:
        return
    deadline = time.monotonic() + RESTORE_CHECK
    with requests.Session() as s:
        for tier, want in expected[0].items():
            for name, url in config.peers(tier).items():
                while True:
                    try:
                        v = s.get(f"{url}/status", timeout=(1, 5), **config.tool_tls()).json()
                        seen = f"index {v['applied_index']}, role {v['role']}, error {v['error']}"
                        if v["error"] is None and v["applied_index"] >= want["index"]:
                            break
                    except (requests.RequestException, ValueError, KeyError, TypeError) as exc:
                        seen = str(exc)[:120]
                    if time.monotonic() > deadline:
                        raise launcher.LaunchError(f"{name} does not run from the restored state: {seen}; expected "
                                                   f"an index of {want['index']} or more")
                    time.sleep(0.2)
            say(f"{tier}: every replica runs from the restored state")
    restored_marker(config).unlink()


class Scheduled(Periodic):
    """``pygmy up --backup-every S``: an archive every ``S`` seconds into the backup folder, named by
    its time (``pygmy-20261126T204500Z.tar``), the newest ``backup_keep`` kept: the restocker's
    style, in the process that runs the cluster. A round that fails says why; the next one tries again."""

    def __init__(self, config: ClusterConfig, say: Say) -> None:
        super().__init__("scheduled-backups", config.backup_every)
        self.config, self.say = config, say
        self.folder = Path(config.backup_dir) if config.backup_dir else config.root / "backups"

    def members_now(self) -> ClusterConfig:
        """The cluster's settings with each tier's members as ``cluster.json`` says now (``pygmy
        member`` keeps it in step): a replaced host's replica is asked, not the one it replaced,
        which serves nothing once removed (every round failed until ``up`` restarted)."""
        try:
            now = ClusterConfig.load(self.config.data_dir)
        except (RuntimeError, OSError, ValueError, TypeError):
            return self.config
        return dataclasses.replace(self.config, members=now.members, tier_learners=now.tier_learners)

    def work(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        dest = self.folder / f"pygmy-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%fZ')}.tar"
        try:
            backup(self.members_now(), dest, stopping=self._stop)
        except (BackupError, OSError, sqlite3.Error) as exc:
            self.say(f"scheduled backup failed (next in {self.every:g} s): {exc}")
            return
        self.say(f"backed up into {dest}")
        # Only archives named as this writes them, oldest by name, never the one just written (a
        # clock stepped back names it older than the rest).
        ours = sorted(p for p in self.folder.glob("pygmy-*.tar") if SCHEDULED_NAME.fullmatch(p.name) and p != dest)
        for old in ours[:max(0, len(ours) + 1 - self.config.backup_keep)]:
            old.unlink(missing_ok=True)
