"""Lose the machine, keep the store: ``pygmy backup`` under buys and admin updates, with the leader
of each tier SIGKILLed during it; every data dir deleted; ``pygmy restore`` into other replica
counts; then, from outside, every order of the archive found, stock = initial + added - sold book
by book, every buy acknowledged before the backup began in it, one order per key. One cluster and
one archive for the module (the checks of the archive alone need no cluster)."""

from __future__ import annotations

import os
import random
import shutil
import sqlite3
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
from harness import MUTATIONS, Cluster, free_port_base, start_cluster, stop_checked, wait_for

from pygmy.cluster import backup, launcher
from pygmy.cluster.local import ROOT, pygmy
from pygmy.kit.config import ClusterConfig

ITEMS = range(1, 8)


@dataclass
class Load:
    """Buyers (each buy under its own key, retried with it until answered) and an admin who adds
    copies; what was acknowledged, and when (Unix seconds)."""

    url: str
    token: str
    buys: list[dict[str, Any]] = field(default_factory=list)  # acknowledged: key, item, quantity, order, at
    updates: list[dict[str, Any]] = field(default_factory=list)  # item, delta, acked (time or None)
    stop: threading.Event = field(default_factory=threading.Event)
    errors: list[str] = field(default_factory=list)

    def _send(self, s: requests.Session, method: str, path: str, **kw: Any) -> requests.Response | None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                r = s.request(method, self.url + path, timeout=6, **kw)
                if r.status_code < 500:
                    return r
            except requests.RequestException:
                pass
            time.sleep(0.05)
        return None

    def buyer(self, seed: int) -> None:
        rng = random.Random(seed)
        with requests.Session() as s:
            while not self.stop.is_set():
                key, item, quantity = uuid.uuid4().hex, rng.choice(ITEMS), rng.randint(1, 3)
                r = self._send(s, "POST", f"/buy/{item}", json={"quantity": quantity},
                               headers={"Idempotency-Key": key})
                if r is not None and r.status_code == 200:
                    self.buys.append({"key": key, "item": item, "quantity": quantity,
                                      "order": r.json()["order_number"], "at": time.time()})
                elif r is not None:
                    self.errors.append(f"buy: {r.status_code} {r.text[:200]}")

    def admin(self) -> None:
        rng = random.Random(99)
        with requests.Session() as s:
            while not self.stop.wait(0.05):
                item, delta = rng.choice(ITEMS), rng.randint(1, 5)
                update = {"item": item, "delta": delta, "acked": None}
                self.updates.append(update)
                r = self._send(s, "POST", f"/update/{item}", json={"stock_delta": delta},
                               headers={"Authorization": f"Bearer {self.token}", "Idempotency-Key": uuid.uuid4().hex})
                if r is not None and r.status_code == 200:
                    update["acked"] = time.time()
                elif r is not None:
                    self.errors.append(f"update: {r.status_code} {r.text[:200]}")


def leader(c: Cluster, tier: str) -> str:
    return wait_for(f"a {tier} leader", lambda: requests.get(c.url + "/status", timeout=3).json()[tier]["leader"])  # type: ignore[return-value]


def back_up_killing_leaders(c: Cluster, archive: Path, gate: Path) -> tuple[float, list[str], str]:
    """``pygmy backup`` as a user runs it, held before each copy (``PYGMY_TEST_BACKUP_GATE``): the
    order leader SIGKILLed before the order copy, the catalog leader before the catalog copy, so
    each copy must find its way through a failover."""
    config = ClusterConfig.load(str(c.data_dir))
    gate.mkdir()
    env = {**os.environ, "PYGMY_TEST_BACKUP_GATE": str(gate),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(MUTATIONS)])}  # this checkout's pygmy in the hook too
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "pygmy.cluster.cli", "backup", str(archive), "--data-dir",
                             str(c.data_dir)], cwd=ROOT, stderr=subprocess.PIPE, text=True, env=env)
    killed: list[str] = []
    for step in (1, 2, 3):
        flag = wait_for(f"the backup before copy {step}", lambda step=step: next(gate.glob(f"before-{step}-*"), None)
                        or proc.poll() is not None)
        if not isinstance(flag, Path):
            break  # it ended: said below
        tier = flag.name.split("-")[-1]
        if not any(k.startswith(tier) for k in killed):
            name = leader(c, tier)
            launcher.kill(config, name)
            killed.append(name)
        flag.unlink()
    _, output = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    return started, killed, output


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("backup")
    c = start_cluster(tmp, "--backup-every", "0.5", "--backup-dir", str(tmp / "scheduled"), "--backup-keep", "2")
    try:
        initial = {i: c.client().lookup(i)["stock"] for i in ITEMS}
        load = Load(c.url, c.admin_token())
        threads = [threading.Thread(target=load.buyer, args=(k,)) for k in range(3)]
        threads.append(threading.Thread(target=load.admin))
        for t in threads:
            t.start()
        try:
            wait_for("buys under way", lambda: len(load.buys) >= 30)
            started, killed, output = back_up_killing_leaders(c, tmp / "store.tar", tmp / "gate")
            with_secrets = pygmy("backup", str(tmp / "with-secrets.tar"), "--with-secrets", "--data-dir", str(c.data_dir))
            assert with_secrets.returncode == 0, with_secrets.stderr
            secret = c.secret()
            time.sleep(1)  # buys and updates go on after the backup: none of them may be in it
            wait_for("three scheduled backups", lambda: sum("backed up into" in line for line in c.output) >= 3)
        finally:
            load.stop.set()
            for t in threads:
                t.join(60)
        assert not load.errors, load.errors[:5]
    finally:
        stop_checked(c)
    shutil.rmtree(c.data_dir)  # the machine is lost: every replica's data dir with it
    members = tmp / "members"
    with tarfile.open(tmp / "store.tar") as tar:
        tar.extractall(members, filter="data")
    yield {"archive": tmp / "store.tar", "with_secrets": tmp / "with-secrets.tar", "secret": secret, "members": members, "initial": initial, "load": load, "started": started,
           "killed": killed, "output": output, "tmp": tmp}


