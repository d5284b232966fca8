"""Snapshots streamed in chunks through files (``pygmy.replication.snapshots``): a stream arrives whole or
not at all, a pinned state is the state at its index however the applier goes on, and a follower
gets its state back through a stream of many chunks, again after a stream broke."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from test_raft_node import KV, Harness

from pygmy.replication import snapshots
from pygmy.replication.node import ReplicationConfig
from pygmy.replication.snapshots import Incoming, stream_frames


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(snapshots, "CHUNK_BYTES", 1000)
    return 1000


def image(tmp_path: Path, size: int = 2500) -> Path:
    path = tmp_path / "image.db"
    path.write_bytes(os.urandom(size))
    return path


def test_a_stream_arrives_whole_in_chunks(tmp_path: Path, small_chunks: int) -> None:
    src = image(tmp_path)
    frames = list(stream_frames("3-40-ab", src))
    assert [len(f) for f in frames] and sum("chunk" in f for f in frames) == 3
    inc = Incoming(tmp_path / "in")
    for f in frames[:-1]:
        inc.chunk("kv-1", f["chunk"])
    got = inc.finish("kv-1", frames[-1]["snapshot"])
    assert got is not None and got.read_bytes() == src.read_bytes()
    inc.discard(got)
    assert list((tmp_path / "in").iterdir()) == []


@pytest.mark.parametrize("fault", ["lost chunk", "corrupt chunk", "wrong size", "no chunks"])
def test_a_stream_that_did_not_arrive_whole_is_never_handed_over(tmp_path: Path, small_chunks: int,
                                                                 fault: str) -> None:
    frames = list(stream_frames("3-40-ab", image(tmp_path)))
    chunks, end = [f["chunk"] for f in frames[:-1]], dict(frames[-1]["snapshot"])
    if fault == "lost chunk":
        del chunks[1]
    elif fault == "corrupt chunk":
        chunks[1] = {**chunks[1], "data": chunks[0]["data"]}
    elif fault == "wrong size":
        end["size"] += 1
    else:
        chunks = []
    inc = Incoming(tmp_path / "in")
    for c in chunks:
        inc.chunk("kv-1", c)
    assert inc.finish("kv-1", end) is None
    assert list((tmp_path / "in").iterdir()) == [], "nothing half-received is left behind"


def test_a_stream_whose_last_bytes_could_not_be_written_is_never_handed_over(tmp_path: Path, small_chunks: int) -> None:
    """Chunks are written through a buffer: a full disk may fail only the flush of the last ones,
    after every chunk was taken and hashed. The stream is then not whole on disk, and dropped."""
    frames = list(stream_frames("3-40-ab", image(tmp_path)))
    inc = Incoming(tmp_path / "in")
    for f in frames[:-1]:
        inc.chunk("kv-1", f["chunk"])

    class Full:
        def __init__(self, file: Any) -> None:
            self.file = file

        def flush(self) -> None:
            raise OSError(28, "No space left on device")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.file, name)

    partial = inc._partial["kv-1"]
    partial.file = Full(partial.file)  # type: ignore[assignment]
    assert inc.finish("kv-1", frames[-1]["snapshot"]) is None
    assert list((tmp_path / "in").iterdir()) == [], "nothing half-written is left behind"


def test_a_new_stream_replaces_a_broken_one_and_late_frames_of_the_old_are_ignored(tmp_path: Path,
                                                                                   small_chunks: int) -> None:
    old = list(stream_frames("3-40-aa", image(tmp_path)))
    src = tmp_path / "new.db"
    src.write_bytes(os.urandom(1800))
    new = list(stream_frames("4-60-bb", src))
    inc = Incoming(tmp_path / "in")
    inc.chunk("kv-1", old[0]["chunk"])
    inc.chunk("kv-1", new[0]["chunk"])
    inc.chunk("kv-1", old[1]["chunk"])  # a late frame of the first stream
    inc.chunk("kv-1", new[1]["chunk"])
    assert inc.finish("kv-1", old[-1]["snapshot"]) is None  # not the stream being received: dropped
    for f in new[:-1]:
        inc.chunk("kv-1", f["chunk"])
    got = inc.finish("kv-1", new[-1]["snapshot"])
    assert got is not None and got.read_bytes() == src.read_bytes()


def test_malformed_chunks_are_ignored(tmp_path: Path) -> None:
    inc = Incoming(tmp_path / "in")
    for body in (None, {}, {"id": "x", "offset": 0, "data": "not base64!"}, {"id": "../up", "offset": 0, "data": ""}):
        inc.chunk("kv-1", body)
    assert inc.finish("kv-1", {"id": "../up", "size": 0, "sha256": ""}) is None
    assert list((tmp_path / "in").iterdir()) == []


def test_what_a_crash_left_is_removed_at_start(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "kv-1.partial").write_bytes(b"half")
    Incoming(tmp_path / "in")
    assert list((tmp_path / "in").iterdir()) == []


def test_a_pinned_state_is_copied_as_of_its_index_while_commands_go_on(tmp_path: Path) -> None:
    state, twin = KV(tmp_path / "a.db"), KV(tmp_path / "b.db")
    for i in range(1, 11):
        state.apply(i, {"k": f"k{i % 3}", "add": i})
        twin.apply(i, {"k": f"k{i % 3}", "add": i})
    pin = state.pin()
    for i in range(11, 21):
        state.apply(i, {"k": "later", "add": i})
    pin.write(tmp_path / "copy.db")
    pin.close()
    assert pin.index == 10
    restored = KV(tmp_path / "c.db")
    restored.restore(pin.index, tmp_path / "copy.db")
    assert restored.applied_and_digest() == twin.applied_and_digest() != state.applied_and_digest()
    assert restored.full_digest()[1:] == (twin.digest(), twin.digest())
    for s in (state, twin, restored):
        s.close()


def test_a_follower_is_rebuilt_by_a_stream_of_many_chunks_even_after_one_broke(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshots, "CHUNK_BYTES", 4096)
    real, broken, seen = Incoming.chunk, [], []

    def losing_one(self: Incoming, peer: str, body: Any) -> None:
        seen.append(body)
        if not broken and isinstance(body, dict) and body.get("offset"):
            broken.append(body["id"])  # the first stream loses a chunk: never handed over
            return
        real(self, peer, body)

    monkeypatch.setattr(Incoming, "chunk", losing_one)
    config = ReplicationConfig(keep_entries=20, compact_slack=10, snapshot_timeout_ticks=50)
    h = Harness(tmp_path, config=config)
    try:
        leader = h.leader()
        away = next(n for n in h.nodes if n != leader.name)
        h.stop(away)
        for i in range(200):
            leader.propose({"k": f"key-{i}-" + "x" * 200, "add": i}, timeout=2)
        back = h.start(away)
        h.converge(timeout=15)
        assert broken, "the first stream lost a chunk"
        assert len(seen) > 2 * 8, "each of the two streams came in many chunks"
        deadline = time.monotonic() + 5  # the state is readable a moment before the count moves
        while back.snapshots_installed == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert back.snapshots_installed == 1 and back.core.snap_index > 100
        streams = list(dict.fromkeys(b["id"] for b in seen if isinstance(b, dict)))  # in the order they began
        assert len(streams) >= 2 and streams[0] == broken[0] and streams[-1] != broken[0], \
            f"installed only from the stream the core sent again: {streams}"
        assert list((tmp_path / away / "snapshots" / "in").iterdir()) == []
        assert list((tmp_path / leader.name / "snapshots" / "out").iterdir()) == []
        assert back.sm.full_digest()[1] == back.sm.full_digest()[2] == leader.sm.digest()
    finally:
        h.close()
