"""The order service: runs the buy transaction and keeps the orders.

A buy is three steps, each safe to repeat: (1) record the intent in the order log (this fixes
the order number and the idempotency key), (2) ask the catalog leader to decrement the stock under
the same key (the catalog remembers keys, so a repeat returns the first result), (3) record the
outcome. Whoever leads the order tier finishes intents a dead leader left half-done, so the
catalog's decrements always equal the confirmed orders.

A successful buy is answered once (2) is committed: its outcome is decided then, and recoverable
from the key by anyone, so the confirm (3) follows off the buyer's path. Until it is applied, a
read of that order finishes it first (on the leader; a follower sends the reader there), so an
answered order is always found (docs/replication.md, "A buy answered before its confirm").
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from datetime import UTC, datetime
from typing import Any

from flask import Flask, Response, jsonify
from prometheus_client import Histogram

from cluster.config import ClusterConfig
from cluster.web import fail, int_field, json_body, parse_item, request_deadline
from order.state import CONFIRMED, FAILED, PENDING, OrderState, confirmed
from replication.batching import Combiner, CombinerTimeout
from replication.node import ProposalTimeout
from replication.router import Reply, TierRouter, TierUnavailable
from replication.service import ReplicaRuntime

log = logging.getLogger(__name__)

#: How long one buy may wait for the catalog (across a catalog failover) before answering 503.
CATALOG_DEADLINE = 4.0
BATCH = Histogram("pygmy_buy_batch_size", "Buys carried together: decrements in one catalog request, "
                  "intents or confirms in one log entry", ["what"], buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256))
#: How long the order leader waits for one of its own proposals to commit.
PROPOSE_TIMEOUT = 5.0
#: A pending intent older than this with no buy in flight here is finished by the background sweep.
STALE_INTENT = 2.0
#: What a buy hears when its time ran out before its decrement was sent.
EXPIRED = Reply(504, {"error": {"code": 504, "message": "the buy's time budget was spent"}}, "order")


class DeadlineSpent(Exception):
    """A buy's time budget ran out; the message says how far it got."""


