"""``pygmy.experiments.wan`` end to end at tiny size, in a network namespace it makes for itself: it
writes its results (with the timers it ran with) and its plot, the report renders them, and nothing
is left behind. No timing is asserted (``python -m pygmy.experiments.wan`` is the measurement)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pygmy.experiments import harness as h
from pygmy.experiments import report, wan
from pygmy.verify import links

pytestmark = [pytest.mark.skipif(bool(links.missing_tools()), reason=f"needs {links.missing_tools()}"),
              pytest.mark.timeout(120)]


def test_the_wan_experiment_measures_each_shape_and_cleans_up(tmp_path: Path) -> None:
    s = h.Settings(tiny=True, results_dir=tmp_path / "results", plots_dir=tmp_path / "plots", progress=False)
    wan.run(s)
    data = json.loads((s.results_dir / "wan.json").read_text())
    adaptive = data["timers"]["modes"]["adaptive"]
    assert data["timers"]["mode"] == "adaptive" and "error" not in adaptive and adaptive["mode"] == "adaptive"
    assert "status" in adaptive or "heartbeat_ms" in adaptive, "what the replicas (or their settings) said of their timers"
    points = data["results"]["points"]
    assert [p["tier"] for p in points] == ["catalog", "catalog"] and not [p for p in points if "error" in p]
    assert {p["timers"] for p in points} == {"adaptive"}  # tiny runs one mode; the full size both
    for p in points:
        for op in ("update", "buy"):
            w = p["window"][op]
            assert w["sent"] > 0 and 0 < w["longest_gap_s"] <= p["window"]["seconds"]
        assert p["window"]["new_terms"] is not None
    assert len(data["table"]["rows"]) == 2
    assert (s.plots_dir / data["plots"][0]).stat().st_size > 1000
    assert "Replica links on a WAN" in report.render(s.results_dir, s.plots_dir, tmp_path / "REPORT.md")
    assert links.CREATED and not set(links.CREATED) & links.made_namespaces()  # its namespace is gone
