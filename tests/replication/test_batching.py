"""The combiner: concurrent callers share batches, each gets its own result, errors reach all of a batch."""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from pygmy.replication.batching import Combiner, CombinerTimeout, _Slot


def held_first_batch() -> tuple[Callable[[list[int]], list[int]], threading.Event, threading.Event, list[list[int]]]:
    """A ``send`` that records its batches, answers each item negated, and holds the first batch
    until ``gate`` is set (``first_in`` tells it began): so callers can arrive while it is in flight."""
    gate, first_in = threading.Event(), threading.Event()
    batches: list[list[int]] = []

    def send(items: list[int]) -> list[int]:
        batches.append(items)
        if len(batches) == 1:
            first_in.set()
            gate.wait(5)
        return [-i for i in items]

    return send, gate, first_in, batches


def test_a_lone_caller_is_sent_alone_and_at_once() -> None:
    batches: list[list[int]] = []
    c = Combiner(lambda items: (batches.append(items), [i * 10 for i in items])[1])
    assert c.call(3, 1) == 30 and c.call(4, 1) == 40
    assert batches == [[3], [4]]


def test_callers_arriving_during_a_batch_share_the_next_and_each_get_their_own_result() -> None:
    send, gate, first_in, batches = held_first_batch()
    c = Combiner(send)
    results: dict[int, int] = {}
    first = threading.Thread(target=lambda: results.__setitem__(0, c.call(0, 5)))
    first.start()
    first_in.wait(5)
    others = [threading.Thread(target=lambda i=i: results.__setitem__(i, c.call(i, 5))) for i in range(1, 9)]
    for t in others:
        t.start()
    deadline = time.monotonic() + 5
    while len(c._queue) < 8:  # all queued behind the first batch
        assert time.monotonic() < deadline
        time.sleep(0.001)
    gate.set()
    for t in [first, *others]:
        t.join(5)
    assert results == {i: -i for i in range(9)}
    assert batches[0] == [0] and sorted(batches[1]) == list(range(1, 9)) and len(batches) == 2


def test_an_error_reaches_every_caller_of_its_batch_and_not_the_next() -> None:
    calls = {"n": 0}

    def send(items: list[int]) -> list[int]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("boom")
        return items

    c = Combiner(send)
    with pytest.raises(ValueError, match="boom"):
        c.call(1, 1)
    assert c.call(2, 1) == 2


def test_a_wrong_number_of_results_is_an_error_and_a_wait_can_time_out() -> None:
    c = Combiner(lambda items: [])
    with pytest.raises(RuntimeError, match="0 results for 1 items"):
        c.call(1, 1)
    gate = threading.Event()
    sent: list[list[int]] = []
    slow = Combiner(lambda items: (sent.append(items), gate.wait(5), items)[2])
    t = threading.Thread(target=lambda: slow.call(1, 5))
    t.start()
    time.sleep(0.05)
    with pytest.raises(CombinerTimeout) as queued:
        slow.call(2, 0.05)  # waits behind the batch in flight
    assert queued.value.sent is False
    gate.set()
    t.join(5)
    assert slow.call(3, 1) == 3
    assert sent == [[1], [3]], "a withdrawn item must never be sent"


def test_batches_are_capped() -> None:
    gate = threading.Event()
    batches: list[list[int]] = []

    def send(items: list[int]) -> list[int]:
        batches.append(items)
        gate.wait(5)
        return items

    c = Combiner(send, max_batch=3)
    threads = [threading.Thread(target=c.call, args=(i, 5)) for i in range(7)]
    threads[0].start()
    time.sleep(0.05)
    for t in threads[1:]:
        t.start()
    time.sleep(0.05)
    gate.set()
    for t in threads:
        t.join(5)
    assert max(len(b) for b in batches) == 3 and sorted(i for b in batches for i in b) == list(range(7))


def test_call_many_gives_each_item_its_own_outcome_and_withdraws_only_the_expired() -> None:
    gate = threading.Event()
    sent: list[list[int]] = []

    def send(items: list[int]) -> list[int]:
        sent.append(items)
        if items == [0]:
            gate.wait(5)  # a batch in flight that the next caller queues behind
        return [i * 10 for i in items]

    c = Combiner(send, max_batch=2)
    first = threading.Thread(target=lambda: c.call(0, 5))
    first.start()
    deadline = time.monotonic() + 5
    while not sent:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    threading.Timer(0.2, gate.set).start()
    out = c.call_many([1, 2, 3, 4, 5], [5, 0.05, 5, 5, 5])
    first.join(5)
    assert out[0] == 10 and out[2:] == [30, 40, 50]
    assert isinstance(out[1], CombinerTimeout) and out[1].sent is False
    assert [i for batch in sent[1:] for i in batch] == [1, 3, 4, 5]  # 2 was withdrawn, never sent
    assert all(len(batch) <= 2 for batch in sent)


