"""``pygmy up`` / ``kill`` / ``start`` as a user runs them, and durability across whole-cluster restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from harness import Cluster, free_port_base, pygmy

from pygmy.catalog.books import DEFAULT_BOOKS
from pygmy.catalog.state import CatalogState
from pygmy.client.api import PygmyError
from pygmy.cluster import launcher
from pygmy.kit.config import ClusterConfig


def groups(data_dir: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in (data_dir / "run").glob("*.pid")}


def alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_up_writes_run_files_and_stops_everything(tmp_path: Path) -> None:
    c = Cluster(tmp_path / "d", free_port_base(), ["--frontend-workers", "2"]).start(reset=True)
    try:
        names = {f"{t}-{k}" for t in ("catalog", "order") for k in (1, 2, 3)} | {"frontend-1"}
        pids = groups(c.data_dir)
        assert set(pids) == names
        assert all(alive(p) for p in pids.values())
        assert c.config()["port_base"] == c.port_base
        assert {p.stem for p in (c.data_dir / "logs").glob("*.log")} == names
        assert (c.data_dir / "secret").stat().st_mode & 0o077 == 0
    finally:
        c.stop()
    assert c.proc is not None and c.proc.returncode == 0
    # What ``up`` had to SIGKILL (slow to stop on a busy machine) may take a moment to exit, and its
    # zombies wait for whoever reaps them; neither is a service left running.
    deadline = time.monotonic() + 10
    while launcher.group_members(pids.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not launcher.group_members(pids.values()), "pygmy up left services running"
    assert groups(c.data_dir) == {}


def test_kill_and_start_one_service(fresh_cluster: Cluster) -> None:
    c = fresh_cluster
    pid = groups(c.data_dir)["order-2"]
    c.kill("order-2")
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)
    with pytest.raises(requests.RequestException):
        requests.get(c.replica_url("order-2") + "/health", timeout=1)
    r = pygmy("kill", "order-2", "--data-dir", str(c.data_dir))
    assert r.returncode != 0 and "not running" in r.stderr
    c.restart("order-2")
    assert requests.get(c.replica_url("order-2") + "/health", timeout=2).status_code == 200
    assert groups(c.data_dir)["order-2"] != pid
    r = pygmy("start", "order-2", "--data-dir", str(c.data_dir))
    assert r.returncode != 0 and "already running" in r.stderr
    r = pygmy("kill", "nonsense-9", "--data-dir", str(c.data_dir))
    assert r.returncode != 0 and "unknown service name" in r.stderr
    with c.client() as client:
        assert client.buy(1)["item_number"] == 1


def snapshot(c: Cluster, orders: list[int]) -> tuple[list[int], list[dict]]:
    with c.client() as client:
        stock = [client.lookup(i)["stock"] for i in range(1, 8)]
        return stock, [client.order(n) for n in orders]


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_whole_cluster_restart_loses_nothing(tmp_path: Path, how: str) -> None:
    c = Cluster(tmp_path / "d", free_port_base(), []).start(reset=True)
    try:
        with c.client() as client:
            orders = [client.buy(1 + i % 7, quantity=1 + i % 3)["order_number"] for i in range(12)]
            client.update(2, stock_delta=7, cost=99.0)
        before = snapshot(c, orders)
        if how == "sigkill":
            c.crash()
        else:
            c.stop()
        c.start(reset=False)
        assert snapshot(c, orders) == before
        with c.client() as client:
            assert client.lookup(2)["cost"] == 99.0
            assert client.buy(3)["order_number"] > max(orders)
    finally:
        c.stop()


def test_reset_starts_empty(tmp_path: Path) -> None:
    c = Cluster(tmp_path / "d", free_port_base(), []).start(reset=True)
    try:
        with c.client() as client:
            n = client.buy(1)["order_number"]
        c.stop()
        c.start(reset=True)
        with c.client() as client, pytest.raises(PygmyError) as e:
            client.order(n)
        assert e.value.status == 404
    finally:
        c.stop()


@pytest.mark.parametrize(("content", "says"), [
    ('[{"item_number": 1, "title": "a", "topic": "t"}, {"item_number": 2, "title": "b", "topic": "t", "stock": -1}]',
     "book #2 (item_number 2): stock must be"),
    ('[{"item_number": 5, "title": "a", "topic": "t"}, {"item_number": 5, "title": "b", "topic": "t"}]',
     "book #2 (item_number 5): item_number must be a unique"),
    ('[{"item_number": 1, "topic": "t"}]', "book #1 (item_number 1): missing field 'title'"),
    ('[{"item_number": 1, "title": "a", "topic": "t"},', "is not JSON: Expecting value at line 1"),
    ('{"books": 7}', "expected a JSON list of books"),
])
def test_up_names_the_bad_book_and_starts_nothing(tmp_path: Path, content: str, says: str) -> None:
    books = tmp_path / "books.json"
    books.write_text(content)
    data = tmp_path / "data"
    r = pygmy("up", "--port-base", str(free_port_base()), "--data-dir", str(data), "--books", str(books), timeout=30)
    assert r.returncode == 1 and says in r.stderr, r.stderr
    assert not (data / "run").exists() or not any((data / "run").iterdir())  # no service was started


def test_up_refuses_busy_ports(tmp_path: Path, cluster: Cluster) -> None:
    r = pygmy("up", "--port-base", str(cluster.port_base), "--data-dir", str(tmp_path / "other"), timeout=30)
    assert r.returncode != 0 and "in use" in r.stderr


# -- stale pid files: after a crash or a reboot ----------------------------------------------------------
SERVICES = [f"{t}-{k}" for t in ("catalog", "order") for k in (1, 2, 3)] + ["frontend-1"]


@pytest.fixture
def others() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Programs that are not Pygmy, each leading a process group of its own as a service would;
    every one is killed and reaped afterwards."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:  # reaps a zombie; a live one leads its own group
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def other(procs: list[subprocess.Popen[bytes]], *cmd: str, stdout: Path | None = None) -> int:
    with open(stdout or os.devnull, "ab") as out:
        procs.append(subprocess.Popen(list(cmd or ("sleep", "60")), start_new_session=True, stdout=out))
    return procs[-1].pid


def test_running_is_only_this_service_of_this_data_dir(tmp_path: Path, others: list) -> None:
    """A pid file counts only for a live ``pygmy serve`` of that very service with this data dir."""
    config = ClusterConfig(data_dir=str(tmp_path / "d"))
    config.run_dir().mkdir(parents=True)
    config.log_dir().mkdir()
    fake = [sys.executable, "-c", "import time; time.sleep(60)", "serve", "catalog", "--id", "2", "--data-dir"]
    # What Gunicorn's master looks like once setproctitle has replaced its arguments.
    retitled = ["bash", "-c", 'exec -a "gunicorn: master [pygmy-catalog-2]" sleep 60']
    cases = {
        "sleep 60": other(others),
        "looks like catalog-2 here": other(others, *fake, str(config.root)),
        "catalog-2 of another data dir": other(others, *fake, str(tmp_path / "elsewhere")),
        "a zombie": other(others, "true"),
        "retitled, logging here": other(others, *retitled, stdout=config.log_dir() / "catalog-2.log"),
        "retitled, logging elsewhere": other(others, *retitled, stdout=tmp_path / "catalog-2.log"),
    }
    time.sleep(0.5)  # every child has exec'd; `true` has exited and stays a zombie until reaped
    seen = {}
    for what, pid in cases.items():
        config.pid_file("catalog-2").write_text(f"{pid}\n")
        seen[what] = launcher.running(config, "catalog-2")
        config.pid_file("catalog-1").write_text(f"{pid}\n")
        assert launcher.running(config, "catalog-1") is None, what  # the wrong service
    ours = ("looks like catalog-2 here", "retitled, logging here")
    assert seen == {what: pid if what in ours else None for what, pid in cases.items()}
    config.pid_file("catalog-2").write_text(f"{cases['looks like catalog-2 here']}\n")
    os.killpg(cases["looks like catalog-2 here"], signal.SIGKILL)
    assert launcher.running(config, "catalog-2") is None, "SIGKILLed, even before it is reaped"


def test_up_starts_over_pid_files_naming_other_programs(tmp_path: Path, others: list) -> None:
    """After a reboot the pids in the pid files belong to whatever runs now: not a reason to refuse,
    and nothing to kill."""
    data = tmp_path / "d"
    (data / "run").mkdir(parents=True)
    gone = other(others, "true")
    others[-1].wait()  # reaped: no such process any more
    zombie = other(others, "true")
    strangers = {name: other(others) for name in SERVICES}
    strangers["catalog-3"], strangers["order-1"] = gone, zombie
    for name, pid in strangers.items():
        (data / "run" / f"{name}.pid").write_text(f"{pid}\n")
    time.sleep(0.3)
    c = Cluster(data, free_port_base(), [])
    try:
        c.start(reset=False)
        assert set(groups(data)) == set(SERVICES)
        assert not set(groups(data).values()) & set(strangers.values())
        with c.client() as client:
            assert client.buy(1)["item_number"] == 1
        r = pygmy("kill", "catalog-3", "--data-dir", str(data))
        assert r.returncode == 0, r.stderr
    finally:
        c.stop()
    assert all(p.poll() is None for p in others[2:]), "a program named in a stale pid file was signalled"


def test_up_right_after_sigkill_of_every_service(tmp_path: Path) -> None:
    """SIGKILL ``pygmy up`` and every service group, then ``pygmy up`` at once on the same data dir:
    the old processes may still be exiting, zombies or gone, and their pid files are all still there."""
    c = Cluster(tmp_path / "d", free_port_base(), []).start(reset=True)
    try:
        with c.client() as client:
            n = client.buy(2, quantity=3)["order_number"]
        before = groups(c.data_dir)
        c.crash()
        assert groups(c.data_dir) == before, "a crash leaves its pid files behind"
        started = time.monotonic()
        c.start(reset=False)
        took = time.monotonic() - started
        assert set(groups(c.data_dir)) == set(SERVICES)
        assert not set(groups(c.data_dir).values()) & set(before.values())
        with c.client() as client:
            assert client.order(n)["quantity"] == 3
        print(f"pygmy up took {took:.1f} s after the crash")  # a figure for the record (pytest -s), not a check
    finally:
        c.stop()


def test_up_refuses_while_the_services_really_run(cluster: Cluster) -> None:
    before = groups(cluster.data_dir)
    r = pygmy("up", "--port-base", str(free_port_base()), "--data-dir", str(cluster.data_dir), timeout=30)
    assert r.returncode != 0 and "already running" in r.stderr, r.stderr
    assert all(name in r.stderr for name in SERVICES), r.stderr
    assert groups(cluster.data_dir) == before and all(alive(p) for p in before.values())
    r = pygmy("start", "catalog-1", "--data-dir", str(cluster.data_dir))
    assert r.returncode != 0 and "already running" in r.stderr, r.stderr
    with cluster.client() as client:
        assert client.lookup(1)["item_number"] == 1


def test_kill_leaves_a_program_that_reused_the_pid_alone(tmp_path: Path, others: list) -> None:
    config = ClusterConfig(data_dir=str(tmp_path / "d"))
    config.save()
    pid = other(others)
    config.pid_file("order-2").write_text(f"{pid}\n")
    r = pygmy("kill", "order-2", "--data-dir", str(config.root))
    assert r.returncode != 0 and "not running" in r.stderr, r.stderr
    time.sleep(0.2)
    assert others[0].poll() is None


def test_start_up_waits_while_a_service_works_and_fails_when_it_stalls(tmp_path: Path, others: list) -> None:
    """A replica loading a large catalogue is not healthy yet but busy: waited for. One that does no
    work for ``stall`` seconds, or exits, fails the start with its name."""
    config = ClusterConfig(data_dir=str(tmp_path / "d"), port_base=free_port_base())
    config.run_dir().mkdir(parents=True)
    config.log_dir().mkdir()
    idle = other(others)  # sleep 60: alive, never healthy, no CPU
    config.pid_file("catalog-1").write_text(f"{idle}\n")
    with pytest.raises(launcher.LaunchError, match="catalog-1 did not become healthy and did no work for 1 s"):
        launcher.wait_healthy(config, ["catalog-1"], stall=1.0)
    assert others[-1].poll() is None, "failed for its stall, while it still ran (sleep 60), not for its end"
    busy = other(others, sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass")
    config.pid_file("catalog-2").write_text(f"{busy}\n")
    with pytest.raises(launcher.LaunchError, match="catalog-2 exited during start-up"):
        launcher.wait_healthy(config, ["catalog-2"], stall=1.0)  # busy for 3 s: waited for, then gone
    # Waited for past the 1 s stall: it was found gone (not stalled), so it had run its 3 s of work
    # and ended by itself. Found while exiting (not a zombie yet), it may take a moment to be reaped.
    assert others[-1].wait(timeout=5) == 0


def test_a_busy_service_does_not_hide_one_that_stalls(tmp_path: Path, others: list) -> None:
    """Each service has its own stall clock: one that works for longer than the stall (here 4 s of
    CPU) does not keep the start waiting on another that does nothing."""
    config = ClusterConfig(data_dir=str(tmp_path / "d"), port_base=free_port_base())
    config.run_dir().mkdir(parents=True)
    config.log_dir().mkdir()
    busy = other(others, sys.executable, "-c", "import time\nend = time.time() + 4\nwhile time.time() < end: pass")
    config.pid_file("catalog-1").write_text(f"{busy}\n")
    config.pid_file("catalog-2").write_text(f"{other(others)}\n")  # sleep 60: alive, idle
    with pytest.raises(launcher.LaunchError, match="^catalog-2 did not become healthy and did no work for 1 s"):
        launcher.wait_healthy(config, ["catalog-1", "catalog-2"], stall=1.0)
    assert others[0].poll() is None, "failed while the busy one still worked (a shared clock waits it out)"


def test_the_catalogue_is_built_once_for_a_new_cluster_and_kept_once_it_began(tmp_path: Path) -> None:
    config = ClusterConfig(data_dir=str(tmp_path / "d"))
    first = [{"item_number": n, "title": f"b{n}", "topic": "t", "stock": 5, "cost": 1.0} for n in range(1, 50)]
    said: list[str] = []
    launcher.prepare_seed(config, first, said.append)
    seed = config.seed_file()
    assert seed.exists() and "49 books" in said[0] and said[1] == "catalogue: 49 of 49 books"
    del said[1]
    assert [p.name for p in seed.parent.iterdir()] == ["catalog.db"], "one file, nothing half-built beside it"
    # A catalog replica began from it: a later ``up`` naming another file keeps the seed it began from.
    state = CatalogState(config.replica_dir("catalog-1") / "state.db")
    state.restore(0, seed)
    built = seed.stat().st_mtime_ns
    launcher.prepare_seed(config, first[:3], said.append)
    assert seed.stat().st_mtime_ns == built and len(said) == 2
    state.close()
    # After a reset nothing began: the seven built-in books get their seed too, so a replica
    # started from nothing later begins from them whatever file is named then.
    launcher.reset(config)
    launcher.prepare_seed(config, None, said.append)
    fresh = CatalogState(tmp_path / "fresh.db")
    fresh.restore(0, seed)
    assert [fresh.book(n)["title"] for n in (1, 7)] == [DEFAULT_BOOKS[0]["title"], DEFAULT_BOOKS[6]["title"]]
    assert fresh.book(8) is None and len(said) == 2, "nothing said for the built-in books"
    fresh.close()


def test_up_ignores_the_settings_of_one_service(tmp_path: Path) -> None:
    """``PYGMY_PORT`` and the peer URLs are ``serve``'s (the Dockerfile sets ``PYGMY_PORT``): ``up``
    neither uses them nor passes them on, so each service still listens on its own port."""
    port = free_port_base() + 7
    env = {"PYGMY_PORT": str(port), "PYGMY_CATALOG_URLS": "http://127.0.0.1:1", "PYGMY_ADVERTISE_HOST": "nowhere"}
    c = Cluster(tmp_path / "d", free_port_base(), [], env).start(reset=True)
    try:
        config = c.cluster_config()
        assert len({config.listen_port(*launcher.parse_name(n)) for n in config.names()}) == len(config.names())
        assert port not in {config.listen_port(*launcher.parse_name(n)) for n in config.names()}
        client = c.client()
        assert client.buy(1, 1)["item_number"] == 1 and client.lookup(1)["item_number"] == 1
    finally:
        c.stop()


@pytest.mark.parametrize(("setting", "says"), [
    ({"PYGMY_RAFT_LEASE_TICKS": "30"}, "need lease_ticks < election_ticks_min"),
    ({"PYGMY_RAFT_HEARTBEAT_TICKS": "40"}, "need 1 <= heartbeat_ticks < election_ticks_min"),
    ({"PYGMY_FRONTEND_BUY_LINGER": "-0.01"}, "--frontend-buy-linger must be 0 to 1 s"),
])
def test_up_refuses_unsafe_raft_settings_before_starting_anything(tmp_path: Path, setting: dict[str, str],
                                                                  says: str) -> None:
    """A lease as long as the election window would let a follower elect a second leader while the
    first still reads from its lease: refused at once, named, with no service started."""
    r = pygmy("up", "--data-dir", str(tmp_path / "d"), "--port-base", str(free_port_base()), env=setting)
    assert r.returncode != 0 and says in r.stderr, r.stderr
    assert not (tmp_path / "d" / "run").exists() or groups(tmp_path / "d") == {}


def test_pygmy_member_in_a_container_takes_the_tiers_from_the_environment(tmp_path: Path, cluster: Cluster) -> None:
    """In a container there is no cluster.json: ``pygmy member`` asks the replicas that
    ``PYGMY_<TIER>_URLS`` names (with ``PYGMY_SECRET``), as ``pygmy serve`` reads them, and records
    nothing; a replica started with its name in ``PYGMY_<TIER>_LEARNERS`` joins as a learner."""
    config = cluster.cluster_config()
    env = {"PYGMY_CATALOG_URLS": ",".join(config.peers("catalog").values()), "PYGMY_SECRET": cluster.secret(),
           "PYGMY_DATA_DIR": str(tmp_path)}
    r = pygmy("member", "list", "catalog", "--json", "--data-dir", str(tmp_path), env=env)
    assert r.returncode == 0, r.stderr
    assert {m["name"] for m in json.loads(r.stdout)["members"]} == set(config.peers("catalog"))
    assert not (tmp_path / "run").exists()
    r = pygmy("member", "list", "catalog", "--data-dir", str(tmp_path), env={"PYGMY_DATA_DIR": str(tmp_path)})
    assert r.returncode == 1 and "cluster.json not found" in r.stderr
    from pygmy.cluster.cli import build_parser, resolve

    args = build_parser(True).parse_args(["serve", "catalog", "--id", "4", "--data-dir", str(tmp_path)])
    urls = "http://c1:8000,http://c2:8000,http://c3:8000,http://c4:8000"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYGMY_CATALOG_URLS", urls)
        mp.setenv("PYGMY_CATALOG_LEARNERS", "catalog-4")
        joined = resolve(args, use_cluster_file=True, serve=True)
        assert joined.peers("catalog")["catalog-4"] == "http://c4:8000" and joined.learners("catalog") == ["catalog-4"]
        assert resolve(args, use_cluster_file=False).learners("catalog") == []  # pygmy up ignores it


def test_the_buys_linger_is_set_by_option_or_environment(tmp_path: Path) -> None:
    from pygmy.cluster.cli import build_parser, resolve

    parser = build_parser()
    assert resolve(parser.parse_args(["up", "--data-dir", str(tmp_path)]), False).frontend_buy_linger == 0.02
    off = parser.parse_args(["up", "--data-dir", str(tmp_path), "--frontend-buy-linger", "0"])
    assert resolve(off, False).frontend_buy_linger == 0.0
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYGMY_FRONTEND_BUY_LINGER", "0.005")
        assert resolve(parser.parse_args(["up", "--data-dir", str(tmp_path)]), False).frontend_buy_linger == 0.005


SPINNERS = """
import os, sys, threading
def spin():
    while True:
        pass
