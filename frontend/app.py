"""The frontend: the only tier clients talk to. Validates input, routes reads and writes, caches reads.

Each Gunicorn worker builds its own app (own routers, own leader hints); nothing here assumes a
single worker.
"""

from __future__ import annotations

import base64
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import parse_qsl

from flask import Flask, Response, g, jsonify, request

from pygmy.frontend import dashboard, openapi
from pygmy.frontend.cache import ReadCache
from pygmy.frontend.statusview import StatusView
from pygmy.frontend.subscription import Subscription
from pygmy.kit import metrics
from pygmy.kit.admission import RETRY_AFTER, parse_timeout_ms
from pygmy.kit.cachekeys import book_key, search_key
from pygmy.kit.config import ClusterConfig
from pygmy.kit.web import (
    ADMIN,
    Answer,
    ApiError,
    Later,
    Shortcut,
    create_base_app,
    error_body,
    fail,
    int_field,
    json_body,
    json_object,
    parse_item,
    query_int,
    request_deadline,
    require_secret,
    update_fields,
)
from pygmy.replication.batching import Combiner, CombinerTimeout
from pygmy.replication.router import (
    ChannelRouter,
    HopError,
    Reply,
    Sightings,
    TierRouter,
    TierUnavailable,
    Watchers,
    overloaded,
)
from pygmy.replication.transport import BUYS_CHANNEL, SUBSCRIBE_CHANNEL

READ_DEADLINE = 5.0
UPDATE_DEADLINE = 5.0
MAX_KEY = 200
#: How long a probe's verdict (``/health``, ``/readyz``: questions to the tiers) is reused, in seconds.
PROBE_AGE = 0.5
BOOK_FIELDS = ("item_number", "title", "topic", "stock", "cost")
#: Books per search answer unless ``limit`` says otherwise, and the most ``limit`` may ask for.
SEARCH_LIMIT, SEARCH_MAX = 100, 1000
ORDER_FIELDS = ("order_number", "item_number", "title", "quantity", "cost", "total")
#: What a buy hears when its time ran out before it was sent to the order leader: nothing was done.
EXPIRED = Reply(504, {"error": {"code": 504, "message": "the buy's time budget was spent before it was sent"}},
                "frontend")


def public_book(book: dict[str, Any]) -> dict[str, Any]:
    """A book as lookups answer and cache it, whether read from a replica or carried by a release."""
    return {k: book[k] for k in BOOK_FIELDS}


def cursor(after: int) -> str:
    """The opaque ``next`` of a search answer: where the next page starts (clients only pass it back)."""
    return base64.urlsafe_b64encode(f"after:{after}".encode()).decode().rstrip("=")


def parse_cursor(raw: str) -> int:
    try:
        text = base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).decode("ascii")
    except (ValueError, UnicodeDecodeError):
        text = ""
    number = text.removeprefix("after:")
    if not text.startswith("after:") or not number.isdigit() or len(number) > 18:
        fail(400, "next must be the cursor of a previous search answer")
    return int(number)


def reply_answer(reply: Reply, fields: tuple[str, ...] | None = None) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """A backend answer as ours, ``(code, body, extra)``: success bodies trimmed to the public
    fields; errors as errors, ``extra`` their extra fields and ``retry_after``. A replica's 503
    stays 503 + Retry-After (it shed the request, so we shed it; or it cannot tell the outcome yet
    and a retry with the same key will); a spent budget stays 504."""
    if reply.status != 200:
        message = reply.body.get("error", {}).get("message", "backend error")
        if reply.status == 503:  # shed, or an outcome not known yet: either way, retry (same key)
            extra = {"overloaded": True} if overloaded(reply) else {}
            return 503, error_body(503, message, **extra), {**extra, "retry_after": RETRY_AFTER}
        code = reply.status if 400 <= reply.status < 500 or reply.status == 504 else 502
        return code, error_body(code, message), {}
    return 200, reply.body if fields is None else {k: reply.body[k] for k in fields}, {}


