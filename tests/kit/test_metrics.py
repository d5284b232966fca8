"""Scraping the multiprocess metrics while a worker starts (``pygmy.kit.metrics``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_a_metrics_file_just_created_by_another_worker_fails_no_scrape(tmp_path: Path) -> None:
    """A worker's file exists empty for an instant before it is sized: a scrape then must count the
    other workers' samples and skip it, not fail. Run in a process of its own, since the
    multiprocess directory must be set before prometheus-client is first imported."""
    script = f"""
import os
os.environ["PROMETHEUS_MULTIPROC_DIR"] = {str(tmp_path)!r}
from prometheus_client import Counter
from pygmy.kit import metrics
c = Counter("pygmy_test_events_total", "test", ["kind"])
c.labels("a").inc(3)
open(os.path.join({str(tmp_path)!r}, "counter_999999.db"), "wb").close()  # created, not yet sized
print(metrics.totals("pygmy_test_events_total", "kind"))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "{'a': 3.0}"
