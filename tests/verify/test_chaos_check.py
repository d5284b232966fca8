"""The chaos checker on hand-made run directories: a clean run passes, and each broken guarantee is
named. Runs the real Porcupine checker (built from tools/lincheck)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from pygmy.verify import chaos_check

MS = 1_000_000
INITIAL = {"1": {"cost": 1000, "stock": 10}, "2": {"cost": 2000, "stock": 5}}


def op(kind: str, item: int, invoke: int, complete: int | None, output: dict[str, Any] | None,
       **input: Any) -> dict[str, Any]:
    return {"client": 0, "kind": kind, "item": item, "invoke": invoke * MS,
            "complete": None if complete is None else complete * MS, "input": input, "output": output}


def clean_run() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Book 1: an update (+2), two acknowledged buys and a keyless buy of unknown outcome that did
    happen (order 3); book 2 only read. An order read after its buy was acknowledged; a search."""
    ops = [
        op("lookup", 1, 0, 5, {"cost": 1000, "stock": 10}),
        op("update", 1, 10, 20, {"cost": 1100, "stock": 12}, stock_delta=2, cost=1100, key="u1"),
        op("buy", 1, 30, 40, {"ok": True, "order_number": 1}, quantity=1, key="b1"),
        op("buy", 1, 50, 60, {"ok": True, "order_number": 2}, quantity=1, key="b2"),
        op("buy", 1, 70, None, None, quantity=1, key=None),
        op("lookup", 1, 200, 210, {"cost": 1100, "stock": 9}),
        op("order", 0, 100, 110, {"status": 200, "item": 1, "quantity": 1}, order_number=2),
        op("search", 0, 100, 110, {"count": 2}, topic="distributed systems"),
        op("lookup", 2, 0, 5, {"cost": 2000, "stock": 5}),
    ]
    history = {"initial": INITIAL, "ops": ops}
    nem = {"seed": 1, "duration": 1, "windows": [{"kind": "split", "detail": "x", "start": 25 * MS, "end": 65 * MS}],
           "errors": []}
    orders = {str(n): {"order_number": n, "item_number": 1, "quantity": 1} for n in (1, 2, 3)}
    # The order tier's hosts were replaced (order-3 by order-4); the catalog's were not.
    orders_conf = {"voters": ["order-1", "order-2", "order-4"], "learners": [], "pending": False}
    status = {"applied_index": 9, "state_digest": "abc"}
    replicas = {f"order-{k}": {"status": {**status, "membership": copy.deepcopy(orders_conf)},
                               "orders": copy.deepcopy(orders)} for k in (1, 2, 4)}
    replicas |= {f"catalog-{k}": {"status": {"applied_index": 7, "state_digest": "def", "membership": {
        "voters": ["catalog-1", "catalog-2", "catalog-3"], "learners": []}},
                                  "books": {"1": {"stock": 9}, "2": {"stock": 5}}} for k in (1, 2, 3)}
    return history, nem, {"converged": True, "replicas": replicas}


