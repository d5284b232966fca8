"""Every background loop of a service survives an unexpected error (#16): it logs and goes on.

The Raft event loop has its own tests (tests/replication/test_raft_node.py: a full disk, an injected
error); here are the others, each driven in-process with an error injected on its first round.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from pygmy.catalog.app import Restocker
from pygmy.frontend.cache import ReadCache
from pygmy.frontend.subscription import Subscription
from pygmy.order.app import BuyProcessor
from pygmy.replication.router import Reply


def eventually(cond: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


class FailsOnce:
    """A callable that raises on its first call and then returns ``value``; counts its calls."""

    def __init__(self, value: Any = None) -> None:
        self.value, self.calls = value, 0

    def __call__(self, *args: Any, **kw: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("injected")
        return self.value


class Obj:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def test_lease_renewal_goes_on_after_an_error() -> None:
    grant = Reply(200, {"leader": "catalog-1", "term": 1, "commit_index": 0, "lease": 0.4, "continued": True,
                        "holds": [], "next_token": 1}, "catalog-1")
    router = Obj(call=FailsOnce(grant), close=lambda: None)
    sub = Subscription(ReadCache(10), router, "s", "127.0.0.1", None, "frontend-1")  # type: ignore[arg-type]
    sub.start()
    try:
        assert eventually(sub.valid), "no lease after the renewal loop's first error"
        assert router.call.calls >= 2
    finally:
        sub.stop()


def test_the_restocker_goes_on_after_an_error() -> None:
    proposed = threading.Event()

    def propose(command: dict, timeout: float) -> dict:
        proposed.set()
        return {"ok": True, "items": command["items"], "index": 9}

    runtime = Obj(node=Obj(is_leader=lambda: True), propose=propose)
    state = Obj(sold_out=FailsOnce([3]))
    held = Obj(holding=lambda keys: _null_hold())
    r = Restocker(runtime, state, held, every=0.01, amount=5)  # type: ignore[arg-type]
    r.start()
    try:
        assert proposed.wait(5), "no restock after the first round failed"
    finally:
        r.stop()


class _null_hold:  # noqa: N801 (stands in for a context manager function)
    def __enter__(self) -> Any:
        return Obj(index=0)

    def __exit__(self, *exc: object) -> None:
        return None


def test_the_intent_sweeper_goes_on_after_an_error() -> None:
    rt = Obj(node=Obj(is_leader=lambda: True, add_leader_listener=lambda cb: None))
    state = Obj(pending=FailsOnce([]))
    sweeper = BuyProcessor(rt, state, catalog=None)  # type: ignore[arg-type]
    sweeper.start()
    try:
        sweeper._wake.set()
        assert eventually(lambda: state.pending.calls >= 2, timeout=5), "the sweeper died on its first error"
    finally:
        sweeper.stop()