@pytest.mark.parametrize("grace", [0.0, 5.0])
def test_call_many_waits_a_grace_longer_for_an_item_already_sent_but_not_for_one_queued(grace: float) -> None:
    gates = [threading.Event(), threading.Event()]
    first_in = threading.Event()
    batches: list[list[int]] = []

    def send(items: list[int]) -> list[int]:
        batches.append(items)
        if len(batches) <= 2:
            first_in.set()
            gates[len(batches) - 1].wait(5)
        return [-i for i in items]

    c = Combiner(send)
    c.submit(10, 5, lambda _: None)  # the helper thread carries it, and the next batch
    assert first_in.wait(5)
    assert c.call_many([1], [0.05], grace=grace)[0].sent is False, "queued at its wait's end: withdrawn"
    out: list[Any] = []
    caller = threading.Thread(target=lambda: out.extend(c.call_many([2], [0.2], grace=grace)))
    caller.start()
    time.sleep(0.05)
    c.submit(11, 5, lambda _: None)
    gates[0].set()  # the helper sends [2, 11] next and holds it past the caller's wait
    time.sleep(0.4)
    gates[1].set()
    caller.join(5)
    c.stop()
    assert batches[1] == [2, 11]
    if grace:
        assert out == [-2], "sent, so waited for past its wait"
    else:
        assert isinstance(out[0], CombinerTimeout) and out[0].sent is True


def test_an_item_whose_wait_ran_out_is_left_out_of_a_batch_another_thread_forms() -> None:
    """Its owner may not have woken yet: the batch leaves it out all the same, and it is withdrawn
    before the lock is let go (an owner waking then finds it done, not still queued)."""
    batches: list[list[int]] = []
    late = _Slot(1, deadline=time.monotonic() - 0.01)  # as ``call_many`` queues it, its wait over
    c = Combiner(lambda items: (batches.append(items), items)[1])
    seen_done: list[bool] = []
    let_go = c._cond.release  # the batch's sender lets the lock go while it sends
    c._cond.release = lambda: (seen_done.append(late.done), let_go())[1]  # type: ignore[method-assign]
    c._queue.append(late)
    assert c.call(2, 1) == 2
    assert batches == [[2]] and seen_done == [True]
    assert late.done and not late.sent and isinstance(late.error, CombinerTimeout) and late.error.sent is False


def test_call_many_queues_its_items_with_their_deadlines() -> None:
    send, gate, first_in, _ = held_first_batch()
    c = Combiner(send)
    first = threading.Thread(target=lambda: c.call(0, 5))
    first.start()
    assert first_in.wait(5)
    queued = threading.Thread(target=lambda: c.call_many([1], [5]))
    queued.start()
    deadline = time.monotonic() + 5
    while not c._queue:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert c._queue[0].deadline < time.monotonic() + 6
    gate.set()
    first.join(5)
    queued.join(5)


def test_call_many_hands_errors_to_the_items_of_the_failed_batch_only() -> None:
    def send(items: list[int]) -> list[int]:
        if 2 in items:
            raise ValueError("boom")
        return items

    out = Combiner(send, max_batch=2).call_many([1, 2, 3, 4], [1, 1, 1, 1])
    assert [type(o).__name__ if isinstance(o, BaseException) else o for o in out] == ["ValueError", "ValueError", 3, 4]


def test_submitted_items_are_carried_by_the_helper_and_told_on_its_thread() -> None:
    send, gate, first_in, batches = held_first_batch()
    c = Combiner(send)
    told: dict[int, object] = {}
    threads: dict[int, str] = {}
    done = threading.Event()

    def tell(i: int) -> Any:
        def callback(result: object) -> None:
            told[i], threads[i] = result, threading.current_thread().name
            if len(told) == 5:
                done.set()
        return callback

    c.submit(0, 5, tell(0))  # returns at once; the helper sends it
    assert first_in.wait(5)
    for i in range(1, 4):
        c.submit(i, 5, tell(i))
    waiter = threading.Thread(target=lambda: told.__setitem__(9, c.call(9, 5)))
    waiter.start()  # a caller that waits shares the batches of submitted items
    c.submit(4, 5, tell(4))
    gate.set()
    assert done.wait(5)
    waiter.join(5)
    assert told == {i: -i for i in (0, 1, 2, 3, 4, 9)}
    assert batches[0] == [0] and sorted(x for b in batches[1:] for x in b) == [1, 2, 3, 4, 9]
    assert threads[0].startswith("combiner")
    c.stop()
    with pytest.raises(RuntimeError):
        c.submit(5, 1, tell(5))


