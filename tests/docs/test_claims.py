"""Claims of the docs that the code can check (#41): the metrics table of docs/operations.md names
every metric the services define, each with the type and the labels it is exported with, and no
metric the code does not define.

The metrics are collected three ways, so that a new one cannot slip past: the prometheus-client
metrics registered once every module of the service packages is imported; the families a replica's
scrape-time collector (``pygmy/replication/metrics.py``) yields, run against a stand-in node in a state
that makes it yield all of them; and, as a net for metrics defined where neither reaches (inside a
function, or a family yielded only in some states), every metric constructor in the source called
with a literal ``pygmy_...`` name."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pygmy.kit", "pygmy.replication", "pygmy.cluster", "pygmy.catalog", "pygmy.order", "pygmy.frontend")
#: Calls that make a metric (or, ``gauge``, the helper of ``ReplicaCollector`` that makes one).
CONSTRUCTORS = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum", "gauge"}
#: Gauge modes in which prometheus-client's multiprocess collector adds a ``pid`` label.
PID_MODES = {"all", "liveall"}

Metric = tuple[str, frozenset[str]]  # (type, label names) as exported


def exported(name: str, kind: str) -> str:
    """The name a metric is exported under: a counter's samples end in ``_total``."""
    return name + "_total" if kind == "counter" and not name.endswith("_total") else name


def documented() -> dict[str, Metric]:
    """The rows of the metrics table: ``| `name` | type | labels (values) | what |``."""
    text = (ROOT / "docs" / "operations.md").read_text()
    start = text.index("\n## Metrics\n")
    section = text[start:text.index("\n## ", start + 1)]
    rows: dict[str, Metric] = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`(pygmy_\w+)`\s*\|\s*(\w+)\s*\|([^|]*)\|", line)
        if m:
            name, kind, labels = m.groups()
            assert name not in rows, f"{name} has two rows"
            names = re.sub(r"\([^)]*\)", "", labels)  # "event (`hit`, `miss`)" -> "event"
            rows[name] = (kind, frozenset(x.strip() for x in names.split(",") if x.strip()))
    assert len(rows) > 10, "the metrics table was not found in docs/operations.md"
    return rows


def registered() -> dict[str, Metric]:
    """The prometheus-client metrics the service packages register when imported."""
    for package in PACKAGES:
        for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
            importlib.import_module(info.name)
    out: dict[str, Metric] = {}
    for collector in list(REGISTRY._collector_to_names):  # noqa: SLF001 - no public way to list them
        if isinstance(collector, MetricWrapperBase) and collector._name.startswith("pygmy_"):  # noqa: SLF001
            labels = set(collector._labelnames)  # noqa: SLF001
            if collector._type == "gauge" and getattr(collector, "_multiprocess_mode", "") in PID_MODES:  # noqa: SLF001
                labels.add("pid")
            out[exported(collector._name, collector._type)] = (collector._type, frozenset(labels))  # noqa: SLF001
    return out


def scraped() -> dict[str, Metric]:
    """The families a leader replica's collector yields, with every optional one present."""
    from pygmy.replication.metrics import ReplicaCollector

    node = SimpleNamespace(
        _view={"term": 3, "role": "leader", "commit": 9, "timers": {
            "heartbeat_ms": 50.0, "election_ms": 300.0, "lease_ms": 200.0, "probe_ms": 100.0,
            "rtt_ms": {"catalog-2": 0.4, "catalog-3": 0.5}}}, applied_index=lambda: 8,
        core=SimpleNamespace(last_index=9, progress=lambda peer: SimpleNamespace(match=7)),
        name="catalog-1", peers={"catalog-1": "", "catalog-2": "", "catalog-3": ""},
        elections=1, leader_changes=1, loop_faults={"storage": 0, "error": 0, "sender": 0}, catch_up_seconds=0.5)
    out: dict[str, Metric] = {}
    for family in ReplicaCollector("catalog-1", node).collect():
        labels = frozenset(k for sample in family.samples for k in sample.labels)
        assert family.samples, f"{family.name}: the stand-in node should give every family a sample"
        out[exported(family.name, family.type)] = (family.type, labels)
    return out


def in_source() -> dict[str, str]:
    """Every metric constructor in the service packages called with a literal name: exported name
    -> where it is."""
    out: dict[str, str] = {}
    paths = [p for package in PACKAGES for folder in importlib.import_module(package).__path__
             for p in sorted(Path(folder).rglob("*.py"))]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
                continue
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            name = node.args[0].value
            if (called in CONSTRUCTORS or called.endswith("MetricFamily")) and isinstance(name, str):
                kind = "counter" if called.startswith("Counter") else "other"
                out[exported(name, kind)] = f"{path.relative_to(ROOT)}:{node.lineno}"
    return out


def test_the_metrics_table_lists_every_metric_with_its_type_and_labels() -> None:
    table = documented()
    code = {**registered(), **scraped()}
    missing = sorted(set(code) - set(table))
    assert not missing, f"metrics the code defines that docs/operations.md does not list: {missing}"
    for name, (kind, labels) in code.items():
        assert table[name] == (kind, labels), (
            f"{name}: docs/operations.md says {table[name][0]} with labels {sorted(table[name][1])}; "
            f"the code exports a {kind} with labels {sorted(labels)}")
    literal = in_source()
    unseen = {name: where for name, where in literal.items() if name not in table}
    assert not unseen, f"metrics constructed in the source that docs/operations.md does not list: {unseen}"
    stale = sorted(set(table) - set(code) - set(literal))
    assert not stale, f"docs/operations.md lists metrics the code does not define: {stale}"


def test_the_collection_sees_what_it_should() -> None:
    """The three ways find the known metrics, so an empty or broken collection cannot pass."""
    code, literal = {**registered(), **scraped()}, in_source()
    for name in ("pygmy_http_requests_total", "pygmy_frame_request_seconds", "pygmy_shed_total",
                 "pygmy_invalidation_push_failures_total", "pygmy_replica_commit_seconds"):
        assert name in code and name in literal, name
    for name in ("pygmy_replica_term", "pygmy_replica_catch_up_seconds", "pygmy_replica_loop_faults_total",
                 "pygmy_replica_follower_lag"):
        assert name in code and name in literal, name
    assert code["pygmy_frontend_worker"] == ("gauge", frozenset({"service", "field", "pid"}))
    assert code["pygmy_buy_batch_size"] == ("histogram", frozenset({"service", "what"}))
