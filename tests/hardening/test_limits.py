"""Hostile input at the frontend: every answer is a JSON error with the right code, never HTML, never 500."""

from __future__ import annotations

import json

import pytest
import requests
from harness import Cluster
from rawhttp import RawReply, send


def json_error(r: requests.Response | RawReply, code: int) -> None:
    status = r.status_code if isinstance(r, requests.Response) else r.status
    headers = r.headers if isinstance(r, requests.Response) else r.headers
    body = r.content if isinstance(r, requests.Response) else r.body
    assert status == code, (status, body[:300])
    ctype = headers.get("Content-Type") or headers.get("content-type", "")
    assert ctype.startswith("application/json"), (ctype, body[:300])
    err = json.loads(body)["error"]
    assert err["code"] == code and isinstance(err["message"], str) and err["message"]


def test_numbers_out_of_range(hard_cluster: Cluster) -> None:
    url = hard_cluster.url
    for path in ("/lookup/99999999999999999999", "/lookup/0", "/lookup/-1", "/lookup/1.5", "/lookup/%C2%B2",
                 "/orders/99999999999999999999", "/orders/abc"):
        json_error(requests.get(url + path, timeout=10), 400)
    json_error(requests.get(url + "/lookup/999999999999999999", timeout=10), 404)  # 18 digits: fits, unknown
    auth = {"Authorization": f"Bearer {hard_cluster.admin_token()}"}
    for body in ({"stock_delta": 2**70}, {"stock_delta": -(2**70)}, {"cost": 1e308}, {"cost": -1},
                 {"stock_delta": True}, {"stock_delta": 1.5}, {"cost": "1"}, {}, {"other": 1}):
        json_error(requests.post(url + "/update/1", json=body, headers=auth, timeout=10), 400)
    for raw in (b'{"cost": NaN}', b'{"cost": Infinity}', b'{"stock_delta": 1e400}'):
        json_error(requests.post(url + "/update/1", data=raw, headers=auth, timeout=10), 400)


@pytest.mark.parametrize("quantity", [0, 1001, -1, True, 1.0, "1", None, 2**70, [1]])
def test_quantity_bounds(hard_cluster: Cluster, quantity: object) -> None:
    json_error(requests.post(hard_cluster.url + "/buy/1", json={"quantity": quantity}, timeout=10), 400)


def test_bodies(hard_cluster: Cluster) -> None:
    url = hard_cluster.url
    for raw in (b"[1]", b"not json", b'"x"', b"\xff\xfe\x00", b'{"quantity": "\xff"}', b"{" * 10_000):
        json_error(requests.post(url + "/buy/1", data=raw, timeout=10), 400)
    json_error(requests.post(url + "/buy/1", data=b" " * (64 * 1024 + 1), timeout=10), 413)
    json_error(requests.post(url + "/buy/1", json={"pad": "x" * (70 * 1024)}, timeout=10), 413)
    json_error(requests.get(url + "/buy/1", timeout=10), 405)


def test_idempotency_key_length(hard_cluster: Cluster) -> None:
    url = hard_cluster.url
    json_error(requests.post(url + "/buy/3", headers={"Idempotency-Key": "k" * 201}, timeout=10), 400)
    r = requests.post(url + "/buy/3", headers={"Idempotency-Key": "k" * 200}, timeout=10)
    assert r.status_code == 200, r.text


def test_url_limits(hard_cluster: Cluster) -> None:
    url = hard_cluster.url
    # Up to 8 KiB reaches the application: an ordinary answer (here: an empty search).
    r = requests.get(url + "/search/" + "a" * 8000, timeout=10)
    assert r.status_code == 200 and r.json()["items"] == []
    json_error(requests.get(url + "/search/" + "a" * 8300, timeout=10), 414)
    json_error(requests.get(url + "/lookup/1?" + "x=1&" * 50_000, timeout=10), 414)


def test_header_limits(hard_cluster: Cluster) -> None:
    url = hard_cluster.url
    r = requests.get(url + "/lookup/1", headers={"X-Pad": "p" * 15_000}, timeout=10)
    assert r.status_code == 200, r.text
    many = {f"X-Pad-{i}": "p" * 100 for i in range(150)}  # 150 headers, ~16 KiB: still ours to answer
    assert requests.get(url + "/lookup/1", headers=dict(list(many.items())[:120]), timeout=10).status_code == 200
    json_error(requests.get(url + "/lookup/1", headers={"X-Pad": "p" * 17_000}, timeout=10), 431)
    json_error(requests.get(url + "/lookup/1", headers=many, timeout=10), 431)
    # Beyond Gunicorn's own limit (32 KiB per field): Gunicorn answers, still in JSON.
    json_error(requests.get(url + "/lookup/1", headers={"X-Pad": "p" * 40_000}, timeout=10), 431)