def passthrough(reply: Reply, fields: tuple[str, ...] | None = None) -> Response:
    """``reply_answer`` as Flask's answer; an error is raised (``ApiError``), so that a cache fill
    that gets one fails every caller waiting for it and stores nothing."""
    code, body, extra = reply_answer(reply, fields)
    if code != 200:
        fail(code, body["error"]["message"], **extra)
    return jsonify(body)


def buy_outcome(result: Reply | BaseException) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """What a buy answers, ``(code, body, extra)`` as ``reply_answer``, from what its batch to the
    order leader gave it: the order leader's answer, or why there was none."""
    if isinstance(result, TierUnavailable):
        message = f"order tier unavailable, try again ({result.last})"
        return 503, error_body(503, message), {"retry_after": RETRY_AFTER}
    if isinstance(result, CombinerTimeout):
        return 504, error_body(504, "the buy's time budget was spent " + (
            "while the order leader worked on it (retry with the same Idempotency-Key)" if result.sent else
            "before it was sent: nothing was done")), {}
    if isinstance(result, BaseException):
        raise result
    return reply_answer(result, ORDER_FIELDS)


def buy_item(item: str, key: str | None, data: dict[str, Any]) -> dict[str, Any]:
    """A buy as the order tier takes it, from the path's item, the ``Idempotency-Key`` and the JSON
    body; 400 (``ApiError``) for bad input. The route and the event loop's ``early_buy`` both read
    a buy so, the latter leaving to the route whatever this refuses."""
    number = parse_item(item)
    if key is not None and not 0 < len(key) <= MAX_KEY:
        fail(400, f"Idempotency-Key must be 1 to {MAX_KEY} characters")
    quantity = int_field(data, "quantity", 1, 1000, default=1)
    # A generated key makes our own retries (across an order-leader failover) exactly-once too.
    return {"item": number, "quantity": quantity, "key": f"k:{key}" if key else f"g:{uuid.uuid4().hex}"}


