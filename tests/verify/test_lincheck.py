"""The Porcupine checker on small hand-made histories: it accepts what is linearizable and catches what is not.

Histories are written with explicit times (nanoseconds) so overlaps are exact; one test goes through the
History recorder. These run the real Go checker: without Go they fail with the build error, not skip.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pygmy.verify import gobuild, lincheck

ITEM = 3
INITIAL = {ITEM: {"cost": 1250, "stock": 10}}


def op(client: int, kind: str, invoke: int, complete: int | None, output: dict[str, Any] | None,
       **input: Any) -> dict[str, Any]:
    return {"client": client, "kind": kind, "item": ITEM, "invoke": invoke, "complete": complete,
            "input": input, "output": output}


def book(cost: int, stock: int) -> dict[str, int]:
    return {"cost": cost, "stock": stock}


def run(tmp_path: Path, ops: list[dict[str, Any]], initial: dict[int, dict[str, int]] = INITIAL,
        ) -> lincheck.CheckResult:
    path = tmp_path / "history.json"
    path.write_text(json.dumps({"initial": {str(k): v for k, v in initial.items()}, "ops": ops}))
    return lincheck.check(path, html_dir=tmp_path / "html", timeout=20)


def assert_caught(result: lincheck.CheckResult) -> None:
    assert not result.ok and result.returncode == 1, result.output
    assert result.items == {ITEM: "illegal"}, result.output
    html = result.html[ITEM]
    assert html.exists() and html.stat().st_size > 1000
    assert f"item {ITEM}: NOT linearizable" in result.output and str(html) in result.output


def test_go_is_there_or_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert lincheck.build_checker().exists()
    # Without Go, a checker not built yet: lincheck's own build says what is missing.
    monkeypatch.setattr(lincheck, "BINARY", tmp_path / "lincheck")
    monkeypatch.setattr(gobuild.shutil, "which", lambda name: None)
    monkeypatch.setattr(gobuild.os, "access", lambda path, mode: False)
    with pytest.raises(RuntimeError, match="Go is needed to build the Porcupine checker"):
        lincheck.build_checker()


def test_linearizable_history_with_overlaps_and_unknown_outcomes(tmp_path: Path) -> None:
    ops = [
        op(0, "lookup", 0, 10, book(1250, 10)),
        # overlapping: the update (stock +5, new price) and a buy of 2, seen in either order by lookups
        op(0, "update", 20, 60, book(1300, 13), stock_delta=5, cost=1300),
        op(1, "buy", 25, 40, {"ok": True}, quantity=2),
        op(2, "lookup", 30, 35, book(1250, 8)),  # buy took effect first, update not yet
        op(2, "lookup", 70, 80, book(1300, 13)),
        # an unknown-outcome buy that never happened: later reads show no change
        op(1, "buy", 90, None, None, quantity=4),
        op(0, "lookup", 200, 210, book(1300, 13)),
        # one that did happen: a later read sees it
        op(1, "buy", 220, None, None, quantity=3),
        op(2, "lookup", 300, 310, book(1300, 10)),
        op(0, "buy", 320, 330, {"ok": False, "out_of_stock": True}, quantity=11),
        op(0, "update", 340, None, None, stock_delta=0, cost=None),
        op(2, "search", 350, 360, {"items": []}, topic="x"),  # not modelled: ignored with a warning
    ]
    result = run(tmp_path, ops)
    assert result.ok and result.returncode == 0, result.output
    assert result.items == {ITEM: "ok"} and result.html == {}
    assert f"item {ITEM}: ok (11 ops)" in result.output
    assert "search" in result.output  # the warning


def test_read_going_back_in_time_is_caught(tmp_path: Path) -> None:
    ops = [
        op(0, "update", 0, 10, book(1300, 10), stock_delta=0, cost=1300),
        op(1, "lookup", 20, 30, book(1300, 10)),
        op(1, "lookup", 40, 50, book(1250, 10)),  # the old price after the new one was seen
    ]
    assert_caught(run(tmp_path, ops))


def test_stock_coming_back_after_an_acknowledged_buy_is_caught(tmp_path: Path) -> None:
    ops = [
        op(0, "buy", 0, 10, {"ok": True}, quantity=1),
        op(1, "lookup", 20, 30, book(1250, 9)),
        op(1, "lookup", 40, 50, book(1250, 10)),
    ]
    assert_caught(run(tmp_path, ops))


def test_out_of_stock_while_stock_was_sufficient_is_caught(tmp_path: Path) -> None:
    ops = [
        op(0, "lookup", 0, 10, book(1250, 10)),
        op(1, "buy", 20, 30, {"ok": False, "out_of_stock": True}, quantity=2),
        op(0, "lookup", 40, 50, book(1250, 10)),
    ]
    assert_caught(run(tmp_path, ops))


def test_items_are_checked_separately_and_bad_input_is_rejected(tmp_path: Path) -> None:
    other = dict(op(0, "lookup", 0, 10, book(500, 1)), item=7)
    result = run(tmp_path, [op(0, "lookup", 0, 10, book(1250, 9)), other], {**INITIAL, 7: book(500, 1)})
    assert result.items == {ITEM: "illegal", 7: "ok"} and not result.ok
    with pytest.raises(ValueError, match="no initial state"):
        run(tmp_path, [other])


def test_recorder_round_trip_and_cli(tmp_path: Path) -> None:
    h = lincheck.History(initial=INITIAL)
    a = h.invoke(0, "lookup", ITEM, {})
    h.ok(a, book(1250, 10))
    b = h.invoke(1, "buy", ITEM, {"quantity": 2})
    h.ok(b, {"ok": True})
    h.drop(h.invoke(0, "lookup", ITEM, {}))  # e.g. a 503: not recorded
    h.unknown(h.invoke(1, "update", ITEM, {"stock_delta": 1, "cost": None}))
    h.ok(h.invoke(0, "buy", ITEM, {"quantity": 100}), {"ok": False, "out_of_stock": True})
    with pytest.raises(ValueError):
        h.ok(a, book(1250, 10))
    assert len(h) == 4
    assert h.counts() == {"lookup/ok": 1, "buy/ok": 1, "lookup/dropped": 1, "update/unknown": 1,
                          "buy/out_of_stock": 1}
    path = h.save(tmp_path / "h.json")
    saved = json.loads(path.read_text())
    assert saved["initial"] == {str(ITEM): INITIAL[ITEM]} and saved["ops"][2]["complete"] is None
    proc = subprocess.run([sys.executable, "-m", "pygmy.verify.lincheck", str(path)], capture_output=True,
                          text=True, cwd=lincheck.ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"ok": True, "items": {str(ITEM): "ok"}, "html": {}}
