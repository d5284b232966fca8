"""The per-thread counters of ``experiments.profile``: each thread's blocks and CPU per operation."""

from __future__ import annotations

import os
import threading
import time

import pytest

from pygmy.experiments import profile


def test_a_threads_blocks_are_counted_and_shown_per_operation(monkeypatch: pytest.MonkeyPatch) -> None:
    pid, ready, go, end = os.getpid(), threading.Event(), threading.Event(), threading.Event()
    tid: list[int] = []

    def sleeper() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        go.wait(10)
        for _ in range(20):
            time.sleep(0.001)  # each one blocks: a voluntary switch
        end.wait(10)  # still there to be read

    t = threading.Thread(target=sleeper, name="sleeper")
    t.start()
    ready.wait(10)
    before = {pid: profile.thread_counters(pid)}
    go.set()
    time.sleep(0.3)  # it has slept its 20 times
    try:
        after = profile.thread_counters(pid)
        monkeypatch.setattr(profile, "thread_names", lambda spy, p: {tid[0]: "sleeper"})
        lines = profile.thread_table("py-spy", before, {pid: "tests"}, ops=10)
    finally:
        end.set()
        t.join()
    assert after[tid[0]][1] - before[pid][tid[0]][1] >= 20
    (line,) = [x for x in lines if "sleeper" in x]
    assert line.split()[:2] == ["tests", "sleeper"] and "switches" in line
    voluntary = float(line.split("switches")[1].split("+")[0])
    assert voluntary >= 2.0  # 20 or more blocks over 10 operations
