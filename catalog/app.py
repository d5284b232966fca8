"""The catalog service: books by item number and topic; stock and cost change only through the log."""

from __future__ import annotations

import logging
import time
from typing import Any

from flask import Flask, Response, jsonify, request

from pygmy.catalog import books as catalogue
from pygmy.catalog.invalidation import Invalidator
from pygmy.catalog.state import CatalogState
from pygmy.kit.admission import MAX_TIMEOUT_MS
from pygmy.kit.cachekeys import book_key
from pygmy.kit.config import ClusterConfig
from pygmy.kit.web import (
    check_deadline,
    error_body,
    fail,
    int_field,
    json_body,
    parse_item,
    query_int,
    request_deadline,
    update_fields,
)
from pygmy.replication.service import Periodic, ReplicaRuntime
from pygmy.replication.transport import DECREMENTS_CHANNEL, SUBSCRIBE_CHANNEL, subscriber_address

log = logging.getLogger(__name__)
#: Most decrements one batch may carry (an order leader sends what its buys have in flight).
MAX_DECREMENTS = 256
#: Most books one search answer carries (a page; ``more`` says whether another follows).
MAX_PAGE = 1000
#: A write's own time budget when its caller gave none (``X-Request-Timeout-Ms``).
WRITE_DEADLINE = 5.0


class Restocker(Periodic):
    """Periodic delivery of new stock for sold-out books, proposed by the leader through the log."""

    def __init__(self, runtime: ReplicaRuntime, state: CatalogState, invalidator: Invalidator,
                 every: float, amount: int) -> None:
        super().__init__("restocker", every)
        self.runtime, self.state, self.invalidator, self.amount = runtime, state, invalidator, amount

    def due(self) -> bool:
        return self.runtime.node.is_leader()

    def work(self) -> None:
        # The command names its books, so their cache keys are held before it is proposed. A lost
        # round only delays the delivery.
        items = self.state.sold_out()
        if not items:
            return
        with self.invalidator.holding([book_key(n) for n in items]) as write:
            result = self.runtime.propose({"op": "restock", "amount": self.amount, "items": items},
                                          timeout=self.every)
            write.index = result["index"]


