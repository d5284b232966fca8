"""The tiers' view behind the frontend's /status: one refresh at a time, reused while young."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest

from pygmy.frontend import statusview
from pygmy.frontend.statusview import StatusView


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The view's clock, moved by the test only: ages are then exact, whatever the machine's speed."""
    now = [0.0]
    monkeypatch.setattr(statusview, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_concurrent_callers_cause_one_refresh_and_a_young_view_is_reused(clock: list[float]) -> None:
    calls: list[float] = []
    gate = threading.Event()

    def fetch() -> dict[str, Any]:
        calls.append(time.monotonic())
        gate.wait(5)
        return {"n": len(calls)}

    view = StatusView(fetch, max_age=0.2)
    with ThreadPoolExecutor(max_workers=20) as pool:
        futures = [pool.submit(view.get) for _ in range(20)]
        time.sleep(0.1)
        gate.set()
        results = [f.result(5) for f in futures]
    assert len(calls) == 1 and all(v == {"n": 1} for v, _ in results)
    clock[0] += 0.2
    assert view.get() == ({"n": 1}, pytest.approx(0.2)) and len(calls) == 1  # as old as it may be: reused
    clock[0] += 0.01
    assert view.get() == ({"n": 2}, 0.0) and view.refreshes == 2


def test_callers_during_a_refresh_get_the_previous_view_with_its_age(clock: list[float]) -> None:
    gate = threading.Event()
    n = {"calls": 0}

    def fetch() -> dict[str, Any]:
        n["calls"] += 1
        if n["calls"] == 2:
            gate.wait(5)
        return {"n": n["calls"]}

    view = StatusView(fetch, max_age=0.05)
    view.get()
    clock[0] += 0.1
    refresher = threading.Thread(target=view.get)
    refresher.start()
    while n["calls"] < 2:
        time.sleep(0.001)
    old, age = view.get()  # the refresh is stuck: no second one, the old view and its age
    assert old == {"n": 1} and age == pytest.approx(0.1) and n["calls"] == 2
    gate.set()
    refresher.join(5)
    assert view.get()[0] == {"n": 2}


def test_a_failed_refresh_is_retried_by_the_next_caller() -> None:
    outcomes = [RuntimeError("replicas unreachable"), {"ok": True}]

    def fetch() -> dict[str, Any]:
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    view = StatusView(fetch)
    with pytest.raises(RuntimeError):
        view.get()
    assert view.get() == ({"ok": True}, 0.0)
