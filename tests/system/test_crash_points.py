"""The real node's order of persist, send and apply (``Ready.steps``), under SIGKILL at each step.

A test-only hook (``PYGMY_TEST_CRASH_AT``, tests/mutations/sitecustomize.py) kills a replica of the
running processes right after it wrote new entries (``persisted``), right after its messages about
them left (``sent``: a follower's acknowledgement, a leader's appends) or right after it applied
committed entries (``applied``), on a follower or on a leader, in each tier, while clients buy,
update and read. Everything is judged from outside, by ``pygmy.verify.chaos_check``: every
acknowledged buy is an order on every order replica, no order is doubled, stock adds up book by
book on every catalog replica, every replica of a tier has one applied index and one state digest
(recomputed from its rows), and Porcupine finds the history linearizable.

The same check follows a frontend SIGKILLed while its buys wait for company
(``PYGMY_TEST_CRASH_LINGERING``): taken by a worker, not yet sent.

And the order matters: a build whose followers acknowledge entries before writing them
(``PYGMY_MUTATION=ack-before-persist``) loses an acknowledged buy in a scenario that the correct
build survives.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
from harness import BackgroundLoad, Cluster, cluster_env, free_port_base, judge_from_outside, wait_for

from pygmy.cluster import launcher
from pygmy.verify import lincheck
from pygmy.verify.chaos import leader_of, replica_status

ITEMS = list(range(1, 8))




def alive(c: Cluster, name: str) -> bool:
    return launcher.running(c.cluster_config(), name) is not None


def leader(c: Cluster, tier: str) -> str:
    return str(wait_for(f"a {tier} leader", lambda: leader_of(c.cluster_config(), tier)))




@pytest.fixture
def crash_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    started: list[Cluster] = []

    def start(**env: str) -> Cluster:
        c = Cluster(tmp_path / "d", free_port_base(), [], cluster_env(**env))
        started.append(c)
        return c.start(reset=True)

    yield start
    for c in started:
        c.stop()


#: Each kill of a test: (tier, point), alternating tiers, so one tier's victim restarts while the
#: other tier's is killed.
POINTS = [(tier, point) for point in ("persisted", "sent", "applied") for tier in ("catalog", "order")]


@pytest.mark.parametrize("role", ["follower", "leader"])
def test_kills_at_each_step_of_a_ready(crash_cluster, tmp_path: Path, role: str) -> None:
    """Six SIGKILLs of a replica in ``role`` under load, one at each step of a Ready in each tier
    (``POINTS``), each victim restarted at once; then every guarantee is checked from outside."""
    kills_under_load(crash_cluster, tmp_path, [(tier, role, point) for tier, point in POINTS])


def test_leaders_killed_after_answering_and_between_a_decrement_and_its_intent(crash_cluster, tmp_path: Path) -> None:
    """Two instants a leader's answer opens, each killed in one run under load (one cluster, one
    check, for the suite's time).

    A leader answers a frame before it starts what the answer does not need
    (``transport.after_reply``): the catalog's release pushes of the decrements it just answered
    (the books stay held in every frontend's cache), the order confirmer's wake-up (the buys it
    just answered stay pending). SIGKILL it right there (``answered``), in each tier.

    An order leader sends a buy's decrement while its intent is being committed. SIGKILL it
    right after the catalog answered decrements whose intents were never proposed
    (``decremented``), twice: the buys' retries and the orphan scan leave every guarantee standing."""
    kills_under_load(crash_cluster, tmp_path, [(tier, "leader", point) for tier, point in [
        ("order", "decremented"), ("catalog", "answered"), ("order", "answered"), ("order", "decremented")]])


def test_a_decrement_that_outlived_its_intent_is_recorded_from_the_catalog(crash_cluster, tmp_path: Path) -> None:
    """The same instant, with nobody to retry: a buy sent straight to the order leader, which dies
    of the hook once the catalog took the stock, before the intent was proposed. The next order
    leader finds the decrement's key with no order (the orphan scan) and records the buy from it,
    confirmed; a retry with the key later gets that order, and the stock falls once."""
    flag = tmp_path / "crash-at"
    c = crash_cluster(PYGMY_TEST_CRASH_AT=str(flag))
    number = buy(c, 5, "warm-up")["order_number"] + 1
    lead = leader(c, "order")
    before = stock(c, leader(c, "catalog"), 3)
    flag.write_text("order leader decremented")
    # Until the leader's first orphan scan is done, buys go intent first and the hook lets them
    # pass: each is answered, and the next is tried under a new key.
    for n in range(50):
        key = f"orphan-{n}"
        try:
            r = requests.post(f"{c.replica_url(lead)}/buy", json={"item": 3, "quantity": 1, "key": f"k:{key}"},
                              headers={"Authorization": f"Bearer {c.secret()}"}, timeout=10)
        except requests.RequestException:
            break  # it died before it answered
        assert r.status_code == 200, r.text
        number, before = r.json()["order_number"] + 1, before - 1
        time.sleep(0.2)
    else:
        pytest.fail("no buy was sent with its decrement")
    assert not flag.exists(), "the hook did not fire"
    wait_for(f"{lead} dead", lambda: not alive(c, lead))
    assert stock(c, leader(c, "catalog"), 3) == before - 1  # taken, and no order has it yet

    def recorded() -> dict | None:
        r = requests.get(f"{c.url}/orders/{number}", timeout=5)
        return r.json() if r.status_code == 200 else None

    order = wait_for("the orphan scan to record the buy", recorded, timeout=30)
    assert (order["item_number"], order["quantity"]) == (3, 1), order
    c.restart(lead)
    again = buy(c, 3, key)
    assert again["order_number"] == number, (again, order)
    assert stock(c, leader(c, "catalog"), 3) == before - 1
    wait_converged(c, "order")
    wait_converged(c, "catalog")


def test_hand_overs_killed_at_either_end(crash_cluster, tmp_path: Path) -> None:
    """A leadership hand-over (``pygmy member lead``) under load, SIGKILLed at each end (one cluster,
    one check, for the suite's time; one end in each tier): the catalog leader right after it told
    its successor to campaign (``handing``: the successor wins without it, holding every entry, and
    still waits out the cache leases the dead leader granted), and the order tier's successor right
    after it asked for votes on that word (``transfer``: the term is raised and nobody leads; the old
    leader, which gave up its lease with the word, steps down, and the survivors elect one)."""
    kills_under_load(crash_cluster, tmp_path, [("catalog", "leader", "handing"), ("order", "candidate", "transfer")],
                     trigger=hand_over)


def hand_over(c: Cluster, tier: str, flag: Path) -> str:
    """``POST /members/F/lead`` (what ``pygmy member lead TIER F`` asks) to the leader, for a
    follower F, asked again (a leader unsure of its lease after the last kill refuses with 503; a
    lagging successor with 409) until the flag is gone. Returns who must have died: the leader
    (``handing``), or F (``transfer``)."""
    secret = {"Authorization": f"Bearer {c.secret()}"}
    deadline = time.monotonic() + 60
    point = flag.read_text().split()[-1]
    victim = ""
    while flag.exists():
        assert time.monotonic() < deadline, f"no {tier} hand-over reached {flag.read_text()!r}"
        lead = leader(c, tier)
        target = next(n for n in (f"{tier}-{k}" for k in (1, 2, 3)) if n != lead and alive(c, n))
        victim = lead if point == "handing" else target
        with contextlib.suppress(requests.RequestException):  # the leader may die answering
            requests.post(f"{c.replica_url(lead)}/members/{target}/lead", headers=secret, timeout=10)
        time.sleep(0.2)
    return victim


def kills_under_load(crash_cluster, tmp_path: Path, points: list[tuple[str, str, str]],
                     trigger: Callable[[Cluster, str, Path], str] | None = None) -> None:
    """A SIGKILL of a replica at each ``(tier, role, point)`` in turn, under load, each victim
    restarted at once; then every guarantee is checked from outside (``chaos_check``). ``trigger``
    (the cluster, the tier, the flag), if given, makes a replica reach the point once the flag
    names it; it returns once the flag is gone, with the name of the replica that must have died."""
    flag = tmp_path / "crash-at"
    c = crash_cluster(PYGMY_TEST_CRASH_AT=str(flag))
    load = BackgroundLoad([c.url], c.admin_token(), ITEMS, writers=3, readers=2, buyers=2, searchers=0, order_readers=1)
    windows: list[dict] = []
    restarts: dict[str, threading.Thread] = {}
    failed: list[str] = []

    def restart(victim: str, window: dict) -> None:
        try:
            c.restart(victim)
        except AssertionError as exc:
            failed.append(f"{victim}: {exc}")
        window["end"] = time.monotonic_ns()

    load.start()
    try:
        load.buys_acked(5)
        for tier, role, point in points:
            if tier in restarts:  # this tier's last victim is back before the next kill in it
                restarts.pop(tier).join(60)
            names = [f"{tier}-{k}" for k in (1, 2, 3)]
            flag.write_text(f"{tier} {role} {point}")
            start = time.monotonic_ns()
            expected = trigger(c, tier, flag) if trigger is not None else None
            wait_for(f"a {tier} {role} at {point}", lambda: not flag.exists())
            victim = str(wait_for("the victim's death", lambda names=names: next(
                (n for n in names if not alive(c, n)), None)))
            assert expected in (None, victim), f"{victim} died at {point}, not {expected}"
            windows.append({"kind": f"{role}-{point}", "detail": victim, "start": start, "end": None})
            restarts[tier] = threading.Thread(target=restart, args=(victim, windows[-1]))
            restarts[tier].start()
            load.buys_acked(2)  # buys go on (across a failover, if a leader died)
        for t in restarts.values():
            t.join(60)
        load.buys_acked(3)
    finally:
        for t in restarts.values():
            t.join(60)
        history = load.finish()
    assert failed == [], failed
    assert [w["kind"] for w in windows] == [f"{role}-{p}" for _, role, p in points]
    assert all(w["detail"].startswith(t) for w, (t, _, _) in zip(windows, points, strict=True))
    check_from_outside(c, tmp_path, load, history, windows)


def check_from_outside(c: Cluster, tmp_path: Path, load: BackgroundLoad, history: lincheck.History,
                       windows: list[dict]) -> None:
    """Every guarantee, judged from outside by ``chaos_check``: acknowledged buys are orders on
    every order replica and none is doubled, stock adds up, each tier has one applied index and
    state digest, and Porcupine finds the history linearizable."""
    result, _ = judge_from_outside(c, tmp_path / "run", history, windows, ITEMS)
    assert load.errors == [], load.errors[:5]
    counts = result["by_outcome"]
    assert counts.get("buy/ok", 0) >= 20 and counts.get("lookup/ok", 0) >= 50, counts


def test_a_frontend_killed_while_its_buys_wait_for_company(crash_cluster, tmp_path: Path) -> None:
    """A frontend worker's batch of buys waits for company (``--frontend-buy-linger``) once the
    batch before it carried several. SIGKILL the frontend right after such a wait, its buys taken
    and not sent (``PYGMY_TEST_CRASH_LINGERING``): their buyers' connections are cut, they retry
    with the same keys once it is back (keyless buys stay unknown), and every guarantee holds,
    Porcupine's included."""
    flag = tmp_path / "crash-lingering"
    c = crash_cluster(PYGMY_TEST_CRASH_LINGERING=str(flag))
    # Eight buyers over two workers: a worker's batches carry several, so the next one waits. Every
    # buy under a key, retried through the kill: each must end answered, none of unknown outcome.
    load = BackgroundLoad([c.url], c.admin_token(), ITEMS, writers=2, readers=2, buyers=8, searchers=0,
                          order_readers=1, keyless_every=10**9)
    windows: list[dict] = []
    load.start()
    try:
        load.buys_acked(10)
        flag.write_text("frontend")
        start = time.monotonic_ns()
        wait_for("a batch of buys that waited for company", lambda: not flag.exists(), 30)
        wait_for("frontend-1 dead", lambda: not alive(c, "frontend-1"))
        c.restart("frontend-1")
        windows.append({"kind": "frontend-lingering", "detail": "frontend-1", "start": start,
                        "end": time.monotonic_ns()})
        load.buys_acked(10)  # buys go on once it is back
        # Enough answered lookups for check_from_outside's count to mean something.
        wait_for("60 lookups answered", lambda: sum(load.cache.values()) >= 60, 60)
    finally:
        history = load.finish()
    check_from_outside(c, tmp_path, load, history, windows)
    assert history.counts().get("buy/unknown", 0) == 0, history.counts()
    # Clients saw failures only while the frontend was down (two seconds either side: a request sent
    # just before the kill, a connection made just before it listened again).
    slack = 2 * 10**9
    outside = [op for op in history.ops() if op.outcome != "ok" and op.kind in ("lookup", "buy", "update")
               and not windows[0]["start"] - slack <= op.invoke <= windows[0]["end"] + slack]
    assert outside == [], outside[:5]


def buy(c: Cluster, item: int, key: str) -> dict:
    """A buy, retried under its key until answered."""
    deadline = time.monotonic() + 30
    while True:
        try:
            r = requests.post(f"{c.url}/buy/{item}", json={"quantity": 1}, headers={"Idempotency-Key": key},
                              timeout=10)
            if r.status_code == 200:
                return r.json()
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, f"buy {key} was never acknowledged"
        time.sleep(0.1)


def stock(c: Cluster, name: str, item: int) -> int:
    secret = {"Authorization": f"Bearer {c.secret()}"}
    return requests.get(f"{c.replica_url(name)}/books/{item}", headers=secret, timeout=5).json()["stock"]


def copies_lost_with_a_follower_killed_after_acknowledging(c: Cluster, flag: Path) -> tuple[int, str]:
    """How many copies of an acknowledged buy the catalog forgets (0 on a correct build), and the
    catalog leader it was killed under.

    The catalog's majority is its leader L and one follower F1, the other follower F2 being down
    (SIGKILLed: a stopped one would read L's appends from its socket once it resumes). F1 dies of
    the hook right after its acknowledgement of the buy's decrement left; once the buy is answered,
    L is SIGKILLed too, and F1 and F2 come back: they elect a leader and write without L, so the
    decrement survives only if F1 wrote it before acknowledging it."""
    buy(c, 5, "warm-up")  # every connection open: F1's acknowledgements go straight out
    lead = leader(c, "catalog")
    before = stock(c, lead, 3)
    f1, f2 = [f"catalog-{k}" for k in (1, 2, 3) if f"catalog-{k}" != lead]
    os.killpg(launcher.running(c.cluster_config(), f2), signal.SIGKILL)
    wait_for(f"{f2} dead", lambda: not alive(c, f2))
    flag.write_text("catalog follower sent")
    acked = buy(c, 3, "the-buy")  # its decrement is committed by L and F1
    assert not flag.exists(), "the buy was acknowledged, and the hook did not fire"
    wait_for(f"{f1} dead of the hook", lambda: not alive(c, f1))
    os.killpg(launcher.running(c.cluster_config(), lead), signal.SIGKILL)
    wait_for(f"{lead} dead", lambda: not alive(c, lead))
    c.restart(f1)
    c.restart(f2)
    wait_for("a catalog leader of a later term", lambda: leader_of(c.cluster_config(), "catalog") in (f1, f2))
    buy(c, 5, "after")  # the new leader's term has committed a write
    new = leader(c, "catalog")
    with requests.Session() as s:  # the order itself is on the order tier, untouched
        assert s.get(f"{c.url}/orders/{acked['order_number']}", timeout=5).json()["item_number"] == 3
    return stock(c, new, 3) - (before - 1), lead


def wait_converged(c: Cluster, tier: str) -> None:
    def one_state() -> bool:
        sts = [replica_status(c.cluster_config(), f"{tier}-{k}") for k in (1, 2, 3)]
        return all(sts) and len({(st["applied_index"], st["state_digest"]) for st in sts}) == 1

    wait_for(f"the {tier} replicas at one applied index and digest", one_state)


@pytest.mark.parametrize("mutation", [None, "ack-before-persist"])
def test_a_follower_killed_right_after_acknowledging(crash_cluster, tmp_path: Path, mutation: str | None) -> None:
    """The correct build keeps the acknowledged buy, and the old leader rejoins the same state; the
    broken build loses it: this test catches it."""
    flag = tmp_path / "crash-at"
    env = {"PYGMY_TEST_CRASH_AT": str(flag)} | ({"PYGMY_MUTATION": mutation} if mutation else {})
    c = crash_cluster(**env)
    lost, old_leader = copies_lost_with_a_follower_killed_after_acknowledging(c, flag)
    if mutation:
        assert lost == 1, f"{mutation}: the acknowledged buy was not lost ({lost}): the test cannot catch it"
        return  # the old leader applied the lost decrement: it would come back diverged
    assert lost == 0, f"the correct build lost {lost} copies of an acknowledged buy"
    c.restart(old_leader)
    wait_converged(c, "catalog")
    assert {stock(c, f"catalog-{k}", 3) for k in (1, 2, 3)} == {stock(c, old_leader, 3)}
