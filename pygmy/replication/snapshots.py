"""Snapshots streamed between replicas in chunks, through files, so that memory stays bounded.

A follower whose log the leader has compacted away needs the whole state. It used to travel as one
frame holding the state in base64: at 1,000,000 books that is a few hundred MB in the leader's
memory (the image, its base64, its JSON) and as much again in the follower's. Now:

- the leader's sender thread for that peer pins the state (a read snapshot, microseconds under the
  apply lock, so that its index and term are known together) and copies it page by page to a file
  (SQLite's backup: the applier goes on meanwhile);
- it streams that file as ``{"chunk": ...}`` frames of ``CHUNK_BYTES`` on the peer connection, then
  the snapshot message itself, with ``{"snapshot": {"id", "size", "sha256"}}`` beside it;
- the follower appends each chunk to a file of its own as it arrives, checks size and hash at the
  end, and only then hands the message, with the file's path as its payload, to its event loop,
  which installs the file page by page (``StateMachine.restore``).

Either side may die at any instant: a stream cut short leaves a partial file that nothing installs
(it is replaced by the next stream from that leader, and every file here is removed at start-up),
and the leader's core sends the snapshot again when no acknowledgement came. The core never sees a
chunk; what it decides (when a follower needs a snapshot, when to send it again) is unchanged.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Bytes of state per frame: large enough that the per-frame cost vanishes, small enough that a frame
#: (and its base64 and JSON copies) is a few MB of memory on either side.
CHUNK_BYTES = 1 << 20
_ID = re.compile(r"^[0-9a-z][0-9a-z-]{0,80}$")


def stream_frames(sid: str, path: Path) -> Iterator[dict[str, Any]]:
    """The chunk frames of the file at ``path``, then the closing ``{"snapshot": ...}`` part that
    goes beside the snapshot message (its ``size`` and ``sha256`` let the follower check it whole)."""
    digest, size = hashlib.sha256(), 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            yield {"chunk": {"id": sid, "offset": size, "data": base64.b64encode(chunk).decode("ascii")}}
            size += len(chunk)
    yield {"snapshot": {"id": sid, "size": size, "sha256": digest.hexdigest()}}


class _Partial:
    """One stream being received: its file, how much of it is written, the running hash."""

    def __init__(self, sid: str, path: Path) -> None:
        self.sid, self.path, self.size, self.hash = sid, path, 0, hashlib.sha256()
        self.file = path.open("wb")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()


class Incoming:
    """A follower's snapshots in transit: one stream per leader at a time, each in its own file under
    ``directory`` (emptied at start: whatever a crash left there is not worth keeping).

    Called from the peer connections' reader threads (``chunk``, ``finish``) and the event loop
    (``discard``). A chunk that does not continue its stream where it stands (a lost frame, a new
    stream) ends that stream: it is never finished, and the leader sends the snapshot again."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._partial: dict[str, _Partial] = {}  # by the sending peer
        self._serial = 0

    def chunk(self, peer: str, body: Any) -> None:
        try:
            sid, offset, data = body["id"], body["offset"], base64.b64decode(body["data"], validate=True)
        except (KeyError, TypeError, ValueError):
            log.warning("snapshot chunk from %s is malformed; its stream is dropped", peer)
            self._drop(peer)
            return
        with self._lock:
            p = self._partial.get(peer)
            if offset == 0 and isinstance(sid, str) and _ID.match(sid):
                if p is not None:
                    p.close()
                    p.path.unlink(missing_ok=True)
                p = self._partial[peer] = _Partial(sid, self.directory / f"{peer}.partial")
            elif p is None or p.sid != sid:
                return  # of a stream already dropped or replaced (a late frame of an old connection)
            elif p.size != offset:
                log.warning("snapshot stream %s from %s broke at %d bytes; dropped", p.sid, peer, p.size)
                self._drop_locked(peer)
                return
            try:
                p.file.write(data)
            except OSError as exc:  # a full disk: the leader tries again later
                log.warning("snapshot stream %s from %s: %s; dropped", sid, peer, exc)
                self._drop_locked(peer)
                return
            p.size += len(data)
            p.hash.update(data)

    def finish(self, peer: str, body: Any) -> Path | None:
        """The stream's file, complete, synced and under a name of its own; None if what arrived is
        not the whole stream (the snapshot message that came with it is then ignored, as if lost)."""
        with self._lock:
            p = self._partial.pop(peer, None)
            if p is None:
                return None
            try:  # every byte on disk, or the stream is not whole (a full disk fails the last flush)
                p.file.flush()
                os.fsync(p.file.fileno())
                written = True
            except OSError as exc:
                log.warning("snapshot stream %s from %s not written whole: %s", p.sid, peer, exc)
                written = False
            p.close()
            ok = written and (isinstance(body, dict) and body.get("id") == p.sid and body.get("size") == p.size
                              and body.get("sha256") == p.hash.hexdigest())
            if not ok:
                log.warning("snapshot stream %s from %s is incomplete or corrupt; dropped", p.sid, peer)
                p.path.unlink(missing_ok=True)
                return None
            self._serial += 1
            ready = self.directory / f"{self._serial}-{p.sid}.db"
            try:
                p.path.rename(ready)
            except OSError as exc:
                log.warning("snapshot stream %s from %s: %s; dropped", p.sid, peer, exc)
                p.path.unlink(missing_ok=True)
                return None
            return ready

    def discard(self, path: Path) -> None:
        """A received snapshot that was installed, or that the core did not need."""
        path.unlink(missing_ok=True)
        for extra in ("-wal", "-shm", "-journal"):
            Path(f"{path}{extra}").unlink(missing_ok=True)

    def _drop(self, peer: str) -> None:
        with self._lock:
            self._drop_locked(peer)

    def _drop_locked(self, peer: str) -> None:
        p = self._partial.pop(peer, None)
        if p is not None:
            p.close()
            p.path.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            for peer in list(self._partial):
                self._drop_locked(peer)
