"""End-to-end test of the docker-compose stack, through the proxy's published port only.

Run by ``bash scripts/compose.sh test`` (``make compose-test``) once the stack is healthy:

1. smoke: search, lookup, buy (and an idempotent retry), order, the lookup shows the new stock;
   ``POST /update`` takes the admin token (``PYGMY_ADMIN_TOKEN``) and refuses the internal secret;
   ``/dashboard`` is served, shows no fault buttons and refuses fault requests (no ``pygmy up`` here);
2. frontends: three lookups pipelined on one connection through the proxy are answered in order;
   both frontends answer through it; ``frontend-1`` is SIGKILLed and lookups and buys go on through
   the proxy; it is started again;
3. failover: find the catalog and order leaders in the frontend's ``GET /status``, SIGKILL both
   containers with ``docker compose kill``, and check that lookups and buys go on (new leaders, every
   buy acknowledged exactly once, retried with its Idempotency-Key through at most one failover window);
4. recovery: ``docker compose start`` them again and check that they catch up: every replica of a tier
   alive with the same ``applied_index`` and ``state_digest``; stock and orders add up;
5. replacement (``--spare docker-compose.spare.yml``): a catalog follower's and then the order leader's
   container killed and removed for good, each replaced by its tier's spare with ``pygmy member`` (add,
   start, promote once caught up, remove), buys going on; the frontend routes to the new members
   without a restart, and stock and orders still add up.

Standard library only, so it runs with any Python 3.11 on the host.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from typing import Any
from urllib.parse import urlsplit

URL = "http://127.0.0.1:8000"
CHECKS: list[str] = []


def log(msg: str) -> None:
    print(f"[compose-test] {msg}", flush=True)


def fail(msg: str) -> None:
    log(f"FAIL: {msg}")
    sys.exit(1)


def check(cond: bool, msg: str) -> None:
    if not cond:
        fail(msg)
    CHECKS.append(msg)


def call(method: str, path: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
         timeout: float = 5.0) -> tuple[int, Any]:
    """(status, JSON body); status 0 for a transport error (connection refused, timeout)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(URL + path, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (OSError, urllib.error.URLError) as exc:
        return 0, {"error": {"code": 0, "message": f"{type(exc).__name__}: {exc}"}}
    try:
        return status, json.loads(raw or b"null")
    except ValueError:
        return status, {"error": {"code": status, "message": f"not JSON: {raw[:200]!r}"}}


def status() -> dict[str, Any]:
    code, body = call("GET", "/status")
    return body if code == 200 and isinstance(body, dict) else {}


def leaders(st: dict[str, Any]) -> tuple[str | None, str | None]:
    return (st.get("catalog") or {}).get("leader"), (st.get("order") or {}).get("leader")


def wait_ready(timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code, _ = call("GET", "/readyz", timeout=2)
        st = status() if code == 200 else {}
        if all(leaders(st)):
            return st
        time.sleep(0.5)
    fail(f"the cluster had no /readyz 200 with a catalog and an order leader within {timeout:.0f}s "
         f"(last status: {json.dumps(status())[:600]})")
    return {}


def buy(item: int, key: str, window: float) -> tuple[dict[str, Any], int]:
    """Buy one copy, retrying with the same Idempotency-Key on 5xx/transport errors for up to ``window`` s."""
    deadline = time.monotonic() + window
    tries = 0
    while True:
        tries += 1
        code, body = call("POST", f"/buy/{item}", {"quantity": 1}, {"Idempotency-Key": key})
        if code == 200:
            return body, tries
        if (code != 0 and code < 500) or time.monotonic() >= deadline:
            fail(f"buy {item} (key {key}) failed after {tries} tries: {code} {body}")
        time.sleep(0.2)


def smoke() -> tuple[int, list[dict[str, Any]]]:
    code, body = call("GET", "/search/distributed%20systems")
    check(code == 200 and {1, 2} <= {i["item_number"] for i in body.get("items", [])},
          f"search 'distributed systems' lists items 1 and 2 (got {code} {body})")
    code, body2 = call("GET", "/search/distributed-systems")
    check(code == 200 and body2.get("items") == body.get("items"), "search 'distributed-systems' is the same topic")
    code, book = call("GET", "/lookup/1")
    check(code == 200 and {"item_number", "title", "topic", "stock", "cost"} <= set(book),
          f"lookup 1 answers a book (got {code} {book})")
    stock0 = book["stock"]
    code, body = call("GET", "/lookup/999999")
    check(code == 404 and body.get("error", {}).get("code") == 404, f"lookup of an unknown item is a JSON 404 ({code} {body})")
    key = f"compose-smoke-{uuid.uuid4()}"
    order, _ = buy(1, key, 10)
    check(order.get("item_number") == 1 and order.get("quantity") == 1, f"buy 1 answers an order ({order})")
    again, _ = buy(1, key, 10)
    check(again.get("order_number") == order["order_number"], "a retried buy with the same Idempotency-Key returns the same order")
    code, got = call("GET", f"/orders/{order['order_number']}")
    check(code == 200 and got.get("item_number") == 1 and got.get("quantity") == 1,
          f"GET /orders/{order['order_number']} returns the order ({code} {got})")
    code, book = call("GET", "/lookup/1")
    check(code == 200 and book.get("stock") == stock0 - 1, f"lookup after the buy shows stock {stock0 - 1} ({code} {book})")
    log(f"smoke ok: search, lookup, buy #{order['order_number']} (idempotent retry), order, stock {stock0} -> {stock0 - 1}")
    admin(book)
    return stock0, [order]


def admin(book: dict[str, Any]) -> None:
    """The admin token updates a book; no token, or the internal secret in its place, is refused."""
    token, secret = os.environ.get("PYGMY_ADMIN_TOKEN"), os.environ.get("PYGMY_SECRET")
    if not token:
        log("PYGMY_ADMIN_TOKEN not set here: admin checks skipped")
        return
    same = {"cost": book["cost"]}  # changes nothing the later checks count
    code, body = call("POST", "/update/1", same)
    check(code == 401, f"POST /update without a token is refused with 401 ({code} {body})")
    if secret:
        code, body = call("POST", "/update/1", same, {"Authorization": f"Bearer {secret}"})
        check(code == 403, f"the internal secret is not an admin token: 403 ({code} {body})")
    code, body = call("POST", "/update/1", same, {"Authorization": f"Bearer {token}"})
    check(code == 200 and body.get("cost") == book["cost"], f"the admin token updates a book ({code} {body})")
    log("admin ok: /update takes the admin token, refuses none and the internal secret")
    dashboard(token)


def dashboard(token: str) -> None:
    """The live page is served in containers too, without fault buttons: only ``pygmy up`` owns
    processes it can kill, so the frontend refuses fault requests here (409), even with the token."""
    req = urllib.request.Request(URL + "/dashboard")
    with urllib.request.urlopen(req, timeout=5) as resp:
        check(resp.status == 200 and resp.headers["Content-Type"].startswith("text/html"), "GET /dashboard is the page")
    code, st = call("GET", "/dashboard/state")
    check(code == 200 and st.get("faults") is False and st["tiers"]["catalog"]["leader"],
          f"the page's state shows the tiers and no fault buttons ({code} {st.get('faults')})")
    code, body = call("POST", "/dashboard/faults", {"action": "kill", "name": "catalog-1"},
                      {"Authorization": f"Bearer {token}"})
    check(code == 409, f"a fault request is refused where pygmy up did not start the services ({code} {body})")
    log("dashboard ok: served, no fault buttons, fault requests refused")


def pipelined(paths: list[str]) -> list[tuple[int, str, dict[str, Any]]]:
    """``paths`` as GETs pipelined in one write on one connection: ``(status, X-Request-Id, body)`` of
    each answer, in the order they came."""
    where = urlsplit(URL)
    out: list[tuple[int, str, dict[str, Any]]] = []
    with socket.create_connection((where.hostname, where.port or 80), timeout=10) as sock:
        sock.sendall(b"".join(f"GET {p} HTTP/1.1\r\nHost: pygmy\r\nX-Request-Id: pipe-{i}\r\n\r\n".encode()
                              for i, p in enumerate(paths)))
        data = b""
        for _ in paths:
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    return out
                data += chunk
            head, _, data = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            length = int(headers.get("content-length", "0"))
            while len(data) < length:
                chunk = sock.recv(65536)
                if not chunk:  # closed mid-body: the answers read so far
                    return out
                data += chunk
            out.append((int(lines[0].split()[1]), headers.get("x-request-id", ""), json.loads(data[:length] or b"{}")))
            data = data[length:]
    return out


def frontends(compose: list[str], orders: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Pipelining through the proxy, both frontends behind it, and one of them killed."""
    paths = ["/lookup/1", "/lookup/2", "/search/distributed%20systems", "/lookup/3"]
    got = pipelined(paths)
    check(len(got) == len(paths) and all(g[0] == 200 and g[1] == f"pipe-{i}" for i, g in enumerate(got))
          and [g[2].get("item_number") for g in got] == [1, 2, None, 3],
          f"{len(paths)} pipelined requests answered in order through the proxy ({[g[:2] for g in got]})")
    names = {(status().get("frontend") or {}).get("name") for _ in range(12)}
    check(names == {"frontend-1", "frontend-2"}, f"both frontends answer through the proxy ({sorted(map(str, names))})")
    log("killing frontend-1 (docker compose kill)")
    subprocess.run([*compose, "kill", "frontend-1"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    failed = [(path, code) for i in range(20)
              for path in (f"/lookup/{1 + i % 7}",) for code, _ in (call("GET", path),) if code != 200]
    check(not failed, f"lookups go on through the proxy with frontend-1 killed (failed: {failed})")
    earlier = {o["order_number"] for o in orders}
    bought = [buy(1, f"compose-frontend-{uuid.uuid4()}", args.window)[0] for _ in range(3)]
    numbers = {o.get("order_number") for o in bought}
    check(len(numbers) == 3 and not numbers & earlier and all(o.get("item_number") == 1 for o in bought),
          f"3 buys acknowledged through the proxy with frontend-1 killed, each a new order ({sorted(map(str, numbers))})")
    orders.extend(bought)
    subprocess.run([*compose, "start", "frontend-1"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log("frontends ok: pipelining through the proxy; one frontend killed, lookups and buys went on")


def failover(compose: list[str], orders: list[dict[str, Any]], args: argparse.Namespace) -> tuple[str, str]:
    cl, ol = leaders(status())
    check(bool(cl and ol), f"the frontend's /status names both leaders ({cl}, {ol})")
    log(f"killing the leaders {cl} and {ol} (docker compose kill)")
    subprocess.run([*compose, "kill", cl, ol], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t_kill = time.monotonic()
    lookups_ok = 0
    read_failures: list[tuple[float, str, int, Any]] = []
    buys = []
    max_tries = 0
    end = t_kill + args.failover_duration
    i = 0
    while time.monotonic() < end or len(buys) < args.buys:
        if time.monotonic() - t_kill > args.failover_duration + args.window * args.buys:
            break
        item = 1 + i % 7
        for path in (f"/lookup/{item}", "/search/graduate%20school"):
            code, body = call("GET", path)
            if code == 200:
                lookups_ok += 1
            else:
                read_failures.append((time.monotonic() - t_kill, path, code, body))
        if len(buys) < args.buys:
            order, tries = buy(1, f"compose-failover-{uuid.uuid4()}", args.window)
            buys.append(order)
            max_tries = max(max_tries, tries)
        i += 1
        time.sleep(0.1)
    log(f"while {cl} and {ol} were down: {lookups_ok} lookups/searches ok, {len(read_failures)} failed; "
        f"{len(buys)} buys acknowledged (most tries for one: {max_tries})")
    for t, path, code, body in read_failures:
        log(f"  read failure {t:.1f}s after the kill: GET {path} -> {code} {json.dumps(body)[:300]}")
    late = [f for f in read_failures if f[0] > args.max_read_outage]
    check(lookups_ok > 0, "lookups and searches go on with a leader down")
    check(len(late) <= args.max_late_read_failures,
          f"lookups and searches fail only in the first {args.max_read_outage}s after the kill "
          f"(then at most {args.max_late_read_failures} stray failures; got {len(late)})")
    check(len(buys) >= args.buys, f"{args.buys} buys acknowledged with both leaders down")
    numbers = [o["order_number"] for o in orders + buys]
    check(len(set(numbers)) == len(numbers), f"no order number acknowledged twice ({numbers})")
    ncl, nol = leaders(status())
    check(bool(ncl and nol and ncl != cl and nol != ol), f"new leaders elected ({cl} -> {ncl}, {ol} -> {nol})")
    orders.extend(buys)
    return cl, ol


def tier_in_sync(st: dict[str, Any], tier: str) -> tuple[bool, str]:
    reps = (st.get(tier) or {}).get("replicas") or []
    view = [(r.get("name"), r.get("alive"), r.get("role"), r.get("applied_index"), r.get("state_digest")) for r in reps]
    ok = (len(reps) >= 3 and all(r.get("alive") for r in reps)
          and len({(r.get("applied_index"), r.get("state_digest")) for r in reps}) == 1
          and all(r.get("applied_index") is not None for r in reps))
    return ok, str(view)


def recovery(compose: list[str], killed: tuple[str, str], stock0: int, orders: list[dict[str, Any]],
             args: argparse.Namespace) -> None:
    log(f"starting {killed[0]} and {killed[1]} again (docker compose start)")
    subprocess.run([*compose, "start", *killed], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + args.catchup_timeout
    views: dict[str, str] = {}
    while True:
        st = status()
        synced = {}
        for tier in ("catalog", "order"):
            synced[tier], views[tier] = tier_in_sync(st, tier)
        if all(synced.values()):
            break
        if time.monotonic() > deadline:
            fail(f"the restarted replicas did not catch up within {args.catchup_timeout}s: {views}")
        time.sleep(1)
    check(True, "restarted replicas caught up (same applied_index and state_digest in each tier)")
    log(f"caught up: catalog {views['catalog']}")
    log(f"caught up: order {views['order']}")
    code, book = call("GET", "/lookup/1")
    bought = sum(o["quantity"] for o in orders if o["item_number"] == 1)
    check(code == 200 and book.get("stock") == stock0 - bought,
          f"stock of item 1 is {stock0} - {bought} bought = {stock0 - bought} ({code} {book})")
    for o in orders:
        code, got = call("GET", f"/orders/{o['order_number']}")
        check(code == 200 and got.get("item_number") == o["item_number"], f"order {o['order_number']} is kept ({code} {got})")
    log(f"all {len(orders)} acknowledged orders are there; stock {stock0} -> {stock0 - bought}")


def member(compose: list[str], *args: str, timeout: float = 90) -> dict[str, Any]:
    """``pygmy member ARGS --json`` run in the frontend's container (the tiers' URLs and the secret are
    in its environment): the JSON it printed."""
    r = subprocess.run([*compose, "exec", "-T", "frontend-1", "pygmy", "member", *args, "--json"],
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        fail(f"pygmy member {' '.join(args)}: exit {r.returncode}: {r.stdout[-400:]} {r.stderr[-400:]}")
    return json.loads(r.stdout)


def replacement(compose: list[str], spare_file: str, stock0: int, orders: list[dict[str, Any]],
                args: argparse.Namespace) -> None:
    """A host lost for good, replaced online: a catalog follower's container is killed and removed,
    the spare catalog-4 (docker-compose.spare.yml) is added as a learner with ``pygmy member``,
    started, promoted once caught up, and the lost one removed; the same for the order leader with
    order-4. Buys go on throughout, and the frontend learns the new members without a restart."""
    spare = [*compose, "-f", spare_file]
    code, book2 = call("GET", "/lookup/2")
    check(code == 200, f"lookup 2 before the replacements ({code} {book2})")
    for tier, role in (("catalog", "follower"), ("order", "leader")):
        st = status()
        lead = (st.get(tier) or {}).get("leader")
        names = sorted(r["name"] for r in (st.get(tier) or {}).get("replicas", []))
        lost = lead if role == "leader" else next(n for n in reversed(names) if n != lead)
        new = f"{tier}-4"
        log(f"{tier}: {lost} ({role}) lost for good; replacing it with {new}")
        subprocess.run([*compose, "kill", lost], check=True, capture_output=True)
        subprocess.run([*compose, "rm", "-f", lost], check=True, capture_output=True)
        deadline = time.monotonic() + args.window
        while True:  # a lost leader: its successor must be elected before it takes a change
            r = subprocess.run([*spare, "exec", "-T", "frontend-1", "pygmy", "member", "add", tier, new,
                                f"http://{new}:8000", "--json"], capture_output=True, text=True, timeout=60)
            if r.returncode == 0:
                added = json.loads(r.stdout)
                break
            if time.monotonic() > deadline:
                fail(f"pygmy member add {tier} {new}: {r.stdout[-300:]} {r.stderr[-300:]}")
            time.sleep(1)
        check(new in added["learners"] and lost in added["voters"], f"{new} joins {tier} as a learner ({added})")
        subprocess.run([*spare, "up", "-d", "--no-deps", new], check=True, capture_output=True)
        order, _ = buy(2, f"compose-replace-{uuid.uuid4()}", args.window)
        orders.append(order)
        promoted = member(spare, "promote", tier, new, "--wait", str(args.catchup_timeout),
                          timeout=args.catchup_timeout + 30)
        check(new in promoted["voters"], f"{new} promoted once caught up ({promoted})")
        removed = member(spare, "remove", tier, lost, "--wait", "30")
        check(lost not in removed["voters"] and len(removed["voters"]) == 3,
              f"{lost} removed: {tier} has three voters again ({removed})")
        deadline = time.monotonic() + 30
        while {r["name"] for r in (status().get(tier) or {}).get("replicas", [])} != set(removed["voters"]):
            if time.monotonic() > deadline:
                fail(f"the frontend still routes {tier} to {(status().get(tier) or {}).get('replicas')}")
            time.sleep(1)
        check(True, f"the frontend routes {tier} to {', '.join(removed['voters'])} without a restart")
        order, _ = buy(1, f"compose-replace-{uuid.uuid4()}", args.window)
        orders.append(order)
    deadline = time.monotonic() + args.catchup_timeout
    while not all(tier_in_sync(status(), tier)[0] for tier in ("catalog", "order")):
        if time.monotonic() > deadline:
            fail(f"the tiers did not agree after the replacements: {tier_in_sync(status(), 'catalog')[1]}")
        time.sleep(1)
    for item, before in ((1, stock0), (2, book2["stock"])):  # item 2 is bought only here
        code, book = call("GET", f"/lookup/{item}")
        bought = sum(o["quantity"] for o in orders if o["item_number"] == item)
        check(code == 200 and book.get("stock") == before - bought,
              f"stock of item {item} is {before} - {bought} bought after the replacements ({code} {book})")
    for o in orders:
        code, got = call("GET", f"/orders/{o['order_number']}")
        check(code == 200 and got.get("item_number") == o["item_number"], f"order {o['order_number']} is kept")
    log("replacement ok: a lost catalog follower and a lost order leader replaced online with pygmy member")


def main() -> int:
    global URL
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default=URL)
    p.add_argument("--compose", default="docker compose", help="the docker compose command for this stack")
    p.add_argument("--ready-timeout", type=float, default=120)
    p.add_argument("--buys", type=int, default=5, help="buys to acknowledge with the leaders down")
    p.add_argument("--window", type=float, default=15, help="seconds one buy may keep retrying (failover window)")
    p.add_argument("--failover-duration", type=float, default=6, help="seconds of lookups with the leaders down")
    p.add_argument("--max-read-outage", type=float, default=3, help="lookups may fail this long after the kill")
    p.add_argument("--max-late-read-failures", type=int, default=1,
                   help="stray read failures tolerated after that (a loaded machine can time out a request)")
    p.add_argument("--catchup-timeout", type=float, default=90)
    p.add_argument("--smoke-only", action="store_true", help="only the smoke test (e.g. for a Swarm stack)")
    p.add_argument("--spare", help="docker-compose.spare.yml: also replace a lost catalog follower and a lost "
                                   "order leader with its spares, online")
    args = p.parse_args()
    URL = args.url.rstrip("/")
    compose = shlex.split(args.compose)
    t0 = time.monotonic()
    st = wait_ready(args.ready_timeout)
    log(f"ready: catalog leader {leaders(st)[0]}, order leader {leaders(st)[1]}")
    stock0, orders = smoke()
    if args.smoke_only:
        log(f"all {len(CHECKS)} checks passed in {time.monotonic() - t0:.0f}s")
        return 0
    frontends(compose, orders, args)
    killed = failover(compose, orders, args)
    recovery(compose, killed, stock0, orders, args)
    if args.spare:
        replacement(compose, args.spare, stock0, orders, args)
    log(f"all {len(CHECKS)} checks passed in {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
