"""Judge a recorded chaos run from its files alone: ``python -m pygmy.verify.chaos_check RUN_DIR``.

Reads ``history.json`` (every client operation: invoke and complete times, input, output or unknown),
``nemesis.json`` (the fault windows) and ``final.json`` (every replica's books, orders, applied index
and digest after healing), and checks the guarantees of docs/replication.md:

- ``linearizable``: per book, lookups, updates and buys are linearizable (Porcupine, tools/lincheck).
  That covers "no read returns a value older than a write acknowledged before it began", across
  frontends and workers, and "stock never negative" for every value read.
- ``converged``: after healing every tier has one leader and its replicas one applied index and one
  state digest, which equals the digest recomputed from every row on each replica.
- ``members``: the replicas read are the voters of the configuration every one of them holds,
  committed, with no learner left (after ``host-lost`` replaced hosts: the new members).
- ``lost-buy``: every acknowledged buy is a confirmed order with its book and quantity on every order
  replica.
- ``doubled-buy``: no order number was given to two buys; per book, no more confirmed orders than
  acknowledged buys plus buys whose outcome is unknown (an unknown buy happened at most once).
- ``stock-equation``: per book, on every catalog replica, final stock = initial + the updates that took
  effect - the copies in confirmed orders (decrements equal confirmed orders); never negative. An
  update of unknown outcome is sent again under its key after the run (``final.json``'s
  ``settled_updates``), so that its answer says whether it took effect: the equation is exact
  unless one stays unanswered.
- ``own-order``: a read of an acknowledged order never answers 404 or another book.
- ``integrity``: every replica's SQLite files pass ``PRAGMA integrity_check`` after the run.
- ``nemesis``: every fault was applied and undone (a fault that failed tested nothing).

Prints operations by outcome, faults by kind, the longest time each tier answered nothing (and no
buy, no update was answered), and every anomaly with the fault windows it overlapped; writes
``check.json``; exits 1 on any anomaly.
``--plot`` also draws the timeline (operations per second and latency, fault windows shaded).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from pygmy.verify import lincheck

TIER_OF = {"lookup": "catalog", "update": "catalog", "search": "catalog", "buy": "order", "order": "order"}


def load(run: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    return tuple(json.loads((run / f).read_text()) for f in ("history.json", "nemesis.json", "final.json"))  # type: ignore[return-value]


def outcome(op: dict[str, Any]) -> str:
    if op["output"] is None:
        return "unknown"
    if op["kind"] == "buy" and op["output"].get("out_of_stock"):
        return "out_of_stock"
    if op["kind"] == "order" and op["output"].get("status") == 404:
        return "not_found"
    return "ok"


def longest_gaps(ops: list[dict[str, Any]], start: int, end: int) -> dict[str, float]:
    """Per tier, the longest time (s) in [start, end] in which no operation of the tier succeeded;
    and the same for buys and updates alone (a tier's reads may go on while its writes cannot)."""
    out = {}
    groups = {"catalog": lambda op: TIER_OF.get(op["kind"]) == "catalog",
              "order": lambda op: TIER_OF.get(op["kind"]) == "order",
              "buy": lambda op: op["kind"] == "buy", "update": lambda op: op["kind"] == "update"}
    for name, member in groups.items():
        times = sorted(op["complete"] for op in ops if member(op) and outcome(op) != "unknown")
        edges = [start, *times, end]
        out[name] = max((b - a) / 1e9 for a, b in zip(edges, edges[1:], strict=False)) if times else (end - start) / 1e9
    return out


def members(tier: str, replicas: dict[str, Any], anomaly: Any) -> None:
    """The replicas read are exactly the voters of the tier's configuration, which every one of them
    holds, committed, with no learner left: after hosts were replaced, the new members are the ones
    checked (a run from before membership changes records no configuration and is not judged)."""
    confs = {(tuple(sorted(m["voters"])), tuple(sorted(m["learners"])), bool(m.get("pending")))
             for r in replicas.values() if (m := r["status"].get("membership")) is not None}
    if not confs:
        return
    if len(confs) != 1:
        anomaly("members", f"{tier} replicas hold different configurations: {sorted(confs)}")
    for voters, learners, pending in sorted(confs):
        if set(voters) != set(replicas) or learners or pending:
            anomaly("members", f"{tier}: the configuration has voters {list(voters)}, learners {list(learners)}"
                               f"{' (pending)' if pending else ''}; the replicas read are {sorted(replicas)}")


def keyed_orders(name: str, orders: dict[int, dict[str, Any]], acked: dict[int, dict[str, Any]],
                 ops: list[dict[str, Any]], anomaly: Any) -> None:
    """Orders held with their keys (``k:<Idempotency-Key>``; a keyless buy's is generated): each
    keyed buy has at most its own order, under its key, with its book and quantity, and none if it
    was answered otherwise; an order under no client's key must be a keyless buy of unknown outcome
    of the same book and quantity (keyless buys take two copies in the chaos load, keyed ones one),
    so a keyed buy done twice cannot pass for a keyless one."""
    by_key = {f"k:{op['input']['key']}": op for op in ops if op["kind"] == "buy" and op["input"].get("key")}
    keyless_unknown = Counter((op["item"], op["input"]["quantity"]) for op in ops
                              if op["kind"] == "buy" and not op["input"].get("key") and op["output"] is None)
    unnamed: Counter[tuple[int, int]] = Counter()
    for n, o in sorted(orders.items()):
        buy = by_key.get(o["key"])
        if n in acked:
            key = acked[n]["input"].get("key")
            if key and o["key"] != f"k:{key}":
                anomaly("lost-buy", f"{name}: acknowledged order {n} is under key {o['key']}, not its buy's k:{key}")
        elif buy is not None:
            if buy["output"] is not None or (o["item_number"], o["quantity"]) != (buy["item"], buy["input"]["quantity"]):
                anomaly("doubled-buy", f"{name}: order {n} ({o['item_number']} x{o['quantity']}) is under the key of "
                                       f"a buy answered {buy['output']}", buy["complete"])
        else:
            unnamed[(o["item_number"], o["quantity"])] += 1
    for (item, quantity), extra in sorted(unnamed.items()):
        if extra > keyless_unknown[(item, quantity)]:
            anomaly("doubled-buy", f"{name}: {extra} orders of {quantity} of book {item} under no client's key, "
                                   f"but only {keyless_unknown[(item, quantity)]} keyless buys of that had an unknown outcome")


def check(run: Path, timeout: float = 300) -> dict[str, Any]:
    history, nem, final = load(run)
    ops: list[dict[str, Any]] = history["ops"]
    initial = {int(k): v for k, v in history["initial"].items()}
    windows = nem["windows"]
    anomalies: list[dict[str, Any]] = []

    def anomaly(kind: str, what: str, at: int | None = None) -> None:
        during = [f"{w['kind']} ({w['detail']})" for w in windows
                  if at is not None and w["start"] <= at <= (w["end"] or at)]
        anomalies.append({"kind": kind, "what": what, "during": during})

    for error in nem.get("errors", []):  # a fault that was not applied (or not undone) was not tested
        anomaly("nemesis", error)
    for error in nem.get("client_errors", []):  # an answer no fault excuses (a 4xx other than out of stock)
        anomaly("client-error", error)
    done = Counter(f"{op['kind']}/{outcome(op)}" for op in ops)
    for kind in ("buy", "lookup"):
        if not done.get(f"{kind}/ok"):  # a cluster that answered nothing must not pass for one that erred in nothing
            anomaly("no-work", f"no {kind} was answered in the whole run")

    # Porcupine on the register part of the history.
    verdict = lincheck.check(run / "history.json", html_dir=run / "lincheck-html", timeout=timeout)
    for item, v in sorted(verdict.items.items()):
        if v != "ok":
            anomaly("linearizable", f"book {item}: {v}" + (f", see {verdict.html[item]}" if item in verdict.html else ""))
    for op in ops:
        out = op["output"] or {}
        if op["kind"] in ("lookup", "update") and out.get("stock", 0) < 0:
            anomaly("stock-equation", f"{op['kind']} of book {op['item']} saw stock {out['stock']}", op["complete"])

    if not final.get("converged"):
        anomaly("converged", f"replicas did not converge after healing: {final.get('status')}")
        replicas: dict[str, Any] = {}
    else:
        replicas = final["replicas"]
        for tier in ("catalog", "order"):
            seen = {(r["status"]["applied_index"], r["status"]["state_digest"])
                    for name, r in replicas.items() if name.startswith(tier)}
            if len(seen) != 1:
                anomaly("converged", f"{tier} replicas differ after healing: {sorted(seen)}")
        for name, r in replicas.items():
            v = r.get("verify")
            if v is not None and not v["ok"]:
                anomaly("converged", f"{name}: maintained digest {v['state_digest']} but its rows give "
                                     f"{v['recomputed']}")
        for tier in ("catalog", "order"):
            members(tier, {n: r for n, r in replicas.items() if n.startswith(tier)}, anomaly)

    for db, verdict_ in final.get("integrity", {}).items():
        if verdict_ != "ok":
            anomaly("integrity", f"{db}: {verdict_}")

    # Buys: acknowledged, unknown, and what the order replicas hold.
    acked: dict[int, dict[str, Any]] = {}  # order number -> the buy op
    unknown_buys: Counter[int] = Counter()
    for op in ops:
        if op["kind"] != "buy":
            continue
        if op["output"] is None:
            unknown_buys[op["item"]] += 1
        elif op["output"].get("ok"):
            n = op["output"]["order_number"]
            if n in acked:
                anomaly("doubled-buy", f"order {n} was given to two buys", op["complete"])
            acked[n] = op
    for name, r in replicas.items():
        if not name.startswith("order"):
            continue
        orders = {int(n): o for n, o in r["orders"].items()}
        for n, op in acked.items():
            o = orders.get(n)
            if o is None or (o["item_number"], o["quantity"]) != (op["item"], op["input"]["quantity"]):
                anomaly("lost-buy", f"acknowledged order {n} (book {op['item']}) is {o} on {name}", op["complete"])
        if orders and all("key" in o for o in orders.values()):
            keyed_orders(name, orders, acked, ops, anomaly)
            continue
        per_book = Counter(o["item_number"] for n, o in orders.items() if n not in acked)
        for item, extra in per_book.items():
            if extra > unknown_buys[item]:
                anomaly("doubled-buy", f"{name}: {extra} orders of book {item} nobody was acknowledged, "
                                       f"but only {unknown_buys[item]} buys of it had an unknown outcome")

    # Stock: initial + updates that took effect - confirmed copies, on every catalog replica.
    orders_any = next((r["orders"] for n, r in replicas.items() if n.startswith("order")), {})
    sold: Counter[int] = Counter()
    for o in orders_any.values():
        sold[o["item_number"]] += o["quantity"]
    added: Counter[int] = Counter()
    maybe: Counter[int] = Counter()
    # An update of unknown outcome sent again under its key after the run (``chaos.settle_updates``)
    # took effect once if that answer was 200, never if another; one still unanswered may have.
    settled = final.get("settled_updates", {})
    for op in ops:
        if op["kind"] != "update":
            continue
        if op["output"] is not None or settled.get(op["input"].get("key")) == 200:
            added[op["item"]] += op["input"]["stock_delta"]
        elif settled.get(op["input"].get("key")) is None:
            maybe[op["item"]] += op["input"]["stock_delta"]
    for name, r in replicas.items():
        if not name.startswith("catalog"):
            continue
        for item, start in initial.items():
            stock = r["books"][str(item)]["stock"]
            low = start["stock"] + added[item] - sold[item]
            if not low <= stock <= low + maybe[item] or stock < 0:
                anomaly("stock-equation", f"{name} book {item}: stock {stock}, expected initial {start['stock']} "
                                          f"+ updates {added[item]} (+ up to {maybe[item]} unknown) - sold {sold[item]}")

    # Own orders: once acknowledged, an order is found (no 404, never another book).
    for op in ops:
        if op["kind"] != "order" or op["output"] is None:
            continue
        n = op["input"]["order_number"]
        buy = acked.get(n)
        if buy is None or buy["complete"] > op["invoke"]:
            continue
        out = op["output"]
        if out["status"] != 200 or (out["item"], out["quantity"], out.get("number", n)) != (
                buy["item"], buy["input"]["quantity"], n):
            anomaly("own-order", f"read of acknowledged order {n} answered {out}", op["complete"])

    times = [op["invoke"] for op in ops] + [op["complete"] for op in ops if op["complete"]]
    start, end = (min(times), max(times)) if times else (0, 0)
    faults = Counter(w["kind"] for w in windows)
    return {
        "ok": not anomalies,
        "operations": len(ops),
        "by_outcome": dict(sorted(Counter(f"{op['kind']}/{outcome(op)}" for op in ops).items())),
        "faults": dict(sorted(faults.items())),
        "nemesis_errors": nem.get("errors", []),
        "longest_unavailable_s": {k: round(v, 2) for k, v in longest_gaps(ops, start, end).items()},
        "lincheck": verdict.items,
        "anomalies_by_kind": dict(Counter(a["kind"] for a in anomalies)),
        "anomalies_by_fault": dict(Counter(d.split(" ")[0] for a in anomalies for d in a["during"])),
        "anomalies": anomalies[:200],
        "seed": nem.get("seed"),
        "duration_s": nem.get("duration"),
    }


def plot(run: Path) -> Path:
    """Operations per second (ok, unknown) and p50/p99 latency per second, fault windows shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history, nem, _ = load(run)
    ops = history["ops"]
    t0 = min(op["invoke"] for op in ops)
    per_s: dict[int, list[float]] = defaultdict(list)
    unknown: Counter[int] = Counter()
    for op in ops:
        sec = int((op["invoke"] - t0) / 1e9)
        if op["complete"] is None:
            unknown[sec] += 1
        else:
            per_s[sec].append((op["complete"] - op["invoke"]) / 1e6)
    secs = sorted(set(per_s) | set(unknown))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 6), sharex=True)
    ax1.plot(secs, [len(per_s[s]) for s in secs], lw=0.8, label="answered")
    ax1.plot(secs, [unknown[s] for s in secs], lw=0.8, color="tab:red", label="unknown outcome")
    ax1.set_ylabel("operations / s")
    ax1.legend(loc="upper right", fontsize=8)

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    ax2.plot(secs, [pct(per_s[s], 0.5) for s in secs], lw=0.8, label="p50")
    ax2.plot(secs, [pct(per_s[s], 0.99) for s in secs], lw=0.8, label="p99")
    ax2.set_yscale("log")
    ax2.set_ylabel("latency (ms)")
    ax2.set_xlabel("seconds into the run")
    ax2.legend(loc="upper right", fontsize=8)
    colors = dict(zip(sorted({w["kind"] for w in nem["windows"]}), plt.cm.tab20.colors, strict=False))
    for w in nem["windows"]:
        if w["end"] is None:
            continue
        for ax in (ax1, ax2):
            ax.axvspan((w["start"] - t0) / 1e9, (w["end"] - t0) / 1e9, color=colors[w["kind"]], alpha=0.15, lw=0)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.3) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper center", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    path = run / "timeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary(result: dict[str, Any]) -> str:
    lines = [f"{'OK' if result['ok'] else 'ANOMALIES'}: {result['operations']} operations, seed {result['seed']}, "
             f"{result['duration_s']} s",
             f"  by outcome: {result['by_outcome']}",
             f"  faults: {result['faults']} ({sum(result['faults'].values())} in all)",
             f"  longest time with no answer: {result['longest_unavailable_s']} s"]
    if result["nemesis_errors"]:
        lines.append(f"  nemesis errors: {result['nemesis_errors'][:5]}")
    if not result["ok"]:
        lines.append(f"  anomalies by kind: {result['anomalies_by_kind']}, by fault: {result['anomalies_by_fault']}")
        lines += [f"  - {a['kind']}: {a['what']}" + (f" [during {', '.join(a['during'])}]" if a["during"] else "")
                  for a in result["anomalies"][:20]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="directory with history.json, nemesis.json and final.json")
    p.add_argument("--plot", action="store_true", help="draw timeline.png too")
    p.add_argument("--timeout", type=float, default=300, help="Porcupine's time limit per book (s)")
    args = p.parse_args(argv)
    try:
        result = check(args.run, args.timeout)
    except (OSError, ValueError, KeyError) as exc:
        print(f"chaos_check: cannot read {args.run}: {exc}", file=sys.stderr)
        return 2
    (args.run / "check.json").write_text(json.dumps(result, indent=1))
    if args.plot:
        result["plot"] = str(plot(args.run))
    print(summary(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
