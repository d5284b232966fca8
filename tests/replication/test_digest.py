"""The incremental state digest always equals a digest recomputed from every row: under random
command sequences, snapshots, restarts and commands that fail half-way, on both services' states."""

from __future__ import annotations

import itertools
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pygmy.catalog.books import DEFAULT_BOOKS
from pygmy.catalog.state import CatalogState
from pygmy.order.state import OrderState

ITEMS = st.integers(1, 8)  # 8 is not in the catalogue: 404s are commands too
KEYS = st.sampled_from([f"k{i}" for i in range(6)])  # few keys: repeats exercise idempotency

TIMES = st.sampled_from([0.0, 100.0, 200.0])  # a key's time; 0: kept for good
DATES = st.sampled_from(["2026-11-22T12:00:00.000+00:00", "2026-11-23T12:00:00.000+00:00"])
CATALOG_COMMANDS = st.one_of(
    st.fixed_dictionaries({"op": st.just("decrement"), "item": ITEMS, "quantity": st.integers(1, 600), "key": KEYS,
                           "at": TIMES}),
    st.fixed_dictionaries({"op": st.just("expire"), "before": st.sampled_from([50.0, 150.0, 250.0])}),
    st.fixed_dictionaries({"op": st.just("update"), "item": ITEMS, "stock_delta": st.integers(-1200, 50),
                           "cost": st.one_of(st.none(), st.floats(0, 100).map(lambda c: round(c, 2))),
                           "key": st.one_of(st.none(), KEYS)}),
    st.fixed_dictionaries({"op": st.just("restock"), "amount": st.integers(1, 5),
                           "items": st.one_of(st.none(), st.lists(ITEMS, max_size=3))}),
)
ORDER_COMMANDS = st.one_of(
    st.fixed_dictionaries({"op": st.just("intent"), "key": KEYS, "item": ITEMS, "quantity": st.integers(1, 3),
                           "created_at": DATES}),
    st.fixed_dictionaries({"op": st.just("expire"), "before": st.sampled_from([50.0, 150.0, 250.0])}),
    st.fixed_dictionaries({"op": st.just("confirm"), "key": KEYS, "title": st.text(max_size=5),
                           "cost": st.floats(0, 100).map(lambda c: round(c, 2))}, optional={"at": TIMES}),
    st.fixed_dictionaries({"op": st.just("fail"), "key": KEYS, "code": st.sampled_from([404, 409]),
                           "message": st.text(max_size=5)}, optional={"at": TIMES}),
)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
_dirs = itertools.count()


def fresh(kind: str, tmp_path: Path) -> CatalogState | OrderState:
    path = tmp_path / f"{kind}-{next(_dirs)}" / "state.db"
    if kind == "catalog":
        state = CatalogState(path)
        state.seed(DEFAULT_BOOKS)
        return state
    return OrderState(path)


def agrees(state: CatalogState | OrderState) -> str:
    applied, kept, recomputed = state.full_digest()
    assert kept == recomputed, f"maintained {kept} != recomputed {recomputed} at index {applied}"
    assert state.applied_and_digest() == (applied, kept)
    return kept


@pytest.mark.parametrize(("kind", "commands"), [("catalog", CATALOG_COMMANDS), ("order", ORDER_COMMANDS)])
def test_random_commands_snapshots_and_restarts_keep_the_digest_exact(tmp_path: Path, kind: str, commands: Any) -> None:
    @FAST
    @given(st.lists(st.tuples(commands, st.sampled_from(["apply", "apply", "apply", "snapshot", "restart"])),
                    max_size=25))
    def run(steps: list[tuple[dict[str, Any], str]]) -> None:
        state, twin = fresh(kind, tmp_path), fresh(kind, tmp_path)
        agrees(state)
        batch: list[tuple[int, dict[str, Any]]] = []
        for index, (command, action) in enumerate(steps, start=1):
            state.apply(index, command)
            batch.append((index, command))
            if action != "apply":  # the twin applies runs of commands as one batch (catch-up, load)
                assert [error for _, error in twin.apply_many(batch)] == [None] * len(batch)
                batch = []
            if action == "snapshot":  # a follower restored from our snapshot has our digest, no rescan
                restored = fresh(kind, tmp_path)
                image = Path(restored.path).with_suffix(".snapshot")
                assert state.snapshot_to(image) == index
                restored.restore(index, image)
                assert agrees(restored) == agrees(state)
            elif action == "restart":  # reopened from disk
                state.close()
                state = type(state)(state.path)
                assert agrees(state) == agrees(twin)  # same commands, same digest
        assert [error for _, error in twin.apply_many(batch)] == [None] * len(batch)
        assert agrees(state) == agrees(twin) and state.applied_index() == twin.applied_index()
        state.close()
        twin.close()

    run()


