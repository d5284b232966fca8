"""Settling the buys a backup's cut splits, and the invariants an archive is checked for, on state
files built command by command (no cluster: tests/system/test_backup.py runs the real thing)."""

import shutil
import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from pygmy.catalog.books import load as load_books
from pygmy.catalog.state import CatalogState, build_seed
from pygmy.cluster import backup
from pygmy.order.state import OrderState

NOW = datetime.now(UTC).isoformat(timespec="milliseconds")


def intent(key: str, item: int = 2, quantity: int = 1, created_at: str = NOW) -> dict:
    return {"op": "intent", "key": key, "item": item, "quantity": quantity, "created_at": created_at}


def decrement(key: str, item: int = 2, quantity: int = 1) -> dict:
    return {"op": "decrement", "key": key, "item": item, "quantity": quantity, "at": time.time(), "keyed": 1}


def copy_of(state: CatalogState | OrderState, path: Path) -> Path:
    """A pinned copy, as ``GET /backup`` makes it."""
    state.snapshot_to(path)
    return path


@pytest.fixture
def cut(tmp_path: Path) -> dict[str, Path]:
    """Copies of both tiers split across six buys and an update, as a backup under load takes them:

    a: intent, decrement, confirm, all before the order copy    -> confirmed as it was
    b: intent before the order copy, decrement before the catalog copy, no confirm -> confirmed
    c: the same, but the catalog refused it (too many copies)   -> failed with the catalog's 409
    d: intent before the order copy, no decrement by the catalog copy -> failed (not in the backup)
    e: intent after the order copy, decrement before the catalog copy -> decrement undone
    f: the same as e, refused by the catalog                    -> its key forgotten, no stock moved
    g: a decrement whose intent was lost with its leader (in neither order copy: the orphan scan
       had not recorded it yet)                                 -> undone from the catalog's own record
    u: an admin update (+5 copies of book 3) under its own key  -> kept, in the ledger
    """
    build_seed(load_books(None), tmp_path / "seed.db")
    live = tmp_path / "live"
    orders, catalog = OrderState(live / "order.db"), CatalogState(live / "catalog.db")
    catalog.restore(0, tmp_path / "seed.db")
    for i, cmd in enumerate([intent("a"), intent("b"), intent("c", quantity=999_999), intent("d")], 1):
        orders.apply(i, cmd)
    for i, cmd in enumerate([decrement("a"), decrement("b"), decrement("c", quantity=999_999)], 1):
        catalog.apply(i, cmd)
    orders.apply(5, {"op": "confirm", "key": "a", "title": "RPCs for Dummies", "cost": 15.0, "at": time.time()})
    folder = tmp_path / "archive"
    folder.mkdir()
    copy_of(orders, folder / "order.db")  # the order cut
    orders.apply(6, intent("e", item=4, quantity=3))
    orders.apply(7, intent("f", item=4, quantity=999_999))
    catalog.apply(4, decrement("e", item=4, quantity=3))
    catalog.apply(5, decrement("f", item=4, quantity=999_999))
    catalog.apply(6, {"op": "update", "item": 3, "stock_delta": 5, "key": "u"})
    catalog.apply(7, decrement("g", item=1, quantity=2))
    copy_of(catalog, folder / "catalog.db")  # the catalog cut
    catalog.apply(8, decrement("d"))  # too late for the catalog copy
    copy_of(orders, tmp_path / "order-after.db")
    shutil.copyfile(tmp_path / "seed.db", folder / "seed.db")
    orders.close_all()
    catalog.close_all()
    return {"folder": folder, "after": tmp_path / "order-after.db"}


def settle(cut: dict[str, Path]) -> dict[str, int]:
    f = cut["folder"]
    return backup.settle(f / "order.db", f / "catalog.db", cut["after"], time.time(), 86_400)


