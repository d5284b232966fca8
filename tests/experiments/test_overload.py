"""The overload experiment (issue #19): its outside checks on made-up answers must name each broken
guarantee, its recovery measure must read a made-up series right, and at tiny size the whole run
(open-loop generator, re-sends, order and stock reads) goes end to end on a cluster of its own.
No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pygmy.experiments import harness as h
from pygmy.experiments import overload
from pygmy.experiments.overload import Answer, check


def clean() -> tuple[list[Answer], dict[int, tuple[int, int] | None], dict[int, int]]:
    """Key a: 200 at once. b: no answer, its re-send 200. c: shed (429), re-sent 200. d: 503 and the
    re-send 503 again (unknown; it did not happen). e: a definite 404 (no such book)."""
    answers = [Answer("a", 1, 1, 200, 1), Answer("b", 2, 1, 0, -1), Answer("c", 1, 1, 429, -1),
               Answer("d", 2, 1, 503, -1), Answer("e", 99, 1, 404, -1),
               Answer("b", 2, 1, 200, 2), Answer("c", 1, 1, 200, 3), Answer("d", 2, 1, 503, -1)]
    orders = {1: (1, 1), 2: (2, 1), 3: (1, 1)}
    return answers, orders, {1: 2, 2: 1}


def test_a_clean_run_passes() -> None:
    result = check(*clean())
    assert result["ok"], result
    assert result["acknowledged"] == 3 and result["unknown"] == 1
    assert result["final_outcomes"] == {"200": 3, "unknown": 1, "404": 1}
    assert result["stock_difference"] == 0 and result["books_off"] == 0


def test_an_unknown_key_may_have_sold_one() -> None:
    answers, orders, _ = clean()
    assert check(answers, orders, {1: 2, 2: 2})["ok"]  # d happened after all: within its slack
    assert not check(answers, orders, {1: 2, 2: 3})["ok"]  # but not twice


def test_a_lost_order_is_flagged() -> None:
    answers, orders, sold = clean()
    result = check(answers, {**orders, 2: None}, sold)
    assert not result["ok"] and result["lost"] == 1 and result["examples"]["lost"] == ["b"]


def test_an_order_of_another_book_is_lost() -> None:
    answers, orders, sold = clean()
    assert check(answers, {**orders, 3: (2, 1)}, sold)["lost"] == 1


def test_an_acknowledged_buy_refused_later_is_lost() -> None:
    answers, orders, sold = clean()
    result = check([*answers, Answer("a", 1, 1, 404, -1)], orders, sold)
    assert not result["ok"] and result["examples"]["lost"] == ["a"]


def test_a_key_with_two_orders_is_flagged() -> None:
    answers, orders, sold = clean()
    result = check([*answers, Answer("a", 1, 1, 200, 4)], {**orders, 4: (1, 1)}, sold)
    assert not result["ok"] and result["doubled_keys"] == 1


def test_an_order_of_two_keys_is_flagged() -> None:
    answers, orders, sold = clean()
    result = check([*answers, Answer("f", 1, 1, 200, 1)], orders, {1: 3, 2: 1})
    assert not result["ok"] and result["shared_orders"] == 1 and result["doubled_keys"] == 0


def test_stock_that_does_not_add_up_is_flagged() -> None:
    answers, orders, _ = clean()
    for sold in ({1: 1, 2: 1}, {1: 3, 2: 1}, {1: 2, 2: 1, 7: 1}):
        result = check(answers, orders, sold)
        assert not result["ok"] and result["books_off"] == 1, sold


def test_recovery_reads_a_series() -> None:
    t = np.arange(10) * 0.1
    good = np.array([0, 0, 1, 0, 0, 1, 1, 1, 1, 1], bool)
    r = overload.recovery(t, np.ones(10, bool), good, 1.0)
    assert r["first"] == pytest.approx(0.2) and r["stable"] == pytest.approx(0.5)
    assert overload.recovery(t, np.ones(10, bool), ~good, 1.0)["stable"] is None


def test_buy_recovery_counts_a_failed_buy_as_slow() -> None:
    rows = [("", "after", "buy", 0.1 * k, 0.010 if k >= 3 else 2.0, 0.0, 200, "", "", f"k{k}", 1, k + 1, 1, 1)
            for k in range(12)]
    rows[8] = (*rows[8][:6], 0, "timeout", *rows[8][8:])
    r = overload.buy_recovery(overload.Shots.of(rows), normal_p50_ms=10.0, horizon=2.0)
    assert r["first"] == pytest.approx(0.1)  # buys 1..5: three of five fast, the median is 10 ms
    assert r["stable"] == pytest.approx(0.1)  # one failure in a window of 5 does not move the median


def test_plans_interleave_one_schedule() -> None:
    streams = [overload.Stream("s", "buy", 100, 0, 1), overload.Stream("l", "lookup", 20, 0.5, 1, "probe")]
    plans = overload.plans(streams, 2)
    assert [len(p.sched) for p in plans] == [50, 50, 10]
    every = np.sort(np.concatenate([p.sched for p in plans[:2]]))
    assert np.allclose(np.diff(every), 0.01)
    assert plans[2].op == ["lookup"] * 10 and plans[2].sched[0] == 0.5


@pytest.mark.timeout(600)
def test_tiny_run_end_to_end(tmp_path: Path) -> None:
    s = h.Settings(tiny=True, results_dir=tmp_path / "results", plots_dir=tmp_path / "plots", progress=False)
    out = overload.run(s)
    data = json.loads((s.results_dir / "overload.json").read_text())
    assert data["size"] == "tiny" and data["table"]["rows"]
    assert [p["multiple"] for p in out["sweep"]] == [0.5, 2.0]
    assert (s.plots_dir / data["plots"][0]).stat().st_size > 1000
    # Open loop: what was offered is the schedule, whatever the answers did.
    first = out["sweep"][0]
    assert first["offered"] == pytest.approx(0.5 * out["capacity_per_s"] * out["point_s"], abs=2)
    # Two lookup streams: random books (misses) and the seven hot ones (hits).
    assert out["surge"]["lookups_during"] == pytest.approx(2 * out["surge"]["seconds"] / overload.LOOKUP_EVERY, abs=2)
    assert out["surge"]["hot_lookup_during_p50_ms"] > 0 and out["surge"]["hot_lookup_ratio"] is not None
    # Correctness holds whatever the load did: nothing lost, nothing doubled, the stock adds up.
    checks = out["checks"]
    assert checks["keys"] >= first["offered"] and checks["orders_read"] == checks["acknowledged"]
    assert checks["ok"], checks
    assert (s.results_dir / data["raw"]).stat().st_size > 1000