class BuyProcessor:
    """Runs buys on the order leader and finishes any intent left pending."""

    def __init__(self, rt: ReplicaRuntime, state: OrderState, catalog: TierRouter) -> None:
        self.rt, self.state, self.catalog = rt, state, catalog
        self._in_flight: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._leader_since = float("inf")
        self._thread = threading.Thread(target=self._sweep_loop, name="intent-sweeper", daemon=True)
        #: Confirms, proposed off the buyers' path by one thread, all that are waiting in one log
        #: entry; a lost one is redone by the sweep.
        self._confirms: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._confirmer = threading.Thread(target=self._confirm_loop, name="confirmer", daemon=True)
        #: The intents of concurrent buys, in one log entry.
        self._intents: Combiner[dict[str, Any], dict[str, Any]] = Combiner(lambda c: self._propose_all(c, "intents"))
        #: The decrements of concurrent buys go to the catalog together: one request, one log entry.
        self._decrements: Combiner[dict[str, Any], Reply] = Combiner(self._send_decrements)

    def start(self) -> None:
        self.rt.node.add_leader_listener(self._on_leader_change)
        self._thread.start()
        self._confirmer.start()

    def _on_leader_change(self, is_leader: bool, term: int) -> None:
        if is_leader:
            # Intents older than our leadership cannot be in flight here: finish them at once.
            self._leader_since = time.time()
            self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._confirms.put(None)
        self._confirmer.join(timeout=5)

    def buy(self, item: int, quantity: int, key: str, deadline: float) -> dict[str, Any]:
        """Run one buy by ``deadline`` (monotonic). No intent is proposed once it has passed; an intent
        proposed in time is finished whatever happens after (here, by a read, or by the sweep)."""
        wait = min(2 * PROPOSE_TIMEOUT + 1, deadline - time.monotonic())
        if wait <= 0:
            raise DeadlineSpent("before its intent was proposed: nothing was done")
        try:
            order = self._intents.call({
                "op": "intent", "key": key, "item": item, "quantity": quantity,
                "created_at": datetime.now(UTC).isoformat(timespec="milliseconds"),
            }, wait)
        except CombinerTimeout as exc:
            if not exc.sent:
                raise DeadlineSpent("before its intent was proposed: nothing was done") from None
            raise ProposalTimeout("the intent was not proposed in time; outcome unknown") from None
        return self.finish(order, deadline)

    def _propose_all(self, commands: list[dict[str, Any]], what: str) -> list[Any]:
        """Commands of concurrent requests as one log entry, each applied as alone, in order."""
        BATCH.labels(what).observe(len(commands))
        return self.rt.propose({"op": "batch", "commands": commands}, PROPOSE_TIMEOUT)

    def finish(self, order: dict[str, Any], deadline: float | None = None) -> dict[str, Any]:
        """Drive one intent to its outcome; the catalog's key makes a repeated decrement harmless.
        Its decrement is not sent once ``deadline`` has passed: the intent stays pending, and the
        sweep (or a read of the order) finishes it later, off the overloaded path."""
        if order["status"] != PENDING:
            return order
        key = order["key"]
        if deadline is None:
            deadline = time.monotonic() + 2 * CATALOG_DEADLINE + 1
        with self._lock:
            self._in_flight.add(key)
        try:
            try:
                reply = self._decrements.call(({"item": order["item_number"], "quantity": order["quantity"],
                                                "key": key}, deadline),
                                              min(2 * CATALOG_DEADLINE + 1, max(0.0, deadline - time.monotonic())))
            except CombinerTimeout:
                raise TierUnavailable("catalog", "the decrement was not sent in time") from None
            if reply.status == 200:
                # Decided: the catalog's decrement under this key is committed. Answer now.
                title, cost = reply.body["title"], reply.body["cost"]
                self._confirm(key, title, cost)
                return confirmed(order, title, cost)
            if reply.status in (404, 409):
                err = reply.body["error"]
                return self.rt.propose({"op": "fail", "key": key, "code": reply.status, "message": err["message"]})
            if reply.status == 504:
                raise DeadlineSpent("after its intent was recorded, before the stock was taken")
            fail(502, f"catalog answered {reply.status}: {reply.body.get('error', {}).get('message', '')}")
        finally:
            with self._lock:
                self._in_flight.discard(key)

    def _send_decrements(self, items: list[tuple[dict[str, Any], float]]) -> list[Reply]:
        """One catalog request for the decrements of every buy waiting (``Combiner``): the catalog
        holds their books once, proposes them as one entry and answers each as a lone decrement would.
        Retried across a catalog failover with the same keys, so each still happens once. Buys whose
        deadline has passed are left out (504): their intents wait for the sweep."""
        now = time.monotonic()
        out = [EXPIRED] * len(items)
        live = [i for i, (_, deadline) in enumerate(items) if deadline > now]
        if not live:
            return out
        BATCH.labels("decrements").observe(len(live))
        deadline = min(now + CATALOG_DEADLINE, max(items[i][1] for i in live))
        reply = self.catalog.write("/books/decrements", {"items": [items[i][0] for i in live]}, deadline=deadline)
        results = reply.body.get("results") if reply.status == 200 else None
        if not isinstance(results, list) or len(results) != len(live):
            results = [None] * len(live)  # the batch itself failed (a 4xx/5xx): every buy hears it
        for i, r in zip(live, results, strict=True):
            out[i] = reply if r is None else Reply(int(r["status"]), r.get("book") or {"error": r.get("error")},
                                                   reply.replica)
        return out

    def _confirm(self, key: str, title: str, cost: float) -> None:
        """Record a decided outcome, soon (the confirmer thread)."""
        self._confirms.put({"op": "confirm", "key": key, "title": title, "cost": cost})

    def _confirm_loop(self) -> None:
        """Every confirm waiting, as one log entry. If that fails (no longer leader, no quorum), the
        orders stay pending until a read or the sweep finishes them again: the catalog's key gives
        the same answer. Supervised: an error costs that batch, not the thread."""
        while True:
            first = self._confirms.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < 256:
                try:
                    item = self._confirms.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._confirms.put(None)  # stop after this batch
                    break
                batch.append(item)
            try:
                self._propose_all(batch, "confirms")
            except Exception as exc:
                log.info("%d confirms not recorded yet (%s); the sweep will redo them", len(batch), exc)

    def settle(self, order: dict[str, Any]) -> dict[str, Any]:
        """A read found ``order`` pending: on the leader finish it (the same answer its buyer got, or
        will get); elsewhere send the reader to the leader."""
        self.rt.leader_only()
        return self.finish(order)

    def _sweep_loop(self) -> None:
        """Supervised: an error in one sweep (a full disk, a bug) is logged; the next sweep retries."""
        while not self._stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            if self._stop.is_set() or not self.rt.node.is_leader():
                continue
            try:
                self._sweep()
            except Exception:
                log.exception("intent sweep failed; retrying on the next one")

    def _sweep(self) -> None:
        for order in self.state.pending():
            with self._lock:
                busy = order["key"] in self._in_flight
            if busy or self._stop.is_set():
                continue
            created = datetime.fromisoformat(order["created_at"]).timestamp()
            if created > self._leader_since and time.time() - created < STALE_INTENT:
                continue
            try:
                self.finish(order)
            except Exception as exc:  # retried on the next sweep
                log.warning("could not finish order %s yet: %s", order["order_number"], exc)


