"""The OpenAPI document names every public route, and a live frontend keeps to it (schemathesis)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import requests
from harness import Cluster

from pygmy.frontend.app import create_app
from pygmy.kit.config import ClusterConfig

SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"


def test_document_names_every_route(hard_cluster: Cluster) -> None:
    doc = requests.get(hard_cluster.url + "/openapi.json", timeout=5).json()
    assert doc["openapi"].startswith("3.") and doc["servers"] == [{"url": hard_cluster.url}]
    config = ClusterConfig.from_dict({**hard_cluster.config(), "data_dir": str(hard_cluster.data_dir)})
    app = create_app(config, 1)  # the frontend as it is built, to read its routes
    try:
        served = {(re.sub(r"<[^>]+>", "{}", rule.rule), method.lower())
                  for rule in app.url_map.iter_rules() if rule.endpoint != "static"
                  for method in rule.methods - {"HEAD", "OPTIONS"}}
    finally:
        app.extensions["pygmy_subscription"].stop()
    documented = {(re.sub(r"{[^}]+}", "{}", path), method) for path, ops in doc["paths"].items() for method in ops}
    assert served == documented
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            codes = set(op["responses"])
            assert "200" in codes and "default" in codes, (path, method)
            for code, resp in op["responses"].items():
                if code not in ("200", "default"):
                    assert resp["$ref"].endswith(f"/E{code}"), (path, code)


def test_schemathesis_finds_nothing(hard_cluster: Cluster, tmp_path: Path) -> None:
    """Generated and mutated requests to every operation (with the admin token): no 5xx, every answer
    matches the document. Bounded examples; one worker (hypothesis' source parsing is not thread safe)."""
    cmd = [str(SCHEMATHESIS), "run", hard_cluster.url + "/openapi.json", "--checks", "all",
           # A reused Idempotency-Key legitimately answers 422 to a valid-looking buy.
           "--exclude-checks", "positive_data_acceptance",
           "--max-examples", "10", "--phases", "coverage,fuzzing", "-w", "1", "--request-timeout", "10",
           "--suppress-health-check", "all", "--no-color",
           # Valid fault requests really kill and pause this cluster's replicas (test_dashboard checks them).
           "--exclude-path", "/dashboard/faults",
           "-H", f"Authorization: Bearer {hard_cluster.admin_token()}"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "No issues found" in r.stdout, r.stdout[-3000:]
