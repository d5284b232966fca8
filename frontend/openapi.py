"""The OpenAPI 3 description of the public API, served at ``GET /openapi.json``: the machine-readable
half of ``docs/api.md``.

Written by hand rather than generated, so it states the contract (bounds, error shapes) and not
whatever the code happens to do; ``tests/hardening`` checks that it names every route the frontend
serves and runs schemathesis against a live cluster to check that every answer matches it.
"""

from __future__ import annotations

from typing import Any

from pygmy.frontend.dashboard import static_files

MAX_ITEM = 999_999_999_999_999_999  # 18 digits: the largest path number we accept (fits SQLite)

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {"code": {"type": "integer", "minimum": 400, "maximum": 599},
                           "message": {"type": "string"}},
        }
    },
}

_BOOK = {
    "type": "object",
    "required": ["item_number", "title", "topic", "stock", "cost"],
    "properties": {
        "item_number": {"type": "integer", "minimum": 1},
        "title": {"type": "string"},
        "topic": {"type": "string"},
        "stock": {"type": "integer", "minimum": 0},
        "cost": {"type": "number", "minimum": 0},
    },
}

_ORDER_PROPS = {
    "order_number": {"type": "integer", "minimum": 1},
    "item_number": {"type": "integer", "minimum": 1},
    "title": {"type": "string"},
    "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
    "cost": {"type": "number", "minimum": 0},
    "total": {"type": "number", "minimum": 0},
}
_BUY_RESULT = {"type": "object", "required": list(_ORDER_PROPS), "properties": _ORDER_PROPS}
_ORDER = {
    "type": "object",
    "required": [*_ORDER_PROPS, "created_at"],
    "properties": {**_ORDER_PROPS, "created_at": {"type": "string"}},
}

_REPLICA = {
    "type": "object",
    "required": ["name", "alive"],
    "properties": {
        "name": {"type": "string"}, "url": {"type": "string"}, "alive": {"type": "boolean"},
        "role": {"type": "string", "enum": ["leader", "follower", "candidate", "recovering", "failed"]},
        "leader_lease": {"type": "boolean"}, "error": {"type": "string", "nullable": True},
        "term": {"type": "integer"}, "leader": {"type": "string", "nullable": True},
        "commit_index": {"type": "integer"}, "applied_index": {"type": "integer"},
        "state_digest": {"type": "string"},
        "loop_faults": {"type": "object", "additionalProperties": {"type": "integer"},
                        "description": "faults survived since start, by kind: storage, error (a bug), sender"},
        "last_loop_fault": {"type": "string", "nullable": True},
        "timers": {"type": "object", "description": "Raft timers in force (ms), whether they follow the network "
                   "(adapt), and on a leader each follower's median and p99 heartbeat round trip (ms)",
                   "properties": {**{f"{k}_ms": {"type": "number", "minimum": 0} for k in
                                     ("heartbeat", "election", "lease", "probe")},
                                  "adapt": {"type": "boolean"},
                                  **{k: {"type": "object", "additionalProperties": {"type": "number", "minimum": 0}}
                                     for k in ("rtt_ms", "rtt_tail_ms")}}},
    },
}
_TIER = {
    "type": "object",
    "required": ["leader", "replicas"],
    "properties": {"leader": {"type": "string", "nullable": True}, "replicas": {"type": "array", "items": _REPLICA}},
}
_STATUS = {
    "type": "object",
    "required": ["frontend", "catalog", "order"],
    "properties": {
        "age_ms": {"type": "number", "minimum": 0, "description": "age of the catalog and order parts"},
        "frontend": {
            "type": "object",
            "required": ["name", "cache"],
            "properties": {
                "name": {"type": "string"},
                "cache": {
                    "type": "object",
                    "required": ["enabled", "entries", "capacity", "hits", "misses", "invalidations"],
                    "properties": {k: {"type": "integer", "minimum": 0} for k in
                                   ("entries", "capacity", "hits", "misses", "invalidations")}
                    | {"enabled": {"type": "boolean"}},
                },
            },
        },
        "catalog": _TIER,
        "order": _TIER,
    },
}

