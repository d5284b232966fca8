"""Intent-first buys run one batch at a time: buys of requests that arrive while a batch is under
way wait and go together in the next; each request gets its own buys' outcomes; a buy still
waiting at its deadline is withdrawn with nothing done."""

from __future__ import annotations

import threading
import time
from typing import Any

from pygmy.order import app as order_app
from pygmy.order.app import Buy


class Recording(order_app.BuyProcessor):
    """``_intent_first`` replaced: records each batch, answers each buy with its key, and holds the
    first batch until told to go on."""

    def __init__(self) -> None:
        super().__init__(None, None, None)  # type: ignore[arg-type]
        self.batches: list[list[str]] = []
        self.first_started = threading.Event()
        self.go_on = threading.Event()

    def _intent_first(self, buys: list[Buy], todo: list[int], created: list[str],
                      out: list[dict[str, Any] | BaseException]) -> None:
        self.batches.append([buys[i].key for i in todo])
        if len(self.batches) == 1:
            self.first_started.set()
            assert self.go_on.wait(5)
        for i in todo:
            out[i] = {"key": buys[i].key, "created_at": created[i]}


def buys(*keys: str, within: float = 5.0) -> list[Buy]:
    return [Buy(1, 1, k, time.monotonic() + within) for k in keys]


def test_buys_arriving_during_a_batch_go_together_in_the_next() -> None:
    p = Recording()
    results: dict[str, list[Any]] = {}

    def run(name: str, batch: list[Buy], created: str) -> None:
        out: list[Any] = [None] * len(batch)
        p._one_batch_at_a_time(batch, list(range(len(batch))), created, out)
        results[name] = out

    first = threading.Thread(target=run, args=("first", buys("a", "b"), "t1"))
    first.start()
    assert p.first_started.wait(5)
    later = [threading.Thread(target=run, args=(f"later{n}", buys(f"c{n}", f"d{n}"), f"t{n + 2}")) for n in range(3)]
    for t in later:
        t.start()
    deadline = time.monotonic() + 5
    while len(p._batches._queue) < 6:  # all three queued behind the first batch
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert p.batches == [["a", "b"]]
    p.go_on.set()
    for t in [first, *later]:
        t.join(5)
    assert len(p.batches) == 2, "the three requests that waited went as one batch"
    assert sorted(p.batches[1]) == sorted(f"{x}{n}" for n in range(3) for x in "cd")
    assert [r["key"] for r in results["first"]] == ["a", "b"]
    for n in range(3):
        assert [(r["key"], r["created_at"]) for r in results[f"later{n}"]] == [(f"c{n}", f"t{n + 2}"), (f"d{n}", f"t{n + 2}")]


def test_a_buy_still_waiting_at_its_deadline_is_withdrawn_with_nothing_done() -> None:
    p = Recording()
    out_first: list[Any] = [None]
    first = threading.Thread(target=p._one_batch_at_a_time, args=(buys("a"), [0], "t", out_first))
    first.start()
    assert p.first_started.wait(5)
    late: list[Any] = [None]
    p._one_batch_at_a_time(buys("late", within=0.1), [0], "t", late)  # returns once its deadline passed
    assert isinstance(late[0], order_app.DeadlineSpent) and "nothing was done" in str(late[0])
    p.go_on.set()
    first.join(5)
    assert p.batches == [["a"]], "the withdrawn buy never ran"
    assert out_first[0]["key"] == "a"


def test_a_batch_that_fails_gives_each_of_its_buys_the_error() -> None:
    class Broken(order_app.BuyProcessor):
        def _intent_first(self, *args: Any) -> None:
            raise RuntimeError("boom")

    p = Broken(None, None, None)  # type: ignore[arg-type]
    out: list[Any] = [None, None]
    p._one_batch_at_a_time(buys("a", "b"), [0, 1], "t", out)
    assert all(isinstance(r, RuntimeError) for r in out)
