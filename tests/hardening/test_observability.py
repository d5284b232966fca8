"""Logs are JSON lines that let one buy be followed across tiers; replicas export their raft metrics."""

from __future__ import annotations

import json
import time
import uuid

import requests
from harness import Cluster

LOG_KEYS = {"time", "level", "service", "logger", "message", "request_id"}
REPLICA_METRICS = ("pygmy_replica_term", "pygmy_replica_role", "pygmy_replica_commit_index",
                   "pygmy_replica_applied_index", "pygmy_replica_apply_lag", "pygmy_replica_elections_total",
                   "pygmy_replica_leader_changes_total", "pygmy_replica_catch_up_seconds")


def log_records(c: Cluster, name: str) -> list[dict[str, object]]:
    lines = (c.data_dir / "logs" / f"{name}.log").read_text(errors="replace").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]  # every line is one JSON object
    for rec in records:
        assert rec.keys() >= LOG_KEYS, rec
    return records


def test_a_buy_can_be_followed_across_services(hard_cluster: Cluster) -> None:
    c = hard_cluster
    rid = f"hardening-{uuid.uuid4().hex}"
    r = requests.post(c.url + "/buy/2", json={"quantity": 1}, headers={"X-Request-Id": rid}, timeout=10)
    assert r.status_code == 200 and r.headers["X-Request-Id"] == rid
    seen: dict[str, list[dict[str, object]]] = {}
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        seen = {}
        for name in ["frontend-1"] + [f"{t}-{k}" for t in ("order", "catalog") for k in (1, 2, 3)]:
            hits = [rec for rec in log_records(c, name) if rec["request_id"] == rid]
            if hits:
                seen[name] = hits
        tiers = {name.split("-")[0] for name in seen}
        if tiers == {"frontend", "order", "catalog"}:
            break
        time.sleep(0.2)
    assert {name.split("-")[0] for name in seen} == {"frontend", "order", "catalog"}, seen
    access = [rec for rec in seen["frontend-1"] if rec["logger"] == "pygmy.access"]
    assert access and access[0]["method"] == "POST" and access[0]["path"] == "/buy/2"
    assert access[0]["status"] == 200 and isinstance(access[0]["duration_ms"], float)
    order_paths = {rec.get("path") for name, recs in seen.items() if name.startswith("order") for rec in recs}
    catalog_paths = {rec.get("path") for name, recs in seen.items() if name.startswith("catalog") for rec in recs}
    # A worker's buys, and their decrements, travel as batches, with the request id of the buy that sent it.
    assert "/buys" in order_paths and "/books/decrements" in catalog_paths


def test_request_ids_are_made_when_absent_or_unusable(hard_cluster: Cluster) -> None:
    r = requests.get(hard_cluster.url + "/lookup/1", timeout=5)
    assert len(r.headers["X-Request-Id"]) >= 16
    for bad in ("x" * 300, "has spaces", "new\u00e9line"):
        r = requests.get(hard_cluster.url + "/lookup/1", headers={"X-Request-Id": bad.encode("latin-1")}, timeout=5)
        assert r.status_code == 200 and r.headers["X-Request-Id"] != bad


def test_every_log_line_is_json(hard_cluster: Cluster) -> None:
    for path in sorted((hard_cluster.data_dir / "logs").glob("*.log")):
        log_records(hard_cluster, path.stem)


def test_replica_metrics(hard_cluster: Cluster) -> None:
    c = hard_cluster
    status = requests.get(c.url + "/status", timeout=5).json()
    leaders = {status["catalog"]["leader"], status["order"]["leader"]}
    for name in ("catalog-1", "catalog-2", "catalog-3", "order-1"):
        text = c.replica_get(name, "/metrics").text
        for metric in REPLICA_METRICS:
            assert f"\n{metric}{{" in text, (name, metric)
        assert f'pygmy_replica_role{{role="leader",service="{name}"}} {1.0 if name in leaders else 0.0}' in text
        assert "pygmy_http_requests_total{" in text
    for leader in leaders:
        text = c.replica_get(leader, "/metrics").text
        assert text.count("pygmy_replica_follower_lag{") == 2, text
