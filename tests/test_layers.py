"""The house's layers (pygmy/__init__.py): no import runs from a lower layer to a higher one, and no
package imports a sibling of its own layer; every module is imported by its one name, ``pygmy.…``.
Lazy imports inside functions count as much as those at the top of a file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Bottom up. A package may import only from the layers below its own.
LAYERS: list[tuple[str, ...]] = [
    ("pygmy.kit",),
    ("pygmy.replication", "pygmy.client"),
    ("pygmy.catalog", "pygmy.order", "pygmy.frontend"),
    ("pygmy.cluster",),
    ("pygmy.verify",),
    ("pygmy.experiments",),
]
FOLDERS = {"pygmy.catalog": "catalog", "pygmy.order": "order", "pygmy.frontend": "frontend",
           "pygmy.client": "client", "pygmy.experiments": "experiments"}
#: The names the folders had before they were one package: importing them would load a second copy.
BARE = ("cluster", "replication", "kit", "verify", *FOLDERS.values())


def layer_of(module: str) -> tuple[int, str] | None:
    for i, packages in enumerate(LAYERS):
        for p in packages:
            if module == p or module.startswith(p + "."):
                return i, p
    return None


def source_files() -> dict[str, Path]:
    """Every module of the distribution by its dotted name."""
    out: dict[str, Path] = {}
    for packages in LAYERS:
        for p in packages:
            folder = ROOT / FOLDERS.get(p, p.replace(".", "/"))
            for f in folder.rglob("*.py"):
                rel = f.relative_to(folder).with_suffix("")
                out[".".join([p, *rel.parts]).removesuffix(".__init__")] = f
    return out


def imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, relative ones resolved."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found += [(node.lineno, f"{base}.{a.name}" if layer_of(f"{base}.{a.name}") else base) for a in node.names]
    return found


def test_the_layers_cover_every_module() -> None:
    files = source_files()
    assert len(files) > 70
    assert {layer_of(m) is not None for m in files} == {True}
    stray = sorted(p.name for p in (ROOT / "pygmy").iterdir()
                   if p.is_dir() and p.name != "__pycache__" and layer_of(f"pygmy.{p.name}") is None)
    assert stray == [], "every folder of pygmy/ is in a layer"


@pytest.mark.parametrize("module", sorted(source_files()))
def test_no_import_runs_up_or_sideways(module: str) -> None:
    path = source_files()[module]
    mine = layer_of(module)
    assert mine is not None
    wrong = []
    for line, target in imports(path, module):
        if target.split(".")[0] in BARE:
            wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}: say pygmy.…")
            continue
        theirs = layer_of(target)
        if theirs is None or theirs[1] == mine[1]:
            continue
        if theirs[0] >= mine[0]:
            wrong.append(f"{path.relative_to(ROOT)}:{line} ({mine[1]}, layer {mine[0]}) imports {target} "
                         f"({theirs[1]}, layer {theirs[0]})")
    assert wrong == []


def test_the_check_sees_an_arrow_up(tmp_path: Path) -> None:
    """The check itself: a kit module that imports a tier, lazily, is caught."""
    f = tmp_path / "web.py"
    f.write_text("def f():\n    from pygmy.catalog import app\n    from ..cluster import serve\n")
    assert imports(f, "pygmy.kit.web") == [(2, "pygmy.catalog.app"), (3, "pygmy.cluster.serve")]
