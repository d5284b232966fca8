"""Quick nemesis runs on real processes in network namespaces, judged by the chaos checker.

One clean run with every fault kind must find no anomaly (the host kinds too: a host isolated, one
slow and lossy, and one lost for good and replaced by a new host with ``pygmy member``); one run of a deliberately broken build
(``stale-leader``: a leader that neither checks its lease nor steps down when cut off) must be caught,
so the checker is shown to fail when a guarantee breaks. ``make chaos`` is the long version.

Each takes both cores for a minute or two: they run in ``make test-nemesis`` (``.ci/run`` runs it
after ``make test``), not in ``make test``, whose 10 minutes on 2 cores could not hold them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import cluster_env

from pygmy.verify import chaos, chaos_check, nemesis

pytestmark = [pytest.mark.nemesis_run,  # ``make test-nemesis`` (and .ci/run), not ``make test``
              pytest.mark.skipif(bool(nemesis.missing_tools()), reason=f"needs {nemesis.missing_tools()}"),
              # The nemesis fills disks: replicas count storage faults and log them, nothing else.
              pytest.mark.allow_faults("storage", logs=[r"disk full: database or disk is full"])]



def test_a_quick_run_with_every_fault_finds_no_anomaly(tmp_path: Path) -> None:
    # Half the clients of a chaos run (ChaosWorkload's defaults): the other nemesis run goes beside it.
    out = chaos.run(40, seed=11, out=tmp_path / "run",
                    clients={"writers": 4, "readers": 2, "buyers": 2, "order_readers": 1})
    result = chaos_check.check(out)
    assert result["ok"], chaos_check.summary(result)
    assert set(result["faults"]) == set(nemesis.KINDS), result["faults"]  # every kind was applied
    ok = sum(v for k, v in result["by_outcome"].items() if not k.endswith("/unknown"))
    assert ok > 1000 and result["by_outcome"].get("buy/ok", 0) > 50, result["by_outcome"]
    assert result["by_outcome"].get("buy/out_of_stock", 0) > 0, "two books are meant to sell out"
    final = json.loads((out / "final.json").read_text())
    assert final["converged"] and len(final["integrity"]) == 12  # 6 replicas x (log, state), all checked
    # Every update of unknown outcome was sent again under its key and answered on the healed
    # cluster: the stock equation was exact.
    ops = json.loads((out / "history.json").read_text())["ops"]
    unknown = {op["input"]["key"] for op in ops if op["kind"] == "update" and op["output"] is None}
    assert set(final["settled_updates"]) == unknown and None not in final["settled_updates"].values(), final["settled_updates"]
    # Each lost host was replaced: the lost replicas are gone, the new hosts' replicas are the ones
    # read and checked (and their databases), each added, caught up, promoted, then the old removed.
    steps = [w["steps"] for w in json.loads((out / "nemesis.json").read_text())["windows"] if w["kind"] == "host-lost"]
    lost = {s[0]["name"] for s in steps}
    new = {s[1]["name"] for s in steps} - lost
    assert all([x["action"] for x in s] == ["lost", "new-host", "add", "started", "caught-up", "promote", "remove"] for s in steps)
    assert new and new <= set(final["replicas"]) and not lost & set(final["replicas"]), (lost, new)
    assert {n.partition("/")[0] for n in final["integrity"]} == set(final["replicas"])


def test_the_checker_catches_an_isolated_leader_serving_stale_reads(tmp_path: Path) -> None:
    env = cluster_env(PYGMY_MUTATION="stale-leader")
    # Isolations of 2-3 s: long enough that a new leader takes writes while the old one still answers.
    # (20 s gave 7 isolations and every book proved not linearizable: a few are plenty.)
    out = chaos.run(12, seed=3, out=tmp_path / "run", kinds=("isolate-catalog-leader",), env=env, hold=(2.0, 3.0))
    result = chaos_check.check(out)
    assert not result["ok"], "a leader serving reads while cut off from its peers went unseen"
    assert "linearizable" in result["anomalies_by_kind"], chaos_check.summary(result)
    assert chaos_check.main([str(out)]) == 1
