"""CatalogState on its own: every command through ``apply`` (the replicated command path), in-process.

Decrements are idempotent by key and never take stock below zero; updates change stock and cost
(once per key when they carry one); restocks refill only the sold-out books they name.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pygmy.catalog.state as state_mod
from pygmy.catalog.state import CatalogState, book_dict, build_seed, cents, error

BOOKS = [
    {"item_number": 1, "title": "How to get a good grade in 677 in 20 minutes a day",
     "topic": "distributed systems", "stock": 10, "cost": 20.0},
    {"item_number": 2, "title": "RPCs for Dummies", "topic": "distributed systems", "stock": 0, "cost": 15.0},
    {"item_number": 3, "title": "Xen and the Forgotten Art of Virtualization", "topic": "Graduate School",
     "stock": 3, "cost": 30.0},
    {"item_number": 4, "title": "Cooking for the Impatient Graduate Student", "topic": "graduate school",
     "stock": 0, "cost": 12.5},
    {"item_number": 5, "title": "Spring in the Pioneer Valley", "topic": "graduate school", "stock": 0,
     "cost": 0.29},
]


def book(item: int, stock: int, version: int = 0, cost: float | None = None) -> dict[str, Any]:
    b = BOOKS[item - 1]
    return {"item_number": item, "title": b["title"], "topic": b["topic"], "stock": stock,
            "cost": b["cost"] if cost is None else cost, "version": version}


class Log:
    """Applies commands at consecutive log indexes, as a replica's applier does."""

    def __init__(self, state: CatalogState) -> None:
        self.state = state
        self.index = 0

    def __call__(self, command: dict[str, Any] | None) -> Any:
        self.index += 1
        return self.state.apply(self.index, command)


def decrement(item: int, quantity: int, key: str) -> dict[str, Any]:
    return {"op": "decrement", "item": item, "quantity": quantity, "key": key}


def update(item: int, **fields: Any) -> dict[str, Any]:
    return {"op": "update", "item": item, **fields}


def restock(amount: int, items: list[int] | None) -> dict[str, Any]:
    cmd: dict[str, Any] = {"op": "restock", "amount": amount}
    if items is not None:
        cmd["items"] = items
    return cmd


@pytest.fixture
def state(tmp_path: Path) -> Iterator[CatalogState]:
    s = CatalogState(tmp_path / "catalog.db")
    s.seed(BOOKS)
    yield s
    s.close()


@pytest.fixture
def log(state: CatalogState) -> Log:
    return Log(state)


def stocks(state: CatalogState) -> list[int]:
    return [state.book(n)["stock"] for n in range(1, 6)]


# -- seeding and reads ------------------------------------------------------------------------------
def test_seed_loads_the_books_once(state: CatalogState, log: Log) -> None:
    assert [state.book(n) for n in range(1, 6)] == [book(n, b["stock"]) for n, b in enumerate(BOOKS, 1)]
    assert state.book(6) is None
    state.seed([{"item_number": 9, "title": "X", "topic": "y", "stock": 1, "cost": 1.0}])
    assert state.book(9) is None  # a replica with books is never seeded again
    assert state.book(5)["cost"] == 0.29 and state.read("SELECT cost_cents FROM books WHERE item_number=5")[0][0] == 29


def test_existing_names_the_items_that_are_books(state: CatalogState, log: Log) -> None:
    """What a batch of decrements holds in the caches: only books (a floor per item that is none,
    from buys of random numbers, would stay in every worker for good)."""
    assert state.existing([5, 6, 1, 2**62]) == [1, 5]
    assert state.existing([6]) == []


def test_an_empty_replica_past_index_zero_is_not_seeded(tmp_path: Path) -> None:
    s = CatalogState(tmp_path / "c.db")
    s.apply(1, None)  # it has applied log entries: its books come from the log or a snapshot
    s.seed(BOOKS)
    assert s.book(1) is None
    s.close()


def test_book_at_gives_the_applied_index(state: CatalogState, log: Log) -> None:
    assert state.book_at(1) == (0, book(1, 10))
    log(None)
    log(decrement(3, 1, "k"))
    assert state.book_at(1) == (2, book(1, 10))  # unchanged since seeding, but read at index 2
    assert state.book_at(3) == (2, book(3, 2, version=2))
    assert state.book_at(42) == (2, None)



