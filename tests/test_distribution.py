"""What ``pip install .`` puts into site-packages: one top-level package, ``pygmy``, holding every
module of the checkout's layers (tests/test_layers.py), the dashboard's files, and working from there
with no checkout in sight."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from test_layers import FOLDERS, source_files

ROOT = Path(__file__).resolve().parents[1]


def _wheel(tmp: Path) -> Path:
    """The wheel built from a copy of the checkout's files (tracked or new, not ignored): a stale
    ``build/lib`` of the working tree could put deleted modules into it."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True, timeout=60).stdout.split("\n")
    src = tmp / "src"
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("pygmy-*.whl")
    return wheel


def test_the_wheel_holds_one_package_and_every_module(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"pygmy", wheel.name.removesuffix("-py3-none-any.whl") + ".dist-info"}
    modules = {n.removesuffix(".py").replace("/", ".").removesuffix(".__init__") for n in names if n.endswith(".py")}
    assert set(source_files()) <= modules
    assert "pygmy/frontend/static/dashboard.html" in names

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    code = ("import pygmy, pygmy.catalog.state, pygmy.cluster.cli, pygmy.frontend.dashboard as d\n"
            "print(pygmy.ROOT, pygmy.catalog.state.__file__, pygmy.cluster.cli.__file__, d.STATIC.is_dir())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    package, state, cli, static = out.stdout.split()
    assert package == str(site / "pygmy") and static == "True"
    assert state.startswith(str(site)) and cli.startswith(str(site)), "the installed copy, not the checkout"
    assert not (site / FOLDERS["pygmy.catalog"]).exists()