def query(db: Path, sql: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def test_a_store_restored_into_other_replica_counts_holds_the_backup_whole(scene: dict[str, Any]) -> None:
    load, members = scene["load"], scene["members"]
    assert {k.split("-")[0] for k in scene["killed"]} == {"catalog", "order"}, scene["output"]
    orders = {n: (key, item, q, status) for n, key, item, q, status in
              query(members / "order.db", "SELECT order_number, key, item_number, quantity, status FROM orders")}
    by_key = {key: n for n, (key, *_rest) in orders.items()}
    assert len(by_key) == len(orders), "a key gives two orders"
    assert all(status in ("confirmed", "failed") for *_r, status in orders.values())
    before = [b for b in load.buys if b["at"] < scene["started"]]
    assert len(before) >= 30
    for b in before:  # every buy acknowledged before the backup began is in it, as its buyer was told
        assert orders.get(b["order"]) == (f"k:{b['key']}", b["item"], b["quantity"], "confirmed"), b
    assert len(orders) < len(load.buys) + 50  # and the buys that went on after it are not all in it
    sold = Counter[int]()
    for _, item, q, status in orders.values():
        sold[item] += q if status == "confirmed" else 0
    added = dict(query(members / "catalog.db", "SELECT item_number, stock_added FROM books"))
    for item in ITEMS:  # what the archive added lies between the updates acknowledged before and all sent
        acked = sum(u["delta"] for u in load.updates if u["item"] == item and u["acked"] and u["acked"] < scene["started"])
        assert acked <= added[item] <= sum(u["delta"] for u in load.updates if u["item"] == item), item

    c = Cluster(scene["tmp"] / "restored", free_port_base(), ["--catalog-replicas", "1", "--order-replicas", "3"],
                command=("restore", str(scene["archive"])))
    # Its frontends answer before it is called ready, and a client (a load balancer's retries) buys
    # at once: the start is not refused for it (the replicas' files were checked before they ran).
    bought: list[int] = []
    done = threading.Event()

    def buyer() -> None:
        with requests.Session() as s:
            while not done.is_set() and len(bought) < 20:
                try:
                    r = s.post(f"{c.url}/buy/1", json={"quantity": 1}, timeout=5)
                    if r.status_code == 200:
                        bought.append(r.json()["order_number"])
                        continue
                except requests.RequestException:
                    pass
                time.sleep(0.01)

    early = threading.Thread(target=buyer)
    early.start()
    try:
        c.start()
        early.join(60)
        assert len(bought) == 20 and min(bought) > max(orders)
        sold[1] += 20
        status = requests.get(c.url + "/status", timeout=5).json()
        assert [r["name"] for r in status["catalog"]["replicas"]] == ["catalog-1"]
        assert len(status["order"]["replicas"]) == 3
        with requests.Session() as s:
            for item in ITEMS:  # book by book, from outside: stock = initial + added - sold
                stock = s.get(f"{c.url}/lookup/{item}", timeout=5).json()["stock"]
                assert stock == scene["initial"][item] + added[item] - sold[item], item
            for n, (_, item, q, status_) in orders.items():  # every confirmed order of the archive is served
                r = s.get(f"{c.url}/orders/{n}", timeout=5)
                if status_ == "confirmed":
                    assert r.status_code == 200 and (r.json()["item_number"], r.json()["quantity"]) == (item, q), n
                else:
                    assert r.status_code == 404, n
            for b in before[:5]:  # a retry with a key the archive holds is the same order, no stock taken
                stock = s.get(f"{c.url}/lookup/{b['item']}", timeout=5).json()["stock"]
                r = s.post(f"{c.url}/buy/{b['item']}", json={"quantity": b["quantity"]},
                           headers={"Idempotency-Key": b["key"]}, timeout=10)
                assert r.status_code == 200 and r.json()["order_number"] == b["order"], r.text
                assert s.get(f"{c.url}/lookup/{b['item']}", timeout=5).json()["stock"] == stock
            stock = s.get(f"{c.url}/lookup/5", timeout=5).json()["stock"]
            r = s.post(f"{c.url}/buy/5", json={"quantity": 2}, timeout=10)  # and it serves new buys
            assert r.status_code == 200 and r.json()["order_number"] > max(orders), r.text
            assert s.get(f"{c.url}/lookup/5", timeout=5).json()["stock"] == stock - 2
    finally:
        done.set()
        early.join(10)
        c.stop()
    assert not (c.data_dir / "run" / "restored.json").exists()  # checked before it was called ready
    # Started again by a plain `pygmy up` (whose flags say 3 + 3): the members the restore recorded.
    again = Cluster(c.data_dir, c.port_base, [])
    again.start()
    try:
        status = requests.get(again.url + "/status", timeout=5).json()
        assert [r["name"] for r in status["catalog"]["replicas"]] == ["catalog-1"]
        assert len(status["order"]["replicas"]) == 3
        assert requests.get(f"{again.url}/lookup/5", timeout=5).json()["stock"] == stock - 2
    finally:
        again.stop()


def test_verify_catches_a_tampered_archive(scene: dict[str, Any], tmp_path: Path) -> None:
    ok = pygmy("backup", "--verify", str(scene["archive"]))
    assert ok.returncode == 0 and ": ok:" in ok.stderr, ok.stderr
    members = tmp_path / "m"
    shutil.copytree(scene["members"], members)
    damaged = bytearray((members / "catalog.db").read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    (members / "catalog.db").write_bytes(bytes(damaged))

    def repack(name: str, fix_hash: bool) -> Path:
        import hashlib
        import json

        manifest = json.loads((members / "manifest.json").read_text())
        if fix_hash:
            manifest["sha256"]["catalog.db"] = hashlib.sha256((members / "catalog.db").read_bytes()).hexdigest()
        (members / "manifest.json").write_text(json.dumps(manifest))
        with tarfile.open(tmp_path / name, "w") as tar:
            for m in sorted(p.name for p in members.iterdir()):
                tar.add(members / m, arcname=m)
        return tmp_path / name

    bad = pygmy("backup", "--verify", str(repack("damaged.tar", fix_hash=False)))
    assert bad.returncode == 1 and "SHA-256 differs" in bad.stderr, bad.stderr
    # A change made with the hash made to match: stock moved without the ledger or any order saying why.
    shutil.copyfile(scene["members"] / "catalog.db", members / "catalog.db")
    conn = sqlite3.connect(members / "catalog.db")
    conn.execute("DROP TRIGGER digest_books_update")
    conn.execute("UPDATE books SET stock = stock + 1 WHERE item_number = 3")
    conn.commit()
    conn.close()
    bad = pygmy("backup", "--verify", str(repack("edited.tar", fix_hash=True)))
    assert bad.returncode == 1 and "book 3: stock" in bad.stderr, bad.stderr
    assert "pygmy backup" in pygmy("backup", "--verify", str(tmp_path / "nothing.tar")).stderr


def test_scheduled_backups_keep_the_newest(scene: dict[str, Any]) -> None:
    """``pygmy up --backup-every 0.5 --backup-keep 2``, through the same failovers: the two newest
    archives are kept, and each passes ``--verify``."""
    kept = sorted((scene["tmp"] / "scheduled").glob("pygmy-*.tar"))
    assert len(kept) == 2, kept
    for archive in kept:
        assert backup.verify(archive)["orders"] > 0


def test_restore_refuses_a_data_dir_that_holds_a_store(scene: dict[str, Any], tmp_path: Path) -> None:
    d = tmp_path / "d"
    (d / "catalog-1").mkdir(parents=True)
    (d / "catalog-1" / "state.db").write_bytes(b"a store")
    r = pygmy("restore", str(scene["archive"]), "--data-dir", str(d), "--port-base", str(free_port_base()))
    assert r.returncode == 1 and "holds a store already" in r.stderr and "--force" in r.stderr, r.stderr
    assert sorted(p.name for p in d.rglob("*")) == ["catalog-1", "state.db"]
    assert (d / "catalog-1" / "state.db").read_bytes() == b"a store"  # nothing changed
    with tarfile.open(scene["archive"]) as tar:
        assert not {"secret", "admin-token"} & set(tar.getnames())
    # --force: that store deleted, the archive's with its credentials in its place, one replica a tier.
    c = Cluster(d, free_port_base(), ["--catalog-replicas", "1", "--order-replicas", "1"],
                command=("restore", str(scene["with_secrets"]), "--force"))
    c.start()
    try:
        assert c.secret() == scene["secret"]
        assert requests.get(f"{c.url}/lookup/1", timeout=5).json()["stock"] >= 0
        assert requests.post(f"{c.url}/buy/1", json={"quantity": 1}, timeout=10).status_code == 200
    finally:
        c.stop()
    assert sorted(p.name for p in d.iterdir() if p.name.startswith(("catalog-", "order-"))) == ["catalog-1", "order-1"]