def test_different_states_have_different_digests(tmp_path: Path) -> None:
    a, b = fresh("catalog", tmp_path), fresh("catalog", tmp_path)
    assert agrees(a) == agrees(b)
    a.apply(1, {"op": "update", "item": 1, "stock_delta": 1})
    b.apply(1, {"op": "update", "item": 2, "stock_delta": 1})
    assert agrees(a) != agrees(b)
    a.apply(2, {"op": "update", "item": 2, "stock_delta": 1})
    b.apply(2, {"op": "update", "item": 1, "stock_delta": 1})
    assert agrees(a) != agrees(b), "the version column records which command changed each book"
    c, d = fresh("catalog", tmp_path), fresh("catalog", tmp_path)
    c.apply(1, {"op": "decrement", "item": 1, "quantity": 1, "key": "x"})
    d.apply(1, {"op": "decrement", "item": 1, "quantity": 1, "key": "y"})
    assert agrees(c) != agrees(d), "idempotency keys are part of the replicated state"


class Breaking(CatalogState):
    """Writes a row, then fails: the transaction (and the digest change with it) must roll back."""

    def execute(self, conn: sqlite3.Connection, index: int, command: dict[str, Any]) -> Any:
        result = super().execute(conn, index, command)
        if command.get("break"):
            raise RuntimeError("half-way")
        return result


def test_a_command_that_fails_half_way_changes_neither_state_nor_digest(tmp_path: Path) -> None:
    state = Breaking(tmp_path / "s.db")
    state.seed(DEFAULT_BOOKS)
    before = agrees(state)
    with pytest.raises(RuntimeError):
        state.apply(1, {"op": "decrement", "item": 1, "quantity": 5, "key": "k", "break": True})
    assert agrees(state) == before and state.applied_index() == 0
    state.apply(1, {"op": "decrement", "item": 1, "quantity": 5, "key": "k"})
    assert agrees(state) != before


def test_a_database_from_before_the_triggers_gets_its_digest_on_open(tmp_path: Path) -> None:
    state = fresh("catalog", tmp_path)
    state.apply(1, {"op": "update", "item": 3, "stock_delta": 7, "key": "u"})
    expected = agrees(state)
    conn = state._conn()
    for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type='trigger'").fetchall():
        conn.execute(f"DROP TRIGGER {name}")
    conn.execute("DROP TABLE digest")
    state.close()
    reopened = CatalogState(state.path)
    assert agrees(reopened) == expected


def test_a_batch_undoes_a_failing_command_alone_and_skips_what_it_already_applied(tmp_path: Path) -> None:
    """``apply_many``: one transaction; once a command fails, the batch is taken again with a
    savepoint per command. A command that fails half-way is undone alone (its error returned, as a lone ``apply`` would raise it); the others stand; the
    applied index covers the batch; entries already applied (a replay after a crash) are skipped."""
    state, alone = Breaking(tmp_path / "s.db"), Breaking(tmp_path / "t.db")
    for s in (state, alone):
        s.seed(DEFAULT_BOOKS)
    batch = [(1, {"op": "decrement", "item": 1, "quantity": 5, "key": "a"}),
             (2, {"op": "decrement", "item": 2, "quantity": 1, "key": "b", "break": True}),
             (3, None),
             (4, {"op": "decrement", "item": 2, "quantity": 2, "key": "c"})]
    outcomes = state.apply_many(batch)
    assert [type(e).__name__ if e else None for _, e in outcomes] == [None, "RuntimeError", None, None]
    assert outcomes[0][0]["book"]["stock"] == DEFAULT_BOOKS[0]["stock"] - 5
    for index, command in batch:  # the same commands one by one, the failing one left out
        if command is None or not command.get("break"):
            alone.apply(index, command)
    assert agrees(state) == agrees(alone) and state.applied_index() == 4
    assert state.apply_many(batch[:2]) == [(None, None), (None, None)]  # replayed: nothing happens
    assert agrees(state) == agrees(alone) and state.applied_index() == 4


def test_a_connection_is_closed_once_its_thread_has_ended(tmp_path: Path) -> None:
    """A thread's SQLite connection stays open only while the thread lives (a frame connection's
    thread has one): the next connection opened closes those of ended threads, and ``close_all``
    the rest, so a long-running replica keeps no file handles of threads long gone."""
    import threading

    sm = CatalogState(str(tmp_path / "c.db"))
    opened: list[sqlite3.Connection] = []

    def read() -> None:
        sm.read("SELECT 1")
        opened.append(sm._local.conn)

    for _ in range(3):
        t = threading.Thread(target=read)
        t.start()
        t.join()

    def works(conn: sqlite3.Connection) -> bool:
        try:
            conn.execute("SELECT 1")
        except sqlite3.ProgrammingError:  # closed
            return False
        return True

    assert [works(c) for c in opened] == [False, False, True]  # the last thread's: until the next opens
    assert len(sm._opened) == 2  # this thread's (the constructor's) and the last thread's
    sm.close_all()
    assert sm._opened == {} and not works(opened[2])


