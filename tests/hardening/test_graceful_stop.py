"""SIGTERM to the order leader's process group while buys are in flight: Gunicorn lets requests in
flight finish, the tier fails over, and every order a client was told about is still there."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import requests
from harness import Cluster, read_answer, send_whole_buys

from pygmy.cluster import launcher


def order_leader(c: Cluster) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        leader = requests.get(c.url + "/status", timeout=5).json()["order"]["leader"]
        if leader:
            return str(leader)
        time.sleep(0.1)
    raise AssertionError("no order leader")


def test_sigterm_to_order_leader_loses_no_acknowledged_buy(fresh_cluster: Cluster) -> None:
    c = fresh_cluster
    leader = order_leader(c)
    acked: list[int] = []
    errors: list[str] = []
    stop = threading.Event()

    def client(i: int) -> None:
        s = requests.Session()
        n = 0
        while not stop.is_set():
            n += 1
            try:
                r = s.post(f"{c.url}/buy/{1 + i % 7}", json={"quantity": 1},
                           headers={"Idempotency-Key": f"graceful-{i}-{n}"}, timeout=15)
            except requests.RequestException as exc:
                errors.append(f"{type(exc).__name__}")
                continue
            if r.status_code == 200:
                acked.append(r.json()["order_number"])
            else:
                errors.append(f"{r.status_code} {r.text[:120]}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    def wait_acked(n: int, what: str) -> None:
        deadline = time.monotonic() + 30
        while len(acked) < n:
            assert time.monotonic() < deadline, f"{what}: {len(acked)} acknowledged, errors {errors[:5]}"
            time.sleep(0.05)

    for t in threads:
        t.start()
    wait_acked(10, "buys before the SIGTERM")
    pgid = int((c.data_dir / "run" / f"{leader}.pid").read_text())
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + 15  # Gunicorn's graceful_timeout is 10 s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"{leader} did not stop within 15 s of SIGTERM")
    wait_acked(len(acked) + 10, "buys after the failover")
    stop.set()
    for t in threads:
        t.join(timeout=30)
    # Clients see at most a failover's worth of 503s, never a server error or a lost connection.
    assert all(e.startswith("503") for e in errors), errors[:10]
    assert not any("Traceback" in line for line in c.logs_tail(leader, 200).splitlines())

    c.restart(leader)
    peers = [f"order-{k}" for k in (1, 2, 3)]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        st = [c.replica_get(p, "/status").json() for p in peers]
        if len({s["applied_index"] for s in st}) == 1 and all(s["role"] in ("leader", "follower") for s in st):
            break
        time.sleep(0.2)
    assert len(set(acked)) == len(acked)
    for number in acked:
        assert requests.get(f"{c.url}/orders/{number}", timeout=5).status_code == 200, number
        for p in peers:
            r = c.replica_get(p, f"/orders/{number}")
            assert r.status_code == 200, (p, number, r.text)


def test_sigkill_to_a_frontend_holding_buys_leaves_each_key_one_order(fresh_cluster: Cluster) -> None:
    """A frontend SIGKILLed while its event loop holds buys (waiting on a SIGSTOPped order leader):
    their clients get no answer, and a retry of each key on the restarted frontend gives one order
    per key, whether the first attempt reached the order tier or not; the stock adds up."""
    c = fresh_cluster
    with c.client() as cl:
        before = cl.lookup(4)["stock"]
    leader = order_leader(c)
    groups = c.process_groups()
    keys = [f"kill-{n}-{time.time()}" for n in range(12)]
    try:
        launcher.pause(groups[leader])
        socks = send_whole_buys(c.url, keys, 4)
        time.sleep(0.15)  # taken, and waiting on the stopped leader
        os.killpg(groups["frontend-1"], signal.SIGKILL)
    finally:
        os.killpg(groups[leader], signal.SIGCONT)
    for sock in socks:
        assert not read_answer(sock).startswith(b"HTTP/1.1 200"), "answered by a killed frontend"
        sock.close()
    c.restart("frontend-1")
    with c.client() as cl:
        orders = {key: cl.buy(4, 1, key=key)["order_number"] for key in keys}
        again = {key: cl.buy(4, 1, key=key)["order_number"] for key in keys}
        assert orders == again and len(set(orders.values())) == len(keys)
        assert cl.lookup(4)["stock"] == before - len(keys)


def test_sigterm_to_a_frontend_answers_the_buys_its_event_loop_holds(fresh_cluster: Cluster) -> None:
    """Buys taken by a frontend worker's event loop hold no thread (pygmy/cluster/worker.py), so Gunicorn's
    graceful stop, which waits for its threads, does not see them: the worker and its batcher
    must see them through (``AdmissionWorker.run``, ``Combiner.stop``). The order
    leader is stopped first, so the buys are still waiting on the order tier when the frontend is
    told to stop; each must be answered 200 once the tier fails over, and the stock must add up."""
    c = fresh_cluster
    with c.client() as cl:
        before = cl.lookup(3)["stock"]
    leader = order_leader(c)
    groups = c.process_groups()
    try:
        launcher.pause(groups[leader])
        socks = send_whole_buys(c.url, [f"term-{n}-{time.time()}" for n in range(12)], 3)
        time.sleep(0.15)  # taken, and waiting on the stopped leader (a router looks elsewhere at 0.25 s)
        os.killpg(groups["frontend-1"], signal.SIGTERM)
        time.sleep(0.5)
    finally:
        os.killpg(groups[leader], signal.SIGCONT)
    answers = [read_answer(sock) for sock in socks]
    for sock in socks:
        sock.close()
    for raw in answers:
        assert raw.startswith(b"HTTP/1.1 200 "), raw[:300]
        assert b"\r\nServer:" not in raw.partition(b"\r\n\r\n")[0], "the buy went through a pool thread"
    orders = {json.loads(raw.partition(b"\r\n\r\n")[2])["order_number"] for raw in answers}
    assert len(orders) == len(socks)
    deadline = time.monotonic() + 15
    while True:  # Gunicorn's graceful_timeout is 10 s
        try:
            os.killpg(groups["frontend-1"], 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "the frontend did not stop"
        time.sleep(0.05)
    c.restart("frontend-1")
    with c.client() as cl:
        assert cl.lookup(3)["stock"] == before - len(socks)
        for number in orders:
            assert cl.order(number)["item_number"] == 3