def test_a_submitted_item_whose_time_ran_out_in_the_queue_is_never_sent() -> None:
    gate, first_in = threading.Event(), threading.Event()
    sent: list[list[int]] = []

    def send(items: list[int]) -> list[int]:
        sent.append(items)
        first_in.set()
        gate.wait(5)
        return items

    c = Combiner(send)
    told: list[object] = []
    c.submit(1, 5, told.append)
    assert first_in.wait(5)
    c.submit(2, 0.05, told.append)  # queued behind a batch that outlasts its wait
    c.submit(3, 5, told.append)
    time.sleep(0.1)
    gate.set()
    deadline = time.monotonic() + 5
    while len(told) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    timeout = next(t for t in told if isinstance(t, CombinerTimeout))
    assert timeout.sent is False
    assert sorted(t for t in told if isinstance(t, int)) == [1, 3]
    assert [x for b in sent for x in b] == [1, 3], "the withdrawn item was sent"
    c.stop()


def test_a_failing_send_and_a_broken_callback_reach_only_their_own() -> None:
    c = Combiner(lambda items: (_ for _ in ()).throw(ValueError("down")) if 0 in items else items)
    got: list[object] = []
    ready = threading.Event()

    def broken(result: object) -> None:
        raise RuntimeError("callback bug")

    c.submit(0, 5, lambda r: (got.append(r), ready.set()))
    assert ready.wait(5) and isinstance(got[0], ValueError)
    ready.clear()
    c.submit(1, 5, broken)
    c.submit(2, 5, lambda r: (got.append(r), ready.set()))
    assert ready.wait(5) and got[-1] == 2
    c.stop()


def test_the_helper_sends_a_batch_in_its_first_submitted_items_context() -> None:
    """So a value such as the request id a lone caller set travels with its batch, as when the
    caller's own thread sent it."""
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="none")
    seen: list[str] = []
    c = Combiner(lambda items: (seen.append(var.get()), items)[1])
    got: list[object] = []
    ready = threading.Event()
    token = var.set("caller-1")
    try:
        c.submit(1, 5, lambda r: (got.append(r), ready.set()))
    finally:
        var.reset(token)
    assert ready.wait(5) and got == [1]
    assert seen == ["caller-1"] and var.get() == "none"
    c.stop()


def test_stop_tells_a_submitted_item_still_queued_that_it_was_not_sent() -> None:
    """An item submitted behind another thread's batch, when ``stop`` comes: no helper may send it
    any more, so it is withdrawn and its callback told at once, not left to its caller's own wait."""
    release, started = threading.Event(), threading.Event()
    sent: list[list[str]] = []

    def send(items: list[str]) -> list[str]:
        sent.append(items)
        started.set()
        release.wait(5)
        return items

    combiner: Combiner[str, str] = Combiner(send)
    caller = threading.Thread(target=combiner.call, args=("first", 5.0))
    caller.start()
    assert started.wait(5)
    told: list[Any] = []
    combiner.submit("queued", 30.0, told.append)
    combiner.stop()
    assert len(told) == 1 and isinstance(told[0], CombinerTimeout) and not told[0].sent
    release.set()
    caller.join(5)
    assert sent == [["first"]]


def _submit_and_wait(c: Combiner[int, int], items: list[int], pause: float = 0.0, wait: float = 30) -> dict[int, Any]:
    """Submit ``items`` (``pause`` between them, each with ``wait``) and return each one's outcome
    once all are told (within 30 s)."""
    told: dict[int, Any] = {}
    done = threading.Event()

    def tell(i: int) -> Callable[[Any], None]:
        def callback(outcome: Any) -> None:
            told[i] = outcome
            if len(told) == len(items):
                done.set()
        return callback

    for n, i in enumerate(items):
        if n:
            time.sleep(pause)
        c.submit(i, wait, tell(i))
    assert done.wait(30), f"told only {told}"
    return told


