"""The README's figures cannot drift from the results they quote.

The README carries its measured figures in one marked block (written by ``python -m
pygmy.experiments.report --readme`` from ``experiments/results/``). These tests read the result files
themselves and check every number of the block against them, rounded as the README shows it; that
no figure lies outside the block; and that the README stays a front door (at most 160 lines).
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pygmy.experiments import report

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS = ROOT / "experiments" / "results"
NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")  # not the 50 of "p50"
#: A measured figure: a number with a unit of time, rate, ratio, share or memory.
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:ms|us|s|%|x|req/s|buys/s|MiB)(?![\w-])")


def _catch_up(r: dict[str, Any]) -> list[float]:
    p = next(p for p in r["catch_up"] if p["k"] == 10_000)
    return [(p["caught_up_s"] - p["start_cmd_s"]) * 1000]


def _window(w: list[float]) -> list[float]:
    return [statistics.median(w), max(w), len(w)]


#: Each figure of the block: its result file, and the raw numbers its value shows, in order.
EXPECTED: dict[str, tuple[str, Callable[[Any], list[float]]]] = {
    "sequential durable buy, 3 replicas per tier":
        ("bench", lambda r: [r["buy_3"]["p50"], r["buy_3"]["paired"]["ratio"]]),
    "cached lookup":
        ("bench", lambda r: [r["cached_lookup"]["sequential"]["p50"], r["cached_lookup"]["paired"]["ops_ratio"]]),
    "32 closed-loop buyers, 1,000 books":
        ("writepath", lambda r: [r["buyers"]["buys_per_s"], r["buyers"]["buys_per_s"] / r["bare_post"]["ops_per_s"],
                                 r["buyers"]["errors"]]),
    "idle default cluster, every process":
        ("writepath", lambda r: [100 * r["idle"]["cpu_share_of_one_core"], r["idle"]["seconds"]]),
    "longest gap between buys, catalog leader SIGKILLed":
        ("bench", lambda r: _window(r["buy_window_ms"]["catalog leader SIGKILL"])),
    "catch-up of 10,000 missed updates": ("bench", _catch_up),
    "1,000,000 books: `pygmy up --books` ready":
        ("store_size", lambda r: [next(x for x in r if x["books"] == 1_000_000 and not x.get("orders"))["ready_s"]]),
    "wiped follower of 1,000,000 books current again":
        ("rebuild", lambda r: [r["rebuilt_s"], r["victim_peak_over_steady"]]),
}


def _readme() -> str:
    return README.read_text()


def _block() -> list[str]:
    text = _readme()
    assert text.count(report.README_START) == 1 and text.count(report.README_END) == 1
    start = text.index(report.README_START) + len(report.README_START)
    return text[start:text.index(report.README_END)].strip("\n").splitlines()


def _rows() -> dict[str, str]:
    rows = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in _block() if line.startswith("| ")]
    assert rows[0] == ["measure", "value", "measured by"]
    return {measure: value for measure, value, _ in rows[1:]}


def _results(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def test_the_readme_is_a_front_door() -> None:
    assert len(_readme().splitlines()) <= 160


def test_every_quoted_figure_equals_the_newest_results_rounded_as_shown() -> None:
    rows = _rows()
    assert set(rows) == set(EXPECTED), "a figure in the README's block that this test does not check, or one missing"
    for measure, value in rows.items():
        name, raw = EXPECTED[measure]
        shown = NUMBER.findall(value)
        expected = raw(_results(name)["results"])
        assert len(shown) == len(expected), (measure, value)
        for text, number in zip(shown, expected, strict=True):
            digits = len(text.partition(".")[2])
            assert text.replace(",", "") == f"{number:.{digits}f}", f"{measure}: README says {text}, results give {number}"


def test_the_block_says_when_its_run_saved_them() -> None:
    saved = sorted(_results(name)["machine"]["date"] for name, _ in EXPECTED.values())
    line = _block()[0]
    assert f"Results saved {saved[0][:10]} {saved[0][11:16]}-{saved[-1][11:16]} UTC" in line
    assert {f"{name}.json" for name, _ in EXPECTED.values()} <= set(re.findall(r"\w+\.json", line))
    sizes = {_results(name)["size"] for name, _ in EXPECTED.values()}
    assert f"size {', '.join(sorted(sizes))}" in line


def test_the_block_is_what_the_generator_writes_from_the_results() -> None:
    assert _block() == report.headline_lines(RESULTS)


def test_no_measured_figure_outside_the_block() -> None:
    text = _readme()
    outside = text[:text.index(report.README_START)] + text[text.index(report.README_END):]
    outside = re.sub(r"```.*?```", "", outside, flags=re.S)  # the session's commands and answers
    assert FIGURE.findall(outside) == [], "figures belong in the generated block (python -m pygmy.experiments.report --readme)"


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_the_commit_the_readme_names_is_in_the_history() -> None:
    named = re.search(r"measured on commit ([0-9a-f]{7,40})", _readme())
    assert named, "the README names the commit its figures were measured on"
    out = subprocess.run(["git", "-C", str(ROOT), "merge-base", "--is-ancestor", named.group(1), "HEAD"],
                         capture_output=True, check=False)
    assert out.returncode == 0, f"{named.group(1)} is not a commit of this branch"


def test_the_performance_page_quotes_the_generated_report() -> None:
    """Every number of docs/performance.md's table of today's figures is one the report's `make bench`
    sections print."""
    page = (ROOT / "docs" / "performance.md").read_text()
    table = page.split("## The figures today", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows, "docs/performance.md has a table of today's figures"
    report_md = (ROOT / "experiments" / "REPORT.md").read_text()
    generated = report_md[report_md.index("\n## Benchmark (make bench)"):]  # make bench's sections, the last
    for row in rows:
        for number in NUMBER.findall(row[1]):
            assert re.search(rf"(?<![\d.]){re.escape(number)}(?![\d])", generated), (row[0], number)