def test_bytes_that_are_not_utf8(hard_cluster: Cluster) -> None:
    url = hard_cluster.url
    for path in (b"/lookup/\xff\xfe", b"/orders/1\xc3"):
        json_error(send(url, b"GET " + path + b" HTTP/1.1"), 400)
    for path in (b"/search/\xff\xfe", b"/search/%FF%FE", b"/search/caf\xc3\xa9"):
        r = send(url, b"GET " + path + b" HTTP/1.1")
        assert r.status == 200 and r.json()["items"] == [], r.body
    json_error(send(url, b"GET /nowhere/\xff HTTP/1.1"), 404)
    r = send(url, b"POST /buy/4 HTTP/1.1\r\nIdempotency-Key: \xff\xfe\xfd", b'{"quantity": 1}')
    assert r.status == 200 and r.json()["quantity"] == 1, r.body
    again = send(url, b"POST /buy/4 HTTP/1.1\r\nIdempotency-Key: \xff\xfe\xfd", b'{"quantity": 1}')
    assert again.json() == r.json()  # the same key, byte for byte: the same order
    r = send(url, b"POST /update/1 HTTP/1.1\r\nAuthorization: Bearer \xff\xfe", b'{"cost": 1}')
    json_error(r, 403)
    json_error(send(url, b"POST /buy/1 HTTP/1.1\r\nContent-Type: application/json", b'{"quantity": "\xff"}'), 400)


def test_malformed_http_gets_json_too(hard_cluster: Cluster) -> None:
    """Requests Gunicorn refuses before the app sees them: its answer is JSON as well."""
    url = hard_cluster.url
    for head in (b"GET /lookup/1 HTTP/1.1\r\nBad Header Name: x", b"GET /lookup/1 HTTP/1.1\r\nX-Nul: a\x00b",
                 b"GARBAGE", b"GET /lookup/1 HTTP/9.9"):
        r = send(url, head)
        assert 400 <= r.status < 500, (head, r.status, r.body)
        json_error(r, r.status)


def test_a_malformed_decrement_batch_is_refused_whole_and_changes_nothing(hard_cluster: Cluster) -> None:
    """The catalog's batch endpoint (the order leader's): every malformed batch is a 400 and takes
    no stock, even when some of its items are well formed."""
    c = hard_cluster
    auth = {"Authorization": f"Bearer {c.secret()}"}
    status = requests.get(c.url + "/status", timeout=5).json()["catalog"]
    lead = c.replica_url(status["leader"])
    before = requests.get(f"{lead}/books/1", headers=auth, timeout=5).json()
    good = {"item": 1, "quantity": 1, "key": "limits-good"}
    for body in ({}, {"items": []}, {"items": "x"}, {"items": [good] * 257}, {"items": [good, 1]},
                 {"items": [good, {"item": 1, "quantity": 0, "key": "k"}]},
                 {"items": [good, {"item": 1, "quantity": 1, "key": ""}]},
                 {"items": [good, {"item": "1", "quantity": 1, "key": "k"}]},
                 {"items": [good, {"item": 1, "quantity": 1}]},
                 {"items": [good, {"item": 1, "quantity": 1, "key": "k", "timeout_ms": -1}]},
                 {"items": [good, {"item": 1, "quantity": 1, "key": "k", "timeout_ms": True}]}):
        json_error(requests.post(f"{lead}/books/decrements", json=body, headers=auth, timeout=10), 400)
    after = requests.get(f"{lead}/books/1", headers=auth, timeout=5).json()
    assert (after["stock"], after["version"]) == (before["stock"], before["version"])


def test_a_decrement_whose_buy_ran_out_of_time_is_not_started(hard_cluster: Cluster) -> None:
    """Each item carries its buy's own time left (``timeout_ms``): one at 0 is answered 504 and takes
    no stock; the others in its batch go on as if it were not there."""
    c = hard_cluster
    auth = {"Authorization": f"Bearer {c.secret()}"}
    lead = c.replica_url(requests.get(c.url + "/status", timeout=5).json()["catalog"]["leader"])
    before = requests.get(f"{lead}/books/2", headers=auth, timeout=5).json()["stock"]
    body = {"items": [{"item": 2, "quantity": 1, "key": "limits-late", "timeout_ms": 0},
                      {"item": 2, "quantity": 1, "key": "limits-live", "timeout_ms": 5000}]}
    r = requests.post(f"{lead}/books/decrements", json=body, headers=auth, timeout=10)
    assert r.status_code == 200, r.text
    late, live = r.json()["results"]
    assert late["status"] == 504 and "time budget" in late["body"]["error"]["message"], late
    assert live["status"] == 200 and live["body"]["stock"] == before - 1, live
    assert requests.get(f"{lead}/books/2", headers=auth, timeout=5).json()["stock"] == before - 1
    body["items"] = body["items"][:1]  # alone: nothing proposed at all
    (again,) = requests.post(f"{lead}/books/decrements", json=body, headers=auth, timeout=10).json()["results"]
    assert again["status"] == 504
    assert requests.get(f"{lead}/books/2", headers=auth, timeout=5).json()["stock"] == before - 1
