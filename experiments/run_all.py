"""Run every experiment (``make experiments [QUICK=1]``), then write ``experiments/REPORT.md``.

The baseline is measured first, once, and shared by all experiments of the run. One experiment
failing does not stop the others; the failure is recorded and the exit code is non-zero.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

from pygmy.experiments import harness as h

ORDER = ("sequential", "cache_miss", "invalidation", "concurrency", "scaling", "failover", "recovery", "cache_size",
         "overload")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pygmy.experiments.run_all")
    p.add_argument("--quick", action="store_true", help="every experiment at small size (a few minutes)")
    p.add_argument("--only", nargs="*", choices=ORDER, help="run just these")
    p.add_argument("--results-dir", type=Path, default=h.RESULTS)
    p.add_argument("--plots-dir", type=Path, default=h.PLOTS)
    p.add_argument("--report", type=Path, default=h.PACKAGE / "REPORT.md")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    s = h.Settings(quick=a.quick, results_dir=a.results_dir, plots_dir=a.plots_dir, progress=not a.no_progress)
    started = time.monotonic()
    timings: dict[str, float] = {}
    failed: dict[str, str] = {}
    t = time.monotonic()
    from pygmy.experiments import baseline

    s.cache["baseline"] = baseline.measure(s)
    timings["baseline"] = time.monotonic() - t
    for name in a.only or ORDER:
        t = time.monotonic()
        print(f"== {name}", flush=True)
        try:
            importlib.import_module(f"pygmy.experiments.{name}").run(s)
        except Exception:  # keep going: one broken experiment should not hide the others' results
            failed[name] = traceback.format_exc()
            print(failed[name], file=sys.stderr, flush=True)
        timings[name] = time.monotonic() - t
        print(f"   {name}: {timings[name]:.0f} s", flush=True)
    total = time.monotonic() - started
    s.results_dir.mkdir(parents=True, exist_ok=True)
    (s.results_dir / "run_all.json").write_text(json.dumps(
        {"size": s.label, "machine": h.machine(), "seconds": timings, "total_seconds": total,
         "failed": failed}, indent=1))
    from pygmy.experiments import report

    report.write(a.results_dir, a.plots_dir, a.report)
    print(f"all experiments ({s.label}): {total:.0f} s; report {a.report}"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
