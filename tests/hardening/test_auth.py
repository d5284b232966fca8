"""Internal and admin endpoints refuse requests without their credential (401) or with a wrong one
(403), with the JSON error body, and change nothing; the admin token and the internal secret are
separate, so the admin token opens no internal endpoint; raft messages from outside the membership
are ignored."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import requests
from harness import Cluster, free_port_base, pygmy

from pygmy.replication.transport import encode, raft_address, read_frame

NAMES = [f"{t}-{k}" for t in ("catalog", "order") for k in (1, 2, 3)]


def snapshot(c: Cluster) -> dict[str, tuple[int, str]]:
    """Each replica's term and state digest (business rows only: a real election changes neither much)."""
    out = {}
    for name in NAMES:
        st = c.replica_get(name, "/status").json()
        out[name] = (st["term"], st["state_digest"])
    return out


def unchanged(before: dict[str, tuple[int, str]], after: dict[str, tuple[int, str]]) -> None:
    """Same business state everywhere; terms moved by no forged jump (a real election adds one or two)."""
    for name, (term, digest) in before.items():
        assert after[name][1] == digest, f"{name}: state changed"
        # A forged message would add 100 or a million; a few real elections add a handful.
        assert term <= after[name][0] < term + 10, f"{name}: term {term} -> {after[name][0]}"


def settled(c: Cluster, timeout: float = 10) -> None:
    """Wait until every replica has applied all its leader has committed now. Handlers propose before
    they answer, so anything a refused call had wrongly let through is in the leader's log by now."""
    for tier in ("catalog", "order"):
        target = c.replica_get(leader(c, tier), "/status").json()["commit_index"]
        deadline = time.monotonic() + timeout
        for name in (n for n in NAMES if n.startswith(tier)):
            while c.replica_get(name, "/status").json()["applied_index"] < target:
                assert time.monotonic() < deadline, f"{name} did not apply up to {target}"
                time.sleep(0.05)


def leader(c: Cluster, tier: str) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        st = requests.get(c.url + "/status", timeout=5).json()[tier]
        if st["leader"]:
            return str(st["leader"])
        time.sleep(0.1)
    raise AssertionError(f"no {tier} leader")


def test_guarded_endpoints_refuse_and_change_nothing(hard_cluster: Cluster) -> None:
    c = hard_cluster
    cat, order = c.replica_url(leader(c, "catalog")), c.replica_url(leader(c, "order"))
    calls: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", cat + "/books/1", None),
        ("GET", cat + "/books?topic=distributed%20systems", None),
        ("POST", cat + "/books/1/decrement", {"quantity": 5, "key": "intruder"}),
        ("POST", cat + "/books/decrements", {"items": [{"item": 1, "quantity": 5, "key": "intruder"}]}),
        ("POST", cat + "/books/1/update", {"stock_delta": -5, "cost": 0}),
        ("POST", cat + "/keys/expire", {"before": 10**9}),
        ("POST", order + "/buy", {"item": 1, "quantity": 5, "key": "intruder"}),
        ("POST", order + "/buys", {"items": [{"item": 1, "quantity": 5, "key": "intruder"}]}),
        ("GET", order + "/orders/1", None),
        ("POST", c.url + "/update/1", {"stock_delta": -5, "cost": 0}),
    ]
    before = snapshot(c)
    for method, url, body in calls:
        for headers, code in (({}, 401), ({"Authorization": "Bearer wrong"}, 403),
                              ({"Authorization": "Basic Zm9vOmJhcg=="}, 403), ({"Authorization": ""}, 401)):
            r = requests.request(method, url, json=body, headers=headers, timeout=5)
            assert r.status_code == code, (method, url, headers, r.status_code, r.text)
            assert r.headers["Content-Type"].startswith("application/json")
            assert r.json()["error"]["code"] == code
    settled(c)  # anything wrongly accepted is applied everywhere by now
    unchanged(before, snapshot(c))
    assert requests.get(c.url + "/lookup/1", timeout=5).json()["cost"] > 0


def say(address: tuple[str, int], greeting: dict[str, Any], *frames: Any) -> Any:
    """Say ``greeting`` to a frame listener, send ``frames``; its first answer, or None."""
    with socket.create_connection(address, timeout=5) as s:
        s.sendall(encode(greeting) + b"".join(encode(f) for f in frames))
        return read_frame(s.makefile("rb"))