def test_a_digested_table_written_outside_a_digest_keeping_transaction_is_refused(tmp_path: Path) -> None:
    """The triggers add to the open write transaction's digest change, folded in before it commits;
    a write that no such transaction would fold in fails instead of leaving the digest behind."""
    state = fresh("catalog", tmp_path)
    before = agrees(state)
    with pytest.raises(sqlite3.OperationalError):
        state._conn().execute("UPDATE books SET stock = stock + 1 WHERE item_number = 1")
    assert agrees(state) == before and state.book(1)["stock"] == DEFAULT_BOOKS[0]["stock"]


def test_a_database_whose_triggers_rewrote_the_digest_row_gets_the_new_ones(tmp_path: Path) -> None:
    """A database written before the digest change was folded once per transaction: its triggers
    rewrote the digest row on every changed row (``pygmy_digest_mix``). Opened here, they still work
    until they are replaced, and the digest it carries is kept."""
    state = fresh("catalog", tmp_path)
    state.apply(1, {"op": "update", "item": 3, "stock_delta": 7, "key": "u"})
    conn = state._conn()
    for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type='trigger'").fetchall():
        conn.execute(f"DROP TRIGGER {name}")
    for table in state.digest_tables:  # the triggers as the earlier version wrote them
        cols = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
        new, old = (", ".join(f"{side}.{c}" for c in cols) for side in ("NEW", "OLD"))
        mix = "UPDATE digest SET value = pygmy_digest_mix(value, {}, '" + table + "', {}) WHERE id = 0;"
        conn.execute(f"CREATE TRIGGER digest_{table}_insert AFTER INSERT ON {table} BEGIN {mix.format(1, new)} END")
        conn.execute(f"CREATE TRIGGER digest_{table}_delete AFTER DELETE ON {table} BEGIN {mix.format(-1, old)} END")
        conn.execute(f"CREATE TRIGGER digest_{table}_update AFTER UPDATE ON {table} "
                     f"BEGIN {mix.format(-1, old)} {mix.format(1, new)} END")
    state.apply(2, {"op": "decrement", "item": 1, "quantity": 2, "key": "d"})  # through the old triggers
    expected = agrees(state)
    state.close()
    reopened = CatalogState(state.path)
    triggers = [sql for (sql,) in reopened.read("SELECT sql FROM sqlite_master WHERE type='trigger'")]
    assert triggers and all("pygmy_digest_note" in sql for sql in triggers)
    assert agrees(reopened) == expected
    reopened.apply(3, {"op": "update", "item": 1, "stock_delta": 1, "key": "v"})
    agrees(reopened)


def test_a_batch_without_failures_takes_no_savepoints_and_nesting_is_refused(tmp_path: Path) -> None:
    """The savepoint per command is taken only on the second pass of a batch whose command failed
    (``test_a_batch_undoes_a_failing_command_alone...``); a batch that applies cleanly runs none. A
    digest-keeping transaction opened inside another is a bug, refused before it touches the first."""
    state = fresh("catalog", tmp_path)
    statements: list[str] = []
    state._conn().set_trace_callback(statements.append)
    state.apply_many([(i, {"op": "update", "item": 1 + i % 3, "stock_delta": 1, "key": f"k{i}"}) for i in range(1, 6)])
    state._conn().set_trace_callback(None)
    assert statements and not [s for s in statements if "SAVEPOINT" in s.upper()]
    with state._writing() as conn:
        conn.execute("UPDATE books SET stock = stock + 1 WHERE item_number = 2")
        with pytest.raises(RuntimeError, match="already open"), state._writing():
            pass
    agrees(state)


def test_an_update_answers_exactly_what_reading_its_book_back_gives(tmp_path: Path) -> None:
    """An update's answer is built from the row read before it, not read back; it is stored under
    its key (and digested), so its text must be what reading the book back would have given."""
    state = fresh("catalog", tmp_path)
    for i, cmd in enumerate([{"stock_delta": 3}, {"cost": 12.34}, {"stock_delta": -1, "cost": 0.1},
                             {"stock_delta": 0}, {"cost": 99999.99, "stock_delta": 7}], start=1):
        result = state.apply(i, {"op": "update", "item": 2, "key": f"u{i}", **cmd})
        assert json.dumps(result) == json.dumps({"ok": True, "book": state.book(2)})


def test_a_database_with_the_current_triggers_is_not_rescanned_when_opened(tmp_path: Path, monkeypatch) -> None:
    """The triggers are compared by their SQL as SQLite keeps it: if that ever differed from what
    ``_triggers`` writes, every start of a replica would recompute the digest from every row (a
    scan of a 1,000,000-book store at each start). Opened again, nothing is summed."""
    state = fresh("catalog", tmp_path)
    state.apply(1, {"op": "update", "item": 1, "stock_delta": 1, "key": "u"})
    expected = agrees(state)
    state.close()
    sums: list[int] = []
    real = CatalogState._sum_rows
    monkeypatch.setattr(CatalogState, "_sum_rows", lambda self, conn: sums.append(1) or real(self, conn))
    reopened = CatalogState(state.path)
    assert sums == [], "reopened with its own triggers, the digest was recomputed from the rows"
    monkeypatch.undo()
    assert agrees(reopened) == expected
