"""The frontend's write cap follows latency (``LatencyLimit``, issue #42), on a real cluster.

The order leader holds its decrements (``PYGMY_TEST_HOLD_DECREMENTS``) so that buys are slow and
the cap is reached: once they finish, the cap is cut below its configured value, and the cut cap is
what admits (the buys past it are refused, 503, and take nothing); fast buys then grow it back.
One frontend worker, so that ``/status`` shows the cap of the worker that measured the buys.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
import requests
from harness import held_decrements_cluster, wait_for

from pygmy.client.api import PygmyClient, PygmyError
from pygmy.cluster.local import LocalCluster

CEILING = 12
BOOK = 3


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with held_decrements_cluster(tmp_path_factory.mktemp("latency-cap"), "--frontend-workers", "1",
                                 "--frontend-write-limit", str(CEILING), "--frontend-write-tolerance", "3") as held:
        yield held


def write_cap(c: LocalCluster) -> dict[str, Any]:
    return requests.get(f"{c.url}/status", timeout=5).json()["frontend"]["admission"]["write"]


def held_buys(c: LocalCluster, flag: Any, offered: int, admitted: int) -> tuple[int, int]:
    """``offered`` buys at once with decrements held until ``admitted`` are in flight and a second
    has passed; returns (acknowledged, refused with 503)."""
    outcomes: list[int] = []
    lock = threading.Lock()

    def buy() -> None:
        with PygmyClient(c.url, timeout=30) as own:
            try:
                own.buy(BOOK, key=f"held-{uuid.uuid4().hex[:10]}")
                code = 200
            except PygmyError as exc:
                code = exc.status
        with lock:
            outcomes.append(code)

    flag.touch()
    threads = [threading.Thread(target=buy) for _ in range(offered)]
    try:
        for t in threads:
            t.start()
        wait_for("the admitted buys in flight, the rest refused",
                 lambda: write_cap(c)["in_flight"] >= admitted and len(outcomes) >= offered - admitted, 15)
        time.sleep(2.5)  # slow against a baseline of milliseconds; and what is left of an older window is dropped
    finally:
        flag.unlink(missing_ok=True)
        for t in threads:
            t.join(30)
    assert len(outcomes) == offered and set(outcomes) <= {200, 503}, outcomes
    return outcomes.count(200), outcomes.count(503)


def test_slow_buys_at_the_cap_cut_it_the_cut_cap_admits_and_fast_buys_grow_it_back(held: Any) -> None:
    c, flag = held
    with PygmyClient(c.url, timeout=30) as client:
        stock = client.lookup(BOOK)["stock"]
        for _ in range(30):
            client.buy(BOOK)
        cap = write_cap(c)
        assert cap["limit"] == cap["ceiling"] == CEILING and cap["baseline_ms"] is not None

        ok, refused = held_buys(c, flag, CEILING + 4, CEILING)
        assert (ok, refused) == (CEILING, 4)
        bought = 30 + CEILING
        while write_cap(c)["limit"] == CEILING and bought < 100:  # a window closes on a buy's end
            client.buy(BOOK)
            bought += 1
        cut = write_cap(c)["limit"]
        assert CEILING // 4 <= cut < CEILING

        ok, refused = held_buys(c, flag, CEILING, cut)
        assert (ok, refused) == (cut, CEILING - cut), "the cut cap is what admits"
        assert client.lookup(BOOK)["stock"] == stock - bought - cut, "a refused buy takes nothing"

        for _ in range(400):
            if write_cap(c)["limit"] == CEILING:
                break
            for _ in range(10):
                client.buy(BOOK)
        assert write_cap(c)["limit"] == CEILING, "fast buys grow the cap back to its ceiling, not past it"