def test_books_reads_the_existing_books_of_a_list_by_item_number(state: CatalogState, log: Log) -> None:
    log(decrement(1, 2, "k1"))
    assert state.books([3, 1, 9]) == {1: book(1, 8, version=1), 3: book(3, 3)}
    assert state.books([9]) == {} and state.books([]) == {}


def test_sold_out_lists_books_with_no_stock_in_item_order(state: CatalogState, log: Log) -> None:
    assert state.sold_out() == [2, 4, 5]
    log(decrement(3, 3, "k"))
    assert state.sold_out() == [2, 3, 4, 5]


def test_search_normalises_the_topic(state: CatalogState, log: Log) -> None:
    assert state.search_at("Graduate-School") == (0, [
        {"item_number": 3, "title": BOOKS[2]["title"]},
        {"item_number": 4, "title": BOOKS[3]["title"]},
        {"item_number": 5, "title": BOOKS[4]["title"]},
    ], False)
    log(None)
    assert state.search_at("distributed_systems") == (1, [
        {"item_number": 1, "title": BOOKS[0]["title"]}, {"item_number": 2, "title": BOOKS[1]["title"]},
    ], False)
    assert state.search_at("cooking") == (1, [], False)


def test_search_pages_by_item_number_and_says_whether_more_follow(state: CatalogState) -> None:
    def numbers(after: int, limit: int | None) -> tuple[list[int], bool]:
        _, items, more = state.search_at("graduate school", after, limit)
        return [i["item_number"] for i in items], more

    assert numbers(0, 2) == ([3, 4], True)
    assert numbers(4, 2) == ([5], False)
    assert numbers(0, 3) == ([3, 4, 5], False)  # exactly a page: no empty page after it
    assert numbers(5, 2) == ([], False)
    assert numbers(3, None) == ([4, 5], False)


def test_a_search_page_costs_its_own_size_not_the_topics(tmp_path: Path) -> None:
    """One index range scan that stops one book past the page: the same page costs the same (in
    SQLite virtual machine steps) on a topic of a page and one book as on a topic of 2,000 books."""
    sizes = {"small": 3, "medium": 50, "large": 2000}
    books, n = [], 0
    for topic, size in sizes.items():
        for _ in range(size):
            n += 1
            books.append({"item_number": n, "title": f"b{n}", "topic": topic, "stock": 1, "cost": 1.0})
    s = CatalogState(tmp_path / "c.db")
    s.seed(books)
    steps = 0

    def step() -> int:
        nonlocal steps
        steps += 1
        return 0

    def cost(topic: str) -> int:
        nonlocal steps
        s._conn().set_progress_handler(step, 1)
        steps = 0
        _, page, more = s.search_at(topic, 0, 2)
        s._conn().set_progress_handler(None, 1)
        assert len(page) == 2 and more
        return steps

    try:
        assert cost("small") == cost("medium") == cost("large") > 0
    finally:
        s.close()


# -- decrement --------------------------------------------------------------------------------------
def test_decrement_takes_stock_and_versions_the_book(state: CatalogState, log: Log) -> None:
    log(None)
    assert log(decrement(1, 4, "k1")) == {"ok": True, "book": book(1, 6, version=2)}
    assert state.book(1) == book(1, 6, version=2)
    assert stocks(state) == [6, 0, 3, 0, 0]


def test_decrement_of_the_whole_stock_sells_out(state: CatalogState, log: Log) -> None:
    assert log(decrement(3, 3, "k")) == {"ok": True, "book": book(3, 0, version=1)}
    assert state.sold_out() == [2, 3, 4, 5]


def test_decrement_beyond_the_stock_is_refused_and_changes_nothing(state: CatalogState, log: Log) -> None:
    assert log(decrement(3, 4, "k")) == {
        "ok": False, "error": {"code": 409, "message": "out of stock: 3 left of item 3, 4 wanted"}}
    assert log(decrement(2, 1, "j")) == {
        "ok": False, "error": {"code": 409, "message": "out of stock: 0 left of item 2, 1 wanted"}}
    assert state.book(3) == book(3, 3) and state.book(2) == book(2, 0)


