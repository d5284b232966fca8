"""Building the project's Go checkers (``tools/lincheck``, ``tools/k8scheck``) on first use."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def go_command(what: str) -> str:
    go = shutil.which("go") or ("/usr/local/go/bin/go" if os.access("/usr/local/go/bin/go", os.X_OK) else None)
    if go is None:
        raise RuntimeError(f"Go is needed to build {what}: install Go 1.26 or newer and put `go` on PATH")
    return go


def build_go_tool(source: Path, binary: Path, what: str, timeout: float = 900) -> Path:
    """``binary`` built from the Go module in ``source`` when missing or older than its sources.

    Several test processes may ask at once: under a file lock one builds (a first build downloads the
    modules), the others wait and find it built. Built to a private name and renamed, so a binary is
    never seen half written (``go build -o`` also refuses to overwrite a file that is not a binary)."""
    sources = [p for p in source.iterdir() if p.suffix == ".go" or p.name in ("go.mod", "go.sum")]
    newest = max(p.stat().st_mtime for p in sources)

    def fresh() -> bool:
        return binary.exists() and binary.stat().st_mtime >= newest

    if fresh():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    with open(binary.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if fresh():
            return binary
        tmp = Path(tempfile.mkdtemp(prefix=f".{binary.name}.", dir=binary.parent))
        try:
            proc = subprocess.run([go_command(what), "build", "-buildvcs=false", "-o", str(tmp / binary.name), "."],
                                  cwd=source, capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"building {what} failed:\n{proc.stderr}")
            os.replace(tmp / binary.name, binary)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return binary
