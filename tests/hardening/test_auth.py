"""Internal and admin endpoints refuse requests without the cluster secret (401) or with a wrong one
(403), with the JSON error body, and change nothing; raft messages from outside the membership are ignored."""

from __future__ import annotations

import socket
import time
from typing import Any

import requests
from harness import Cluster

from replication.transport import encode, raft_address, read_frame

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
        ("POST", cat + "/books/1/update", {"stock_delta": -5, "cost": 0}),
        ("POST", order + "/buy", {"item": 1, "quantity": 5, "key": "intruder"}),
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


def hello(c: Cluster, name: str, greeting: dict[str, Any], *frames: Any) -> Any:
    """Say ``greeting`` on the replica's peer transport, send ``frames``; its first answer, or None."""
    with socket.create_connection(raft_address(c.replica_url(name)), timeout=5) as s:
        s.sendall(encode(greeting) + b"".join(encode(f) for f in frames))
        return read_frame(s.makefile("rb"))


def test_the_peer_transport_refuses_without_the_secret_or_membership(hard_cluster: Cluster) -> None:
    c = hard_cluster
    before = snapshot(c)
    for name in NAMES:
        tier = name.split("-")[0]
        vote = {"type": "vote", "src": f"{tier}-9", "dst": name, "term": 10**6, "index": 10**9, "log_term": 10**6}
        for greeting, why in (({"hello": f"{tier}-1", "channel": "raft"}, "wrong cluster secret"),
                              ({"hello": f"{tier}-1", "secret": "wrong", "channel": "raft"}, "wrong cluster secret"),
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
    refuses everyone without it, answers 400 to a malformed request and 421 (naming the leader) off
    the leader."""
    c = hard_cluster
    lead = leader(c, "catalog")
    follower = next(n for n in NAMES if n.startswith("catalog") and n != lead)
    refused = hello(c, lead, {"hello": "x", "secret": "wrong", "channel": "subscribe"}, {"id": "i", "url": "tcp://a:1"})
    assert refused["error"]["code"] == 403
    with socket.create_connection(raft_address(c.replica_url(lead)), timeout=5) as s:
        stream = s.makefile("rb")
        s.sendall(encode({"hello": "probe", "secret": c.secret(), "channel": "subscribe"}))
        assert read_frame(stream) == {"ok": True}
        for bad in ({"id": "i"}, {"id": "i", "url": "http://127.0.0.1:9"}, [1, 2]):
            s.sendall(encode(bad))
            assert read_frame(stream)["status"] == 400, bad
    with socket.create_connection(raft_address(c.replica_url(follower)), timeout=5) as s:
        stream = s.makefile("rb")
        s.sendall(encode({"hello": "probe", "secret": c.secret(), "channel": "subscribe"}))
        assert read_frame(stream) == {"ok": True}
        s.sendall(encode({"id": "i", "url": "tcp://127.0.0.1:9"}))
        answer = read_frame(stream)
        assert answer["status"] == 421 and answer["body"]["error"]["leader"] == lead
