"""Timestamps on a buy's path, for ``python -m pygmy.experiments.breakdown``; not part of Pygmy.

The breakdown puts this folder on the PYTHONPATH of the cluster it starts, so every service process
imports it at start-up (Python's ``sitecustomize`` hook). With ``PYGMY_TRACE_DIR`` set it wraps the
functions a buy passes through, each wrapped call recording ``time.perf_counter_ns()`` (CLOCK_MONOTONIC:
one clock for every process of the machine) at its start (``+``) and end (``-``), or once (``.``);
a daemon thread appends them to ``$PYGMY_TRACE_DIR/<pid>.txt`` every 0.1 s. Without the variable it
does nothing, and nothing of Pygmy's own code carries a timestamp: the production path is untouched.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

_events: list[tuple[int, str]] = []


def _flush(path: str) -> None:
    while True:
        time.sleep(0.1)
        batch = _events[:]
        del _events[:len(batch)]
        if batch:
            with open(path, "a") as f:
                f.write("".join(f"{t} {label}\n" for t, label in batch))


def _wrap(cls: Any, attr: str, label: Callable[..., str | None], span: bool = True) -> None:
    """Record ``label(self, *args)`` around (``span``) or at the start of every call of ``cls.attr``."""
    fn = getattr(cls, attr)
    now, add = time.perf_counter_ns, _events.append

    @functools.wraps(fn)
    def traced(self: Any, *args: Any, **kw: Any) -> Any:
        name = label(self, *args)
        if name is None:
            return fn(self, *args, **kw)
        add((now(), name + (" +" if span else " .")))
        if not span:
            return fn(self, *args, **kw)
        try:
            return fn(self, *args, **kw)
        finally:
            add((now(), name + " -"))

    setattr(cls, attr, traced)


def _types(msgs: Any) -> str:
    return ",".join(sorted({m.type for m in msgs}))


def _install() -> None:
    from pygmy.catalog.invalidation import Invalidator
    from pygmy.frontend.subscription import Subscription
    from pygmy.order.app import BuyProcessor
    from pygmy.replication.batching import Combiner
    from pygmy.replication.node import ReplicaNode
    from pygmy.replication.router import ChannelRouter
    from pygmy.replication.service import ReplicaRuntime

    _wrap(Combiner, "submit", lambda self, *a: "fe.submit", span=False)
    tell = Combiner._tell  # a staticmethod

    def traced_tell(slot: Any) -> None:
        _events.append((time.perf_counter_ns(), "fe.answer ."))
        tell(slot)

    Combiner._tell = staticmethod(traced_tell)
    _wrap(ChannelRouter, "write_batch", lambda self, *a: f"call.{self._channel}")
    _wrap(BuyProcessor, "_propose_intents", lambda self, *a: "order.intents")
    _wrap(ReplicaNode, "propose", lambda self, *a: f"{self.name}.propose")
    _wrap(ReplicaNode, "_persist", lambda self, *a: f"{self.name}.persist")
    _wrap(ReplicaNode, "_apply", lambda self, entries: f"{self.name}.apply" if entries else None)
    _wrap(ReplicaNode, "_send", lambda self, msgs: f"{self.name}.send[{_types(msgs)}]" if msgs else None,
          span=False)
    _wrap(ReplicaNode, "_submit", lambda self, kind, value: f"{self.name}.in[{_types(value[0])}]" if kind == "msgs"
          else f"{self.name}.in[{kind}]", span=False)
    _wrap(Invalidator, "hold", lambda self, *a: "catalog.hold")
    _wrap(Invalidator, "release", lambda self, *a: "catalog.release", span=False)
    _wrap(Subscription, "_on_push", lambda self, peer, frame: "fe.push" + (
        "[hold]" if frame.get("holds") else "[release]"))

    serve_frames = ReplicaRuntime.serve_frames

    def traced_serve(self: Any, channel: str, path: str, handle: Any) -> None:
        add, now = _events.append, time.perf_counter_ns

        def traced(body: Any, deadline: float) -> Any:
            add((now(), f"{self.name}.frame{path} +"))
            try:
                return handle(body, deadline)
            finally:
                add((now(), f"{self.name}.frame{path} -"))

        serve_frames(self, channel, path, traced)

    ReplicaRuntime.serve_frames = traced_serve


def _start_flusher() -> None:
    """One flusher per process, to a file of its own pid (again in a forked child: Gunicorn's workers)."""
    del _events[:]
    path = os.path.join(os.environ["PYGMY_TRACE_DIR"], f"{os.getpid()}.txt")
    threading.Thread(target=_flush, args=(path,), daemon=True, name="trace-flush").start()


if os.environ.get("PYGMY_TRACE_DIR"):
    _install()
    _start_flusher()
    os.register_at_fork(after_in_child=_start_flusher)