def test_decrement_of_an_unknown_book_is_404(state: CatalogState, log: Log) -> None:
    assert log(decrement(99, 1, "k")) == {
        "ok": False, "error": {"code": 404, "message": "no book with item number 99"}}
    assert stocks(state) == [10, 0, 3, 0, 0]


def test_a_decrement_key_applies_once_and_repeats_its_first_answer(state: CatalogState, log: Log) -> None:
    first = log(decrement(1, 4, "k"))
    log(update(1, stock_delta=5))
    # The retry (after a timeout or failover) answers what the first did, and takes no more stock.
    assert log(decrement(1, 4, "k")) == first == {"ok": True, "book": book(1, 6, version=1)}
    assert state.book(1) == book(1, 11, version=2)
    assert log(decrement(1, 4, "other"))["book"]["stock"] == 7


def test_a_refused_decrement_key_stays_refused(state: CatalogState, log: Log) -> None:
    refused = log(decrement(2, 1, "k"))
    log(restock(5, [2]))
    assert log(decrement(2, 1, "k")) == refused  # the buyer was told 409; a retry must not sell
    assert state.book(2)["stock"] == 5
    missing = log(decrement(99, 1, "m"))
    assert log(decrement(99, 1, "m")) == missing


def test_a_batch_of_decrements_is_each_decrement_in_order_under_its_own_key(state: CatalogState, log: Log) -> None:
    """One log entry for the buys in flight: each applies as it would alone, in order (the second
    takes what the first left), refusals and repeats included, so batching changes no outcome."""
    alone = log(decrement(3, 1, "before"))
    batch = log({"op": "decrements", "items": [decrement(3, 1, "a"), decrement(3, 2, "b"), decrement(2, 1, "c"),
                                                decrement(3, 1, "before"), decrement(99, 1, "d"), decrement(3, 1, "a")]})
    assert batch["ok"] and batch["index"] == 2
    a, b, c, before, d, a_again = batch["results"]
    assert a == {"ok": True, "book": book(3, 1, version=2)}
    assert b == error(409, "out of stock: 1 left of item 3, 2 wanted")
    assert c["error"]["code"] == 409 and d["error"]["code"] == 404
    assert before == alone and a_again == a  # a key repeats its first answer, in or out of a batch
    assert state.book(3)["stock"] == 1
    assert log(decrement(3, 2, "b")) == b  # and after it


# -- update -----------------------------------------------------------------------------------------
def test_update_changes_stock_and_cost(state: CatalogState, log: Log) -> None:
    log(None)
    assert log(update(3, stock_delta=7, cost=31.5)) == {"ok": True, "book": book(3, 10, version=2, cost=31.5)}
    assert state.book(3) == book(3, 10, version=2, cost=31.5)


def test_update_without_a_cost_keeps_it(state: CatalogState, log: Log) -> None:
    assert log(update(3, stock_delta=-1)) == {"ok": True, "book": book(3, 2, version=1)}
    assert log(update(3, stock_delta=1, cost=None)) == {"ok": True, "book": book(3, 3, version=2)}


def test_update_of_the_cost_alone_keeps_the_stock(state: CatalogState, log: Log) -> None:
    assert log(update(1, cost=0.29)) == {"ok": True, "book": book(1, 10, version=1, cost=0.29)}
    assert state.read("SELECT cost_cents FROM books WHERE item_number=1")[0][0] == 29
    assert log(update(1, stock_delta=None, cost=0.0)) == {"ok": True, "book": book(1, 10, version=2, cost=0.0)}


def test_update_down_to_exactly_zero_is_allowed(state: CatalogState, log: Log) -> None:
    assert log(update(3, stock_delta=-3)) == {"ok": True, "book": book(3, 0, version=1)}
    assert state.sold_out() == [2, 3, 4, 5]


def test_update_below_zero_is_refused_and_changes_nothing(state: CatalogState, log: Log) -> None:
    assert log(update(3, stock_delta=-4, cost=1.0)) == {
        "ok": False, "error": {"code": 409, "message": "stock would go negative: 3 in stock, delta -4"}}
    assert state.book(3) == book(3, 3)


