from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import CHECKED, FAULTS_AT_STOP, Cluster, hidden_faults, start_cluster, stop_checked  # noqa: E402

from pygmy.cluster.local import LocalCluster  # noqa: E402
from pygmy.replication.node import ReplicaNode  # noqa: E402

# -- hidden faults fail the test that hid them -----------------------------------------------------
# A replica's event loop survives any error in a turn (it reloads from disk), a sender thread
# survives a failed batch, and a service logs a traceback and answers 500 or goes on. Clients may
# never notice, so a test that looks only from outside would pass on a build whose turns keep
# failing. Every cluster and every in-process node a test starts is therefore checked when the
# test ends: no replica counted a loop fault and no service logged a traceback, except what the
# test declares it injects with ``@pytest.mark.allow_faults(...)``.

_clusters: list[LocalCluster] = []
_stopped: set[LocalCluster] = set()
_nodes: list[ReplicaNode] = []


def pytest_configure(config: pytest.Config) -> None:
    worker = getattr(config, "workerinput", None)  # an xdist worker: ports of its own (pygmy/cluster/local.py)
    if worker is not None:
        os.environ["PYGMY_PORT_SLICE"] = f"{worker['workerid'].removeprefix('gw')}/{worker['workercount']}"
    config.addinivalue_line(
        "markers",
        "allow_faults(*kinds, logs=()): the faults this test injects on purpose: loop fault kinds a "
        "replica may count (storage, error, sender) and regular expressions for tracebacks its services "
        "may log (matched against '<service>: <logging line> | <exception>')")
    config.addinivalue_line(
        "markers",
        "nemesis_run: a whole cluster in network namespaces under the nemesis (minutes each, both cores): "
        "left out of make test's 10 minutes, run by make test-nemesis (and .ci/run)")
    _start, _stop, _init = LocalCluster.start, LocalCluster.stop, ReplicaNode.__init__

    def start(self: LocalCluster, *args, **kwargs):  # type: ignore[no-untyped-def]
        _clusters.append(self)
        return _start(self, *args, **kwargs)

    def stop(self: LocalCluster, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        if self.proc is not None and self.proc.poll() is None:
            FAULTS_AT_STOP[self] = self.loop_faults()
        _stopped.add(self)
        _stop(self, *args, **kwargs)

    def init(self: ReplicaNode, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        _init(self, *args, **kwargs)
        _nodes.append(self)

    LocalCluster.start = start  # type: ignore[method-assign]
    LocalCluster.stop = stop  # type: ignore[method-assign]
    ReplicaNode.__init__ = init  # type: ignore[method-assign]


def _allowed(item: pytest.Item) -> tuple[tuple[str, ...], tuple[str, ...]]:
    kinds: list[str] = []
    logs: list[str] = []
    for mark in item.iter_markers("allow_faults"):
        kinds += mark.args
        logs += mark.kwargs.get("logs", ())
    return tuple(kinds), tuple(logs)


@pytest.fixture(autouse=True)
def _no_hidden_faults(request: pytest.FixtureRequest) -> Iterator[None]:
    """Torn down after every other fixture of the test: every cluster stopped by then and every node
    started meanwhile is checked (a cluster still running, e.g. the session's, when it stops)."""
    nodes_before = len(_nodes)
    yield
    kinds, logs = _allowed(request.node)
    problems: list[str] = []
    for c in [c for c in _clusters if c in _stopped]:
        _clusters.remove(c)
        if c not in CHECKED:
            problems += hidden_faults(c, kinds, logs)
        FAULTS_AT_STOP.pop(c, None)
    for node in _nodes[nodes_before:]:
        problems += [f"in-process {node.name}: {n} loop fault(s) of kind {k!r} (last: {node.last_loop_fault})"
                     for k, n in sorted(node.loop_faults.items()) if n and k not in kinds]
    del _nodes[nodes_before:]
    if problems:
        pytest.fail("faults hidden from clients (declare injected ones with @pytest.mark.allow_faults):\n"
                    + "\n".join(problems[:20]), pytrace=False)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One default cluster (3 replicas per tier, 2 frontend workers) shared by read-mostly tests."""
    c = start_cluster(tmp_path_factory.mktemp("shared"))
    yield c
    stop_checked(c)


@pytest.fixture
def fresh_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A cluster of one's own, for tests that kill, restart or count stock exactly."""
    c = start_cluster(tmp_path)
    yield c
    c.stop()


# -- the long tests first ---------------------------------------------------------------------------
#: Folders whose tests start clusters of their own and take tens of seconds to minutes each.
LONG = ("system", "verify", "experiments")


@pytest.hookimpl(trylast=True)  # after ``-m`` and ``-k`` deselected theirs: the shares count what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Long tests first. Under xdist's ``worksteal``, which hands each worker one contiguous share
    of this order at the start (idle workers then steal the tail of the longest queue), the long
    modules are dealt whole, the one with most tests first, each to the share with the fewest long
    tests so far, at its head; the rest fill each share after them. With every long test at the
    head of the whole list, the first worker got nearly all of them and the minutes-long ones ran
    on at the end; dealt one test at a time, a module's fixtures (a cluster each) were built on
    every worker."""
    here = Path(__file__).resolve().parent

    def long(item: pytest.Item) -> bool:
        path = Path(str(item.path)).resolve()
        return path.is_relative_to(here) and path.relative_to(here).parts[0] in LONG

    slow = [i for i in items if long(i)]
    rest = [i for i in items if not long(i)]
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if workers <= 1 or config.getoption("dist", "no") != "worksteal":
        items[:] = slow + rest
        return
    modules: dict[str, list[pytest.Item]] = {}
    for item in slow:
        modules.setdefault(str(item.path), []).append(item)
    shares: list[list[pytest.Item]] = [[] for _ in range(workers)]
    for tests in sorted(modules.values(), key=len, reverse=True):
        min(shares, key=len).extend(tests)
    # The shares xdist cuts: worker k takes len(pending) // (workers - k) of what is left.
    left = len(items)
    for k, share in enumerate(shares):
        size = left // (workers - k)
        left -= size
        take = max(0, size - len(share))
        share.extend(rest[:take])
        del rest[:take]
    shares[-1].extend(rest)
    items[:] = [i for share in shares for i in share]


# -- no silent skips where every test must run -----------------------------------------------------
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under ``PYGMY_NO_SKIP=1`` (``.ci/run``) a skipped test fails the run: CI installs what every
    test needs, so a skip there means a test silently stopped running. Locally a skip prints why
    (``-ra``) and the run passes."""
    if os.environ.get("PYGMY_NO_SKIP") != "1" or hasattr(session.config, "workerinput"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped:
        reporter.write_line(f"PYGMY_NO_SKIP=1: {len(skipped)} test(s) skipped; every test must run here:", red=True)
        for rep in skipped:
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            reporter.write_line(f"  {rep.nodeid}: {reason}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
