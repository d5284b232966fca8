"""The documentation a fresh clone gets is whole: every link in the README and docs/ points to a file
(and heading) inside the repository, and docs/api.md names every operation of the OpenAPI document."""

from __future__ import annotations

import re
from pathlib import Path

from pygmy.frontend import openapi

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to '-'."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_every_link_stays_inside_the_repository() -> None:
    checked = 0
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)} -> {target}"
            assert dest.is_relative_to(ROOT), f"{where}: outside the repository"
            assert dest.exists(), f"{where}: no such file"
            if anchor and dest.suffix == ".md":
                assert anchor in anchors(dest), f"{where}: no such heading"
            checked += 1
    assert checked > 20
    assert not [p for p in PAGES if "shared/" in p.read_text()]


def test_the_api_reference_names_every_operation() -> None:
    text = (ROOT / "docs" / "api.md").read_text()
    documented = {(m, re.sub(r"\{[^}]+\}", "{}", p)) for m, p in re.findall(r"`(GET|POST) (/[^`\s]*)`", text)}
    for path, ops in openapi.spec()["paths"].items():
        for method in ops:
            assert (method.upper(), re.sub(r"\{[^}]+\}", "{}", path)) in documented, (method, path)
    assert "/openapi.json" in text and "(docs/api.md)" in (ROOT / "README.md").read_text()
