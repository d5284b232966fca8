"""``LogStore``: what is saved is what a restart loads."""

from __future__ import annotations

from pygmy.replication.core import Entry, HardState, Membership
from pygmy.replication.log_store import LogStore


def entries(lo: int, hi: int, term: int = 1) -> list[Entry]:
    return [Entry(i, term, {"i": i, "s": "x" * 3}) for i in range(lo, hi + 1)]


def test_persist_and_reload(tmp_path):
    store = LogStore(tmp_path / "raft.db")
    assert store.load().hard_state == HardState() and store.load().entries == []
    store.save(HardState(3, "n2", 5), entries(1, 10) + [Entry(11, 3, None)])
    store.close()
    loaded = LogStore(tmp_path / "raft.db").load()
    assert loaded.hard_state == HardState(3, "n2", 5)
    assert loaded.entries == entries(1, 10) + [Entry(11, 3, None)]
    assert loaded.snapshot == (0, 0) and loaded.installing is None


def test_vote_none_round_trips(tmp_path):
    store = LogStore(tmp_path / "raft.db")
    store.save(HardState(4, None, 0))
    assert store.load().hard_state == HardState(4, None, 0)


def test_the_announced_election_window_round_trips(tmp_path):
    """A restarted follower keeps out of elections as long as its last leader's lease assumed."""
    store = LogStore(tmp_path / "raft.db")
    store.save(HardState(4, "n1", 2, floor=300))
    store.close()
    assert LogStore(tmp_path / "raft.db").load().hard_state == HardState(4, "n1", 2, 300)


def test_truncate_suffix(tmp_path):
    store = LogStore(tmp_path / "raft.db")
    store.save(None, entries(1, 10))
    store.save(None, entries(6, 7, term=2), truncate_from=6)
    assert store.load().entries == entries(1, 5) + entries(6, 7, term=2)


def test_compact_prefix(tmp_path):
    store = LogStore(tmp_path / "raft.db")
    store.save(None, entries(1, 20))
    store.compact(12, 1)
    loaded = store.load()
    assert loaded.snapshot == (12, 1)
    assert loaded.entries == entries(13, 20)


def test_snapshot_install_replaces_log_and_clears_intent(tmp_path):
    store = LogStore(tmp_path / "raft.db")
    store.save(None, entries(1, 5))
    m = Membership(frozenset({"a", "b", "d"}), urls={"a": "http://a", "b": "http://b", "d": "http://d"})
    store.begin_install(40, 3, m)
    assert store.load().installing == (40, 3) and store.load().installing_membership == m
    store.save(HardState(3, None, 40), entries(41, 42, term=3), snapshot=(40, 3))
    loaded = store.load()
    assert loaded.installing is None and loaded.snapshot == (40, 3)
    assert loaded.entries == entries(41, 42, term=3)
    store.begin_install(50, 3, m)
    store.abort_install()
    assert store.load().installing is None and store.load().installing_membership is None
    store.begin_install(60, 3, m)
    store.begin_install(60, 3)  # an intent without a configuration keeps none of an earlier one's
    assert store.load().installing_membership is None


def test_a_full_disk_fails_the_save_cleanly_and_the_store_recovers(tmp_path):
    """SQLite rolls a transaction back by itself on SQLITE_FULL; the save must raise *that* error
    (not "cannot rollback"), keep what was saved before, and work again once there is room."""
    import sqlite3

    import pytest

    store = LogStore(tmp_path / "raft.db")
    store.save(HardState(1, "n1", 0), entries(1, 5))
    conn = store._conn
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count={pages + 1}")  # the disk is full from here on
    big = [Entry(i, 1, {"blob": "x" * 20_000}) for i in range(6, 40)]
    with pytest.raises(sqlite3.OperationalError, match="full"):
        store.save(HardState(2, "n1", 0), big)
    assert not conn.in_transaction
    assert store.load().hard_state == HardState(1, "n1", 0) and store.load().entries == entries(1, 5)
    conn.execute("PRAGMA max_page_count=1073741823")  # space returns
    store.save(HardState(2, "n1", 0), big)
    assert store.load().entries[-1] == big[-1]
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def size(store: LogStore) -> int:
    return store._conn.execute("SELECT COALESCE(SUM(LENGTH(command)), 0) FROM raft_log").fetchone()[0]


def test_the_logs_size_is_kept_through_every_change_and_a_restart(tmp_path):
    store = LogStore(tmp_path / "raft.db")
    store.save(None, entries(1, 20))
    assert store.log_bytes == size(store) > 0
    store.save(None, entries(15, 16, term=2), truncate_from=15)
    assert store.log_bytes == size(store)
    store.save(None, [Entry(17, 2, {"big": "y" * 500}), Entry(18, 2, None)])
    assert store.log_bytes == size(store)
    store.compact(10, 1)
    assert store.log_bytes == size(store)
    big = 500 + len('{"big":""}')
    # The oldest entries go first, as few as leave the rest within the budget.
    assert store.index_keeping(big) == 16, "entries 11-16 go, the big one and the empty one stay"
    assert store.index_keeping(big - 1) == 17
    assert store.index_keeping(size(store)) == 0, "within budget: nothing to compact"
    total = size(store)
    store.close()
    again = LogStore(tmp_path / "raft.db")
    assert again.log_bytes == total
    again.save(None, entries(31, 33, term=3), snapshot=(30, 3))
    assert again.log_bytes == size(again)
