"""Every row of the public API table (docs/api.md), success and error, on a real cluster."""

from __future__ import annotations

import json
import os
import socket
import time
from http.client import HTTPConnection
from typing import Any

import pytest
import requests
from harness import Cluster

from pygmy.client.api import PygmyError
from pygmy.frontend.app import create_app
from pygmy.kit.admission import Deferred


def err(resp: requests.Response, code: int) -> dict:
    assert resp.status_code == code, resp.text
    assert resp.headers["Content-Type"].startswith("application/json")
    body = resp.json()
    assert body["error"]["code"] == code and body["error"]["message"]
    return body


def test_search_topic_forms(cluster: Cluster) -> None:
    for topic in ("distributed systems", "distributed-systems", "Distributed%20Systems", "DISTRIBUTED-systems"):
        r = requests.get(f"{cluster.url}/search/{topic}", timeout=5)
        assert r.status_code == 200
        body = r.json()
        assert [i["item_number"] for i in body["items"]] == [1, 2]
        assert body["items"][1]["title"] == "RPCs for Dummies"
    grad = requests.get(f"{cluster.url}/search/graduate school", timeout=5).json()
    assert [i["item_number"] for i in grad["items"]] == [3, 4, 5, 6, 7]
    assert requests.get(f"{cluster.url}/search/knitting", timeout=5).json() == {"topic": "knitting", "items": []}


def test_search_pages_follow_their_cursor_to_the_end(cluster: Cluster) -> None:
    """``limit`` and the opaque ``next``: every book once, in order; no ``next`` on the last page;
    the default page holds a seven-book topic whole, so its answer has no ``next`` either."""
    url = f"{cluster.url}/search/graduate-school"
    assert "next" not in requests.get(url, timeout=5).json()
    pages, params = [], {"limit": "2"}
    while True:
        r = requests.get(url, params=params, timeout=5)
        assert r.status_code == 200, r.text
        body = r.json()
        pages.append([i["item_number"] for i in body["items"]])
        if "next" not in body:
            break
        params = {"limit": "2", "next": body["next"]}
        again = requests.get(url, params=params, timeout=5)  # a page is cached like any read
        assert again.status_code == 200
    assert pages == [[3, 4], [5, 6], [7]]
    # Cached like any read: each of the two workers fills it once, then hits.
    assert "hit" in {requests.get(url, params=params, timeout=5).headers["X-Cache"] for _ in range(10)}
    for bad in ({"limit": "0"}, {"limit": "1001"}, {"limit": "two"}, {"limit": "-1"},
                {"next": "not-a-cursor"}, {"next": ""}, {"next": "YWZ0ZXI6LTE"}):  # the last: "after:-1"
        err(requests.get(url, params=bad, timeout=5), 400)


def test_lookup(cluster: Cluster) -> None:
    book = requests.get(f"{cluster.url}/lookup/3", timeout=5).json()
    assert set(book) == {"item_number", "title", "topic", "stock", "cost"}
    assert book["title"] == "Xen and the Forgotten Art of Virtualization" and book["topic"] == "graduate school"
    for bad in ("abc", "-1", "0", "1.5", "99999999999999999999999"):
        err(requests.get(f"{cluster.url}/lookup/{bad}", timeout=5), 400)
    err(requests.get(f"{cluster.url}/lookup/424242", timeout=5), 404)