def rows(db: Path, sql: str) -> list[tuple]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def test_each_split_buy_is_settled_to_what_its_client_may_have_seen(cut: dict[str, Path]) -> None:
    assert settle(cut) == {"confirmed": 1, "failed": 1, "failed_not_in_catalog": 1, "undone": 2,
                           "forgotten_refusals": 1}
    f = cut["folder"]
    status = dict(rows(f / "order.db", "SELECT key, status FROM orders"))
    assert status == {"a": "confirmed", "b": "confirmed", "c": "failed", "d": "failed"}
    assert rows(f / "order.db", "SELECT error_code FROM orders WHERE key='d'") == [(409,)]
    keys = {k for (k,) in rows(f / "catalog.db", "SELECT key FROM idempotency")}
    assert keys == {"a", "b", "c", "u"}  # e's, f's and g's decrements are forgotten, the update's key kept
    stock = dict(rows(f / "catalog.db", "SELECT item_number, stock FROM books"))
    initial = dict(rows(f / "seed.db", "SELECT item_number, stock FROM books"))
    assert stock[2] == initial[2] - 2 and stock[4] == initial[4] and stock[3] == initial[3] + 5
    assert stock[1] == initial[1]
    problems, facts = backup.check(f)
    assert problems == [] and facts["confirmed"] == 2 and facts["copies_sold"] == 2 and facts["stock_ledger"]


def test_unsettled_copies_fail_the_check(cut: dict[str, Path]) -> None:
    """What a backup that skipped settling would write: caught by the stock equation and the pending orders."""
    problems, _ = backup.check(cut["folder"])
    assert any("book 4: stock" in p for p in problems), problems  # e's copies taken, no order for them
    assert any("book 2: stock" in p for p in problems), problems  # b's copies taken, b still pending
    assert any("is pending" in p for p in problems), problems


def test_a_catalog_copy_older_than_the_order_copy_fails_the_check(tmp_path: Path, cut: dict[str, Path]) -> None:
    """Copies taken the wrong way round: a confirmed order whose decrement the catalog copy lacks."""
    f = cut["folder"]
    build_seed(load_books(None), tmp_path / "fresh-seed.db")
    early = CatalogState(tmp_path / "early.db")
    early.restore(0, tmp_path / "fresh-seed.db")
    early.close_all()
    shutil.copyfile(tmp_path / "early.db", f / "catalog.db")
    settle(cut)
    problems, _ = backup.check(f)
    assert any("book 2: stock" in p for p in problems), problems


def test_a_store_whose_catalogue_predates_the_ledger_is_checked_without_the_equation(cut: dict[str, Path]) -> None:
    f = cut["folder"]
    settle(cut)
    conn = sqlite3.connect(f / "catalog.db")
    conn.execute("UPDATE meta SET value=0 WHERE key='stock_ledger'")
    conn.commit()
    conn.close()
    problems, facts = backup.check(f)
    assert problems == [] and not facts["stock_ledger"]


def test_an_intent_pending_longer_than_the_key_window_is_not_guessed(cut: dict[str, Path]) -> None:
    """The catalog may have forgotten its key: the backup refuses rather than pick an outcome."""
    f = cut["folder"]
    with pytest.raises(backup.BackupError, match="longer than the key window"):
        backup.settle(f / "order.db", f / "catalog.db", cut["after"], time.time() + 100, 10)


def test_a_restore_takes_no_setting_that_names_the_old_machines_files_or_addresses() -> None:
    """The books file the first cluster was built from may not exist where the archive is restored
    (the archive's seed holds the catalogue); members, URLs, the address bound and the certificates'
    folder belong to the old machines."""
    from pygmy.cluster.backup import restore_settings

    old = {"books": "/old/machine/books.json", "members": {"catalog": {"catalog-1": "http://10.0.0.1:8101"}},
           "catalog_replicas": 5, "key_window": 3600.0}
    old.update(certs_dir="/srv/prod/certs", bind="10.0.0.5", tls=True)
    config = restore_settings(old, {"catalog_replicas": 1}, "/new/data")
    assert config.books is None and config.members == {} and config.data_dir == "/new/data"
    assert config.certs_path() == Path("/new/data/certs").resolve() and config.bind == "127.0.0.1" and config.tls
    assert config.catalog_replicas == 1 and config.key_window == 3600.0


