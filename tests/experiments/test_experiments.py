"""Each experiment end to end at tiny size: it runs, writes its results and its plot, and the report renders.

One shared default cluster serves every experiment that does not need its own settings; output goes
to a tmp dir, never the repo. No timing is asserted anywhere.
"""

from __future__ import annotations

import csv
import importlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pygmy.experiments import baseline, report
from pygmy.experiments import harness as h

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[h.Settings]:
    out = tmp_path_factory.mktemp("experiments")
    s = h.Settings(tiny=True, results_dir=out / "results", plots_dir=out / "plots", progress=False)
    with h.cluster(s) as c:
        s.shared = c
        yield s


def _check(s: h.Settings, name: str) -> dict:
    data = json.loads((s.results_dir / f"{name}.json").read_text())
    assert data["table"]["rows"], name
    for plot in data["plots"]:
        assert (s.plots_dir / plot).stat().st_size > 1000, plot
    assert data["machine"]["cores"] >= 1
    return data


SHARED = ["sequential", "cache_miss", "invalidation", "concurrency", "scaling", "recovery", "failover"]


@pytest.fixture(scope="module")
def ran(settings: h.Settings) -> dict[str, BaseException | None]:
    """Every experiment of the shared cluster, run once in order, whichever tests are selected."""
    out: dict[str, BaseException | None] = {}
    for name in SHARED:
        try:
            importlib.import_module(f"pygmy.experiments.{name}").run(settings)
            out[name] = None
        except Exception as exc:  # reported by that experiment's test
            out[name] = exc
    return out


@pytest.mark.parametrize("name", SHARED)
def test_experiment_runs_on_shared_cluster(settings: h.Settings, ran: dict, name: str) -> None:
    if ran[name] is not None:
        raise ran[name]
    data = _check(settings, name)
    assert data["size"] == "tiny"


def test_failover_marks_the_kill_and_a_new_leader(settings: h.Settings, ran: dict) -> None:
    events = json.loads((settings.results_dir / "failover.json").read_text())["events"]
    ev = events[0]
    assert ev["victim"] == ev["old_leader"]
    assert ev["kill"] > 0 and ev["new_leader"] not in (None, ev["victim"])
    assert ev["switch"] is not None and ev["switch"] > ev["kill"], ev  # seen after the kill, not before
    # What the load saw (every request: op, start, status): buys answered by the new leader, sent
    # after the kill; no read failed; a buy failed only as the contract allows in a failover (503).
    with (settings.results_dir / "failover_raw.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["scenario"] == ev["scenario"] and r["trial"] == str(ev["trial"])]
    assert any(r["op"] == "buy" and r["status"] == "200" and float(r["start_s"]) > ev["kill"] for r in rows), \
        "no buy sent after the kill was answered"
    failed = [(r["op"], r["status"]) for r in rows if r["status"] != "200"]
    assert all(op == "buy" and status == "503" for op, status in failed), failed[:5]
    assert ev["errors"]["lookup"] == ev["errors"]["search"] == 0, ev["errors"]


def test_a_paused_leader_is_left_for_a_new_one_and_resumed_after(settings: h.Settings, ran: dict) -> None:
    """``failover.trial(pause=...)``: SIGSTOP, not SIGKILL. Buys go on at a new leader, and the old one
    is running again (not stopped) and caught up when the trial returns, without a restart."""
    from pygmy.experiments import failover

    c = settings.shared
    assert c is not None
    ev = failover.trial(c, "order-leader", 2, 0.5, 2.0, seed=0, pause=1.0)["event"]
    assert ev["fault"] == "SIGSTOP 1 s" and ev["new_leader"] not in (None, ev["victim"])
    assert ev["errors"]["buy"] == 0 and ev["buy_window_ms"] > 0
    pgid = c.process_groups()[ev["victim"]]
    state = Path(f"/proc/{pgid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert state != "T", "the paused replica was not resumed"
    assert (h.replica_status(c, ev["victim"]) or {}).get("role") == "follower"


def test_cache_size_uses_its_own_catalogue(settings: h.Settings) -> None:
    from pygmy.experiments import cache_size

    cache_size.run(settings)
    data = _check(settings, "cache_size")
    assert [r[0] for r in data["table"]["rows"]] == [10, 1000]


def test_store_size_measures_each_catalogue_size(settings: h.Settings) -> None:
    from pygmy.experiments import store_size

    store_size.run(settings)
    data = _check(settings, "store_size")
    assert [r[0] for r in data["table"]["rows"]] == ["7", "1,000", "1,000 + 600 orders"]
    big, grown = data["results"][1:]
    assert big["lookup"]["n"] == 10 and set(big["rss_mib"]) >= {"catalog-1", "order-1", "frontend-1"}
    assert all(mib > 0 for sizes in big["rss_mib"].values() for mib in sizes)
    assert grown["orders"] == 600 and grown["orders_per_s"] > 0 and grown["buy"]["n"] == 10
    assert all(r[op]["ratio"] > 0 and r[op]["base_p50"] > 0 for r in data["results"] for op in store_size.OPS)


def test_rebuild_brings_a_wiped_follower_back_by_a_snapshot(settings: h.Settings) -> None:
    from pygmy.experiments import rebuild

    out = rebuild.run(settings)
    assert out["books"] == 20_000 and out["snapshots_installed"] == 1 and out["digests_equal"]
    assert out["victim_peak_mib"] > 0 and out["steady_follower_rss_mib"] > 0 and out["leader_peak_mib"] > 0
    assert (settings.results_dir / "rebuild.json").exists()


def test_report_renders_every_result(settings: h.Settings, ran: dict, tmp_path: Path) -> None:
    baseline.of_run(settings)  # measured once per run (already, if an experiment ran first) and saved
    out = report.write(settings.results_dir, settings.plots_dir, tmp_path / "REPORT.md")
    text = out.read_text()
    assert "# Pygmy performance report" in text and "9. Machine baseline" in text
    for name in ("sequential", "cache_miss", "invalidation", "concurrency", "scaling", "failover", "recovery"):
        assert (settings.results_dir / f"{name}.json").exists()
    assert "![sequential_series.png]" in text


def test_stats_come_from_complete_records() -> None:
    s = h.stats([0.001 * i for i in range(1, 101)])
    assert s["n"] == 100 and s["p50"] == pytest.approx(50.5) and s["p99"] == pytest.approx(99.01)
    assert h.stats([])["p50"] is None


def test_open_loop_counts_from_the_scheduled_time(settings: h.Settings) -> None:
    rec = h.run_load(settings.shared.url, 2, {"lookup": 1.0}, duration=1.0, rate=20)
    assert 10 <= rec.op.size <= 22
    # scheduled starts are evenly spaced whatever the replies did
    assert max(abs(d - 0.05) for d in h.np.diff(rec.start)) < 1e-6