def hello(c: Cluster, name: str, greeting: dict[str, Any], *frames: Any) -> Any:
    """Say ``greeting`` on the replica's peer transport, send ``frames``; its first answer, or None."""
    return say(raft_address(c.replica_url(name)), greeting, *frames)


def test_the_peer_transport_refuses_without_the_secret_or_membership(hard_cluster: Cluster) -> None:
    c = hard_cluster
    before = snapshot(c)
    for name in NAMES:
        tier = name.split("-")[0]
        vote = {"type": "vote", "src": f"{tier}-9", "dst": name, "term": 10**6, "index": 10**9, "log_term": 10**6}
        for greeting, why in (({"hello": f"{tier}-1", "channel": "raft"}, "wrong internal secret"),
                              ({"hello": f"{tier}-1", "secret": "wrong", "channel": "raft"}, "wrong internal secret"),
                              ({"hello": f"{tier}-9", "secret": c.secret(), "channel": "raft"}, "not a member"),
                              ({"hello": name, "secret": c.secret(), "channel": "raft"}, "not a member")):  # itself
            answer = hello(c, name, greeting, {"messages": [{**vote, "src": greeting["hello"]}]})
            assert answer["error"]["code"] == 403 and why in answer["error"]["message"], (name, greeting, answer)
    settled(c)
    unchanged(before, snapshot(c))


def test_raft_messages_not_from_the_connected_member_are_ignored(hard_cluster: Cluster) -> None:
    c = hard_cluster
    before = snapshot(c)
    for name in NAMES:
        tier = name.split("-")[0]
        member = next(n for n in NAMES if n.startswith(tier) and n != name)
        forged = [
            # A vote request with a huge term from a name outside the membership would depose the leader.
            {"type": "vote", "src": f"{tier}-9", "dst": name, "term": before[name][0] + 100,
             "index": 10**9, "log_term": before[name][0] + 100},
            {"type": "append", "src": "intruder", "dst": name, "term": before[name][0] + 100, "index": 10**9,
             "log_term": 1, "commit": 10**9, "entries": []},
            # Addressed to someone else, or claiming to come from the receiver itself.
            {"type": "vote", "src": name, "dst": name, "term": before[name][0] + 100, "index": 0, "log_term": 0},
            {"type": "vote", "src": member, "dst": member, "term": before[name][0] + 100, "index": 0, "log_term": 0},
        ]
        assert hello(c, name, {"hello": member, "secret": c.secret(), "channel": "raft"}, {"messages": forged}) == {"ok": True}
    settled(c)
    unchanged(before, snapshot(c))


def test_lease_renewals_need_the_secret_and_a_well_formed_request(hard_cluster: Cluster) -> None:
    """The subscribe channel (frontend workers' cache leases) is open to any name with the secret,
    for a subscription under that name (``tests/catalog/test_app.py``), refuses everyone without it,
    answers 400 to a malformed request and 421 (naming the leader) off the leader."""
    c = hard_cluster
    lead = leader(c, "catalog")
    follower = next(n for n in NAMES if n.startswith("catalog") and n != lead)
    refused = hello(c, lead, {"hello": "x", "secret": "wrong", "channel": "subscribe"}, {"id": "i", "url": "tcp://a:1"})
    assert refused["error"]["code"] == 403
    with socket.create_connection(raft_address(c.replica_url(lead)), timeout=5) as s:
        stream = s.makefile("rb")
        s.sendall(encode({"hello": "probe", "secret": c.secret(), "channel": "subscribe"}))
        assert read_frame(stream) == {"ok": True}
        for bad in ({"id": "probe/1"}, {"id": "probe/1", "url": "http://127.0.0.1:9"}, [1, 2],
                    *({"id": "probe/1", "url": "tcp://127.0.0.1:9", "rtt": rtt} for rtt in (-1, 61, "1", True, None))):
            s.sendall(encode(bad))
            assert read_frame(stream)["status"] == 400, bad
    with socket.create_connection(raft_address(c.replica_url(follower)), timeout=5) as s:
        stream = s.makefile("rb")
        s.sendall(encode({"hello": "probe", "secret": c.secret(), "channel": "subscribe"}))
        assert read_frame(stream) == {"ok": True}
        s.sendall(encode({"id": "probe/1", "url": "tcp://127.0.0.1:9"}))
        answer = read_frame(stream)
        assert answer["status"] == 421 and answer["body"]["error"]["leader"] == lead