_COUNT = {"type": "integer", "minimum": 0}
_DASHBOARD = {
    "type": "object",
    "required": ["frontend", "now", "age_ms", "tiers", "workers", "operations", "faults"],
    "properties": {
        "frontend": {"type": "string"}, "now": {"type": "number", "description": "Unix time of this answer"},
        "age_ms": {"type": "number", "minimum": 0, "description": "age of the tiers part"},
        "tiers": {"type": "object", "required": ["catalog", "order"], "properties": {"catalog": _TIER, "order": _TIER}},
        "workers": {"type": "array", "items": {
            "type": "object", "required": ["pid", "entries", "hits", "misses", "invalidations", "lease_valid"],
            "properties": {k: _COUNT for k in ("pid", "entries", "hits", "misses", "invalidations", "pushes",
                                               "lease_left_ms", "lease_term")} | {"lease_valid": {"type": "boolean"}}}},
        "operations": {"type": "object", "description": "search, lookup and buy since this frontend started",
                       "additionalProperties": {"type": "object", "required": ["count", "errors", "buckets"], "properties": {
                           "count": _COUNT, "errors": _COUNT,
                           "buckets": {"type": "array", "description": "[upper bound in s (null: +Inf), requests at "
                                                                       "or under it]", "items": {"type": "array"}}}}},
        "faults": {"type": "boolean", "description": "whether /dashboard/faults can act (a `pygmy up` cluster)"},
        "max_pause": {"type": "number"},
    },
}

#: What each status means on this API; every one of them has the JSON error body.
ERROR_MEANINGS = {
    400: "Bad input: a malformed number, body, field or header",
    401: "No admin token (Authorization: Bearer <admin token>)",
    403: "Wrong admin token",
    404: "No such item, order or route",
    405: "Method not allowed on this route",
    409: "Out of stock, or stock would go negative; a fault the launcher cannot carry out, or no launcher",
    413: "Body over 64 KiB",
    414: "URL over 8 KiB",
    422: "Idempotency-Key already used for a different buy",
    431: "Headers over 16 KiB",
    502: "A backend tier answered with an error we cannot pass on",
    503: "A backend tier is unavailable right now (retry; buys with the same Idempotency-Key)",
}


def _errors(*codes: int) -> dict[str, Any]:
    """Error responses: the listed codes, plus the size and availability ones any request may get."""
    every = (400, 404, 405, 413, 414, 431, 503)
    out = {str(c): {"$ref": f"#/components/responses/E{c}"} for c in sorted({*codes, *every})}
    out["default"] = {"$ref": "#/components/responses/Error"}
    return out


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _number_param(name: str, what: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "description": what,
            "schema": {"type": "integer", "minimum": 1, "maximum": MAX_ITEM}}