if os.fork() == 0:  # a worker of the group, as Gunicorn's
    for _ in range(3):
        threading.Thread(target=spin, daemon=True).start()
    spin()
for _ in range(3):
    threading.Thread(target=spin, daemon=True).start()
print("spinning", flush=True)
spin()
"""


def test_pause_returns_once_every_thread_of_the_group_has_stopped() -> None:
    """``kill()`` returns before a group's threads stop; ``pause`` returns only after. Two processes
    of eight busy threads on two cores: right after ``pause`` every thread reads as stopped, and no
    CPU is used from then on."""
    proc = subprocess.Popen([sys.executable, "-c", SPINNERS], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "spinning\n"

        def tasks() -> list[str]:
            return [f"/proc/{p.pid}/task/{tid}" for p in launcher._group(proc.pid) for tid in os.listdir(f"/proc/{p.pid}/task")]

        deadline = time.monotonic() + 10
        while len(tasks()) < 8:  # the forked worker starts its threads on its own
            assert time.monotonic() < deadline, tasks()
            time.sleep(0.01)
        members = [p.pid for p in launcher._group(proc.pid)]
        assert len(members) == 2
        launcher.pause(proc.pid)
        assert launcher._running_threads(members) == []
        assert len(tasks()) == 8
        ticks = sum(p.cpu_ticks for p in launcher._group(proc.pid))
        time.sleep(0.3)
        assert sum(p.cpu_ticks for p in launcher._group(proc.pid)) == ticks, "a paused group used CPU"
        os.killpg(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while not launcher._running_threads(members):
            assert time.monotonic() < deadline, "SIGCONT did not resume the group"
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close() if proc.stdout else None


def test_pause_of_a_group_that_is_gone_raises_process_lookup_error() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    with pytest.raises(ProcessLookupError):
        launcher.pause(proc.pid)


def test_up_with_reset_refuses_while_a_replica_added_by_pygmy_member_runs(tmp_path: Path, monkeypatch) -> None:
    """``--reset`` derives the members from the flags, but a replica ``pygmy member`` added (its
    directory and pid file in the data dir) that still runs is found, and nothing is deleted."""
    config = ClusterConfig(data_dir=str(tmp_path / "d"))
    (config.root / "catalog-4").mkdir(parents=True)
    (config.root / "catalog-4" / "state.db").write_text("kept")
    monkeypatch.setattr(launcher, "running", lambda config, name: 4242 if name == "catalog-4" else None)

    def never(*args: object) -> None:
        raise AssertionError("went on past the check")

    monkeypatch.setattr(launcher, "reset", never)  # (nothing is deleted nor started, whatever happens)
    monkeypatch.setattr(launcher, "spawn", never)
    with pytest.raises(launcher.LaunchError, match=r"already running .*catalog-4 \(pid 4242\)"):
        launcher.up(config, reset_state=True)
    assert (config.root / "catalog-4" / "state.db").read_text() == "kept"