def test_update_of_an_unknown_book_is_404(state: CatalogState, log: Log) -> None:
    assert log(update(99, stock_delta=1)) == {
        "ok": False, "error": {"code": 404, "message": "no book with item number 99"}}


def test_an_update_key_applies_once(state: CatalogState, log: Log) -> None:
    first = log(update(1, stock_delta=5, key="u"))
    assert first == {"ok": True, "book": book(1, 15, version=1)}
    assert log(update(1, stock_delta=5, key="u")) == first
    assert state.book(1) == book(1, 15, version=1)
    refused = log(update(3, stock_delta=-9, key="v"))
    log(update(3, stock_delta=10))
    assert log(update(3, stock_delta=-9, key="v")) == refused  # its answer stays the first one
    assert state.book(3)["stock"] == 13


def test_an_update_without_a_key_applies_every_time(state: CatalogState, log: Log) -> None:
    log(update(1, stock_delta=5))
    log(update(1, stock_delta=5, key=None))
    log(update(1, stock_delta=5, key=""))
    assert state.book(1) == book(1, 25, version=3)
    assert state.read("SELECT COUNT(*) FROM idempotency")[0][0] == 0


def test_update_and_decrement_keys_share_one_table(state: CatalogState, log: Log) -> None:
    first = log(decrement(1, 1, "same"))
    assert log(update(1, stock_delta=100, key="same")) == first
    assert state.book(1)["stock"] == 9


# -- restock ----------------------------------------------------------------------------------------
def test_restock_refills_only_the_named_sold_out_books(state: CatalogState, log: Log) -> None:
    log(None)
    # 3 is named but not sold out (skipped), 2 is sold out but not named (left), 9 does not exist.
    assert log(restock(7, [5, 3, 4, 9])) == {"ok": True, "items": [4, 5], "index": 2}
    assert [state.book(n) for n in (2, 3, 4, 5)] == [book(2, 0), book(3, 3), book(4, 7, version=2),
                                                     book(5, 7, version=2)]


def test_restock_naming_nothing_restocks_nothing(state: CatalogState, log: Log) -> None:
    assert log(restock(7, [])) == {"ok": True, "items": [], "index": 1}
    assert stocks(state) == [10, 0, 3, 0, 0]


def test_an_old_restock_without_names_refills_every_sold_out_book(state: CatalogState, log: Log) -> None:
    assert log(restock(4, None)) == {"ok": True, "items": [2, 4, 5], "index": 1}
    assert stocks(state) == [10, 4, 3, 4, 4]
    assert [state.book(n)["version"] for n in range(1, 6)] == [0, 1, 0, 1, 1]


def test_a_book_sold_again_before_the_restock_applies_is_skipped(state: CatalogState, log: Log) -> None:
    log(update(2, stock_delta=1))  # restocked by hand between proposing and applying
    assert log(restock(5, [2, 4])) == {"ok": True, "items": [4], "index": 2}
    assert stocks(state) == [10, 1, 3, 5, 0]


# -- the command path ---------------------------------------------------------------------------------
def test_an_unknown_command_is_refused_and_applies_nothing(state: CatalogState, log: Log) -> None:
    log(None)
    with pytest.raises(ValueError, match=r"^unknown catalog command 'burn'$"):
        state.apply(2, {"op": "burn", "item": 1})
    assert state.applied_index() == 1


def test_a_replayed_log_entry_changes_nothing(state: CatalogState, log: Log) -> None:
    log(decrement(1, 1, "a"))
    log(decrement(1, 1, "b"))
    assert state.apply(2, decrement(1, 1, "c")) is None
    assert state.applied_index() == 2 and state.book(1)["stock"] == 8


def test_replicas_applying_the_same_log_have_the_same_digest(tmp_path: Path) -> None:
    replicas = [CatalogState(tmp_path / f"r{i}.db") for i in range(3)]
    for r in replicas:
        r.seed(BOOKS)
    assert len({r.digest() for r in replicas}) == 1
    commands = [decrement(1, 2, "a"), update(3, stock_delta=1, cost=9.99), restock(2, [2])]
    for r in replicas[:2]:
        lg = Log(r)
        for cmd in commands:
            lg(cmd)
    lg = Log(replicas[2])
    for cmd in commands[:2]:
        lg(cmd)
    assert replicas[0].digest() == replicas[1].digest() != replicas[2].digest()
    for r in replicas:
        r.close()