def public_order(order: dict[str, Any]) -> dict[str, Any]:
    return {k: order[k] for k in ("order_number", "item_number", "title", "quantity", "cost", "total", "created_at")}


def create_app(config: ClusterConfig, k: int) -> Flask:
    state = OrderState(config.replica_dir(f"order-{k}") / "state.db")
    rt = ReplicaRuntime("order", k, config, state)
    catalog = TierRouter("catalog", config.peers("catalog"), rt.secret)
    buys = BuyProcessor(rt, state, catalog)
    app = rt.create_app()
    app.extensions["pygmy_runtime"] = rt

    @app.post("/buy")
    @rt.guard
    def buy() -> Response:
        body = json_body(required=True)
        item = int_field(body, "item", 1, 2**62)
        quantity = int_field(body, "quantity", 1, 1000)
        key = body.get("key")
        if not isinstance(key, str) or not 0 < len(key) <= 256:
            fail(400, "key must be a non-empty string")
        rt.leader_only()
        try:
            order = buys.buy(item, quantity, key, request_deadline(config.buy_deadline))
        except DeadlineSpent as exc:
            fail(504, f"the buy's time budget was spent {exc} (retry with the same key)")
        except TierUnavailable as exc:
            fail(503, f"catalog unavailable, buy not finished yet (retry with the same key): {exc.last}")
        if order["item_number"] != item or order["quantity"] != quantity:
            fail(422, "this idempotency key was already used for a different buy")
        if order["status"] == FAILED:
            fail(order["error"]["code"], order["error"]["message"])
        assert order["status"] == CONFIRMED
        return jsonify(public_order(order))

    @app.get("/orders/<number>")
    @rt.guard
    def get_order(number: str) -> Response:
        n = parse_item(number, "order number")
        rt.ensure_readable()
        order = state.order(n)
        if order is not None and order["status"] == PENDING:
            try:
                order = buys.settle(order)
            except TierUnavailable as exc:
                fail(503, f"order {n} is not settled yet and the catalog is unavailable: {exc.last}")
        if order is None or order["status"] != CONFIRMED:
            fail(404, f"no order with number {n}")
        return jsonify(public_order(order))

    rt.start()
    buys.start()
    app.extensions["pygmy_buys"] = buys
    return app