def create_app(config: ClusterConfig, k: int) -> Flask:
    state = CatalogState(config.replica_dir(f"catalog-{k}") / "state.db")
    if state.is_new():  # else the books file is not read at all: the state is on disk already
        seed = config.seed_file()
        if seed.exists():  # built once by ``pygmy up``: copied page by page, not parsed
            state.restore(0, seed)
        else:  # started on its own (a container, ``pygmy serve``): it reads the file itself
            state.seed(catalogue.load(config.books))
    rt = ReplicaRuntime("catalog", k, config, state)
    invalidator = Invalidator(rt.node, rt.secret)
    app = rt.create_app()
    app.extensions["pygmy_runtime"] = rt
    app.extensions["pygmy_invalidator"] = invalidator

    def fresh(items: list[int]) -> dict[str, Any] | None:
        """The books a write just changed, read here after it applied (so at its index or later):
        caches refresh their entries from these instead of missing on the next lookup. Best effort:
        without them (a failed read) caches only drop the entries."""
        if not items:
            return None
        try:
            return {book_key(n): book for n, book in state.books(items).items()}
        except Exception:
            log.exception("could not read the books a write changed; caches will miss on them")
            return None

    def key_time(body: dict[str, Any]) -> float:
        """A decrement's ``at``: when the order leader sent it (Unix seconds), which the key expiry
        goes by on both tiers (``pygmy.order.app.KeyExpirer``); 0 or absent: the key is kept for good."""
        at = body.get("at", 0)
        if isinstance(at, bool) or not isinstance(at, int | float) or not 0 <= at <= time.time() + 3600:
            fail(400, "at must be a time in Unix seconds")
        return float(at)

    def write(item: int, command: dict[str, Any]) -> Response:
        """Propose a change to one book, held out of every leased cache until it is applied here."""
        rt.leader_only()
        # Before the hold: an error inside it would keep the books held until the next term.
        check_deadline(request_deadline(WRITE_DEADLINE), "the change was proposed")
        with invalidator.holding([book_key(item)]) as held:
            result = rt.propose(command)
            held.index = result["book"]["version"] if result["ok"] else 0
            held.values = fresh([item]) if result["ok"] else None
        if not result["ok"]:
            fail(result["error"]["code"], result["error"]["message"])
        return jsonify(result["book"])

    def subscribe(worker: str, body: Any) -> dict[str, Any]:
        """A frontend worker asks for its cache lease (``SUBSCRIBE_CHANNEL`` of the peer transport, about
        ten times a second per worker while its cache is read, five when idle: a frame, not an HTTP request). Answers ``{"status", "body"}``."""
        def answer(code: int, message: str, **extra: Any) -> dict[str, Any]:
            return {"status": code, "body": {"error": {"code": code, "message": message, **extra}}}

        sub_id, url = (body.get("id"), body.get("url")) if isinstance(body, dict) else (None, None)
        if not isinstance(sub_id, str) or not isinstance(url, str):
            return answer(400, "id and url (tcp://host:port, where the worker takes pushes) are required")
        try:
            subscriber_address(url)
        except ValueError as exc:
            return answer(400, str(exc))
        rtt = body.get("rtt", 0.0)
        if isinstance(rtt, bool) or not isinstance(rtt, int | float) or not 0 <= rtt <= 60:
            return answer(400, "rtt, if given, is the worker's renewal round trip in seconds (0 to 60)")
        if sub_id.partition("/")[0] != worker.partition("/")[0]:
            # A worker subscribes as its own frontend (its hello's name, which a certificate must
            # name under TLS): one subscribing under another's id would take over that worker's
            # entry, and its pushes, while that worker went on serving its cache under its lease.
            return answer(403, f"{worker} may not subscribe as {sub_id.partition('/')[0]}")
        if not rt.node.is_leader():
            leader = rt.node.leader()
            return answer(421, f"{rt.name} is not the catalog leader", leader=leader[0] if leader else None)
        if not rt.node.can_serve_reads():
            # Grant leases only under our leader lease: then no other leader can exist right now,
            # and a successor's lease wait after its election outlasts every lease we granted.
            return answer(503, f"{rt.name} cannot grant invalidation leases right now (no quorum contact)")
        grant = invalidator.subscribe(sub_id, url, float(rtt))
        # Read after the grant: at least the index of every write released before it.
        return {"status": 200, "body": {"leader": rt.name, "term": rt.node.term(),
                                        "commit_index": state.applied_index(), **grant}}

    rt.node.add_channel(SUBSCRIBE_CHANNEL, subscribe)

    @app.get("/books/<item>")
    @rt.guard
    def get_book(item: str) -> Response:
        number = parse_item(item)
        rt.ensure_readable()
        applied, book = state.book_at(number)
        if book is None:
            fail(404, f"no book with item number {number}")
        return jsonify({**book, "applied_index": applied})

    @app.get("/books")
    @rt.guard
    def search() -> Response:
        """``?topic=T[&after=N][&limit=L]``: a page of the topic's books above item number N; ``more``
        says whether another page follows."""
        topic = request.args.get("topic", "")
        after = query_int("after", 0, 2**62, 0)
        limit = query_int("limit", 1, MAX_PAGE, MAX_PAGE)
        rt.ensure_readable()
        applied, items, more = state.search_at(topic, after, limit)
        return jsonify({"topic": topic, "items": items, "more": more, "applied_index": applied})

    @app.post("/books/<item>/decrement")
    @rt.only("order")
    def decrement(item: str) -> Response:
        number = parse_item(item)
        body = json_body(required=True)
        quantity = int_field(body, "quantity", 1, 1000)
        key = body.get("key")
        if not isinstance(key, str) or not 0 < len(key) <= 256:
            fail(400, "key must be a non-empty string")
        return write(number, {"op": "decrement", "item": number, "quantity": quantity, "key": key,
                              "at": key_time(body), "keyed": 1})

    def run_decrements(body: dict[str, Any], deadline: float) -> dict[str, Any]:
        """The decrements of the buys an order leader has in flight, as one write: one hold round,
        one log entry, one release; ``{"results": [{"status", "body"}, ...]}`` in order, each body as
        ``/decrement`` answers (``router.batch_write``). An item's ``timeout_ms`` is its buy's own
        time left: one that has run out is answered 504 and not started (no hold, no entry)."""
        received = time.monotonic()
        raw = body.get("items")
        if not isinstance(raw, list) or not 0 < len(raw) <= MAX_DECREMENTS:
            fail(400, f"items must be a list of 1 to {MAX_DECREMENTS} decrements")
        items, ends = [], []
        for d in raw:
            if not isinstance(d, dict):
                fail(400, "each item must be an object {item, quantity, key}")
            key = d.get("key")
            if not isinstance(key, str) or not 0 < len(key) <= 256:
                fail(400, "key must be a non-empty string")
            items.append({"item": int_field(d, "item", 1, 2**62), "quantity": int_field(d, "quantity", 1, 1000),
                          "key": key, "at": key_time(d)})
            ends.append(received + int_field(d, "timeout_ms", 0, MAX_TIMEOUT_MS, MAX_TIMEOUT_MS) / 1000)
        rt.leader_only()
        check_deadline(deadline, "the decrements were proposed")
        now = time.monotonic()
        live = [i for i, end in enumerate(ends) if end > now]
        results: list[dict[str, Any]] = [
            {"status": 504, "body": error_body(504, "the buy's time budget was spent before its decrement")}
            for _ in items]
        if not live:
            return {"results": results}
        todo = [items[i] for i in live]
        # Only books that exist are held, and so get a floor in every worker's cache: a buy of an
        # item that is no book changes nothing, and its floor would stay there for good.
        with invalidator.holding([book_key(i) for i in state.existing(sorted({d["item"] for d in todo}))]) as held:
            result = rt.propose({"op": "decrements", "items": todo, "keyed": 1})
            held.index = result["index"]  # a floor for every key in it; unchanged books lose nothing
            held.values = fresh(sorted({d["item"] for d, r in zip(todo, result["results"], strict=True) if r["ok"]}))
        for i, r in zip(live, result["results"], strict=True):
            results[i] = {"status": 200, "body": r["book"]} if r["ok"] else {
                "status": r["error"]["code"], "body": {"error": r["error"]} | ({"buy": r["buy"]} if "buy" in r else {})}
        return {"results": results}

    @app.post("/books/decrements")
    @rt.only("order")
    def decrements() -> Response:
        """``run_decrements`` over HTTP; order leaders send theirs as frames (``DECREMENTS_CHANNEL``)."""
        return jsonify(run_decrements(json_body(required=True), request_deadline(WRITE_DEADLINE)))

    rt.serve_frames(DECREMENTS_CHANNEL, "/books/decrements", run_decrements)

    @app.post("/books/<item>/update")
    @rt.only("frontend")
    def update(item: str) -> Response:
        number = parse_item(item)
        body = json_body(required=True)
        command: dict[str, Any] = {"op": "update", "item": number, **update_fields(body)}
        key = body.get("key")
        if key is not None:
            if not isinstance(key, str) or not 0 < len(key) <= 256:
                fail(400, "key must be a non-empty string")
            command["key"] = key
            command["at"] = time.time()
        return write(number, command)

    @app.get("/keys")
    @rt.only("order")
    def keys() -> Response:
        """``?after=N[&after_key=K][&limit=L]``: the decrements' keys first used at log indexes above
        N (or at N with a key above K), in log order (``CatalogState.keys_after``); ``more`` says
        whether another page follows. The order
        leader reads them to record buys whose decrement outlived their intent."""
        after = query_int("after", 0, 2**62, 0)
        limit = query_int("limit", 1, MAX_PAGE, MAX_PAGE)
        after_key = request.args.get("after_key")
        rt.ensure_readable()
        applied, found, more = state.keys_after(after, limit, after_key)
        return jsonify({"keys": found, "more": more, "applied_index": applied})

    @app.post("/keys/expire")
    @rt.only("order")
    def expire_keys() -> Response:
        """Forget the idempotency keys used before ``before`` (Unix seconds). The order leader asks,
        since it knows which buys are unfinished: it never names a time after the oldest of them.
        ``scanned``: the log index up to which it has read the decrements' keys back; later ones
        are kept (``CatalogState._expire``)."""
        body = json_body(required=True)
        before = body.get("before")
        if isinstance(before, bool) or not isinstance(before, int | float) or not 0 <= before <= time.time():
            fail(400, "before must be a time (Unix seconds) in the past")
        command: dict[str, Any] = {"op": "expire", "before": float(before)}
        if "scanned" in body:
            command["scanned"] = int_field(body, "scanned", 0, 2**62)
        rt.leader_only()
        check_deadline(request_deadline(WRITE_DEADLINE), "the expiry was proposed")
        # Books are unchanged: no hold, no release.
        return jsonify(rt.propose(command))

    rt.start()
    if config.restock_every > 0 and config.restock_amount > 0:
        restocker = Restocker(rt, state, invalidator, config.restock_every, config.restock_amount)
        restocker.start()
        app.extensions["pygmy_restocker"] = restocker
    return app