def judge(tmp_path: Path, run: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    for name, data in zip(("history.json", "nemesis.json", "final.json"), run, strict=True):
        (tmp_path / name).write_text(json.dumps(data))
    return chaos_check.check(tmp_path, timeout=20)


def test_a_clean_run_passes(tmp_path: Path) -> None:
    result = judge(tmp_path, clean_run())
    assert result["ok"], result["anomalies"]
    assert result["by_outcome"]["buy/unknown"] == 1 and result["faults"] == {"split": 1}
    assert chaos_check.main([str(tmp_path)]) == 0
    assert json.loads((tmp_path / "check.json").read_text())["ok"] is True


def broken(mutate: Any) -> tuple[dict[str, Any], ...]:
    run = clean_run()
    mutate(*run)
    return run


@pytest.mark.parametrize(("what", "mutate"), [
    ("linearizable", lambda h, n, f: h["ops"].append(op("lookup", 1, 300, 310, {"cost": 1000, "stock": 10}))),
    ("lost-buy", lambda h, n, f: f["replicas"]["order-2"]["orders"].pop("2")),
    ("lost-buy", lambda h, n, f: f["replicas"]["order-1"]["orders"]["1"].update(item_number=2)),
    ("doubled-buy", lambda h, n, f: [r["orders"].update({"4": {"order_number": 4, "item_number": 1, "quantity": 1}})
                                     for k, r in f["replicas"].items() if k.startswith("order")]),
    ("doubled-buy", lambda h, n, f: h["ops"][3]["output"].update(order_number=1)),
    ("stock-equation", lambda h, n, f: f["replicas"]["catalog-3"]["books"]["1"].update(stock=10)),
    ("converged", lambda h, n, f: f["replicas"]["catalog-2"]["status"].update(state_digest="other")),
    ("converged", lambda h, n, f: f.update(converged=False, status={})),
    ("converged", lambda h, n, f: f["replicas"]["order-4"].update(
        verify={"ok": False, "state_digest": "abc", "recomputed": "abd"})),
    ("own-order", lambda h, n, f: h["ops"].append(
        op("order", 0, 120, 130, {"status": 404, "item": None, "quantity": None}, order_number=1))),
    ("nemesis", lambda h, n, f: n["errors"].append("loss: iptables failed")),
    # Another acknowledged order of the same book and quantity read back under the number.
    ("own-order", lambda h, n, f: h["ops"][6]["output"].update(number=1)),
    # An answer no fault excuses, which the load recorded and dropped from the history.
    ("client-error", lambda h, n, f: n.update(client_errors=["buy 1: 422 this key was already used"])),
    # A cluster that answered no buy (or no lookup) at all.
    ("no-work", lambda h, n, f: h.update(ops=[o for o in h["ops"] if o["kind"] != "buy"])),
    # A final state read from the first members only: the new host's replica goes unchecked.
    ("members", lambda h, n, f: f["replicas"].pop("order-4")),
    ("members", lambda h, n, f: [r["status"]["membership"].update(learners=["order-5"])
                                 for k, r in f["replicas"].items() if k.startswith("order")]),
    ("integrity", lambda h, n, f: f.update(integrity={"order-1/raft.db": "*** in database main ***"})),
])
def test_each_broken_guarantee_is_named(tmp_path: Path, what: str, mutate: Any) -> None:
    result = judge(tmp_path, broken(mutate))
    assert not result["ok"] and what in result["anomalies_by_kind"], result["anomalies"]
    assert chaos_check.main([str(tmp_path)]) == 1


def test_an_anomaly_names_the_fault_it_happened_in(tmp_path: Path) -> None:
    result = judge(tmp_path, broken(lambda h, n, f: f["replicas"]["order-2"]["orders"].pop("2")))
    assert result["anomalies_by_fault"] == {"split": 1}
    assert "split (x)" in result["anomalies"][0]["during"]


def test_an_order_read_before_its_buy_was_acknowledged_may_miss(tmp_path: Path) -> None:
    run = clean_run()
    run[0]["ops"].append(op("order", 0, 45, 58, {"status": 404, "item": None, "quantity": None}, order_number=2))
    assert judge(tmp_path, run)["ok"]


def test_a_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    assert chaos_check.main([str(tmp_path)]) == 2


def keyed(run: tuple[dict[str, Any], ...], keys: dict[int, str]) -> tuple[dict[str, Any], ...]:
    """``run`` with its orders as the order replicas list them: each under its key."""
    for name, r in run[2]["replicas"].items():
        if name.startswith("order"):
            for n, o in r["orders"].items():
                o["key"] = keys[int(n)]
    return run


def test_orders_are_told_apart_by_their_keys(tmp_path: Path) -> None:
    """With keys, each keyed buy has at most its own order; an order under no client's key must be a
    keyless buy of unknown outcome of its book and quantity (the chaos load's keyless buys take two
    copies): a keyed buy done twice under a generated key cannot pass for the keyless one."""
    run = keyed(clean_run(), {1: "k:b1", 2: "k:b2", 3: "g:x"})
    assert judge(tmp_path, run)["ok"]

    def twice(h: dict[str, Any], n: dict[str, Any], f: dict[str, Any]) -> None:
        # The keyless buy takes two copies and did nothing; order 3 is b1 again, under a new key.
        h["ops"][4]["input"]["quantity"] = 2
        h["ops"] = [o for o in h["ops"] if not (o["kind"] == "lookup" and o["invoke"] == 200 * MS)]

    result = judge(tmp_path, keyed(broken(twice), {1: "k:b1", 2: "k:b2", 3: "g:y"}))
    assert not result["ok"] and list(result["anomalies_by_kind"]) == ["doubled-buy"], result["anomalies"]
    legacy = broken(twice)  # the same run, orders without keys: it passed before
    assert judge(tmp_path, legacy)["ok"]
    result = judge(tmp_path, keyed(clean_run(), {1: "k:b1", 2: "k:b2", 3: "k:b1"}))
    assert not result["ok"] and "doubled-buy" in result["anomalies_by_kind"], result["anomalies"]
    result = judge(tmp_path, keyed(clean_run(), {1: "k:b2", 2: "k:b1", 3: "g:x"}))  # acknowledged under another key
    assert not result["ok"] and "lost-buy" in result["anomalies_by_kind"], result["anomalies"]


def test_an_update_of_unknown_outcome_counts_as_its_key_says(tmp_path: Path) -> None:
    """An update whose answer was lost allowed the stock a range (it did or did not take effect), and
    a lost decrement of the same size hid in it. Sent again under its key after the run
    (``settled_updates``), it took effect once if answered 200: the equation is exact again."""
    def unknown_update(stock: int, settled: dict[str, int | None] | None) -> tuple[dict[str, Any], ...]:
        run = clean_run()
        run[0]["ops"].append(op("update", 1, 220, None, None, stock_delta=1, cost=1200, key="u2"))
        for name, r in run[2]["replicas"].items():
            if name.startswith("catalog"):
                r["books"]["1"]["stock"] = stock
        if settled is not None:
            run[2]["settled_updates"] = settled
        return run

    # Not sent again (or no answer to it): 9 or 10 both pass, so a lost decrement (10 without the update) hides.
    assert judge(tmp_path, unknown_update(10, None))["ok"]
    assert judge(tmp_path, unknown_update(10, {"u2": None}))["ok"]
    # Sent again and answered 200: it took effect exactly once, so the stock is 10, and 11 (the
    # update applied now, on top of a lost decrement) or 9 (applied never) is named.
    assert judge(tmp_path, unknown_update(10, {"u2": 200}))["ok"]
    for wrong in (9, 11):
        result = judge(tmp_path, unknown_update(wrong, {"u2": 200}))
        assert list(result["anomalies_by_kind"]) == ["stock-equation"], result["anomalies"]
    # Answered with a refusal (its key's first answer): it never took effect.
    assert judge(tmp_path, unknown_update(9, {"u2": 404}))["ok"]
    assert not judge(tmp_path, unknown_update(10, {"u2": 404}))["ok"]