def test_a_hit_answered_before_flask_is_the_answer_flask_gives(cluster: Cluster) -> None:
    """Cached lookups are answered at the edge (``cached_lookup`` in frontend/app.py), misses by the
    Flask route: the same bytes and headers either way. A worker of a frontend that is not running
    here, built in this process, so that its cache starts empty and the first lookup misses."""
    app = create_app(cluster.cluster_config(), 2)
    try:
        deadline = time.monotonic() + 10
        while not app.extensions["pygmy_subscription"].valid() and time.monotonic() < deadline:
            time.sleep(0.05)
        client = app.test_client()
        miss, hit = client.get("/lookup/4"), client.get("/lookup/4")
        assert (miss.status_code, hit.status_code) == (200, 200)
        assert miss.headers["X-Cache"] == "miss" and hit.headers["X-Cache"] == "hit"
        assert hit.data == miss.data and hit.json["item_number"] == 4
        assert hit.headers["X-Served-By"] == f"frontend-2/{os.getpid()}"

        def steady(resp: Any) -> dict[str, str]:
            return {k: v for k, v in resp.headers.items() if k not in ("X-Cache", "X-Served-By", "X-Request-Id")}

        assert steady(hit) == steady(miss)
        # Not for the edge: other methods, malformed and unknown numbers get the route's answers.
        assert client.head("/lookup/4").status_code == 200
        for bad, code in (("0", 400), ("00", 400), ("4x", 400), ("1" * 19, 400), ("424242", 404)):
            assert client.get(f"/lookup/{bad}").status_code == code, bad
        # Search pages likewise, with their cursors; a query the edge does not read goes to the route.
        first = "/search/distributed%20systems?limit=1"
        miss, hit = client.get(first), client.get(first)
        assert miss.headers["X-Cache"] == "miss" and hit.headers["X-Cache"] == "hit"
        assert hit.data == miss.data and steady(hit) == steady(miss) and hit.json["next"]
        assert client.get(first + "&x=1").data == hit.data  # a query the edge leaves to the route
        page2 = f"/search/distributed%20systems?next={hit.json['next']}&limit=1"
        miss, hit = client.get(page2), client.get(page2)
        assert hit.headers["X-Cache"] == "hit" and hit.data == miss.data and hit.json["items"] != []
        for bad in ("?limit=0", "?limit=1001", "?limit=a", "?next=zz", "?limit=1&limit=2"):
            got = client.get("/search/distributed%20systems" + bad)
            assert got.status_code == (200 if bad == "?limit=1&limit=2" else 400), bad
    finally:
        app.extensions["pygmy_subscription"].stop()


def test_cache_misses_go_to_the_catalog_leader_once_a_replica_has_named_it(cluster: Cluster) -> None:
    """``--read-from leader`` (the default): a worker never writes to the catalog, so it learns the
    leader from its replicas' answers; after the first miss, misses are served by the leader (one
    request, where a follower must ask the leader for the read index)."""
    app = create_app(cluster.cluster_config(), 2)
    try:
        client = app.test_client()
        leader = requests.get(f"{cluster.url}/status", timeout=5).json()["catalog"]["leader"]
        served = [client.get(f"/lookup/{n}").headers["X-Served-By"].split("@")[0] for n in range(1, 8)]
        assert served[1:] == [leader] * 6, served
    finally:
        app.extensions["pygmy_subscription"].stop()


def test_a_hit_is_answered_by_the_workers_event_loop_as_flask_would(cluster: Cluster) -> None:
    """Under Gunicorn a hit is answered before a pool thread takes the request (pygmy/cluster/worker.py):
    the same body, cache headers and request id, on a connection kept for the next request."""
    host, port = cluster.url.removeprefix("http://").split(":")
    conn = HTTPConnection(host, int(port), timeout=5)
    try:
        answers, sock = [], None
        for n in range(6):  # one connection, so one worker: its cache fills on the first miss
            conn.request("GET", "/lookup/5", headers={"X-Request-Id": f"early-{n}"})
            r = conn.getresponse()
            answers.append((r.status, dict(r.getheaders()), r.read()))
            sock = sock or conn.sock
            assert conn.sock is sock, "the connection was not kept"
        hits = [a for a in answers if a[1]["X-Cache"] == "hit"]
        assert hits, "no lookup hit the worker's cache"
        for n, (status, headers, body) in enumerate(answers):
            assert status == 200 and headers["X-Request-Id"] == f"early-{n}"
            assert json.loads(body) == json.loads(answers[0][2]) and json.loads(body)["item_number"] == 5
            assert headers["Content-Type"] == "application/json" and headers["Date"]
        # Gunicorn names itself on what its pool threads answer; the event loop's hits are ours alone.
        assert all("Server" not in h for _, h, _ in hits), "hits went through a pool thread"
        assert all(h["Server"].startswith("gunicorn") for _, h, _ in answers if h["X-Cache"] == "miss")
        assert hits[-1][2] == answers[-1][2]
        # A search page too, its topic percent-encoded in the request line.
        for _ in range(3):
            conn.request("GET", "/search/distributed%20systems?limit=2")
            r = conn.getresponse()
            page = (r.status, dict(r.getheaders()), r.read())
        assert page[0] == 200 and page[1]["X-Cache"] == "hit" and "Server" not in page[1]
        assert json.loads(page[2])["topic"] == "distributed systems" and len(json.loads(page[2])["items"]) == 2
    finally:
        conn.close()


