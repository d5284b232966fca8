"""A randomized nemesis run: clients through both frontends while real faults come and go.

``python -m pygmy.verify.chaos --duration 600 --seed 7`` (``make chaos DURATION=600 SEED=7``) starts a
cluster of 3+3 replicas and 2 frontends x 2 workers, each service in its own network namespace with a
small tmpfs data disk per replica, and runs for ``duration`` seconds:

- clients: admin updates (with ``Idempotency-Key``, retried with the same key until answered), buys
  (with a key and retried the same way, or without a key and not retried), lookups, searches and
  reads of orders that were acknowledged, alternating between the two frontends;
- the nemesis (``pygmy.verify.nemesis``): isolated leaders, a frontend that reaches only a minority,
  majority/minority splits, one-way cuts, delay, loss, SIGSTOP, SIGKILL and full disks, and faults of
  a replica's host as a whole: isolated, slow and lossy, or lost for good and replaced by a new host
  with ``pygmy member``; one at a time in seeded shuffled rounds. Leaders, the final state and the
  databases checked are those of the members at the time (``cluster.json``), not the first ones.

Every operation is recorded with invoke and complete times and its outcome. After the nemesis heals
everything and the replicas converge, the run records each replica's final state, then
``pygmy.verify.chaos_check`` judges the files (it can be rerun on them alone).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from pygmy import ROOT
from pygmy.cluster.local import LocalCluster, free_port_base
from pygmy.kit.config import ClusterConfig
from pygmy.verify import chaos_check, hosts, lincheck, nemesis
from pygmy.verify.linearizability import DEFINITE_FAILURES, Workload

RESULTS = ROOT / "experiments" / "results" / "chaos"
#: How long a client keeps retrying one update or keyed buy (same key) before calling it unknown.
RETRY_FOR = 30.0
#: Seconds clients go on after the nemesis stopped: retries find out what became of their operations.
DRAIN = 8.0
#: Seconds of load on the healed cluster after the last fault.
SETTLE = 5.0


def _set_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


@dataclass
class ChaosWorkload(Workload):
    """The linearizability workload plus buys retried under one key, keyless buys, searches and
    reads of acknowledged orders; buys and updates keep retrying through faults."""

    searchers: int = 1
    order_readers: int = 2
    keyless_every: int = 4  # one buy in this many goes without Idempotency-Key
    acked: list[tuple[int, int]] = field(default_factory=list)  # (order number, complete time)
    #: Books that start with this little stock and whose writers change only the cost: buyers sell
    #: them out, so the run also checks "no oversell" at zero stock under faults (409s).
    scarce: dict[int, int] = field(default_factory=lambda: {6: 20, 7: 20})
    #: Cleared, buyers start no buy (one under way finishes): a test may need the order tier idle.
    buying: threading.Event = field(default_factory=_set_event)

    def __post_init__(self) -> None:
        auth = {"Authorization": f"Bearer {self.token}"}
        with requests.Session() as s:
            for item, stock in self.scarce.items():
                now = s.get(f"{self.urls[0]}/lookup/{item}", timeout=self.timeout).json()["stock"]
                r = s.post(f"{self.urls[0]}/update/{item}", json={"stock_delta": stock - now}, headers=auth,
                           timeout=self.timeout)
                r.raise_for_status()
        super().__post_init__()

    def targets(self) -> list[Any]:
        return super().targets() + [self._searcher] * self.searchers + [self._order_reader] * self.order_readers

    def run(self, seconds: float, drain: float = DRAIN) -> lincheck.History:
        self._stop_at = time.monotonic() + seconds
        return super().run(seconds, drain)

    def stop(self) -> None:
        """End the run now (``run`` returns once the clients have finished; retries under way give
        up once the drain is over)."""
        self._stop_at = time.monotonic()
        self._stop.set()

    def _send(self, send: Any) -> requests.Response | None:
        """``send(attempt)`` until a definite answer (the same key every time), for up to
        ``RETRY_FOR`` seconds, and no longer than ``DRAIN`` seconds past the end of the run (which
        ``stop`` may bring forward)."""
        retry_until = time.monotonic() + RETRY_FOR
        for attempt in itertools.count():
            r = send(attempt)
            if r is not None and r.status_code < 500:
                return r
            if time.monotonic() > min(retry_until, self._stop_at + DRAIN):
                break
            time.sleep(0.1)
        return None

    def _delta(self, item: int, i: int) -> int:
        return 0 if item in self.scarce else super()._delta(item, i)

    def _buyer(self, k: int) -> None:
        client = next(self._clients)
        rng = random.Random(k)
        with requests.Session() as s:
            for i in itertools.count():
                while not self.buying.wait(0.05):
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                item = self.items[(i + k) % len(self.items)]
                keyless = rng.randrange(self.keyless_every) == 0
                key = None if keyless else f"chaos-b-{uuid.uuid4().hex}"
                # Keyless buys take two copies, keyed ones one: an order no client's key names is then
                # a keyless buy's only if it is of two (``chaos_check``), never a keyed buy's double.
                quantity = 2 if keyless else 1
                op = self.history.invoke(client, "buy", item, {"quantity": quantity, "key": key})

                def send(a: int, item: int = item, key: str | None = key, i: int = i,
                         quantity: int = quantity) -> requests.Response | None:
                    return self._call(s, "POST", f"{self._url(k, i + a)}/buy/{item}", json={"quantity": quantity},
                                      headers={"Idempotency-Key": key} if key else {})

                r = send(0) if keyless else self._send(send)
                if r is None or r.status_code >= 500:
                    self.history.unknown(op)
                elif r.status_code == 200:
                    order = r.json()
                    self.history.ok(op, {"ok": True, "order_number": order["order_number"]})
                    self.acked.append((order["order_number"], time.monotonic_ns()))
                elif r.status_code == 409:
                    self.history.ok(op, {"ok": False, "out_of_stock": True})
                else:
                    self.history.drop(op)
                    self.errors.append(f"buy {item}: {r.status_code} {r.text[:200]}")

    def _searcher(self, k: int) -> None:
        client = next(self._clients)
        with requests.Session() as s:
            for i in itertools.count():
                if self._stop.wait(0.05):
                    return
                topic = ("distributed systems", "graduate school")[i % 2]
                op = self.history.invoke(client, "search", 0, {"topic": topic})
                r = self._call(s, "GET", f"{self._url(k, i)}/search/{topic}")
                if r is not None and r.status_code == 200:
                    self.history.ok(op, {"count": len(r.json()["items"])})
                elif r is not None and r.status_code in DEFINITE_FAILURES:
                    self.history.drop(op)
                    self.errors.append(f"search {topic}: {r.status_code} {r.text[:200]}")
                else:
                    self.history.unknown(op)

    def _order_reader(self, k: int) -> None:
        """Reads an acknowledged order; the checker flags a 404 for an order acknowledged before."""
        client = next(self._clients)
        rng = random.Random(1000 + k)
        with requests.Session() as s:
            for i in itertools.count():
                if self._stop.wait(0.05):
                    return
                if not self.acked:
                    continue
                number = self.acked[-1 - min(len(self.acked) - 1, int(rng.expovariate(0.2)))][0]
                op = self.history.invoke(client, "order", 0, {"order_number": number})
                r = self._call(s, "GET", f"{self._url(k, i)}/orders/{number}")
                if r is not None and r.status_code in (200, 404):
                    body = r.json()
                    self.history.ok(op, {"status": r.status_code, "item": body.get("item_number"),
                                         "quantity": body.get("quantity"), "number": body.get("order_number")})
                else:
                    self.history.unknown(op)


# -- the final state, read from every replica ----------------------------------------------------------
def replica_status(config: ClusterConfig, name: str) -> dict[str, Any] | None:
    try:
        return requests.get(f"{config.peers(name.rsplit('-', 1)[0])[name]}/status", timeout=2).json()
    except (requests.RequestException, ValueError):
        return None


def leader_of(config: ClusterConfig, tier: str) -> str | None:
    best: tuple[int, str] | None = None
    for name in config.peers(tier):
        st = replica_status(config, name)
        if st and st.get("role") == "leader" and (best is None or st["term"] > best[0]):
            best = (st["term"], name)
    return best[1] if best else None


def converged(config: ClusterConfig) -> dict[str, list[dict[str, Any]]] | None:
    """Every replica's status if every tier has a leader and all its replicas are at one applied
    index with one digest, else None."""
    out: dict[str, list[dict[str, Any]]] = {}
    for tier in ("catalog", "order"):
        sts = [replica_status(config, name) for name in config.peers(tier)]
        if any(st is None or st.get("error") for st in sts):
            return None
        if sum(st["role"] == "leader" for st in sts) != 1 or len({(st["applied_index"], st["state_digest"])
                                                                    for st in sts}) != 1:
            return None
        out[tier] = sts
    return out


def read_orders(get: Any, url: str, headers: dict[str, str], settle: float = 15.0,
                **kwargs: Any) -> dict[int, dict[str, Any]]:
    """Every confirmed order of the order replica at ``url``, by number: ``GET /orders`` a page of
    a thousand at a time (``get``: a session's, or ``_Patient``'s). A page that still holds pending
    orders (left by a fault; the order leader's sweeper settles them within seconds), or that is
    refused for a moment (503: no read index yet), is read again, for up to ``settle`` s a page;
    any other answer is an error at once."""
    found: dict[int, dict[str, Any]] = {}
    after: int | None = 0
    while after is not None:
        settle_by = time.monotonic() + settle
        while True:
            r = get(f"{url}/orders", params={"after": after, "limit": 1000}, headers=headers, timeout=10, **kwargs)
            page = r.json() if r.status_code == 200 else None
            if page is not None and not page["pending"]:
                break
            if r.status_code not in (200, 503) or time.monotonic() > settle_by:
                raise RuntimeError(f"{url}/orders?after={after}: " + (
                    f"{r.status_code} {r.text[:200]}" if page is None else f"still pending: {page['pending'][:10]}"))
            time.sleep(0.2)
        found.update((o["order_number"], o) for o in page["orders"])
        after = page["next"]
    return found


#: The answers that tell an update's outcome by its key: 200 took effect once, 404 and 409 never
#: (the key's first answer). Any other (a 401 for a wrong token, a 503) tells nothing.
SETTLED = (200, 404, 409)


def settle_updates(config: ClusterConfig, history: lincheck.History, admin_token: str,
                   timeout: float = 60) -> dict[str, int | None]:
    """Each update of unknown outcome sent again under its key, through a frontend, until a
    definite answer: ``{key: status}`` (None: still none). The key makes that answer the first
    attempt's if it took effect, and applies the update now if it did not: either way it took
    effect exactly once if 200, never if 404 or 409, and the stock equation counts it so
    (``chaos_check``) instead of allowing it or not, a range a lost decrement could hide in.
    Done after the run, outside the history Porcupine reads."""
    unknown = [op for op in history.ops() if op.kind == "update" and op.outcome == "unknown" and op.input.get("key")]
    urls = [config.frontend_url(k) for k in range(1, config.frontends + 1)]
    auth = {"Authorization": f"Bearer {admin_token}"}
    out: dict[str, int | None] = {}
    deadline = time.monotonic() + timeout
    with requests.Session() as s:
        for op in unknown:
            key, out[op.input["key"]] = op.input["key"], None
            body = {"stock_delta": op.input["stock_delta"], "cost": op.input["cost"] / 100}
            for attempt in itertools.count():
                try:
                    r = s.post(f"{urls[attempt % len(urls)]}/update/{op.item}", json=body, timeout=5,
                               headers={**auth, "Idempotency-Key": key})
                    if r.status_code in SETTLED:
                        out[key] = r.status_code
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    return out


def final_state(config: ClusterConfig, secret: str, items: list[int], timeout: float = 90,
                history: lincheck.History | None = None, admin_token: str | None = None) -> dict[str, Any]:
    """Wait until the replicas agree and stay put for 3 s (the order leader's sweeper finishes
    intents left by faults within a few seconds), then read every book and order from every replica.
    With ``history``, first learn what became of its updates of unknown outcome (``settle_updates``)."""
    if history is not None and not admin_token:
        raise ValueError("settling a history's updates needs the admin token")
    settled = settle_updates(config, history, admin_token) if history is not None and admin_token else {}
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while True:
        st = converged(config)
        key = None if st is None else {t: (s[0]["applied_index"], s[0]["state_digest"]) for t, s in st.items()}
        if key is None or key != last:
            last, since = key, time.monotonic()
        elif time.monotonic() - since >= 3.0:
            break
        if time.monotonic() > deadline:
            return {"converged": False, "status": {n: replica_status(config, n) for n in config.names()
                                                   if not n.startswith("frontend")}}
        time.sleep(0.3)
    auth = {"Authorization": f"Bearer {secret}"}
    replicas: dict[str, Any] = {}
    # Every order of every replica, a page of a thousand a read (``GET /orders``): one read an order
    # took 20-25 s for a thousand orders on three replicas, most of a quick chaos run's check.
    with requests.Session() as session:
        s = _Patient(session)
        for tier, sts in st.items():
            for status in sts:
                name, url, entry = status["name"], status["url"], {"status": status}
                if tier == "catalog":
                    entry["books"] = {str(i): s.get(f"{url}/books/{i}", headers=auth, timeout=5).json() for i in items}
                else:
                    entry["orders"] = {str(n): o for n, o in read_orders(s.get, url, auth).items()}
                entry["verify"] = s.get(f"{url}/verify", headers=auth, timeout=60).json()
                replicas[name] = entry
    return {"converged": True, "replicas": replicas, "settled_updates": settled}


class _Patient:
    """A session whose GETs try again after a timeout or a 503, as any client of the API does: one
    read stalled on a loaded machine (seen once in some 12,000 reads of the final state), or a
    follower whose read-index question to its leader took longer than its 0.5 s wait (seen once in
    CI, on 2 cores shared by three test workers), must not cost the whole run. Any other answer,
    and a 503 that persists, is returned as it is."""

    ATTEMPTS = 5

    def __init__(self, session: requests.Session) -> None:
        self.session = session

    def get(self, url: str, **kw: Any) -> requests.Response:
        for attempt in range(1, self.ATTEMPTS + 1):
            try:
                r = self.session.get(url, **kw)
            except requests.Timeout:
                if attempt == self.ATTEMPTS:
                    raise
            else:
                if r.status_code != 503 or attempt == self.ATTEMPTS:
                    return r
            time.sleep(1)
        raise AssertionError("unreachable")


def run(duration: float, seed: int, out: Path, kinds: tuple[str, ...] = nemesis.KINDS,
        env: dict[str, str] | None = None, hold: tuple[float, float] | None = None,
        clients: dict[str, int] | None = None) -> Path:
    """One chaos run; writes history.json, nemesis.json and final.json to ``out`` and returns it.
    ``hold``: how long each fault lasts (s, uniform), if not the nemesis' default; ``clients``: how
    many of each ``ChaosWorkload`` client (``writers``, ``readers``, ...), if not its defaults."""
    missing = nemesis.missing_tools()
    if missing:
        raise RuntimeError(f"the nemesis needs {', '.join(missing)} (network namespaces and iptables)")
    lincheck.build_checker()
    nemesis.build_toxiproxy()
    out.mkdir(parents=True, exist_ok=True)
    prefix, subnet = nemesis.fresh_addressing("c")
    config = ClusterConfig(port_base=free_port_base(), frontends=2, frontend_workers=2, netns=prefix,
                           netns_subnet=subnet)
    items = list(range(1, 8))
    with tempfile.TemporaryDirectory(prefix="pygmy-chaos-") as tmp:
        data = Path(tmp) / "data"
        config.data_dir = str(data)
        disks = [config.replica_dir(n) for n in config.names() if not n.startswith("frontend")]
        with nemesis.tmpfs_disks(disks) as mounted, nemesis.Network(config, out) as net:
            cluster = LocalCluster(data, config.port_base, [
                "--frontends", "2", "--frontend-workers", "2", "--netns", config.netns,
                "--netns-subnet", config.netns_subnet], env)
            try:
                cluster.start(reset=True)
                urls = [config.frontend_url(1), config.frontend_url(2)]
                load = ChaosWorkload(urls, cluster.admin_token(), items, **(clients or {}))

                def pid(name: str) -> int | None:
                    try:
                        return int((data / "run" / f"{name}.pid").read_text())
                    except (OSError, ValueError):
                        return None

                # The members as ``pygmy member`` left them (``host-lost`` replaces hosts), not the first ones.
                nem = nemesis.Nemesis(net, lambda tier: leader_of(cluster.cluster_config(), tier), cluster.kill,
                                      cluster.restart, pid, config.replica_dir, seed=seed, kinds=kinds,
                                      operator=hosts.Operator(data, env), disks=mounted,
                                      **({"hold": hold} if hold else {}))
                def end() -> None:
                    """At ``duration``: the nemesis stops once its first round is over and the fault under
                    way healed (a lost host replaced), and clients go on for ``SETTLE`` s more (a healed
                    network resolves retries): every fault happens under load."""
                    nem.stop()
                    if not ended.wait(SETTLE):
                        load.stop()

                ended = threading.Event()
                nem.start()
                stopper = threading.Timer(duration, end)
                stopper.start()
                try:
                    history = load.run(duration + SETTLE + nemesis.STOP_WAIT)
                finally:
                    ended.set()
                    stopper.cancel()
                    nem.stop(now=True)
                    stopper.join()
                net.heal()
                config = cluster.cluster_config()
                for name in config.names():  # anything the nemesis left down comes back
                    if pid(name) is None or not _alive(pid(name)):
                        try:
                            cluster.restart(name)
                        except AssertionError as exc:  # judged as the nemesis' fault (and unconverged)
                            nem.errors.append(f"restart {name} after the run: {str(exc)[:300]}")
                final = final_state(config, cluster.secret(), items, history=history,
                                    admin_token=cluster.admin_token())
            finally:
                logs = cluster.logs_tail(lines=60)
                cluster.stop()
            # Every database whole, after all the full disks and kills.
            final["integrity"] = nemesis.integrity({n: config.replica_dir(n) for n in config.names()})
        history.save(out / "history.json")
        (out / "nemesis.json").write_text(json.dumps({
            "seed": seed, "duration": duration, "kinds": list(kinds),
            "windows": nemesis.describe_windows(nem.windows), "errors": nem.errors,
            "client_errors": load.errors[:100], "cache": dict(load.cache)}, indent=1))
        (out / "final.json").write_text(json.dumps(final, indent=1))
        if not final["converged"]:
            (out / "logs.txt").write_text(logs)
    return out


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=None, help="nemesis seed (default: random, printed)")
    p.add_argument("--out", type=Path, default=None, help="result directory (default experiments/results/chaos/seed-S)")
    p.add_argument("--kinds", default=",".join(nemesis.KINDS),
                   help="comma-separated fault kinds; 'host' stands for the host kinds (host-isolated, ...)")
    p.add_argument("--plot", action="store_true", help="also draw the run's timeline (timeline.png)")
    return p


def execute(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[int, Path]:
    """Run and judge: the checker's exit status (0 no anomaly, 1 anomalies, 2 could not run) and
    the run's directory."""
    seed = args.seed if args.seed is not None else random.randrange(1_000_000)
    kinds = tuple(k for part in args.kinds.split(",") if part
                  for k in (nemesis.HOST_KINDS if part == "host" else (part,)))
    unknown = set(kinds) - set(nemesis.KINDS)
    if unknown:
        p.error(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(nemesis.KINDS)}")
    out = args.out or RESULTS / f"seed-{seed}"
    print(f"chaos: {args.duration:.0f} s, seed {seed}, faults {', '.join(kinds)}; results in {out}", flush=True)
    try:
        run(args.duration, seed, out, kinds)
    except RuntimeError as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2, out
    return chaos_check.main([str(out)] + (["--plot"] if args.plot else [])), out


def main(argv: list[str] | None = None) -> int:
    p = parser()
    return execute(p, p.parse_args(argv))[0]


if __name__ == "__main__":
    sys.exit(main())
