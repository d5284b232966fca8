"""The client half of the ``pygmy`` command line: search, lookup, buy, order, update, status.

Readable tables by default, ``--json`` for scripts; any error exits non-zero with its message on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import uuid
from typing import Any

from pygmy.client.api import DEFAULT_URL, PygmyClient, PygmyError
from pygmy.kit.config import ClusterConfig

#: Retries of requests safe to repeat after a 503 or no answer (backoff, Retry-After, a budget).
RETRIES = 3


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def money(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def show_book(b: dict[str, Any]) -> str:
    return "\n".join([f"item {b['item_number']}: {b['title']}", f"  topic: {b['topic']}",
                      f"  stock: {b['stock']}", f"  cost:  {money(b['cost'])}"])


def show_order(o: dict[str, Any]) -> str:
    line = (f"order {o['order_number']}: {o['quantity']} x item {o['item_number']} "
            f"\"{o['title']}\" at {money(o['cost'])} = {money(o['total'])}")
    return line + (f"\n  created at {o['created_at']}" if o.get("created_at") else "")


def role_of(replica: dict[str, Any]) -> str:
    """A leader that no longer holds its leader lease may have been replaced already: say so."""
    role = str(replica.get("role", "-"))
    if role == "leader" and replica.get("leader_lease") is False:
        return "leader (lease lapsed)"
    return role


def show_status(st: dict[str, Any]) -> str:
    fe = st["frontend"]
    cache = fe["cache"]
    out = [f"{fe['name']}: cache {'on' if cache['enabled'] else 'off'}"
           + (f", {cache['entries']}/{cache['capacity']} entries, {cache['hits']} hits, {cache['misses']} misses, "
              f"{cache['invalidations']} invalidations" if cache["enabled"] else "")]
    for tier in ("catalog", "order"):
        view = st[tier]
        out.append(f"\n{tier}: leader {view['leader'] or '(none)'}")
        rows = [[r["name"], "up" if r.get("alive") else "DOWN", role_of(r), r.get("term", "-"),
                 r.get("commit_index", "-"), r.get("applied_index", "-"), r.get("state_digest", "-")]
                for r in view["replicas"]]
        out.append(table(rows, ["replica", "alive", "role", "term", "commit", "applied", "digest"]))
        out += [f"  {r['name']}: {r['error']}" for r in view["replicas"] if r.get("error")]
    return "\n".join(out)


def admin_token(args: argparse.Namespace) -> str:
    """``--token``, else the cluster's own setting (``PYGMY_ADMIN_TOKEN``, else ``DATA_DIR/admin-token``)."""
    return args.token or ClusterConfig(data_dir=args.data_dir).admin_token()


def run(args: argparse.Namespace) -> int:
    try:
        token = admin_token(args) if args.command == "update" else None
    except RuntimeError as exc:
        print(f"pygmy {args.command}: {exc}", file=sys.stderr)
        return 1
    client = PygmyClient(args.url, timeout=args.timeout, token=token, retries=RETRIES, verify=args.ca or True)
    try:
        if args.command == "search":
            res = client.search(args.topic, args.limit, args.next)
            text = table([[i["item_number"], i["title"]] for i in res["items"]], ["item", "title"]) \
                if res["items"] else f"no books on topic {args.topic!r}"
            if res.get("next"):
                text += f"\nmore: pygmy search {shlex.quote(args.topic)} --next {res['next']}"
        elif args.command == "lookup":
            res = client.lookup(args.item)
            text = show_book(res)
        elif args.command == "buy":
            # A key of our own makes the buy safe to retry; the same key never buys twice.
            res = client.buy(args.item, args.quantity, args.idempotency_key or f"cli-{uuid.uuid4().hex}")
            text = show_order(res)
        elif args.command == "order":
            res = client.order(args.number)
            text = show_order(res)
        elif args.command == "update":
            if args.stock_delta is None and args.cost is None:
                raise PygmyError(400, "give --stock-delta, --cost, or both")
            res = client.update(args.item, args.stock_delta, args.cost)
            text = "updated\n" + show_book(res)
        else:
            res = client.status()
            text = show_status(res)
    except PygmyError as exc:
        print(f"pygmy {args.command}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(json.dumps(res, indent=2) if args.json else text)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=os.environ.get("PYGMY_URL", DEFAULT_URL), help="frontend URL")
    common.add_argument("--ca", default=os.environ.get("PYGMY_CA") or None,
                        help="the CA certificate an https:// frontend's must come from (a --tls cluster's "
                             "DATA_DIR/certs/ca.pem; default: PYGMY_CA, else the system's)")
    common.add_argument("--json", action="store_true", help="print the raw JSON answer")
    common.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer")
    p = sub.add_parser("search", parents=[common], help="books on a topic, a page at a time")
    p.add_argument("topic")
    p.add_argument("--limit", type=int, default=None, help="books per page (default 100, at most 1000)")
    p.add_argument("--next", default=None, help="the cursor a previous page printed, for the page after it")
    p = sub.add_parser("lookup", parents=[common], help="one book by item number")
    p.add_argument("item")
    p = sub.add_parser("buy", parents=[common], help="buy a book")
    p.add_argument("item")
    p.add_argument("--quantity", type=int, default=None)
    p.add_argument("--idempotency-key", default=None, help="retry-safe key: the same key never buys twice")
    p = sub.add_parser("order", parents=[common], help="look up an order")
    p.add_argument("number")
    p = sub.add_parser("update", parents=[common], help="admin: change stock and/or cost")
    p.add_argument("item")
    p.add_argument("--stock-delta", type=int, default=None)
    p.add_argument("--cost", type=float, default=None)
    p.add_argument("--token", default=None, help="admin token (default: PYGMY_ADMIN_TOKEN, else DATA_DIR/admin-token)")
    p.add_argument("--data-dir", default=os.environ.get("PYGMY_DATA_DIR", "data"))
    sub.add_parser("status", parents=[common], help="cluster view: leaders, replicas, cache")
