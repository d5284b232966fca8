"""Confirms ride in the next intents entry (one commit per buy instead of two); when no buy comes,
the confirmer records them alone; a failed entry loses nothing the sweep cannot redo."""

from __future__ import annotations

import time
from typing import Any

import pytest

from pygmy.order import app as order_app


class FakeRuntime:
    name = "order-test"

    def __init__(self) -> None:
        self.proposed: list[list[dict[str, Any]]] = []
        self.fail = False

    def propose(self, command: dict[str, Any], timeout: float = 5.0) -> list[Any]:
        if self.fail:
            raise order_app.ProposalTimeout("no quorum")
        self.proposed.append(command["commands"])
        return [{"applied": c} for c in command["commands"]]


@pytest.fixture()
def buys() -> Any:
    rt = FakeRuntime()
    return order_app.BuyProcessor(rt, None, None), rt  # type: ignore[arg-type]


def test_the_next_intents_entry_carries_the_confirms_waiting(buys: Any) -> None:
    processor, rt = buys
    processor._confirm("k1", "t", 1.0, 5.0)
    processor._confirm("k2", "t", 2.0, 5.0)
    intent = {"op": "intent", "key": "k3"}
    assert processor._propose_intents([intent]) == [{"applied": intent}]
    (entry,) = rt.proposed
    assert [(c["op"], c["key"]) for c in entry] == [("confirm", "k1"), ("confirm", "k2"), ("intent", "k3")]
    processor._propose_intents([intent])
    assert [c["op"] for c in rt.proposed[1]] == ["intent"]  # each confirm is carried once


def test_without_buys_the_confirmer_records_them_alone_and_a_failure_is_survived(buys: Any) -> None:
    processor, rt = buys
    processor._confirmer.start()
    try:
        rt.fail = True
        processor._confirm("k1", "t", 1.0, 5.0)  # lost with its entry: the sweep redoes it from the key
        processor._confirm_due.set()
        time.sleep(order_app.CONFIRM_LINGER * 5)
        rt.fail = False
        processor._confirm("k2", "t", 1.0, 5.0)
        processor._confirm_due.set()  # as the caller does once its buys are answered
        deadline = time.monotonic() + 5
        while not rt.proposed:
            assert time.monotonic() < deadline, "the confirm was never proposed"
            time.sleep(0.01)
        assert [[c["key"] for c in entry] for entry in rt.proposed] == [["k2"]]
        processor._confirm("k3", "t", 1.0, 5.0)
    finally:
        processor._stop.set()
        processor._confirm_due.set()
        processor._confirmer.join(5)
    assert not processor._confirmer.is_alive()
    assert [c["key"] for entry in rt.proposed for c in entry] == ["k2", "k3"]  # recorded on the way out


