"""The ``pygmy`` client commands: readable output, ``--json``, exit codes and stderr."""

from __future__ import annotations

import json
from pathlib import Path

from harness import Cluster, pygmy


def test_human_and_json_output(cluster: Cluster) -> None:
    u = ["--url", cluster.url]
    r = pygmy("search", "distributed systems", *u)
    assert r.returncode == 0 and "RPCs for Dummies" in r.stdout and r.stdout.startswith("item")
    assert json.loads(pygmy("search", "graduate-school", "--json", *u).stdout)["items"][0]["item_number"] == 3
    r = pygmy("search", "graduate-school", "--limit", "3", *u)
    more = r.stdout.strip().splitlines()[-1].split()
    assert r.returncode == 0 and more[:4] == ["more:", "pygmy", "search", "graduate-school"], r.stdout
    r = pygmy("search", "graduate-school", "--limit", "3", "--next", more[-1], *u)
    assert r.returncode == 0 and "more:" not in r.stdout and "Spring in the Pioneer Valley" in r.stdout
    r = pygmy("lookup", "2", *u)
    assert r.returncode == 0 and "item 2: RPCs for Dummies" in r.stdout and "stock:" in r.stdout
    r = pygmy("buy", "2", "--quantity", "2", "--json", *u)
    order = json.loads(r.stdout)
    assert order["quantity"] == 2
    r = pygmy("order", str(order["order_number"]), *u)
    assert r.returncode == 0 and f"order {order['order_number']}: 2 x item 2" in r.stdout
    r = pygmy("update", "2", "--cost", "16", "--data-dir", str(cluster.data_dir), *u)
    assert r.returncode == 0 and "cost:  16.00" in r.stdout
    r = pygmy("status", *u)
    assert r.returncode == 0 and "catalog: leader catalog-" in r.stdout and "order-3" in r.stdout
    st = json.loads(pygmy("status", "--json", *u).stdout)
    assert st["order"]["leader"].startswith("order-")


def test_errors_exit_non_zero_with_message(cluster: Cluster) -> None:
    u = ["--url", cluster.url]
    r = pygmy("lookup", "31337", *u)
    assert r.returncode != 0 and "404" in r.stderr and "31337" in r.stderr and r.stdout == ""
    r = pygmy("buy", "1", "--quantity", "0", *u)
    assert r.returncode != 0 and "400" in r.stderr
    r = pygmy("update", "1", "--cost", "3", "--token", "wrong", *u)
    assert r.returncode != 0 and "403" in r.stderr
    r = pygmy("lookup", "1", "--url", "http://127.0.0.1:1")
    assert r.returncode != 0 and "cannot reach" in r.stderr


def test_update_uses_the_admin_token_not_the_internal_secret(cluster: Cluster, tmp_path: Path) -> None:
    """``pygmy update`` sends ``--token``, else ``PYGMY_ADMIN_TOKEN``, else ``DATA_DIR/admin-token``;
    the internal secret (``PYGMY_SECRET``) is never taken for it."""
    u = ["--url", cluster.url]
    cost = json.loads(pygmy("lookup", "4", "--json", *u).stdout)["cost"]
    r = pygmy("update", "4", "--cost", str(cost), "--data-dir", str(cluster.data_dir), *u)
    assert r.returncode == 0, r.stderr
    r = pygmy("update", "4", "--cost", str(cost), *u, env={"PYGMY_ADMIN_TOKEN": cluster.admin_token()})
    assert r.returncode == 0, r.stderr
    r = pygmy("update", "4", "--cost", str(cost), "--data-dir", str(cluster.data_dir), *u,
              env={"PYGMY_ADMIN_TOKEN": "not-the-token"})
    assert r.returncode != 0 and "403" in r.stderr and "wrong admin token" in r.stderr
    r = pygmy("update", "4", "--cost", str(cost), "--data-dir", str(tmp_path), *u, env={"PYGMY_SECRET": cluster.secret()})
    assert r.returncode != 0 and "no admin token" in r.stderr and "PYGMY_ADMIN_TOKEN" in r.stderr, r.stderr
    r = pygmy("update", "4", "--cost", str(cost), "--token", cluster.secret(), *u)
    assert r.returncode != 0 and "403" in r.stderr
