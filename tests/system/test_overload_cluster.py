"""Overload from outside (issue #19), on a real cluster with the write path held full on purpose.

The order leader holds its decrements (``PYGMY_TEST_HOLD_DECREMENTS``) so buys stay in flight:
- past the frontend's cap a buy is refused at once, 503 with ``Retry-After``, and does nothing;
  reads are still served; the held buys finish once released; stock falls by exactly those;
- the cap is the frontend's, whichever of its two workers holds the buys, and the places of a
  worker SIGKILLed while holding them are free again once Gunicorn has replaced it;
- a buy whose time runs out after its intent was recorded is still exactly-once: the caller hears
  an error, the intent is finished off the buyer's path, and a retry with its key gets that order;
  also when the order leader is SIGKILLed at that instant (intent pending, decrement not sent).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import requests
from harness import held_decrements_cluster, pygmy, read_answer, send_whole_buys

from pygmy.client.api import PygmyClient, PygmyError
from pygmy.cluster import launcher
from pygmy.cluster.local import LocalCluster

LIMIT = 2


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Any:
    # A fixed cap (the default, named): these tests hold buys at it (test_admission_latency.py: one that follows latency).
    with held_decrements_cluster(tmp_path_factory.mktemp("overload"), "--frontend-workers", "2", "--frontend-write-limit",
                                 str(LIMIT), "--frontend-write-tolerance", "0") as held:
        yield held


def in_flight_writes(c: LocalCluster) -> int:
    """Buys the frontend is working on, all its workers together, from its ``/status``."""
    return requests.get(f"{c.url}/status", timeout=5).json()["frontend"]["admission"]["write"]["in_flight"]


def shed_writes(c: LocalCluster) -> float:
    text = requests.get(f"{c.url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pygmy_shed_total{") and 'cls="write"' in line and "frontend-1" in line)


def wait_for(check: Any, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_past_the_cap_a_buy_is_refused_at_once_does_nothing_and_reads_go_on(held: Any) -> None:
    c, flag = held
    with PygmyClient(c.url, timeout=30) as client:
        stock = client.lookup(4)["stock"]
        flag.touch()
        answers: list[Any] = [None] * LIMIT

        def buy(k: int) -> None:
            with PygmyClient(c.url, timeout=30) as own:
                answers[k] = own.buy(4, key=f"held-{k}-{uuid.uuid4().hex[:8]}")

        threads = [threading.Thread(target=buy, args=(k,)) for k in range(LIMIT)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: in_flight_writes(c) >= LIMIT)
            shed_before = shed_writes(c)
            refused_key = f"refused-{uuid.uuid4().hex[:8]}"
            with pytest.raises(PygmyError) as err:
                client.buy(4, key=refused_key)
            assert err.value.status == 503 and err.value.retry_after == 1
            assert err.value.body["error"]["overloaded"] is True
            assert shed_writes(c) == shed_before + 1
            # Reads have their own cap: served while every write place is taken.
            assert client.lookup(4)["stock"] == stock
            assert client.search("distributed systems")["items"]
        finally:
            flag.unlink(missing_ok=True)
            for t in threads:
                t.join(30)
        assert all(a is not None for a in answers)
        assert client.lookup(4)["stock"] == stock - LIMIT, "the refused buy must have taken nothing"
        # Refused means not done: its key is unknown, so the retry is a new buy, done once.
        order = client.buy(4, key=refused_key)
        assert order["order_number"] not in {a["order_number"] for a in answers}
        assert client.buy(4, key=refused_key)["order_number"] == order["order_number"]
        assert client.lookup(4)["stock"] == stock - LIMIT - 1


def test_a_buy_whose_time_runs_out_after_its_intent_is_still_exactly_once(held: Any) -> None:
    c, flag = held
    key = f"late-{uuid.uuid4().hex[:8]}"
    with PygmyClient(c.url, timeout=30) as client:
        stock = client.lookup(5)["stock"]
        flag.touch()
        try:
            with PygmyClient(c.url, timeout=1.0) as hurried, pytest.raises(PygmyError) as err:
                hurried.buy(5, key=key)  # its intent is recorded, then its decrement is held
            assert err.value.status in (0, 503, 504)
            time.sleep(1.0)  # the order leader's copy of its deadline has passed too
            assert client.lookup(5)["stock"] == stock
        finally:
            flag.unlink(missing_ok=True)
        # Finished off the buyer's path (the sweep, or this retry's read of the intent): once.
        first = client.buy(5, key=key)
        assert client.buy(5, key=key)["order_number"] == first["order_number"]
        assert client.order(first["order_number"])["item_number"] == 5
        wait_for(lambda: client.lookup(5)["stock"] == stock - 1)
        time.sleep(2.5)  # a sweep after the retry must not take a second copy
        assert client.lookup(5)["stock"] == stock - 1


def test_the_order_leader_killed_with_a_late_buys_intent_pending(held: Any) -> None:
    """The instant a spent deadline leaves open: an intent recorded, its buyer gone with an error,
    its decrement not sent; then its leader is SIGKILLed there. The next leader finishes it: one
    order, one copy, every order replica's digest equal and equal to a recount."""
    c, flag = held
    key = f"orphan-{uuid.uuid4().hex[:8]}"
    with PygmyClient(c.url, timeout=30) as client:
        stock = client.lookup(6)["stock"]
        flag.touch()
        try:
            with PygmyClient(c.url, timeout=1.0) as hurried, pytest.raises(PygmyError):
                hurried.buy(6, key=key)
            time.sleep(1.0)  # past the order leader's copy of the deadline too
            leader = requests.get(f"{c.url}/status", timeout=5).json()["order"]["leader"]
            c.kill(leader)
        finally:
            flag.unlink(missing_ok=True)
        first = client.buy(6, key=key)  # on the new leader, which found the intent pending
        assert client.buy(6, key=key)["order_number"] == first["order_number"]
        assert client.order(first["order_number"])["item_number"] == 6
        wait_for(lambda: client.lookup(6)["stock"] == stock - 1)
        c.restart(leader)

        def agreed() -> bool:
            st = requests.get(f"{c.url}/status", timeout=5).json()["order"]["replicas"]
            return len({(r.get("applied_index"), r.get("state_digest")) for r in st}) == 1 and all(
                r.get("role") in ("leader", "follower") for r in st)

        wait_for(agreed, timeout=30)
        assert client.lookup(6)["stock"] == stock - 1
    verify = pygmy("verify", "--data-dir", str(c.data_dir))
    assert verify.returncode == 0, verify.stdout + verify.stderr


