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