def test_a_snapshot_carries_the_books_and_the_keys(state: CatalogState, log: Log, tmp_path: Path) -> None:
    first = log(decrement(1, 2, "a"))
    other = CatalogState(tmp_path / "other.db")
    state.snapshot_to(tmp_path / "snap.db")
    other.restore(state.applied_index(), tmp_path / "snap.db")
    assert other.digest() == state.digest() and other.applied_index() == 1
    assert other.apply(2, decrement(1, 2, "a")) == first  # the key came along: no second decrement
    assert other.book(1)["stock"] == 8
    other.close()


# -- helpers ------------------------------------------------------------------------------------------
def test_helpers() -> None:
    assert cents(0.29) == 29 and cents(12.5) == 1250 and cents(19.999) == 2000 and cents(0) == 0
    assert error(503, "busy") == {"ok": False, "error": {"code": 503, "message": "busy"}}
    row = {"item_number": 7, "title": "T", "topic": "t", "stock": 2, "cost_cents": 1999, "version": 4}
    assert book_dict(row) == {"item_number": 7, "title": "T", "topic": "t", "stock": 2, "cost": 19.99, "version": 4}


# -- key windows --------------------------------------------------------------------------------------
def test_expire_forgets_keys_before_its_time_and_keeps_the_rest(state: CatalogState, log: Log) -> None:
    log({**decrement(1, 1, "old"), "at": 100.0})
    log({**decrement(1, 1, "new"), "at": 200.0})
    log(decrement(1, 1, "timeless"))  # no time: kept for good
    log({**update(2, stock_delta=1), "key": "u-old", "at": 150.0})
    before = stocks(state)
    assert log({"op": "expire", "before": 200.0}) == {"ok": True, "forgotten": 2}
    assert state.key_count() == 2
    assert stocks(state) == before, "forgetting keys changes no book"
    # A forgotten key is a new request; a remembered one still repeats its first answer.
    assert log({**decrement(1, 1, "old"), "at": 300.0})["book"]["stock"] == before[0] - 1
    assert log({**decrement(1, 1, "new"), "at": 300.0})["book"]["stock"] == before[0] + 1, "its first answer"
    applied, kept, recomputed = state.full_digest()
    assert kept == recomputed


def old_database(path: Path, table: str, row: str) -> Path:
    """A catalog database as an older version left it: only its idempotency table, one key in it."""
    conn = sqlite3.connect(path)
    conn.execute(table)
    conn.execute(f"INSERT INTO idempotency VALUES {row}")
    conn.commit()
    conn.close()
    return path


def test_a_database_from_before_key_windows_keeps_its_keys_and_digest(tmp_path: Path) -> None:
    """The idempotency table without ``at``: migrated in place, its keys without a time (kept)."""
    path = old_database(tmp_path / "old.db", "CREATE TABLE idempotency (key TEXT PRIMARY KEY, result TEXT NOT NULL)",
                        "('k1', '{\"ok\": true}')")
    migrated = [CatalogState(path), CatalogState(tmp_path / "copy.db")]
    migrated[0].snapshot_to(tmp_path / "snap.db")
    migrated[1].restore(0, tmp_path / "snap.db")
    for s in migrated:
        assert s.key_count() == 1
        s.apply(1, {"op": "expire", "before": 10**10})
        assert s.key_count() == 1, "a key without a time is never forgotten"
        applied, kept, recomputed = s.full_digest()
        assert kept == recomputed
    assert migrated[0].applied_and_digest() == migrated[1].applied_and_digest()