def test_a_confirm_that_came_a_moment_ago_waits_for_the_next_buys_entry(buys: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A sequential buyer: each buy's confirm comes as its answer goes, and the next buy's intents
    entry takes it a moment later. When an older confirm's linger runs out, the confirmer must not
    take the one that just came with it: that one waits for the next buy's entry."""
    monkeypatch.setattr(order_app, "CONFIRM_LINGER", 60.0)  # margins of 30 s and more, whatever the machine
    processor, rt = buys
    now = time.monotonic()
    confirm = {"op": "confirm", "title": "t", "cost": 1.0, "at": 5.0}
    processor._confirms.extend([(now - 60.0, {**confirm, "key": "k1"}), (now, {**confirm, "key": "k2"})])
    processor._confirmer.start()
    try:
        processor._confirm_due.set()
        deadline = time.monotonic() + 5
        while not rt.proposed:
            assert time.monotonic() < deadline, "the due confirm was never proposed"
            time.sleep(0.01)
        assert [[c["key"] for c in entry] for entry in rt.proposed] == [["k1"]]
        processor._propose_intents([{"op": "intent", "key": "k3"}])  # the next buy's entry takes k2's
        assert [[c["key"] for c in entry] for entry in rt.proposed] == [["k1"], ["k2", "k3"]]
    finally:
        processor._stop.set()
        processor._confirm_due.set()
        processor._confirmer.join(5)
    assert len(rt.proposed) == 2 and not processor._confirmer.is_alive()


def test_more_confirms_than_an_entry_carries_all_go_out_from_one_wake_up(buys: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The confirmer takes MAX_CONFIRMS an entry; what is left must not wait for a wake-up that no
    buy may bring (the orders would stay pending until the sweep decremented them again). A burst
    that came together (within half a linger) goes in as few entries as that allows."""
    monkeypatch.setattr(order_app, "CONFIRM_LINGER", 1.0)  # the burst's 300 confirms come well within 0.5 s
    processor, rt = buys
    processor._confirmer.start()
    try:
        for i in range(order_app.MAX_CONFIRMS + 44):
            processor._confirm(f"k{i}", "t", 1.0, 5.0)
        processor._confirm_due.set()  # once, as the buys' answer does
        deadline = time.monotonic() + 5
        while sum(len(e) for e in rt.proposed) < order_app.MAX_CONFIRMS + 44:
            assert time.monotonic() < deadline, f"{sum(len(e) for e in rt.proposed)} confirms proposed"
            time.sleep(0.01)
        assert [len(e) for e in rt.proposed] == [order_app.MAX_CONFIRMS, 44]
    finally:
        processor._stop.set()
        processor._confirm_due.set()
        processor._confirmer.join(5)


def test_on_stop_every_confirm_waiting_is_proposed(buys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Young or not, and more than one entry carries: the stop's last pass leaves none behind."""
    monkeypatch.setattr(order_app, "CONFIRM_LINGER", 60.0)
    processor, rt = buys
    processor._confirmer.start()
    for i in range(order_app.MAX_CONFIRMS + 3):
        processor._confirm(f"k{i}", "t", 1.0, 5.0)
    processor._confirm_due.set()
    processor._stop.set()
    processor._confirm_due.set()
    processor._confirmer.join(5)
    assert not processor._confirmer.is_alive()
    assert [len(e) for e in rt.proposed] == [order_app.MAX_CONFIRMS, 3]


def test_a_read_settles_a_pending_order_within_its_own_time(buys: Any) -> None:
    """A read of a pending order finishes it by the read's deadline, not the sweep's 9 s, and a
    catalog that answers 504 ends the read with DeadlineSpent (504 to the reader), not a crash."""
    processor, rt = buys
    sent: list[float] = []

    class Catalog:
        def write_batch(self, items: list[tuple[dict[str, Any], float]], deadline: float, expired: Any) -> list[Any]:
            sent.extend(end for _, end in items)
            return [order_app.Reply(504, {"error": {"code": 504, "message": "spent"}}, "catalog-1") for _ in items]

    processor.catalog = Catalog()
    rt.leader_only = lambda: None
    end = time.monotonic() + 0.5
    order = {"key": "k", "item_number": 1, "quantity": 1, "status": "pending"}
    with pytest.raises(order_app.DeadlineSpent):
        processor.settle(order, end)
    assert sent == [end]


def test_a_refusal_not_recorded_for_want_of_leadership_is_an_unknown_outcome_not_a_421(buys: Any) -> None:
    """The catalog refused a buy (no stock) after its intent was committed; recording the failure
    meets a lost leadership. Both halves were done, so the buyer must not hear NotLeader (a 421,
    which routers take for nothing done): an unknown outcome, retried under its key."""
    processor, rt = buys

    def deposed(command: dict[str, Any], timeout: float = 5.0) -> list[Any]:
        raise order_app.NotLeader("order-2", "http://order-2")

    rt.propose = deposed
    order = {"item_number": 3, "quantity": 1, "key": "k", "status": order_app.PENDING}
    refused = order_app.Reply(409, {"error": {"code": 409, "message": "out of stock"}}, "catalog-1")
    out: list[Any] = [order]
    processor._outcomes(out, [(0, order, (3, 1), refused)], time.time())
    assert isinstance(out[0], order_app.ProposalTimeout), out[0]
    assert order_app.answer(order_app.Buy(3, 1, "k", time.monotonic() + 5), out[0])[0] == 503