def test_answers_to_a_client_that_closes_each_connection_say_so(cluster: Cluster) -> None:
    """A hit or a buy answered by the event loop to ``Connection: close`` says ``Connection: close``:
    without it a pooled client took the connection for kept alive, sent its next request into the
    close and got a reset (1 request in 50 failed so)."""
    with requests.Session() as session:
        session.headers["Connection"] = "close"
        answers = [session.get(f"{cluster.url}/lookup/{1 + n % 3}", timeout=5) for n in range(150)]
        # No body: the request goes out in one segment, whole, so the event loop takes the buy
        # (``json={}`` sends the body in a second one, which leaves the buy to a pool thread).
        answers += [session.post(f"{cluster.url}/buy/{1 + n % 3}", timeout=5) for n in range(30)]
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200][:3]
    assert all(r.headers.get("Connection") == "close" for r in answers)
    # Gunicorn names itself on what its pool threads answer (and always said close): the event
    # loop's answers are the ones this is about.
    assert any(r.headers["X-Cache"] == "hit" and "Server" not in r.headers for r in answers[:150]), \
        "no lookup hit was answered by the event loop"
    assert any("Server" not in r.headers for r in answers[150:]), "no buy was answered by the event loop"


def parse_answer(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k: v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    assert int(headers["Content-Length"]) == len(body)
    return int(lines[0].split()[1]), headers, body


def test_a_buy_taken_by_the_event_loop_is_answered_as_flask_would(cluster: Cluster) -> None:
    """A plain buy is taken without Flask (``early_buy`` in frontend/app.py, through
    ``Admission.early``) and answered when its batch returns: the route's status, body and error
    headers, for a new order, its key's repeat and an unknown book; anything the route would read
    differently is left to it. A worker built in this process, of a frontend not running here."""
    app = create_app(cluster.cluster_config(), 2)
    admission = app.wsgi_app
    try:
        client = app.test_client()

        def early(path: str, body: bytes = b"", **headers: str) -> tuple[int, dict[str, str], bytes] | None:
            raw = {k.lower().replace("_", "-").encode(): v.encode() for k, v in headers.items()}
            answer = admission.early("POST", path, raw, body)
            if answer is None:
                return None
            assert isinstance(answer, Deferred)
            got: list[bytes] = []
            answer.start(got.append)
            deadline = time.monotonic() + 10
            while not got:
                assert time.monotonic() < deadline, "a deferred buy was never answered"
                time.sleep(0.01)
            assert admission.gates["write"].in_flight == 0, "a delivered buy kept its place"
            return parse_answer(got[0])

        key = f"early-{time.time()}"
        status, headers, body = early("/buy/3", b'{"quantity": 2}', idempotency_key=key, x_request_id="buy-1")
        assert status == 200 and headers["X-Request-Id"] == "buy-1" and "Server" not in headers
        order = json.loads(body)
        assert order["item_number"] == 3 and order["quantity"] == 2
        again = client.post("/buy/3", json={"quantity": 2}, headers={"Idempotency-Key": key})
        assert again.status_code == 200 and again.data == body, "the route's answer to the same key differs"
        assert headers["Content-Type"] == again.headers["Content-Type"]
        again.close()  # gives back its place, as Gunicorn does once the body is sent
        for answer in (early("/buy/3", b"", idempotency_key=key + "x"), early("/buy/3"),  # default quantity
                       early("/buy/3", b"", x_request_timeout_ms="5000")):
            assert answer is not None and answer[0] == 200 and json.loads(answer[2])["quantity"] == 1
        missing = early("/buy/424242", b"{}", idempotency_key=key + "-404")
        route = client.post("/buy/424242", json={}, headers={"Idempotency-Key": key + "-404b"})
        assert missing is not None and missing[0] == route.status_code == 404
        assert missing[2] == route.data
        route.close()
        # What the route refuses or reads otherwise is its own to answer.
        for path, body, hdrs in (("/buy/0", b"", {}), ("/buy/x", b"", {}), ("/buy/" + "1" * 19, b"", {}),
                                 ("/buy/3", b"[1]", {}), ("/buy/3", b"{", {}), ("/buy/3", b"\n", {}),
                                 ("/buy/3", b"  ", {}), ("/buy/3", b'{"quantity": 0}', {}),
                                 ("/buy/3", b'{"quantity": true}', {}), ("/buy/3", b'{"quantity": "2"}', {}),
                                 ("/buy/3", b"", {"idempotency_key": "k" * 201}), ("/buy/3", b"", {"idempotency_key": ""}),
                                 ("/update/3", b"{}", {})):
            assert early(path, body, **hdrs) is None, (path, body, hdrs)
        # A body of whitespace is not an empty body: it is not JSON either, and buys nothing
        # (schemathesis once bought a book with ``-d $'\n'``).
        for blank in (b"\n", b"  "):
            refused = client.post("/buy/3", data=blank, content_type="application/json")
            assert refused.status_code == 400 and refused.json["error"]["message"] == "body is not valid JSON"
            refused.close()
        assert admission.gates["write"].in_flight == 0
    finally:
        app.extensions["pygmy_subscription"].stop()
        app.extensions["pygmy_buys"].stop()


def test_a_buy_is_answered_by_the_workers_event_loop_on_a_kept_connection(cluster: Cluster) -> None:
    """Under Gunicorn, a buy that arrives whole is taken by the event loop and answered by the
    thread its batch returns on (pygmy/cluster/worker.py): no pool thread, so no ``Server`` header; the
    connection is kept for the next request, which may be another buy or a read."""
    host, port = cluster.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        orders = []
        for n in range(3):
            body = b'{"quantity": 1}'
            sock.sendall(f"POST /buy/2 HTTP/1.1\r\nHost: t\r\nIdempotency-Key: loop-{time.time()}-{n}\r\n"
                         f"X-Request-Id: loop-{n}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            data = b""
            while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
                    data.partition(b"Content-Length: ")[2].split(b"\r\n")[0] or b"0"):
                chunk = sock.recv(4096)
                assert chunk, "the connection closed"
                data += chunk
            status, headers, answer = parse_answer(data)
            assert status == 200 and headers["X-Request-Id"] == f"loop-{n}", data
            assert "Server" not in headers, "the buy went through a pool thread"
            orders.append(json.loads(answer)["order_number"])
        assert len(set(orders)) == 3
        sock.sendall(b"GET /orders/%d HTTP/1.1\r\nHost: t\r\n\r\n" % orders[-1])
        data = b""
        while b"order_number" not in data:
            chunk = sock.recv(4096)
            assert chunk
            data += chunk
        assert parse_answer(data)[0] == 200


def test_buy_and_order(cluster: Cluster) -> None:
    with cluster.client() as c:
        before = c.lookup(6)["stock"]
        order = c.buy(6, quantity=2)
        assert set(order) == {"order_number", "item_number", "title", "quantity", "cost", "total"}
        assert order["item_number"] == 6 and order["quantity"] == 2 and order["total"] == 2 * order["cost"]
        assert c.lookup(6)["stock"] == before - 2
        got = c.order(order["order_number"])
        assert {k: got[k] for k in order} == order and got["created_at"]
        default_qty = c.buy(6)
        assert default_qty["quantity"] == 1 and default_qty["order_number"] > order["order_number"]


def test_buy_errors_change_nothing(cluster: Cluster) -> None:
    url = cluster.url
    with cluster.client() as c:
        before = c.lookup(7)["stock"]
    for body in ({"quantity": 0}, {"quantity": 1001}, {"quantity": 1.0}, {"quantity": True}, {"quantity": "2"},
                 [1], "x"):
        err(requests.post(f"{url}/buy/7", json=body, timeout=5), 400)
    err(requests.post(f"{url}/buy/7", data=b"{not json", timeout=5), 400)
    err(requests.post(f"{url}/buy/7", headers={"Idempotency-Key": "k" * 201}, timeout=5), 400)
    err(requests.post(f"{url}/buy/abc", timeout=5), 400)
    err(requests.post(f"{url}/buy/424242", timeout=5), 404)
    err(requests.get(f"{url}/buy/7", timeout=5), 405)
    err(requests.post(f"{url}/buy/7", data=b"x" * (65 * 1024), timeout=5), 413)
    with cluster.client() as c:
        assert c.lookup(7)["stock"] == before
        if before >= 1000:  # make "more than the stock" expressible as a quantity (at most 1000)
            c.update(7, stock_delta=999 - before)
        try:
            err(requests.post(f"{url}/buy/7", json={"quantity": 1000}, timeout=5), 409)
            assert c.lookup(7)["stock"] == min(before, 999), "a refused buy changed the stock"
        finally:
            c.update(7, stock_delta=before - c.lookup(7)["stock"])


def test_out_of_stock_is_409(cluster: Cluster) -> None:
    with cluster.client() as c:
        stock = c.lookup(4)["stock"]
        c.update(4, stock_delta=-stock)
        try:
            c.buy(4)
            raise AssertionError("bought a book with no stock")
        except PygmyError as e:
            assert e.status == 409
        assert c.lookup(4)["stock"] == 0
        c.update(4, stock_delta=stock)


def test_orders_errors(cluster: Cluster) -> None:
    err(requests.get(f"{cluster.url}/orders/xyz", timeout=5), 400)
    err(requests.get(f"{cluster.url}/orders/987654", timeout=5), 404)


def test_update(cluster: Cluster) -> None:
    auth = {"Authorization": f"Bearer {cluster.admin_token()}"}
    url = cluster.url
    before = requests.get(f"{url}/lookup/1", timeout=5).json()
    r = requests.post(f"{url}/update/1", json={"stock_delta": 5, "cost": 21.5}, headers=auth, timeout=5)
    assert r.status_code == 200, r.text
    assert r.json()["stock"] == before["stock"] + 5 and r.json()["cost"] == 21.5
    assert requests.get(f"{url}/lookup/1", timeout=5).json()["cost"] == 21.5
    err(requests.post(f"{url}/update/1", json={"stock_delta": 1}, timeout=5), 401)
    err(requests.post(f"{url}/update/1", json={"stock_delta": 1}, headers={"Authorization": "Bearer nope"},
                      timeout=5), 403)
    for body in ({}, {"stock_delta": 1.5}, {"cost": -1}, {"cost": "3"}, {"stock_delta": True}):
        err(requests.post(f"{url}/update/1", json=body, headers=auth, timeout=5), 400)
    err(requests.post(f"{url}/update/424242", json={"cost": 1}, headers=auth, timeout=5), 404)
    err(requests.post(f"{url}/update/1", json={"stock_delta": -10**8}, headers=auth, timeout=5), 409)
    after = requests.get(f"{url}/lookup/1", timeout=5).json()
    assert after["stock"] == before["stock"] + 5


def test_health_status_and_unknown_routes(cluster: Cluster) -> None:
    assert requests.get(f"{cluster.url}/health", timeout=5).status_code == 200
    st = requests.get(f"{cluster.url}/status", timeout=5).json()
    assert st["frontend"]["name"] == "frontend-1" and "cache" in st["frontend"]
    for tier in ("catalog", "order"):
        assert st[tier]["leader"] == f"{tier}-1" or st[tier]["leader"].startswith(tier)
        assert len(st[tier]["replicas"]) == 3
        for r in st[tier]["replicas"]:
            assert {"name", "url", "role", "term", "leader", "commit_index", "applied_index",
                    "state_digest", "alive"} <= set(r)
    assert st["age_ms"] >= 0
    err(requests.get(f"{cluster.url}/no/such/route", timeout=5), 404)


def _flood(cluster: Cluster, path: str, requests_: int, route: str, replicas: list[str]) -> tuple[float, float]:
    """``requests_`` GETs of ``path`` from 16 threads, all answered 200: how many times the
    ``replicas`` served ``route`` meanwhile (their ``/metrics``), and how long the flood took."""
    from concurrent.futures import ThreadPoolExecutor

    def served() -> float:
        total = 0.0
        for name in replicas:
            text = cluster.replica_get(name, "/metrics").text
            total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("pygmy_http_requests_total") and f'route="{route}"' in line)
        return total

    before, started = served(), time.monotonic()
    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(lambda _: requests.get(f"{cluster.url}{path}", timeout=5).status_code, range(requests_)))
    took = time.monotonic() - started
    assert answers == [200] * requests_
    return served() - before, took


