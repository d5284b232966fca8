"""The catalog service: books by item number and topic; stock and cost change only through the log."""

from __future__ import annotations

import logging
import threading
from typing import Any

from flask import Flask, Response, jsonify, request

from catalog import books as catalogue
from catalog.invalidation import Invalidator, change_for
from catalog.state import CatalogState
from cluster.config import ClusterConfig
from cluster.web import fail, int_field, json_body, parse_item, update_fields
from replication.service import ReplicaRuntime

log = logging.getLogger(__name__)





class Restocker:
    """Periodic delivery of new stock for sold-out books, proposed by the leader through the log."""

    def __init__(self, runtime: ReplicaRuntime, state: CatalogState, invalidator: Invalidator,
                 every: float, amount: int) -> None:
        self.runtime, self.state, self.invalidator = runtime, state, invalidator
        self.every, self.amount = every, amount
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="restocker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            if self.runtime.node.is_leader():
                try:
                    result = self.runtime.propose({"op": "restock", "amount": self.amount}, timeout=self.every)
                    books = [b for n in result["items"] if (b := self.state.book(n))]
                    self.invalidator.publish([change_for(b) for b in books])
                except Exception as exc:  # the next round tries again; a lost round only delays delivery
                    log.warning("restock round failed: %s", exc)


def create_app(config: ClusterConfig, k: int) -> Flask:
    state = CatalogState(config.replica_dir(f"catalog-{k}") / "state.db")
    state.seed(catalogue.load(config.books))
    rt = ReplicaRuntime("catalog", k, config, state)
    invalidator = Invalidator(rt.node, rt.secret)
    app = rt.create_app()
    app.extensions["pygmy_runtime"] = rt
    app.extensions["pygmy_invalidator"] = invalidator

    def answer(result: dict[str, Any]) -> Response:
        """A command's result as HTTP, acknowledged only once every leased frontend cache forgot it."""
        if not result["ok"]:
            invalidator.publish([])  # a new leader still owes its lease wait, even for refusals
            fail(result["error"]["code"], result["error"]["message"])
        invalidator.publish([change_for(result["book"])])
        return jsonify(result["book"])

    @app.post("/subscribe")
    @rt.guard
    def subscribe() -> Response:
        body = json_body(required=True)
        sub_id, url = body.get("id"), body.get("url")
        if not isinstance(sub_id, str) or not isinstance(url, str) or not url.startswith("http"):
            fail(400, "id and url (http://host:port) are required")
        rt.leader_only()
        if not rt.node.can_serve_reads():
            # Grant leases only under our leader lease: then no other leader can exist right now,
            # and a successor's lease wait after its election outlasts every lease we granted.
            fail(503, f"{rt.name} cannot grant invalidation leases right now (no quorum contact)")
        continued = invalidator.subscribe(sub_id, url)
        return jsonify({"leader": rt.name, "term": rt.node.term(), "commit_index": state.applied_index(),
                        "lease": invalidator.lease, "continued": continued})

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
        topic = request.args.get("topic", "")
        rt.ensure_readable()
        applied, items = state.search_at(topic)
        return jsonify({"topic": topic, "items": items, "applied_index": applied})

    @app.post("/books/<item>/decrement")
    @rt.guard
    def decrement(item: str) -> Response:
        number = parse_item(item)
        body = json_body(required=True)
        quantity = int_field(body, "quantity", 1, 1000)
        key = body.get("key")
        if not isinstance(key, str) or not 0 < len(key) <= 256:
            fail(400, "key must be a non-empty string")
        rt.leader_only()
        return answer(rt.propose({"op": "decrement", "item": number, "quantity": quantity, "key": key}))

    @app.post("/books/<item>/update")
    @rt.guard
    def update(item: str) -> Response:
        number = parse_item(item)
        body = json_body(required=True)
        command: dict[str, Any] = {"op": "update", "item": number, **update_fields(body)}
        key = body.get("key")
        if key is not None:
            if not isinstance(key, str) or not 0 < len(key) <= 256:
                fail(400, "key must be a non-empty string")
            command["key"] = key
        rt.leader_only()
        return answer(rt.propose(command))

    rt.start()
    if config.restock_every > 0 and config.restock_amount > 0:
        restocker = Restocker(rt, state, invalidator, config.restock_every, config.restock_amount)
        restocker.start()
        app.extensions["pygmy_restocker"] = restocker
    return app