def create_app(config: ClusterConfig, k: int = 1) -> Flask:
    name = f"frontend-{k}"
    secret = config.secret()
    app = create_base_app(name, limits=config.limits("frontend"), tolerances=config.tolerances("frontend"))
    # What one router finds of a stopped replica or of the leader, the others of its tier use
    # (``Sightings``): the lease renewals' find of a new catalog leader sends the reads there too.
    seen = {t: Sightings(via=config.router_urls.get(name, {}), configured=lambda t=t: config.peers_now(name, t))
            for t in ("catalog", "order")}
    catalog = TierRouter("catalog", config.peers_for(name, "catalog"), secret, sightings=seen["catalog"])
    orders = TierRouter("order", config.peers_for(name, "order"), secret, sightings=seen["order"])
    # Buys go as frames on the order replicas' peer transport (``/buys``'s work, without HTTP).
    buy_frames = ChannelRouter("order", config.peers_for(name, "order"), secret, f"{name}/{os.getpid()}", BUYS_CHANNEL,
                               sightings=seen["order"])
    # Its own token, not the internal secret: whoever may update books cannot act as a replica.
    admin = require_secret(config.admin_token(), ADMIN)
    if config.read_from not in ("leader", "any"):
        raise ValueError(f"read_from must be 'leader' or 'any', not {config.read_from!r}")
    reads_at_leader = config.read_from == "leader"
    probe = ThreadPoolExecutor(max_workers=2, thread_name_prefix="health")
    events = {e: metrics.CACHE_EVENTS.labels(name, e) for e in ("hit", "miss", "invalidation", "eviction", "flush")}
    entries_gauge = metrics.CACHE_ENTRIES.labels(name)
    worker = {f: metrics.FRONTEND_WORKER.labels(name, f) for f in dashboard.WORKER_FIELDS}
    per_worker = {"hit": worker["hits"], "miss": worker["misses"], "invalidation": worker["invalidations"]}

    def on_cache_event(event: str, entries: int) -> None:
        if event in events:
            events[event].inc()
        if event in per_worker:
            per_worker[event].inc()
        if event not in ("hit", "miss"):  # only these leave the entries as they were
            entries_gauge.set(entries)
            worker["entries"].set(entries)

    cache = ReadCache(config.cache_size, enabled=config.cache, on_event=on_cache_event)
    # Always subscribe, cache or not: the invalidation floors are what make follower reads fresh.
    leases = ChannelRouter("catalog", config.peers_for(name, "catalog"), secret, f"{name}/{os.getpid()}", SUBSCRIBE_CHANNEL,
                           sightings=seen["catalog"])
    def shape(key: str, book: Any) -> Any:
        """A book a release carries, as a lookup caches it (``book:N`` keys only)."""
        if key.startswith("book:") and isinstance(book, dict) and all(f in book for f in BOOK_FIELDS):
            return public_book(book)
        return None

    subscription = Subscription(cache, leases, secret, config.bind_address(name), config.advertise_host, name, shape)
    cache.lease_valid = subscription.valid

    def mirror_lease() -> None:
        holder = subscription.holder()
        worker["lease_until"].set(time.time() + subscription.valid_for())
        worker["lease_term"].set(holder[1] if holder else 0)
        worker["pushes"].set(subscription.pushes)

    subscription.on_change = mirror_lease
    app.extensions["pygmy_subscription"] = subscription
    app.extensions["pygmy_sightings"] = Watchers(*seen.values())  # stopped with the worker (pygmy/cluster/serve.py)

    def send_buys(items: list[tuple[dict[str, Any], float]]) -> list[Reply]:
        """This worker's buys in flight, as one request to the order leader (``Combiner``): its
        intents then go as one log entry and its decrements as one catalog request."""
        metrics.BUY_BATCH.labels(name, "buys").observe(len(items))
        return buy_frames.write_batch(items, config.buy_deadline, EXPIRED)

    buys: Combiner[tuple[dict[str, Any], float], Reply] = Combiner(send_buys, linger=config.frontend_buy_linger)
    app.extensions["pygmy_buys"] = buys  # stopped with the worker (pygmy/cluster/serve.py)

    def call(fn: Any, *args: Any, **kw: Any) -> Reply:
        try:
            return fn(*args, **kw)
        except TierUnavailable as exc:
            fail(503, f"{exc.tier} tier unavailable, try again ({exc.last})", retry_after=RETRY_AFTER)

    def catalog_read(path: str, floor: int, params: dict[str, Any] | None = None) -> Reply:
        """The leader first (``read_from``: its read index is local) or any replica; at least
        ``floor`` while our lease holds, otherwise only the leader."""
        extra = {"min_index": floor} if subscription.valid() else {"leader": 1}
        reply = call(catalog.read, path, request_deadline(READ_DEADLINE), params={**(params or {}), **extra},
                     prefer_leader=reads_at_leader)
        if reply.status != 200:
            passthrough(reply)  # raises: errors go to every waiting caller and are never cached
        return reply

    me = f"{name}/{os.getpid()}"  # this worker: Gunicorn forks after the app is built (--preload is off)

    def traced(resp: Response) -> Response:
        """Say where a read came from: ``X-Cache: hit`` or ``miss`` and the replica@index that served it."""
        served = g.get("served_by")
        resp.headers["X-Cache"] = "miss" if served else "hit"
        resp.headers["X-Served-By"] = served or me
        return resp

    @app.get("/search/<path:topic>")
    def search(topic: str) -> Response:
        """A page of the topic's books: ``limit`` of them (default 100, at most 1,000), from the
        ``next`` cursor of the previous page on; ``next`` is in the answer while more follow. Pages
        are cached like any read (no command changes a book's number or title)."""
        limit = query_int("limit", 1, SEARCH_MAX, SEARCH_LIMIT)
        raw = request.args.get("next")
        after = 0 if raw is None else parse_cursor(raw)

        def fetch(floor: int) -> tuple[int, Any]:
            reply = catalog_read("/books", floor, {"topic": topic, "after": after, "limit": limit})
            g.served_by = f"{reply.replica}@{reply.body['applied_index']}"
            return reply.body["applied_index"], {"items": reply.body["items"], "more": bool(reply.body.get("more"))}

        page = cache.get_or_fetch(search_key(topic, after, limit), fetch, usable=subscription.valid())
        body: dict[str, Any] = {"topic": topic, "items": page["items"]}
        if page["more"] and page["items"]:
            body["next"] = cursor(page["items"][-1]["item_number"])
        return traced(jsonify(body))

    @app.get("/lookup/<item>")
    def lookup(item: str) -> Response:
        number = parse_item(item)

        def fetch(floor: int) -> tuple[int, Any]:
            reply = catalog_read(f"/books/{number}", floor)
            g.served_by = f"{reply.replica}@{reply.body['applied_index']}"
            # Fresh as of the log position it was read at (not merely its own last change).
            return reply.body["applied_index"], public_book(reply.body)

        return traced(jsonify(cache.get_or_fetch(book_key(number), fetch, usable=subscription.valid())))

    hit_headers = [("X-Cache", "hit"), ("X-Served-By", me)]

    def cached_read(environ: dict[str, Any]) -> Shortcut | None:
        """A lookup or a search page that hits the cache, answered before Flask (``pygmy.kit.web.Edge``,
        and from Gunicorn's event loop, ``pygmy/cluster/worker.py``) with the bytes its route would give:
        cached reads are most of a store's traffic, and Flask's request context, routing and
        response object cost more than the hit itself. Anything else (a miss, a held key, no lease,
        anything the route would refuse or read differently) goes on to the route."""
        if environ.get("REQUEST_METHOD") != "GET" or not subscription.valid():
            return None
        path = environ.get("PATH_INFO", "")
        if path.startswith("/lookup/"):
            return cached_lookup(path[8:])
        if path.startswith("/search/"):
            return cached_search(path[8:], environ.get("QUERY_STRING", ""))
        return None

    def cached_lookup(item: str) -> Shortcut | None:
        if not (item.isascii() and item.isdigit() and len(item) <= 18):
            return None
        hit = cache.peek(book_key(int(item)))
        if hit is None:
            return None
        body = app.json.dumps(hit[1], separators=(",", ":")) + "\n"  # as jsonify writes it
        return "/lookup/<item>", body.encode(), hit_headers

    def cached_search(raw_topic: str, query: str) -> Shortcut | None:
        try:
            topic = raw_topic.encode("latin-1").decode("utf-8")  # as Werkzeug reads PATH_INFO
        except UnicodeError:
            return None
        args: dict[str, str] = {}
        for name, value in parse_qsl(query, keep_blank_values=True):
            if name not in ("limit", "next") or name in args:
                return None  # not the plain cases: the route reads them
            args[name] = value
        limit, raw = args.get("limit"), args.get("next")
        if not topic or topic.startswith("/") or (limit is not None and not (
                limit.isascii() and limit.isdigit() and len(limit) <= 18 and 1 <= int(limit) <= SEARCH_MAX)):
            return None
        try:
            after = 0 if raw is None else parse_cursor(raw)
        except ApiError:
            return None
        hit = cache.peek(search_key(topic, after, SEARCH_LIMIT if limit is None else int(limit)))
        if hit is None:
            return None
        page = hit[1]
        body: dict[str, Any] = {"topic": topic, "items": page["items"]}
        if page["more"] and page["items"]:
            body["next"] = cursor(page["items"][-1]["item_number"])
        return "/search/<path:topic>", (app.json.dumps(body, separators=(",", ":")) + "\n").encode(), hit_headers

    app.extensions["pygmy_edge"].shortcut = cached_read

    @app.post("/buy/<item>")
    def buy(item: str) -> Response:
        body = buy_item(item, request.headers.get("Idempotency-Key"), json_body())
        deadline = request_deadline(config.buy_deadline)
        try:
            result: Reply | BaseException = buys.call((body, deadline), max(0.0, deadline - time.monotonic()))
        except (TierUnavailable, CombinerTimeout) as exc:
            result = exc
        code, body, extra = buy_outcome(result)
        if code != 200:
            fail(code, body["error"]["message"], **extra)
        return jsonify(body)

    def early_buy(path: str, headers: dict[bytes, bytes], raw: bytes) -> Later | None:
        """A plain buy taken from Gunicorn's event loop without a thread (``pygmy.kit.web.Edge.deferred``):
        it waits in the worker's batch with the buys of the route, and is answered, as the route
        would answer it, by the thread its batch returns on. Anything the route would refuse or
        read differently (a malformed number, key or body) is left to the route: None."""
        if not path.startswith("/buy/"):
            return None
        given = headers.get(b"idempotency-key")
        try:
            body = buy_item(path[5:], None if given is None else given.decode("latin-1"), json_object(raw))
        except ApiError:
            return None
        now = time.monotonic()
        deadline = now + config.buy_deadline
        budget = headers.get(b"x-request-timeout-ms")  # well formed and not 0: Admission.early saw to it
        if budget is not None:
            try:
                deadline = min(deadline, now + parse_timeout_ms(budget.decode("latin-1").strip()) / 1000)
            except ValueError:  # read as Admission.__call__ reads it, which then answers 400
                return None

        def work(answer: Answer) -> None:
            def done(result: Reply | BaseException) -> None:
                try:
                    code, out, extra = buy_outcome(result)
                except BaseException:
                    app.logger.exception("unhandled error on POST %s", path)
                    code, out, extra = 500, error_body(500, "internal error"), {}
                retry = extra.pop("retry_after", None)
                answer(code, (app.json.dumps(out, separators=(",", ":")) + "\n").encode(),
                       [] if retry is None else [("Retry-After", str(retry))])

            try:
                buys.submit((body, deadline), max(0.0, deadline - time.monotonic()), done)
            except RuntimeError as exc:  # the worker is stopping
                done(TierUnavailable("order", str(exc)))

        return "/buy/<item>", work

    app.extensions["pygmy_edge"].deferred = early_buy

    @app.get("/orders/<number>")
    def order(number: str) -> Response:
        n = parse_item(number, "order number")
        return passthrough(call(orders.read, f"/orders/{n}", request_deadline(READ_DEADLINE),
                                prefer_leader=reads_at_leader))

    @app.post("/update/<item>")
    @admin
    def update(item: str) -> Response:
        number = parse_item(item)
        body = json_body(required=True)
        command = update_fields(body)
        # Our retries (across a catalog failover) must not apply a stock delta twice.
        given = request.headers.get("Idempotency-Key")
        if given is not None and not 0 < len(given) <= MAX_KEY:
            fail(400, f"Idempotency-Key must be 1 to {MAX_KEY} characters")
        command["key"] = f"u:{given}" if given else f"ug:{uuid.uuid4().hex}"
        reply = call(catalog.write, f"/books/{number}/update", command, request_deadline(UPDATE_DEADLINE))
        return passthrough(reply, BOOK_FIELDS)

    def first_replica(router: TierRouter, path: str, good: Callable[[Reply], bool]) -> str | None:
        """The first replica whose answer to ``GET path`` is ``good``, asking the last known leader
        first (one round trip when it still leads), within 0.5 s each; None if none is."""
        router.follow_members()
        for replica in router.leader_first():
            try:
                reply = router.get(replica, path, 0.5)
            except HopError:
                continue
            if good(reply):
                return replica
        return None

    def tier_alive(router: TierRouter) -> bool:
        return first_replica(router, "/health", lambda reply: reply.status == 200) is not None

    # Probes are asked by anyone, as often as they like: each verdict is found by one caller at a
    # time per worker and reused for ``PROBE_AGE`` s (``StatusView``; callers during a refresh get
    # the last one), or a flood of them queued behind the two probe threads, held every Gunicorn
    # thread, and kubelet's ``/readyz`` and then ``/livez`` timed out: a restart of a working frontend.
    alive_view = StatusView(lambda: {"ok": all(probe.map(tier_alive, (catalog, orders)))}, PROBE_AGE)

    @app.get("/health")
    def health() -> Response:
        """Kept for compatibility: a replica of each tier answers. ``/livez`` and ``/readyz`` mean more."""
        ok = alive_view.get()[0]["ok"]
        if not ok:
            fail(503, f"{name} cannot reach a catalog and an order replica")
        return jsonify({"name": name, "status": "ok"})

    @app.get("/livez")
    def livez() -> Response:
        """This worker answers. It asks no other service: a liveness probe built on it must not
        restart every frontend while the catalog tier fails over."""
        return jsonify({"name": name, "status": "live"})

    def tier_leader(router: TierRouter) -> str | None:
        """The tier's leader, ready (holding its lease) and reachable from here, else None."""
        return first_replica(router, "/readyz", lambda reply: reply.status == 200 and reply.body.get("role") == "leader")

    leaders_view = StatusView(
        lambda: dict(zip(("catalog", "order"), probe.map(tier_leader, (catalog, orders)), strict=True)), PROBE_AGE)

    @app.get("/readyz")
    def readyz() -> Response:
        """This frontend can serve buys and updates now: it reaches a leader of each tier that holds
        its lease. Not while a tier elects, nor while this frontend cannot reach its leader."""
        leaders = dict(leaders_view.get()[0])
        missing = [t for t, leader in leaders.items() if leader is None]
        if missing:
            fail(503, f"{name} reaches no ready {' or '.join(missing)} leader", leaders=leaders)
        return jsonify({"name": name, "status": "ready", "leaders": leaders})

    def tier_view(router: TierRouter) -> dict[str, Any]:
        replicas = router.statuses()
        # The newest term wins; within it, one holding its leader lease (a deposed leader that has
        # not heard of its successor yet reports a lapsed lease and an older term).
        leaders = [r for r in replicas if r.get("alive") and r.get("role") == "leader"]
        best = max(leaders, key=lambda r: (r.get("term", 0), bool(r.get("leader_lease", True))), default=None)
        leader = best["name"] if best else None
        return {"leader": leader, "replicas": replicas}

    def cache_status() -> dict[str, Any]:
        """This frontend's cache across all its worker processes (from the shared metrics files)."""
        counts = metrics.totals("pygmy_cache_events_total", "event")
        entries = metrics.totals("pygmy_cache_entries", "service").get(name, cache.snapshot()["entries"])
        out: dict[str, Any] = {"enabled": cache.enabled, "entries": int(entries),
                               "capacity": cache.capacity * config.frontend_workers}
        for event, field in (("hit", "hits"), ("miss", "misses"), ("invalidation", "invalidations"),
                             ("eviction", "evictions"), ("flush", "flushes")):
            out[field] = int(counts.get(event, 0))
        return out

    views = StatusView(lambda: dict(zip(("catalog", "order"), probe.map(tier_view, (catalog, orders)), strict=True)))

    @app.get("/status")
    def status() -> Response:
        """This worker's own state, now, and the tiers' as of ``age_ms`` ago (``StatusView``)."""
        tiers, age = views.get()
        cat, ordr = tiers["catalog"], tiers["order"]
        return jsonify({
            "age_ms": round(age * 1000, 1),
            "frontend": {"name": name, "cache": cache_status(), "worker": os.getpid(),
                         "admission": app.wsgi_app.snapshot(),  # type: ignore[attr-defined]
                         "lease": {"valid": subscription.valid(), "holder": subscription.holder(),
                                   "pushes": subscription.pushes}},
            "catalog": cat, "order": ordr,
        })

    dashboard.register(app, config, name, views, admin)

    @app.get("/openapi.json")
    def openapi_document() -> Response:
        return jsonify(openapi.spec(request.host_url.rstrip("/")))

    subscription.start()
    return app