def test_many_status_pollers_cost_the_replicas_a_bounded_number_of_rounds(cluster: Cluster) -> None:
    """Each worker asks the replicas at most once per 0.25 s however many call /status (StatusView)."""
    asked, took = _flood(cluster, "/status", 60, "/status", ["catalog-1"])
    assert asked <= cluster.config()["frontend_workers"] * (took / 0.25 + 1)


@pytest.mark.parametrize("probe", ["/readyz", "/health"])
def test_a_flood_of_probes_costs_the_replicas_a_bounded_number_of_rounds(cluster: Cluster, probe: str) -> None:
    """Anyone may ask a frontend's probes, as often as they like: each worker asks the tiers at most
    once per ``PROBE_AGE`` s, so a flood cannot queue behind its probe threads and hold every
    Gunicorn thread until kubelet's own probes time out."""
    from pygmy.frontend.app import PROBE_AGE

    asked, took = _flood(cluster, probe, 80, probe, list(cluster.cluster_config().peers("catalog")))
    # A round asks the last leader first, and the others only if it does not answer as one.
    assert asked <= 3 * cluster.config()["frontend_workers"] * (took / PROBE_AGE + 1), (asked, took)


def test_idempotent_retry(cluster: Cluster) -> None:
    with cluster.client() as c:
        before = c.lookup(5)["stock"]
        first = c.buy(5, quantity=3, key="retry-me")
        again = c.buy(5, quantity=3, key="retry-me")
        assert first == again
        assert c.lookup(5)["stock"] == before - 3


def test_internal_endpoints_need_the_secret(cluster: Cluster) -> None:
    for name, path in (("catalog-1", "/books/1"), ("order-1", "/orders/1")):
        r = requests.get(cluster.replica_url(name) + path, timeout=5)
        err(r, 401)
    r = requests.post(cluster.replica_url("catalog-1") + "/books/1/decrement", json={"quantity": 1, "key": "x"},
                      timeout=5)
    err(r, 401)


def test_update_retried_with_a_key_applies_once(cluster: Cluster) -> None:
    auth = {"Authorization": f"Bearer {cluster.admin_token()}", "Idempotency-Key": "restock-42"}
    before = requests.get(f"{cluster.url}/lookup/6", timeout=5).json()["stock"]
    for _ in range(2):
        r = requests.post(f"{cluster.url}/update/6", json={"stock_delta": 10}, headers=auth, timeout=5)
        assert r.status_code == 200 and r.json()["stock"] == before + 10
    assert requests.get(f"{cluster.url}/lookup/6", timeout=5).json()["stock"] == before + 10