def test_a_pending_order_becomes_the_buy_the_catalog_took_stock_for_under_its_key(tmp_path: Path) -> None:
    """A request reused a key for another book: its intent is the pending order, the catalog's
    decrement under the key is the first buy's. Settled, the order is the first buy, so book by book
    stock = initial + added - sold holds in the archive."""
    build_seed(load_books(None), tmp_path / "seed.db")
    folder = tmp_path / "archive"
    folder.mkdir()
    orders, catalog = OrderState(tmp_path / "order.db"), CatalogState(tmp_path / "catalog.db")
    catalog.restore(0, tmp_path / "seed.db")
    orders.apply(1, intent("k", item=2, quantity=1))
    catalog.apply(1, decrement("k", item=4, quantity=2))
    copy_of(orders, folder / "order.db")
    copy_of(catalog, folder / "catalog.db")
    copy_of(orders, tmp_path / "after.db")
    shutil.copyfile(tmp_path / "seed.db", folder / "seed.db")
    orders.close_all()
    catalog.close_all()
    assert backup.settle(folder / "order.db", folder / "catalog.db", tmp_path / "after.db", time.time(), 86_400) == {
        "confirmed": 1}
    assert rows(folder / "order.db", "SELECT item_number, quantity, status FROM orders") == [(4, 2, "confirmed")]
    problems, facts = backup.check(folder)
    assert problems == [] and facts["copies_sold"] == 2


def test_an_archive_is_written_whole_and_readable_by_its_owner_only(tmp_path: Path, cut: dict[str, Path]) -> None:
    """With ``--with-secrets`` it holds the internal secret and the admin token."""
    from pygmy.kit.config import ClusterConfig

    settled = settle(cut)
    config = ClusterConfig(data_dir=str(tmp_path / "data"))
    config.secret(create=True)
    config.admin_token(create=True)
    dest = tmp_path / "out" / "x.tar"
    dest.parent.mkdir()
    backup.write_archive(cut["folder"], config, dest, {}, settled, time.time(), time.monotonic(), with_secrets=True)
    assert dest.stat().st_mode & 0o077 == 0
    with backup.opened(dest) as (folder, manifest):  # whole: every member as its hash says
        assert manifest["with_secrets"] and (folder / "secret").read_text() == config.secret()


def test_a_member_the_manifest_does_not_list_refuses_the_archive(tmp_path: Path, cut: dict[str, Path]) -> None:
    """Nothing vouches for a member added after the archive was written (a ``secret`` appended to an
    archive made without ``--with-secrets`` would be installed by a restore): refused whole."""
    import tarfile

    from pygmy.kit.config import ClusterConfig

    settled = settle(cut)
    config = ClusterConfig(data_dir=str(tmp_path / "data"))
    dest = tmp_path / "x.tar"
    backup.write_archive(cut["folder"], config, dest, {}, settled, time.time(), time.monotonic(), with_secrets=False)
    with backup.opened(dest) as (_, manifest):
        assert not manifest["with_secrets"]
    (tmp_path / "secret").write_text("not the cluster's")
    with tarfile.open(dest, "a") as tar:
        tar.add(tmp_path / "secret", arcname="secret")
    with pytest.raises(backup.BackupError, match="does not list: secret"), backup.opened(dest):
        pass


