"""Record client histories against Pygmy and check them for linearizability with Porcupine.

Recording is pure Python and cheap, so experiments can record while under load; the check itself is
a small Go tool (tools/lincheck) on top of Porcupine, built on first use into build/lincheck.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pygmy import ROOT
from pygmy.verify.gobuild import build_go_tool

SOURCE = ROOT / "tools" / "lincheck"
BINARY = ROOT / "build" / "lincheck" / "lincheck"


@dataclass
class Op:
    """One client operation; a handle returned by History.invoke and finished by ok/unknown/drop."""

    client: int
    kind: str
    item: int
    input: dict[str, Any]
    invoke: int
    complete: int | None = None
    output: dict[str, Any] | None = None
    outcome: str = "pending"  # then "ok", "unknown" or "dropped"


class History:
    """A thread-safe recorder of what clients asked and saw, with times from one monotonic clock.

    A definite failure with no effect (404, 503 before anything happened) is dropped, since it tells the
    checker nothing; an outcome that may or may not have taken effect (timeout, lost connection) is kept
    as unknown, and the checker lets it happen or not.
    """

    def __init__(self, initial: dict[int, dict[str, int]]) -> None:
        self.initial = {int(k): dict(v) for k, v in initial.items()}
        self._ops: list[Op] = []
        self._lock = threading.Lock()

    def invoke(self, client: int, kind: str, item: int, input: dict[str, Any] | None = None) -> Op:
        """Call just before sending the request: the invoke time must not be later than the send."""
        op = Op(client, kind, item, dict(input or {}), time.monotonic_ns())
        with self._lock:
            self._ops.append(op)
        return op

    def ok(self, op: Op, output: dict[str, Any]) -> None:
        """Call as soon as the answer is in: a buy's 409 is an answer too, {"ok": False, "out_of_stock": True}."""
        self._finish(op, "ok", time.monotonic_ns(), dict(output))

    def unknown(self, op: Op) -> None:
        self._finish(op, "unknown", None, None)

    def drop(self, op: Op) -> None:
        self._finish(op, "dropped", None, None)

    def _finish(self, op: Op, outcome: str, complete: int | None, output: dict[str, Any] | None) -> None:
        with self._lock:
            if op.outcome != "pending":
                raise ValueError(f"operation already finished as {op.outcome}: {op}")
            op.outcome, op.complete, op.output = outcome, complete, output

    def __len__(self) -> int:
        with self._lock:
            return sum(op.outcome != "dropped" for op in self._ops)

    def ops(self) -> list[Op]:
        """Every operation so far, dropped ones included (a test may ask when its failures were)."""
        with self._lock:
            return list(self._ops)

    def counts(self) -> dict[str, int]:
        """Operations by "kind/outcome", e.g. "buy/ok", "buy/out_of_stock", "update/unknown", "lookup/dropped"."""
        with self._lock:
            ops = list(self._ops)
        out_of_stock = {"ok": False, "out_of_stock": True}
        return dict(Counter(
            f"{op.kind}/{'out_of_stock' if op.output == out_of_stock else op.outcome}" for op in ops))

    def save(self, path: Path) -> Path:
        """Write the history atomically; operations still pending are written as unknown outcomes."""
        with self._lock:
            ops = [op for op in self._ops if op.outcome != "dropped"]
        data = {
            "initial": {str(k): v for k, v in sorted(self.initial.items())},
            "ops": [{"client": op.client, "kind": op.kind, "item": op.item, "invoke": op.invoke,
                     "complete": op.complete, "input": op.input, "output": op.output}
                    for op in sorted(ops, key=lambda op: op.invoke)],
        }
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, separators=(",", ":")))
        tmp.replace(path)
        return path


def build_checker() -> Path:
    """Build tools/lincheck only when the binary is missing or older than its sources."""
    return build_go_tool(SOURCE, BINARY, "the Porcupine checker (tools/lincheck)", timeout=600)


@dataclass
class CheckResult:
    """The checker's verdict: items maps each book to "ok", "illegal" or "unknown" (timed out)."""

    ok: bool
    returncode: int
    items: dict[int, str] = field(default_factory=dict)
    html: dict[int, Path] = field(default_factory=dict)
    output: str = ""

    @property
    def illegal(self) -> list[int]:
        """The books Porcupine proved not linearizable: a definite verdict, unlike a timeout."""
        return sorted(item for item, verdict in self.items.items() if verdict == "illegal")

    @property
    def unknown(self) -> list[int]:
        """The books whose check timed out: neither proved linearizable nor proved not."""
        return sorted(item for item, verdict in self.items.items() if verdict == "unknown")


def check(history_path: Path, html_dir: Path | None = None, timeout: float = 60) -> CheckResult:
    """Check a saved history; raises ValueError if the checker rejects the file as malformed."""
    cmd = [str(build_checker()), str(history_path), "--timeout", str(timeout)]
    if html_dir is not None:
        cmd += ["--html-dir", str(html_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 120 if timeout > 0 else None)
    output = proc.stderr + proc.stdout  # warnings first: the JSON summary stays the last line
    if proc.returncode not in (0, 1):
        raise ValueError(f"lincheck rejected {history_path} (exit {proc.returncode}):\n{output}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return CheckResult(
        ok=summary["ok"] and proc.returncode == 0,
        returncode=proc.returncode,
        items={int(k): v for k, v in summary["items"].items()},
        html={int(k): Path(v) for k, v in summary["html"].items()},
        output=output,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("history", type=Path)
    parser.add_argument("--html-dir", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=60)
    args = parser.parse_args(argv)
    try:
        result = check(args.history, args.html_dir, args.timeout)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    print(result.output, end="")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