def test_a_database_from_before_the_stock_ledger_gets_it_marked_incomplete(tmp_path: Path) -> None:
    """A books table without ``stock_added``: migrated in place, each book's added copies start at
    0, and the store says its ledger does not cover its history (``pygmy backup --verify`` then
    leaves out the stock check it would fail). A new store's ledger is complete."""
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE books (item_number INTEGER PRIMARY KEY, title TEXT NOT NULL, topic TEXT NOT NULL, "
                 "topic_key TEXT NOT NULL, stock INTEGER NOT NULL CHECK (stock >= 0), "
                 "cost_cents INTEGER NOT NULL, version INTEGER NOT NULL DEFAULT 0)")
    conn.execute("INSERT INTO books VALUES (1, 'b1', 't', 't', 7, 250, 3)")
    conn.commit()
    conn.close()
    old = CatalogState(path)
    try:
        assert not old.ledger_complete() and old.ledger() == {1: (7, 0)}
        assert old.apply(1, update(1, stock_delta=5))["ok"]
        assert old.ledger() == {1: (12, 5)} and not old.ledger_complete()
        applied, kept, recomputed = old.full_digest()
        assert kept == recomputed
    finally:
        old.close()
    again = CatalogState(path)  # as ``pygmy backup --verify`` opens a copy: the mark is kept
    new = CatalogState(tmp_path / "new.db")
    try:
        assert not again.ledger_complete() and again.ledger() == {1: (12, 5)}
        assert new.ledger_complete()
    finally:
        again.close()
        new.close()


def test_a_replica_started_from_the_built_catalogue_holds_what_seeding_it_would(tmp_path: Path) -> None:
    books = [{"item_number": n, "title": f"b{n}", "topic": f"t{n % 3}", "stock": n, "cost": n / 4} for n in range(1, 300)]
    build_seed(books, tmp_path / "seed" / "catalog.db")
    copied, seeded = CatalogState(tmp_path / "a.db"), CatalogState(tmp_path / "b.db")
    assert copied.is_new() and seeded.is_new()
    copied.restore(0, tmp_path / "seed" / "catalog.db")
    seeded.seed(books)
    assert not copied.is_new()
    assert copied.applied_and_digest() == seeded.applied_and_digest() == (0, copied.full_digest()[2])
    assert copied.book(299) == seeded.book(299)
    assert copied.apply(1, update(5, stock_delta=1)) == seeded.apply(1, update(5, stock_delta=1))
    assert copied.digest() == seeded.digest()
    copied.close()
    seeded.close()


def test_build_seed_reports_progress_makes_its_directory_and_leaves_only_the_seed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_mod, "SEED_STEP", 2)  # the books go in steps of 2 instead of 100,000
    dest = tmp_path / "data" / "seed" / "catalog.db"  # neither directory exists yet
    reports: list[tuple[int, int]] = []
    build_seed(BOOKS, dest, lambda done, total: reports.append((done, total)))
    assert reports == [(2, 5), (4, 5), (5, 5)]
    assert os.listdir(dest.parent) == ["catalog.db"]
    # Built again where an interrupted build left its half-written file: that file is not kept.
    (dest.parent / "catalog.db.building").write_bytes(b"half a database")
    build_seed(BOOKS[:2], dest)
    assert os.listdir(dest.parent) == ["catalog.db"]
    built = CatalogState(dest)
    assert [built.book(n) for n in (1, 2, 3)] == [book(1, 10), book(2, 0), None]
    built.close()


def keyed(command: dict[str, Any]) -> dict[str, Any]:
    """As this version's catalog leader proposes it: the key's index and buy are kept."""
    return {**command, "keyed": 1}


def test_keys_after_lists_the_decrements_keys_in_log_order_with_their_buy(state: CatalogState, log: Log) -> None:
    """What the order leader's orphan scan reads: each decrement's key at the index that first
    used it, with its book, quantity and answer; an update's key is not a buy's and is left out."""
    log(keyed({**decrement(1, 2, "a"), "at": 100.0}))  # index 1
    log(keyed({**update(3, stock_delta=1), "key": "u", "at": 100.0}))  # index 2
    log(keyed({"op": "decrements", "items": [{**decrement(2, 1, "c"), "at": 101.0},  # index 3: refused
                                             {**decrement(3, 1, "b"), "at": 101.0}]}))
    log(keyed({**decrement(1, 2, "a"), "at": 200.0}))  # a repeat: still at index 1, its first time
    applied, keys, more = state.keys_after(0, 10)
    assert applied == 4 and not more
    assert [(k["key"], k["idx"], k["item"], k["quantity"], k["ok"], k["at"]) for k in keys] == [
        ("a", 1, 1, 2, True, 100.0), ("b", 3, 3, 1, True, 101.0), ("c", 3, 2, 1, False, 101.0)]
    assert (keys[0]["title"], keys[0]["cost"]) == (BOOKS[0]["title"], BOOKS[0]["cost"])
    assert keys[2]["title"] is None
    # Pages end anywhere, inside an entry too: the next begins after the last (index, key) seen.
    assert [k["key"] for k in state.keys_after(0, 2)[1]] == ["a", "b"] and state.keys_after(0, 2)[2]
    assert [k["key"] for k in state.keys_after(3, 10, "b")[1]] == ["c"]
    assert state.keys_after(3, 10)[1] == []
    assert state.decrements() == {"a": (1, 2), "b": (3, 1), "c": (2, 1)}