def test_buys_and_decrements_as_frames_answer_as_their_http_routes(hard_cluster: Cluster) -> None:
    """The buys channel of the order replicas and the decrements channel of the catalog replicas
    (what the frontend and the order leader send instead of ``POST /buys`` and ``POST
    /books/decrements``): a malformed request gets 400 and changes nothing, a follower answers 421
    naming its leader, and a well-formed one is answered like the HTTP route."""
    c = hard_cluster
    before = snapshot(c)
    for tier, channel in (("order", "buys"), ("catalog", "decrements")):
        lead = leader(c, tier)
        follower = next(n for n in NAMES if n.startswith(tier) and n != lead)
        with socket.create_connection(raft_address(c.replica_url(lead)), timeout=5) as s:
            stream = s.makefile("rb")
            s.sendall(encode({"hello": "probe", "secret": c.secret(), "channel": channel}))
            assert read_frame(stream) == {"ok": True}
            for bad in ([1], {"items": []}, {"body": {"items": []}}, {"body": {"items": [{"item": 0}]}},
                        {"body": {"items": [{"item": 1, "quantity": 1}]}, "timeout_ms": 2000},
                        {"body": {"items": "all"}}, {"body": {"items": [{"item": 1, "quantity": 1, "key": 5}]}}):
                s.sendall(encode(bad))
                answer = read_frame(stream)
                assert answer["status"] == 400 and answer["body"]["error"]["code"] == 400, (channel, bad, answer)
        with socket.create_connection(raft_address(c.replica_url(follower)), timeout=5) as s:
            stream = s.makefile("rb")
            s.sendall(encode({"hello": "probe", "secret": c.secret(), "channel": channel}))
            assert read_frame(stream) == {"ok": True}
            s.sendall(encode({"body": {"items": [{"item": 1, "quantity": 1, "key": "probe-follower"}]}}))
            answer = read_frame(stream)
            assert answer["status"] == 421 and answer["body"]["error"]["leader"] == lead, answer
    settled(c)
    unchanged(before, snapshot(c))
    # A well-formed buy through the channel is a buy: an order, whose number a lookup by key repeats.
    with socket.create_connection(raft_address(c.replica_url(leader(c, "order"))), timeout=5) as s:
        stream = s.makefile("rb")
        s.sendall(encode({"hello": "probe", "secret": c.secret(), "channel": "buys"}))
        assert read_frame(stream) == {"ok": True}
        answers = []
        for _ in range(2):
            s.sendall(encode({"body": {"items": [{"item": 2, "quantity": 1, "key": "k:frame-probe"}]},
                              "timeout_ms": 5000, "request_id": "frame-probe-1"}))
            answers.append(read_frame(stream))
    assert answers[0]["status"] == 200 and answers[0] == answers[1], answers
    (result,) = answers[0]["body"]["results"]
    assert result["status"] == 200 and result["body"]["item_number"] == 2, result
    order = requests.get(f"{c.url}/orders/{result['body']['order_number']}", timeout=5).json()
    assert order["order_number"] == result["body"]["order_number"]


