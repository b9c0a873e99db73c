"""The documents are self-contained and true of the code: no citation of a file outside the
repository, every relative link resolves, design.md's layout lists exactly what src/grouprl
holds, and its contracts block runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SEARCHED = ("src", "docs", "tests", "benchmarks", "reproductions", "configs", "scripts", ".ci")
# Spelled in pieces so that this file does not match itself.
OUTSIDE = ("MODELS-AND-" + "TASKS", "DESIGN" + ".md", "../" + "shared", "/work/" + "shared")


def _text_files():
    for top in SEARCHED:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and path.suffix in {".py", ".md", ".yaml", ".sh", ""}:
                yield path
    yield ROOT / "README.md"


def test_nothing_cites_a_file_outside_the_repository():
    hits = [
        f"{path.relative_to(ROOT)}:{no}: {line.strip()}"
        for path in _text_files()
        for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if any(s in line for s in OUTSIDE)
    ]
    assert hits == []


def _links(path: Path):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if not re.match(r"[a-z]+://", target):
            yield target


@pytest.mark.parametrize(
    "doc", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name
)
def test_relative_links_resolve(doc):
    missing = [t for t in _links(doc) if not (doc.parent / t).exists()]
    assert missing == []


def _blocks(path: Path) -> list[str]:
    return re.findall(r"```(?:python)?\n(.*?)```", path.read_text(), re.S)


def test_design_layout_is_what_src_holds():
    layout = _blocks(ROOT / "docs" / "design.md")[1]
    listed = {m for m in re.findall(r"^  (\S+)", layout, re.M)}
    listed = {name.rstrip("/") for name in listed}
    # private or packaging-only entries the page need not list
    ignored = {"__init__.py", "__main__.py", "_json.py", "py.typed", "__pycache__"}
    present = {p.name for p in (ROOT / "src" / "grouprl").iterdir()} - ignored
    assert listed == present


def test_design_contracts_block_runs():
    (contracts,) = [b for b in _blocks(ROOT / "docs" / "design.md") if "advantages.compute" in b]
    exec(compile(contracts, "docs/design.md#contracts", "exec"), {})


def test_readme_counts_the_presets_there_are():
    """The README's opening list says how many named presets there are; it said 31 for a
    while after five more were registered."""
    from grouprl import presets

    said = re.findall(r"(\d+) named presets", (ROOT / "README.md").read_text(encoding="utf-8"))
    assert said, "the README no longer says how many named presets there are"
    assert {int(n) for n in said} == {len(presets.names())}
