"""The tiers' view behind the frontend's /status: one refresh at a time, reused while young."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from frontend.statusview import StatusView


def test_concurrent_callers_cause_one_refresh_and_a_young_view_is_reused() -> None:
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
    again, age = view.get()
    assert again == {"n": 1} and 0 <= age <= 0.2 and len(calls) == 1
    time.sleep(0.25)
    assert view.get() == ({"n": 2}, 0.0) and view.refreshes == 2


def test_callers_during_a_refresh_get_the_previous_view_with_its_age() -> None:
    gate = threading.Event()
    n = {"calls": 0}

    def fetch() -> dict[str, Any]:
        n["calls"] += 1
        if n["calls"] == 2:
            gate.wait(5)
        return {"n": n["calls"]}

    view = StatusView(fetch, max_age=0.05)
    view.get()
    time.sleep(0.1)
    refresher = threading.Thread(target=view.get)
    refresher.start()
    while n["calls"] < 2:
        time.sleep(0.001)
    old, age = view.get()  # the refresh is stuck: no second one, the old view and its age
    assert old == {"n": 1} and age >= 0.1 and n["calls"] == 2
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