def listeners(c: Cluster, frontend: str = "frontend-1") -> list[tuple[str, int]]:
    """The addresses of the cache-push listeners of a frontend's workers: the TCP ports its processes
    listen on (from ``/proc``), less the frontend's own HTTP port."""
    pgid = int((c.data_dir / "run" / f"{frontend}.pid").read_text())
    inodes = set()
    for entry in os.listdir("/proc"):
        try:
            if not entry.isdigit() or int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for fd in os.listdir(f"/proc/{entry}/fd"):
                link = os.readlink(f"/proc/{entry}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except (FileNotFoundError, ProcessLookupError):
            continue
    own = int(c.url.rsplit(":", 1)[1])
    ports = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        port = int(f[1].split(":")[1], 16)
        if f[3] == "0A" and f[9] in inodes and port != own:  # 0A: LISTEN
            ports.add(port)
    return [("127.0.0.1", p) for p in sorted(ports)]


def test_the_admin_token_opens_no_internal_endpoint(hard_cluster: Cluster) -> None:
    """Whoever holds the admin token can update books at the frontend, and nothing else: every
    internal endpoint (the peer transport of every replica and its lease channel, read index, replica
    reads and writes, the digest check, a backup's copy, a frontend worker's cache-push listener) refuses it with 403
    and nothing changes."""
    c = hard_cluster
    token = c.admin_token()
    admin = {"Authorization": f"Bearer {token}"}
    assert token != c.secret()
    cat, order = c.replica_url(leader(c, "catalog")), c.replica_url(leader(c, "order"))
    calls: list[tuple[str, str, dict[str, Any] | None]] = [
        *[("GET", c.replica_url(n) + "/raft/read_index", None) for n in NAMES],
        *[("GET", c.replica_url(n) + "/verify", None) for n in NAMES],
        *[("GET", c.replica_url(n) + "/backup", None) for n in NAMES],  # a copy of the whole state
        ("GET", cat + "/books/1", None),
        ("GET", cat + "/books?topic=distributed%20systems", None),
        ("POST", cat + "/books/1/decrement", {"quantity": 5, "key": "intruder"}),
        ("POST", cat + "/books/decrements", {"items": [{"item": 1, "quantity": 5, "key": "intruder"}]}),
        ("POST", cat + "/books/1/update", {"stock_delta": -5, "cost": 0}),
        ("POST", cat + "/keys/expire", {"before": 10**9}),
        ("POST", order + "/buy", {"item": 1, "quantity": 5, "key": "intruder"}),
        ("POST", order + "/buys", {"items": [{"item": 1, "quantity": 5, "key": "intruder"}]}),
        ("GET", order + "/orders/1", None),
    ]
    workers = listeners(c)
    assert len(workers) == c.config()["frontend_workers"], workers
    before = snapshot(c)
    for method, url, body in calls:
        r = requests.request(method, url, json=body, headers=admin, timeout=5)
        assert r.status_code == 403, (method, url, r.status_code, r.text)
        assert r.json()["error"] == {"code": 403, "message": "wrong internal secret"}
    for name in NAMES:  # a member's name and a vote that would depose the leader, with the admin token
        tier = name.split("-")[0]
        member = next(n for n in NAMES if n.startswith(tier) and n != name)
        vote = {"type": "vote", "src": member, "dst": name, "term": 10**6, "index": 10**9, "log_term": 10**6}
        answer = hello(c, name, {"hello": member, "secret": token, "channel": "raft"}, {"messages": [vote]})
        assert answer["error"]["code"] == 403, (name, answer)
        answer = hello(c, name, {"hello": "frontend-1/1", "secret": token, "channel": "subscribe"},
                       {"id": "intruder", "url": "tcp://127.0.0.1:9"})
        assert answer["error"]["code"] == 403, (name, answer)
        # The frame forms of /buys and /books/decrements (a frontend worker's buys, an order leader's
        # decrements): refused at the hello, whatever the channel.
        channel, items = (("buys", [{"item": 1, "quantity": 5, "key": "intruder"}]) if tier == "order" else
                          ("decrements", [{"item": 1, "quantity": 5, "key": "intruder", "at": 0}]))
        answer = hello(c, name, {"hello": "frontend-1/1", "secret": token, "channel": channel},
                       {"body": {"items": items}, "timeout_ms": 2000})
        assert answer["error"]["code"] == 403, (name, answer)
    for w in workers:
        answer = say(w, {"hello": "catalog-1", "secret": token, "channel": "push"}, {"holds": [[1, ["book:1"]]]})
        assert answer["error"]["code"] == 403, (w, answer)
    settled(c)
    unchanged(before, snapshot(c))
    # The listeners are the real ones: the internal secret gets through (an empty push changes nothing).
    for w in workers:
        assert say(w, {"hello": "catalog-1", "secret": c.secret(), "channel": "push"}) == {"ok": True}
    # And the other way round: the internal secret is no admin token; the admin token is.
    r = requests.post(c.url + "/update/1", json={"cost": 1}, headers={"Authorization": f"Bearer {c.secret()}"},
                      timeout=5)
    assert r.status_code == 403 and r.json()["error"]["message"] == "wrong admin token", r.text
    cost = requests.get(c.url + "/lookup/1", timeout=5).json()["cost"]
    r = requests.post(c.url + "/update/1", json={"cost": cost}, headers=admin, timeout=10)
    assert r.status_code == 200 and r.json()["cost"] == cost, r.text


def test_the_admin_token_must_differ_from_the_internal_secret(tmp_path: Path) -> None:
    same = {"PYGMY_SECRET": "one-value-for-both", "PYGMY_ADMIN_TOKEN": "one-value-for-both"}
    base = str(free_port_base())
    for cmd in (["serve", "frontend"], ["up"]):
        r = pygmy(*cmd, "--port-base", base, "--data-dir", str(tmp_path / "d"), env=same, timeout=30)
        assert r.returncode != 0 and "admin token must differ from the internal secret" in r.stderr, r.stderr
    assert not (tmp_path / "d" / "run").exists() or not list((tmp_path / "d" / "run").glob("*.pid"))