def spec(server_url: str | None = None) -> dict[str, Any]:
    """The document; ``server_url`` (the frontend's own URL) fills ``servers`` when known."""
    item = _number_param("item_number", "item number of a book")
    paths: dict[str, Any] = {
        "/search/{topic}": {"get": {
            "operationId": "search", "summary": "A page of a topic's books (case-insensitive; '-' = space)",
            "parameters": [
                {"name": "topic", "in": "path", "required": True, "schema": {"type": "string"}},
                {"name": "limit", "in": "query", "required": False, "description": "books per page (default 100)",
                 "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
                {"name": "next", "in": "query", "required": False,
                 "description": "the `next` cursor of the previous page", "schema": {"type": "string"}},
            ],
            "responses": {"200": _json({
                "type": "object", "required": ["topic", "items"],
                "properties": {"topic": {"type": "string"}, "items": {"type": "array", "items": {
                    "type": "object", "required": ["item_number", "title"],
                    "properties": {"item_number": {"type": "integer"}, "title": {"type": "string"}}}},
                    "next": {"type": "string", "description": "present while more pages follow"}},
            }, "a page of the topic's books, by item number (empty for an unknown topic)"), **_errors()},
        }},
        "/lookup/{item_number}": {"get": {
            "operationId": "lookup", "summary": "One book", "parameters": [item],
            "responses": {"200": _json(_BOOK, "the book"), **_errors()},
        }},
        "/buy/{item_number}": {"post": {
            "operationId": "buy", "summary": "Buy copies of a book (exactly once per Idempotency-Key)",
            "parameters": [item, {"name": "Idempotency-Key", "in": "header", "required": False,
                                  "schema": {"type": "string", "minLength": 1, "maxLength": 200}}],
            "requestBody": {"required": False, "content": {"application/json": {"schema": {
                "type": "object", "properties": {"quantity": {"type": "integer", "minimum": 1, "maximum": 1000}}}}}},
            "responses": {"200": _json(_BUY_RESULT, "the order"), **_errors(409, 422, 502)},
        }},
        "/orders/{order_number}": {"get": {
            "operationId": "order", "summary": "One order",
            "parameters": [_number_param("order_number", "order number")],
            "responses": {"200": _json(_ORDER, "the order"), **_errors(502)},
        }},
        "/update/{item_number}": {"post": {
            "operationId": "update", "summary": "Restock and/or reprice a book (admin)",
            "security": [{"adminToken": []}],
            "parameters": [item, {"name": "Idempotency-Key", "in": "header", "required": False,
                                  "description": "a retried update with the same key is applied once",
                                  "schema": {"type": "string", "minLength": 1, "maxLength": 200}}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "minProperties": 1,
                "properties": {"stock_delta": {"type": "integer", "minimum": -1_000_000_000, "maximum": 1_000_000_000},
                               "cost": {"type": "number", "minimum": 0, "maximum": 1_000_000_000}}}}}},
            "responses": {"200": _json(_BOOK, "the updated book"), **_errors(401, 403, 409, 502)},
        }},
        "/health": {"get": {
            "operationId": "health", "summary": "200 once this frontend can reach both tiers",
            "responses": {"200": _json({"type": "object", "required": ["name", "status"],
                                        "properties": {"name": {"type": "string"}, "status": {"type": "string"}}},
                                       "ready"), **_errors()},
        }},
        "/livez": {"get": {
            "operationId": "livez", "summary": "200 while this frontend's worker answers; asks no other service",
            "responses": {"200": _json({"type": "object", "required": ["name", "status"],
                                        "properties": {"name": {"type": "string"}, "status": {"type": "string"}}},
                                       "live"), **_errors()},
        }},
        "/readyz": {"get": {
            "operationId": "readyz",
            "summary": "200 while this frontend reaches a leader of each tier holding its lease",
            "responses": {"200": _json({"type": "object", "required": ["name", "status", "leaders"],
                                        "properties": {"name": {"type": "string"}, "status": {"type": "string"},
                                                       "leaders": {"type": "object"}}},
                                       "ready"), **_errors(503)},
        }},
        "/status": {"get": {
            "operationId": "status", "summary": "Cluster view: leaders, replicas, cache",
            "responses": {"200": _json(_STATUS, "the cluster view"), **_errors()},
        }},
        "/metrics": {"get": {
            "operationId": "metrics", "summary": "Prometheus text format",
            "responses": {"200": {"description": "metrics", "content": {"text/plain": {"schema": {"type": "string"}}}},
                          **_errors()},
        }},
        "/dashboard": {"get": {
            "operationId": "dashboard", "summary": "The live cluster page (HTML; polls /dashboard/state)",
            "responses": {"200": {"description": "the page", "content": {"text/html": {"schema": {"type": "string"}}}},
                          **_errors()},
        }},
        "/dashboard/static/{filename}": {"get": {
            "operationId": "dashboardFile", "summary": "The page's script, style and vendored chart library",
            "parameters": [{"name": "filename", "in": "path", "required": True,
                            "schema": {"type": "string", "enum": static_files()}}],
            "responses": {"200": {"description": "the file", "content": {"*/*": {"schema": {"type": "string"}}}},
                          **_errors()},
        }},
        "/dashboard/state": {"get": {
            "operationId": "dashboardState", "summary": "What the page draws: tiers, this frontend's workers "
                                                        "and its per-operation counts and latency histograms",
            "responses": {"200": _json(_DASHBOARD, "the state, now"), **_errors()},
        }},
        "/dashboard/faults": {"post": {
            "operationId": "dashboardFault",
            "summary": "Kill, pause or start a replica (admin; clusters started by `pygmy up` only)",
            "security": [{"adminToken": []}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["action", "name"],
                "properties": {"action": {"type": "string", "enum": ["kill", "pause", "start"]},
                               "name": {"type": "string", "description": "a replica, e.g. catalog-1"},
                               "seconds": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 60,
                                           "description": "how long a pause lasts (default 5)"}}}}}},
            "responses": {"200": _json({"type": "object", "required": ["ok", "message"],
                                        "properties": {"ok": {"type": "boolean"}, "message": {"type": "string"}}},
                                       "done"), **_errors(401, 403, 409)},
        }},
        "/openapi.json": {"get": {
            "operationId": "openapi", "summary": "This document",
            "responses": {"200": _json({"type": "object", "required": ["openapi", "paths"]}, "OpenAPI 3 document"),
                          **_errors()},
        }},
    }
    responses = {f"E{c}": _json({"$ref": "#/components/schemas/Error"}, text) for c, text in ERROR_MEANINGS.items()}
    responses["Error"] = _json({"$ref": "#/components/schemas/Error"}, "any other error, same body")
    doc: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {"title": "Pygmy bookstore", "version": "1.0",
                 "description": "Every error body is {\"error\": {\"code\": <status>, \"message\": <text>}}."},
        "paths": paths,
        "components": {
            "schemas": {"Error": _ERROR},
            "responses": responses,
            "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer",
                                               "description": "the admin token (PYGMY_ADMIN_TOKEN or D/admin-token); "
                                                              "not the internal secret between services"}},
        },
    }
    if server_url:
        doc["servers"] = [{"url": server_url}]
    return doc