def test_a_lingering_combiner_waits_for_company_only_after_a_batch_of_several(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a batch of two, the next batch waits ``linger`` and carries what came meanwhile; after
    a batch of one (a lone caller), it goes at once, alone."""
    from pygmy.replication import batching

    monkeypatch.setattr(batching, "LINGER_RECENT", 600.0)  # a slow thread start is still "recent"
    batches: list[list[int]] = []
    c: Combiner[int, int] = Combiner(lambda items: (batches.append(items), [-i for i in items])[1], linger=2.0)
    try:
        assert c.call_many([1, 2], [5, 5]) == [-1, -2]  # one batch of two: the way is busy
        assert _submit_and_wait(c, [3, 4], pause=0.2) == {3: -3, 4: -4}
        assert batches == [[1, 2], [3, 4]], "4 came 0.2 s after 3, within the linger: one batch"
        assert _submit_and_wait(c, [5, 6], pause=0.2) == {5: -5, 6: -6}
        # The batch before carried two, so 5 lingered too and took 6.
        assert batches[2:] == [[5, 6]]
        c.call(7, 5)  # after the batch of two, 7 lingers alone: the batch before it was [5, 6]
        # After a batch of one, nobody waits, however long the linger: 8 and 9 are each told
        # within 30 s (an hour's time to spare, which a ten-minute linger would keep clear of).
        c.linger = 600.0
        assert _submit_and_wait(c, [8], wait=3600) == {8: -8}
        assert _submit_and_wait(c, [9], wait=3600) == {9: -9}
        assert batches[3:] == [[7], [8], [9]]
    finally:
        c.stop()


def test_a_lone_caller_never_lingers_and_a_quiet_spell_ends_the_busy_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a linger of ten minutes (and callers of an hour's time, which it would keep clear of),
    a lone caller's calls all return at once (no batch of two came before them); and a batch of
    two long ago (beyond ``LINGER_RECENT``) does not make the next wait."""
    from pygmy.replication import batching

    c: Combiner[int, int] = Combiner(lambda items: [-i for i in items], linger=600.0)
    results: list[int] = []

    def calls() -> None:
        results.extend(c.call(i, 3600) for i in range(5))
        assert c.call_many([1, 2], [3600, 3600]) == [-1, -2]
        monkeypatch.setattr(batching, "LINGER_RECENT", 0.0)  # that batch is now "long ago"
        results.append(c.call(3, 3600))

    caller = threading.Thread(target=calls, daemon=True)
    try:
        caller.start()
        caller.join(30)
        assert not caller.is_alive(), "a call lingered"
        assert results == [0, -1, -2, -3, -4, -3]
    finally:
        c.stop()


def test_stopping_a_lingering_combiner_ends_the_wait_and_withdraws_what_is_queued(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from pygmy.replication import batching

    monkeypatch.setattr(batching, "LINGER_RECENT", 600.0)
    batches: list[list[int]] = []
    c: Combiner[int, int] = Combiner(lambda items: (batches.append(items), [-i for i in items])[1], linger=600.0)
    assert c.call_many([1, 2], [30, 30]) == [-1, -2]
    told: list[Any] = []
    c.submit(3, 3600, told.append)  # the helper lingers with it (600 s: an hour's item allows it)
    deadline = time.monotonic() + 10
    while not c._busy:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    stopper = threading.Thread(target=c.stop)
    stopper.start()
    stopper.join(30)
    assert not stopper.is_alive(), "stop waited out the linger"
    assert len(told) == 1 and isinstance(told[0], CombinerTimeout) and not told[0].sent
    assert batches == [[1, 2]]


def test_a_lingering_batch_keeps_clear_of_its_items_deadlines_and_goes_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait ends a ``linger`` before the soonest queued item's time runs out: with a linger of
    ten minutes, an item with 2.5 s left goes at once (a wait into its last ten minutes would
    withdraw it). With ``max_batch`` items queued it goes at once, whatever the linger."""
    from pygmy.replication import batching

    monkeypatch.setattr(batching, "LINGER_RECENT", 600.0)
    batches: list[list[int]] = []
    c: Combiner[int, int] = Combiner(lambda items: (batches.append(items), [-i for i in items])[1], linger=600.0)
    try:
        assert c.call_many([1, 2], [30, 30]) == [-1, -2]
        assert _submit_and_wait(c, [3], wait=2.5) == {3: -3}, "3 waited into its last ten minutes"
        assert batches == [[1, 2], [3]]
    finally:
        c.stop()
    full: Combiner[int, int] = Combiner(lambda items: (batches.append(items), [-i for i in items])[1],
                                        max_batch=2, linger=600.0)
    try:
        assert full.call_many([1, 2], [30, 30]) == [-1, -2]
        assert _submit_and_wait(full, [5, 6], wait=3600) == {5: -5, 6: -6}  # told within 30 s: not after 600
        assert batches[2:] == [[1, 2], [5, 6]]
    finally:
        full.stop()