def test_a_restore_cut_short_leaves_a_data_dir_that_up_refuses(tmp_path: Path) -> None:
    from pygmy.cluster.launcher import LaunchError
    from pygmy.kit.config import ClusterConfig

    config = ClusterConfig(data_dir=str(tmp_path / "data"))
    marker = backup.restored_marker(config)
    backup.refuse_unfinished(config, reset_state=False)  # no restore: nothing to say
    marker.parent.mkdir(parents=True)
    for unfinished in ('{"unfinished": true}', '{"unfin'):  # as the restore begins; cut short writing it
        marker.write_text(unfinished)
        with pytest.raises(LaunchError, match="did not finish"):
            backup.refuse_unfinished(config, reset_state=False)
    backup.refuse_unfinished(config, reset_state=True)  # --reset deletes the store, and forgets it
    assert not marker.exists()
    marker.write_text('{"catalog": {"index": 3, "digest": "ab"}}')  # finished: checked once up
    backup.refuse_unfinished(config, reset_state=False)
    assert marker.exists()


def test_a_replica_is_not_started_alone_on_an_unfinished_restore(tmp_path: Path) -> None:
    """``pygmy start NAME`` and ``pygmy serve`` refuse the data dir ``pygmy up`` would refuse,
    starting nothing."""
    from pygmy.cluster.local import pygmy
    from pygmy.kit.config import ClusterConfig

    config = ClusterConfig(data_dir=str(tmp_path / "data"))
    config.save()
    marker = backup.restored_marker(config)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text('{"unfinished": true}')
    r = pygmy("start", "catalog-1", "--data-dir", str(tmp_path / "data"))
    assert r.returncode == 1 and "did not finish" in r.stderr, (r.stdout, r.stderr)
    assert not config.pid_file("catalog-1").exists()
    # Nor by ``pygmy serve``, what ``start`` runs (and what a container or a unit file runs).
    r = pygmy("serve", "order", "--id", "1", "--data-dir", str(tmp_path / "data"), timeout=30)
    assert r.returncode == 1 and "did not finish" in r.stderr, (r.stdout, r.stderr)
    assert not config.replica_dir("order-1").exists()


def test_scheduled_backups_prune_only_their_own_archives_and_never_the_newest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pygmy.kit.config import ClusterConfig

    config = ClusterConfig(data_dir=str(tmp_path / "data"), backup_every=60, backup_keep=2,
                           backup_dir=str(tmp_path / "b"))
    folder = tmp_path / "b"
    folder.mkdir()
    theirs = [folder / "pygmy-1.tar", folder / "pygmy-mine.tar"]  # an operator's, in the same folder
    # Written by a clock that ran ahead: the next archive's name sorts before them.
    ahead = [folder / f"pygmy-2999010{i}T000000000000Z.tar" for i in (1, 2, 3)]
    for p in theirs + ahead:
        p.write_text("x")
    written: list[Path] = []
    monkeypatch.setattr(backup, "backup", lambda config, dest, *a, **k: (dest.write_text("new"), written.append(dest)))
    backup.Scheduled(config, lambda line: None).work()
    (dest,) = written
    assert dest.exists() and all(p.exists() for p in theirs)
    assert sorted(p.name for p in folder.glob("pygmy-2999*")) == [ahead[2].name]  # with the new one: 2 kept


