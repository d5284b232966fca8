"""Write ``experiments/REPORT.md`` from the result files alone (``python -m pygmy.experiments.report``).

Every experiment saves its own table, comparison and plot names, so the report is generic: it
never recomputes a number, and a rerun of one experiment updates its section only. Since each
experiment may be rerun on its own, the report says where each section came from: when it was
saved, at what size, by which command, and what its ratios divide by.

The headline figures (``HEADLINES``) are the few numbers the README quotes. They are read from the
same result files, rendered at the top of the report, and written into the README's marked block by
``python -m pygmy.experiments.report --readme`` (``tests/docs/test_figures.py`` fails when the two differ).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pygmy.experiments import harness as h

SECTIONS = ("baseline", "sequential", "cache_miss", "invalidation", "concurrency", "scaling", "failover",
            "recovery", "cache_size", "overload", "growth", "store_size", "rebuild", "wan", "replace", "bench",
            "writepath", "chaos", "backup")

#: What ``make bench`` runs, in order (the Makefile); ``bench`` measures the baseline first.
MAKE_BENCH = ("bench", "writepath", "store_size", "rebuild")

#: What a section's ratios divide by, for the sections that store no machine baseline of their own.
DIVISORS = {
    "baseline": "- (this is the baseline)",
    "writepath": "bare endpoints measured within its own run (before and after the cluster's loads)",
    "store_size": "a seven-book store running beside it, timed alternately with it",
    "rebuild": "a healthy follower of the same run",
    "overload": "C, the closed-loop capacity measured at the start of its own run",
    "growth": "the same cluster fresh, at the start of its own run",
    "chaos": "- (no ratios)",
    "wan": "- (no ratios)",
    "replace": "- (no ratios)",
}

README_START = "<!-- figures: written by `python -m pygmy.experiments.report --readme` from experiments/results; do not edit -->"
README_END = "<!-- /figures -->"


def _table(columns: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(h.fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(out)


def _machine(m: dict[str, Any]) -> str:
    load = f", load {m['load_1min']:.1f}" if m.get("load_1min") is not None else ""
    return (f"{m.get('cores')} cores ({m.get('cpu') or 'cpu unknown'}), {m.get('memory_gib')} GiB, "
            f"Python {m.get('python')}, {m.get('platform')}, {m.get('date')}{load}")


def _when(d: dict[str, Any]) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(d["machine"]["date"])
    except (KeyError, TypeError, ValueError):
        return None


def _number(title: str) -> int | None:
    m = re.match(r"(\d+)\.", title)
    return int(m.group(1)) if m else None


def _ordered(data: dict[str, dict[str, Any]]) -> list[str]:
    """Numbered sections by their number, then the unnumbered ones (``make bench``'s) as listed."""
    numbered = sorted((n for n in data if _number(data[n].get("title", "")) is not None),
                      key=lambda n: _number(data[n]["title"]) or 0)
    return numbered + [n for n in SECTIONS if n in data and n not in numbered]


# -- where each section came from -----------------------------------------------------------------------
def _run_all_window(results: Path) -> tuple[dt.datetime, dt.datetime, dict[str, Any]] | None:
    path = results / "run_all.json"
    if not path.exists():
        return None
    r = json.loads(path.read_text())
    end = dt.datetime.fromisoformat(r["machine"]["date"])
    return end - dt.timedelta(seconds=r["total_seconds"]), end, r


def _source(name: str, d: dict[str, Any], data: dict[str, dict[str, Any]],
            window: tuple[dt.datetime, dt.datetime, dict[str, Any]] | None) -> str:
    """The command whose run saved this section."""
    when, quick = _when(d), " QUICK=1" if d.get("size") == "quick" else ""
    if window and when and window[0] <= when <= window[1] and name in window[2].get("seconds", {}):
        return f"`make experiments{quick}`"
    bench = data.get("bench")
    if name in MAKE_BENCH or (name == "baseline" and bench and d.get("baseline") == bench["results"].get("baseline")):
        return f"`make bench{quick}`"
    if name == "chaos":
        return "`make chaos`"
    measure = " --measure" if name == "baseline" else ""
    return f"`python -m pygmy.experiments.{name}{measure}{' --quick' if quick else ''}` alone"


def _divisor(name: str, d: dict[str, Any], data: dict[str, dict[str, Any]]) -> str:
    results = d.get("results")
    base = d.get("baseline") or (results.get("baseline") if isinstance(results, dict) else None)
    if name in DIVISORS or not isinstance(base, dict) or "http_rtt" not in base:
        return DIVISORS.get(name, "-")
    same = " (= section 9)" if data.get("baseline", {}).get("baseline") == base else ""
    sqlite = f", SQLite commit p50 {base['sqlite_commit']['p50']:.2f} ms" if "sqlite_commit" in base else ""
    return f"the baseline of its own run: bare HTTP p50 {base['http_rtt']['p50']:.2f} ms{sqlite}{same}"


#: Sentences older result files carry that are no longer true of a report built from several runs.
STALE = {"A bare Flask endpoint returning one static book under the frontend's Gunicorn settings (2 workers x 16 "
         "gthreads)": "A bare Flask endpoint returning one static book under the frontend's Gunicorn options with 2 "
         "workers x 16 gthreads (a frontend worker has 120)",
         "Every other table divides by these numbers from the same run.":
         "Each section divides by the baseline measured at the start of its own run (see \"Where each section "
         "comes from\"); this one is the newest, and only the sections of the same run divide by it."}


def _description(name: str, d: dict[str, Any]) -> str:
    text = d.get("description", "")
    for old, new in STALE.items():
        text = text.replace(old, new)
    return text


def _provenance(data: dict[str, dict[str, Any]], results: Path) -> list[str]:
    window = _run_all_window(results)
    rows = []
    for name in _ordered(data):
        d = data[name]
        rows.append([d.get("title", name).split(":")[0], d.get("machine", {}).get("date", "?").replace("+00:00", " UTC"),
                     d.get("size", "?"), _source(name, d, data, window), _divisor(name, d, data)])
    out = ["## Where each section comes from", "",
           "Each experiment saves its own results and may be run again alone, so the sections below come "
           "from different runs, possibly on different days and machines (each section's *Machine* line "
           "names its platform). *Saved* is when a section's results were written (the end of its run). A ratio "
           "column divides by the machine baseline stored with that section, measured at the start of "
           "the run that produced it, never by a baseline of another run; section 9 shows the newest "
           "baseline only.", ""]
    if window:
        start, end, r = window
        out += [f"The last whole `make experiments` run took {r['total_seconds']:.0f} s, "
                f"{start.isoformat(timespec='minutes').replace('+00:00', '')} to "
                f"{end.isoformat(timespec='minutes').replace('+00:00', ' UTC')}, size {r['size']}"
                + (f"; failed: {', '.join(r['failed'])}" if r.get("failed") else "")
                + ". Sections run by another command below were run apart from it (those of its experiments replace its results).", ""]
    out += [_table(["section", "saved", "size", "run by", "ratios divide by"], rows), ""]
    return out


# -- headline figures -------------------------------------------------------------------------------------
def _window(what: str) -> Callable[[dict[str, Any]], str]:
    def fmt(r: dict[str, Any]) -> str:
        w = r["buy_window_ms"][what]
        return f"median {statistics.median(w):.0f} ms, max {max(w):.0f} ms over {len(w)} trials"
    return fmt


def _catch_up(k: int) -> Callable[[dict[str, Any]], str]:
    def fmt(r: dict[str, Any]) -> str:
        p = next(p for p in r["catch_up"] if p["k"] == k)
        how = "by a snapshot" if p["by_snapshot"] else "from the log"
        return f"{(p['caught_up_s'] - p['start_cmd_s']) * 1000:.0f} ms after `pygmy start` returned, {how}"
    return fmt


def _ready(books: int) -> Callable[[Any], str]:
    def fmt(rows: list[dict[str, Any]]) -> str:
        row = next(x for x in rows if x["books"] == books and not x.get("orders"))
        return f"{row['ready_s']:.1f} s"
    return fmt


#: (measure, result file, what to print from its ``results``, the command that measures it alone).
HEADLINES: tuple[tuple[str, str, Callable[[Any], str], str], ...] = (
    ("sequential durable buy, 3 replicas per tier", "bench",
     lambda r: f"p50 {r['buy_3']['p50']:.2f} ms; {r['buy_3']['paired']['ratio']:.2f}x a bare lookup "
               "in alternating blocks", "python -m pygmy.experiments.bench --quick"),
    ("cached lookup", "bench",
     lambda r: f"p50 {r['cached_lookup']['sequential']['p50']:.2f} ms; "
               f"{r['cached_lookup']['paired']['ops_ratio']:.2f}x the bare endpoint's throughput in alternating blocks",
     "python -m pygmy.experiments.bench --quick"),
    ("32 closed-loop buyers, 1,000 books", "writepath",
     lambda r: f"{r['buyers']['buys_per_s']:.0f} buys/s = {r['buyers']['buys_per_s'] / r['bare_post']['ops_per_s']:.3f}x "
               f"a bare POST; {r['buyers']['errors']} errors", "python -m pygmy.experiments.writepath --quick"),
    ("idle default cluster, every process", "writepath",
     lambda r: f"{r['idle']['cpu_share_of_one_core'] * 100:.1f}% of one core over {r['idle']['seconds']:.0f} s",
     "python -m pygmy.experiments.writepath --quick"),
    ("longest gap between buys, catalog leader SIGKILLed", "bench", _window("catalog leader SIGKILL"),
     "python -m pygmy.experiments.bench --quick"),
    ("catch-up of 10,000 missed updates", "bench", _catch_up(10_000), "python -m pygmy.experiments.bench --quick"),
    ("1,000,000 books: `pygmy up --books` ready", "store_size", _ready(1_000_000),
     "python -m pygmy.experiments.store_size --quick"),
    ("wiped follower of 1,000,000 books current again", "rebuild",
     lambda r: f"{r['rebuilt_s']:.2f} s after `pygmy start`; peak memory {r['victim_peak_over_steady']:.2f}x "
               "a healthy follower's", "python -m pygmy.experiments.rebuild --quick"),
)


def headlines(results: Path = h.RESULTS) -> list[dict[str, str]]:
    """The headline figures the result files give, each with the run it came from (missing ones left out)."""
    out = []
    for measure, name, get, command in HEADLINES:
        path = results / f"{name}.json"
        if not path.exists():
            continue
        d = json.loads(path.read_text())
        try:
            value = get(d["results"])
        except (KeyError, TypeError, IndexError, StopIteration, ZeroDivisionError):
            continue
        out.append({"measure": measure, "value": value, "source": name, "size": d.get("size", "?"),
                    "saved": d.get("machine", {}).get("date", "?"), "command": command})
    return out


def headline_lines(results: Path = h.RESULTS) -> list[str]:
    """The README's block: one line on the run, then the table (what ``--readme`` writes)."""
    rows = headlines(results)
    if not rows:
        return []
    saved = sorted(r["saved"] for r in rows)
    sizes = sorted({r["size"] for r in rows})
    first, last = saved[0].replace("+00:00", ""), saved[-1].replace("+00:00", "")
    span = f"{first[:10]} {first[11:16]}-{last[11:16]} UTC" if first[:10] == last[:10] else f"{first} to {last} UTC"
    return [f"Results saved {span}, size {', '.join(sizes)} "
            f"(`experiments/results/`: {', '.join(sorted({r['source'] + '.json' for r in rows}))}).", "",
            "| measure | value | measured by |", "|---|---|---|",
            *[f"| {r['measure']} | {r['value']} | `{r['command']}` |" for r in rows]]


def write_readme(readme: Path, results: Path = h.RESULTS) -> Path:
    """Replace what lies between the README's figure markers with the figures of ``results``."""
    text = readme.read_text()
    start, end = text.index(README_START) + len(README_START), text.index(README_END)
    readme.write_text(text[:start] + "\n" + "\n".join(headline_lines(results)) + "\n" + text[end:])
    return readme


# -- the report -------------------------------------------------------------------------------------------
def render(results: Path, plots: Path, report: Path) -> str:
    data = {n: json.loads((results / f"{n}.json").read_text()) for n in SECTIONS if (results / f"{n}.json").exists()}
    sizes = sorted({d.get("size", "?") for d in data.values()})
    rel = os.path.relpath(plots, report.parent)
    out = ["# Pygmy performance report", "",
           f"Generated by `python -m pygmy.experiments.report` from `{os.path.relpath(results, report.parent)}/`. "
           f"Run sizes: **{', '.join(sizes)}**"
           + (" (QUICK runs only: small sizes, numbers are indicative only)" if "full" not in sizes else "")
           + ". Latencies are in milliseconds, percentiles from complete per-request records. Clients and "
           "cluster share the same machine.", ""]
    out += _provenance(data, results)
    top = headlines(results)
    if top:
        out += ["## Headline figures", "", "The figures the README quotes, from the results below.", "",
                _table(["measure", "value", "section", "saved", "measured by"],
                       [[r["measure"], r["value"], data[r["source"]].get("title", r["source"]),
                         r["saved"].replace("+00:00", " UTC"), f"`{r['command']}`"] for r in top]), ""]
    for name in _ordered(data):
        d = data[name]
        out += [f"## {d.get('title', name)}", "", _description(name, d), "",
                f"*Machine:* {_machine(d.get('machine', {}))}. *Size:* {d.get('size')}.", ""]
        columns = " ".join((d.get("table") or {}).get("columns", []))
        if name not in DIVISORS and ("bare" in columns or "SQLite" in columns):
            out += [f"*Ratios divide by:* {_divisor(name, d, data)}.", ""]
        if d.get("table"):
            out += [_table(d["table"]["columns"], d["table"]["rows"]), ""]
        for extra in d.get("tables", []):  # further tables, each with its caption
            out += [f"*{extra['caption']}*", "", _table(extra["columns"], extra["rows"]), ""]
        for p in d.get("plots", []):
            out += [f"![{p}]({rel}/{p})", ""]
        comp = d.get("comparison")
        if comp:
            out += ["Against the reference study:", "", _table(comp["columns"], comp["rows"]), ""]
            if comp.get("note"):
                out += [f"*{comp['note']}*", ""]
    return "\n".join(out) + "\n"


def write(results: Path = h.RESULTS, plots: Path = h.PLOTS, report: Path = h.PACKAGE / "REPORT.md") -> Path:
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(render(results, plots, report))
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m pygmy.experiments.report")
    p.add_argument("--results-dir", type=Path, default=h.RESULTS)
    p.add_argument("--plots-dir", type=Path, default=h.PLOTS)
    p.add_argument("--report", type=Path, default=h.PACKAGE / "REPORT.md")
    p.add_argument("--readme", type=Path, nargs="?", const=h.PACKAGE.parent / "README.md",
                   help="also rewrite the headline figures between the README's markers")
    a = p.parse_args(argv)
    print(write(a.results_dir, a.plots_dir, a.report))
    if a.readme:
        print(write_readme(a.readme, a.results_dir))


if __name__ == "__main__":
    main()
