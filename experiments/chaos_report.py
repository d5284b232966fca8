"""Section 10 of ``experiments/REPORT.md``: a randomized nemesis run (``pygmy.verify.chaos``), its
timeline drawn, in the report's section format.

``python -m pygmy.experiments.chaos_report --duration 600 --seed 7`` (``make chaos``) takes the same
options as ``python -m pygmy.verify.chaos``, runs and judges it, then writes
``experiments/results/chaos.json`` and the report.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from pygmy.experiments import harness as h
from pygmy.experiments import report
from pygmy.verify import chaos, nemesis


def section(run_dir: Path, result: dict[str, Any]) -> Path:
    """``experiments/results/chaos.json`` in the report's section format (``python -m
    pygmy.experiments.report`` renders it), with the run's timeline copied to ``plots/``."""
    h.PLOTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(run_dir / "timeline.png", h.PLOTS / "chaos_timeline.png")
    outcomes = ", ".join(f"{k} {v}" for k, v in result["by_outcome"].items())
    unavailable = ", ".join(f"{k} {v:.2f} s" for k, v in result["longest_unavailable_s"].items())
    section = {
        "title": "10. Under a randomized nemesis",
        "description": (
            f"`make chaos DURATION={result['duration_s']:.0f} SEED={result['seed']}`: 3 catalog and 3 order "
            "replicas and 2 frontends x 2 workers, each service in its own network namespace, each replica on a "
            "64 MiB tmpfs. Clients update, buy (with and without a key), look up, search and read their orders "
            "through both frontends while one fault at a time is applied (docs/testing.md lists how). "
            f"**{result['operations']} operations** ({outcomes}). Longest time with no answer (a tier; buys, updates): "
            f"{unavailable}. **Anomalies: {sum(result['anomalies_by_kind'].values())}**"
            + (f" ({result['anomalies_by_kind']})" if result["anomalies_by_kind"] else "")
            + f"; every book linearizable: {all(v == 'ok' for v in result['lincheck'].values())}. "
            "The plot shades each fault window; unknown outcomes are operations a client never learned "
            "the end of (the checker lets them have happened or not)."),
        "machine": h.machine(),
        "size": "full" if result["duration_s"] >= 600 else "quick",
        "table": {"columns": ["fault", "applied", "anomalies during it"],
                  "rows": [[k, result["faults"].get(k, 0), result["anomalies_by_fault"].get(k, 0)]
                           for k in nemesis.KINDS]},
        "plots": ["chaos_timeline.png"],
    }
    path = h.RESULTS / "chaos.json"
    path.write_text(json.dumps(section, indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    p = chaos.parser()
    args = p.parse_args(argv)
    args.plot = True
    status, out = chaos.execute(p, args)
    if status in (0, 1):
        section(out, json.loads((out / "check.json").read_text()))
        print(f"report: {report.write()}")
    return status


if __name__ == "__main__":
    sys.exit(main())