def test_scheduled_backups_ask_the_members_pygmy_member_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A round takes each tier's members from ``cluster.json`` as ``pygmy member`` left it, not as
    ``pygmy up`` started: after a lost host's replica is replaced, the removed one (which serves
    nothing) is not what every round asks."""
    from pygmy.cluster import members
    from pygmy.kit.config import ClusterConfig

    config = ClusterConfig(data_dir=str(tmp_path / "data"), backup_every=60, backup_dir=str(tmp_path / "b"))
    config.save()
    asked: list[dict[str, str]] = []
    monkeypatch.setattr(backup, "backup", lambda config, dest, *a, **k: asked.append(config.peers("order")))
    scheduled = backup.Scheduled(config, lambda line: None)
    scheduled.work()
    first = config.peers("order")
    assert asked == [first] and "order-3" in first
    urls = {**first, "order-4": "http://127.0.0.1:9204"}
    del urls["order-3"]
    members.record(ClusterConfig.load(config.data_dir), "order",
                   {"voters": ["order-1", "order-2", "order-4"], "learners": [], "urls": urls})
    scheduled.work()
    assert list(asked[1]) == ["order-1", "order-2", "order-4"] and asked[1]["order-4"] == "http://127.0.0.1:9204"
    assert config.peers("order") == first  # the settings ``up`` runs with are left as they were


def test_a_scheduled_backup_under_way_ends_when_stopped_and_leaves_no_copies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pygmy up`` stopping: a backup still asking for its copies (for up to two minutes) ends at
    once, and the folder of its copies goes with it (it was left behind, a full copy each time)."""
    from pygmy.kit.config import ClusterConfig

    folder = tmp_path / "b"
    config = ClusterConfig(data_dir=str(tmp_path / "data"), backup_every=0.05, backup_dir=str(folder))
    config.secret(create=True)
    monkeypatch.setattr(backup, "_candidates", lambda config, tier: [("order-1", "http://127.0.0.1:9")])
    said: list[str] = []
    scheduled = backup.Scheduled(config, said.append)
    scheduled.start()
    deadline = time.monotonic() + 10
    while not list(folder.glob(".pygmy-backup-*")):  # a round has begun, and keeps asking
        assert time.monotonic() < deadline, said
        time.sleep(0.01)
    scheduled.stop()
    assert not scheduled._thread.is_alive() and not list(folder.glob(".pygmy-backup-*"))
    assert any("stopped" in line for line in said), said


def test_up_checks_each_restored_replicas_state_file_before_it_first_runs(tmp_path: Path, cut: dict[str, Path]) -> None:
    """The archive's state in every replica's file, or ``pygmy up`` refuses to start them: checked on
    the files, since once running a replica's state may move on at once (a buy, key expiry). Once
    they passed, a start cut short before ``ready`` does not make the next one refuse."""
    import json

    from pygmy.cluster.launcher import LaunchError
    from pygmy.kit.config import ClusterConfig

    settled = settle(cut)
    old = ClusterConfig(data_dir=str(tmp_path / "old"))
    old.secret(create=True)
    archive = tmp_path / "x.tar"
    _, facts = backup.check(cut["folder"])
    at = {tier: {"index": facts[tier]["index"]} for tier in ("catalog", "order")}
    backup.write_archive(cut["folder"], old, archive, at, settled, time.time(), time.monotonic())
    config = ClusterConfig(data_dir=str(tmp_path / "data"))
    index = backup.restore(archive, config)["catalog"]["index"]
    marker = backup.restored_marker(config)
    written = marker.read_text()
    said: list[str] = []
    follower = config.replica_dir("catalog-2") / "state.db"
    good = follower.read_bytes()
    state = CatalogState(follower)  # one more buy in one copy: its digest and index move on
    state.apply(index + 1, decrement("late", item=5))
    state.close_all()
    with pytest.raises(LaunchError, match="catalog-2 does not hold the restored state"):
        backup.check_restored_files(config, said.append)
    follower.write_bytes(b"not a database")
    with pytest.raises(LaunchError, match="catalog-2's state file .* cannot be read"):
        backup.check_restored_files(config, said.append)
    follower.unlink()
    with pytest.raises(LaunchError, match="catalog-2 has no state file"):
        backup.check_restored_files(config, said.append)
    assert marker.read_text() == written and said == []
    follower.write_bytes(good)
    backup.check_restored_files(config, said.append)
    assert len(said) == 2 and json.loads(marker.read_text())["files_checked"]  # removed only once they run
    for name in config.peers("catalog"):  # they ran (a new leader's entry), and the start was cut short
        state = CatalogState(config.replica_dir(name) / "state.db")
        state.apply(index + 1, None)
        state.close_all()
    backup.check_restored_files(config, said.append)  # the next start checks the running replicas only
    assert len(said) == 2
    marker.unlink()  # no restore: nothing to check
    backup.check_restored_files(config, said.append)