def frontend_workers(c: LocalCluster) -> set[int]:
    master = c.process_groups()["frontend-1"]
    return {int(pid) for pid in Path(f"/proc/{master}/task/{master}/children").read_text().split()}


def test_the_cap_is_the_frontends_and_a_killed_worker_gives_its_places_back(held: Any) -> None:
    """Both places taken on one worker (the other is SIGSTOPped, so it accepts nothing); then that
    one is stopped and the other let go: a third buy, which only the other can take, is refused,
    not admitted by the worker with room of its own. Then the full worker is SIGKILLed with the
    buys in it: once Gunicorn has forked its replacement the places are free again, and every key
    still gives one order when retried."""
    c, flag = held
    with PygmyClient(c.url, timeout=30) as client:
        stock = client.lookup(6)["stock"]
    first, second = sorted(frontend_workers(c))
    keys = [f"split-{n}-{uuid.uuid4().hex[:8]}" for n in range(2 * LIMIT)]
    socks = []
    flag.touch()
    try:
        try:
            launcher.pause(second, group=False)
            socks += send_whole_buys(c.url, keys[:LIMIT], 6)  # all accepted by the first worker
            wait_for(lambda: in_flight_writes(c) >= LIMIT)
            launcher.pause(first, group=False)
            os.kill(second, signal.SIGCONT)
            (refused,) = send_whole_buys(c.url, [f"over-{uuid.uuid4().hex[:8]}"], 6)  # to the second
            answer = read_answer(refused)
            refused.close()
            assert answer.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in answer
            assert b'"overloaded": true' in answer, answer
            os.kill(first, signal.SIGKILL)
        finally:
            for pid in (first, second):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        wait_for(lambda: len(frontend_workers(c)) == 2 and first not in frontend_workers(c))
        assert in_flight_writes(c) == 0, "a killed worker's places must not be lost"
        socks += send_whole_buys(c.url, keys[LIMIT:], 6)
        wait_for(lambda: in_flight_writes(c) >= LIMIT)
    finally:
        flag.unlink(missing_ok=True)
    for sock in socks[LIMIT:]:
        assert read_answer(sock).startswith(b"HTTP/1.1 200 "), "held buys finish once released"
    for sock in socks:
        sock.close()
    with PygmyClient(c.url, timeout=30) as client:
        orders = {key: client.buy(6, key=key)["order_number"] for key in keys}
        assert len(set(orders.values())) == len(keys), "one order per key, killed or not"
        wait_for(lambda: client.lookup(6)["stock"] == stock - len(keys))