def test_a_key_reused_for_another_buy_is_refused_with_the_buy_it_holds(state: CatalogState, log: Log) -> None:
    """422, with the first buy under the key (its book, quantity, time and answer), and nothing changed."""
    first = log(keyed({**decrement(1, 2, "k"), "at": 100.0}))
    before = stocks(state)
    got = log(keyed({**decrement(3, 1, "k"), "at": 200.0}))
    assert got == {**error(422, "this idempotency key was already used for a different buy"),
                   "buy": {"item": 1, "quantity": 2, "at": 100.0, "result": first}}
    assert stocks(state) == before and log(keyed({**decrement(1, 2, "k"), "at": 300.0})) == first


def test_an_entry_from_before_keys_were_indexed_is_replayed_as_it_was_first_applied(tmp_path: Path) -> None:
    """A command without ``keyed`` (written before) keeps index 0 and no buy, on a replica that
    applies it now as on one that applied it then and migrated: the same rows, the same digest."""
    s = CatalogState(tmp_path / "c.db")
    s.seed(BOOKS)
    s.apply(1, {**decrement(1, 1, "old"), "at": 100.0})
    assert s.keys_after(0, 10)[1] == [] and s.decrements() == {}
    assert s.read("SELECT idx, item, quantity FROM idempotency")[0][:] == (0, None, None)
    s.close()


def test_expire_keeps_the_keys_the_order_tier_has_not_read_back(state: CatalogState, log: Log) -> None:
    """With ``scanned``, a decrement's key used after that index is kept whatever its time (it may be
    all that is left of a buy), and the oldest time kept so is reported; an update's key is not a buy's."""
    log(keyed({**decrement(1, 1, "read"), "at": 100.0}))  # index 1
    log(keyed({**decrement(1, 1, "unread"), "at": 120.0}))  # index 2
    log(keyed({**update(3, stock_delta=1), "key": "u", "at": 110.0}))  # index 3
    log(keyed({**decrement(1, 1, "young"), "at": 500.0}))  # index 4
    assert log({"op": "expire", "before": 200.0, "scanned": 1}) == {"ok": True, "forgotten": 2, "kept_before": 120.0}
    assert sorted(state.remembered()) == ["unread", "young"]
    assert log({"op": "expire", "before": 200.0, "scanned": 4}) == {"ok": True, "forgotten": 1, "kept_before": None}
    assert sorted(state.remembered()) == ["young"]
    applied, kept, recomputed = state.full_digest()
    assert kept == recomputed


def test_a_database_from_before_the_keys_were_indexed_counts_them_as_read_back(tmp_path: Path) -> None:
    """Keys from before ``idx`` are of buys whose intent came first: index 0, never orphans."""
    s = CatalogState(old_database(
        tmp_path / "old.db", "CREATE TABLE idempotency (key TEXT PRIMARY KEY, result TEXT NOT NULL, at REAL NOT NULL DEFAULT 0)",
        "('k1', '{\"ok\": true, \"book\": {}}', 100.0)"))
    assert s.keys_after(0, 10)[1] == [] and s.decrements() == {}
    assert s.apply(1, {"op": "expire", "before": 200.0, "scanned": 0}) == {"ok": True, "forgotten": 1, "kept_before": None}
    applied, kept, recomputed = s.full_digest()
    assert kept == recomputed
    s.close()
