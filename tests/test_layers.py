"""The import-layer contract (docs/design.md, "Layers"): no import circle, none against the flow.

Every ``import`` in ``src/grouprl`` counts, wherever it is written (module level, inside a
function, under ``TYPE_CHECKING``): a lazy import is still a dependency. A module belongs to
the first component of :data:`COMPONENTS` whose prefix it has; it may import its own
component's modules and those of the components :data:`MAY_IMPORT` lists for it, nothing
else. The module graph has no cycle (Tarjan's strongly connected components).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

COMPONENTS: dict[str, tuple[str, ...]] = {
    "entry": ("grouprl.cli", "grouprl.__main__", "grouprl.train.api"),
    "facade": ("=grouprl.train",),  # the package alone: its lazy ``run`` is the entry's
    # tasks/answers.py: answer spans in text, a leaf that imports nothing (the tasks and
    # AGPO's vote entropy read answers with it)
    "foundation": (
        "=grouprl", "grouprl._json", "grouprl._progress", "grouprl._threads", "grouprl.types",
        "grouprl.tasks.answers", "grouprl.registry", "grouprl.plugins",
    ),
    "math": (
        "grouprl.advantages", "grouprl.losses", "grouprl.diagnostics", "grouprl.sampling",
        "grouprl.presets", "grouprl.control",
    ),
    "report": ("grouprl.report",),
    "simulate": ("grouprl.simulate",),
    "domain": ("grouprl.tasks", "grouprl.models", "grouprl.rollout"),
    "trainer": ("grouprl.train",),
    "adapters": ("grouprl.integrations",),
}  # fmt: skip
"""Component -> module prefixes: a prefix matches that module and its submodules, ``=name``
only that module. The first component that matches, in this order, holds the module."""

MAY_IMPORT: dict[str, set[str]] = {
    "foundation": set(),
    "math": {"foundation"},
    "report": {"foundation", "math"},  # reads a run folder's files; never the trainer's objects
    "simulate": {"foundation", "math", "report"},
    "domain": {"foundation", "math"},
    "trainer": {"foundation", "math", "domain"},
    "adapters": {"foundation", "math", "domain"},  # TRL / verl: never imported by the core
    "entry": {"foundation", "math", "report", "simulate", "domain", "trainer", "adapters",
              "facade"},
    "facade": {"entry"},
}  # fmt: skip
"""The flow: math ← trainer ← entry points (CLI, ``grouprl.train.run``); the report reads
files; the adapters stand beside the trainer and nothing of the core imports them."""


def component(module: str) -> str:
    for name, prefixes in COMPONENTS.items():
        for prefix in prefixes:
            if module == prefix.lstrip("=") or (
                not prefix.startswith("=") and module.startswith(prefix + ".")
            ):
                return name
    raise AssertionError(f"{module} is in no component of the contract: add it to COMPONENTS")


def modules(src: Path = SRC) -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    out = {}
    for path in src.rglob("*.py"):
        parts = path.relative_to(src).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (relative imports resolved)."""
    mods = modules(src)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
                ]
            for target in targets:
                while target not in mods and "." in target:
                    target = target.rpartition(".")[0]
                if target in mods and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def against_the_flow(graph: dict[str, set[str]]) -> list[str]:
    """``"a -> b (component -> component)"`` for every import the contract does not allow."""
    bad = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            a, b = component(src), component(dst)
            if a != b and b not in MAY_IMPORT[a]:
                bad.append(f"{src} -> {dst} ({a} -> {b})")
    return bad


def test_no_import_circle():
    assert cycles(imports()) == []


def test_no_import_against_the_flow():
    assert against_the_flow(imports()) == []


def test_every_component_is_in_the_contract():
    assert set(MAY_IMPORT) == set(COMPONENTS)
    for module in modules():
        component(module)  # raises for a module no component holds


# ---- the contract can fail: planted circles and planted imports ------------------------------


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    src = tmp_path / "src"
    for rel, text in files.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return src


def test_a_planted_circle_is_found(tmp_path):
    src = _plant(tmp_path, {
        "grouprl/__init__.py": "",
        "grouprl/train/__init__.py": "",
        "grouprl/train/a.py": "from grouprl.train import b\n",
        "grouprl/train/b.py": "def f():\n    from . import c\n",
        "grouprl/train/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from grouprl.train.a import X\n",
    })  # fmt: skip
    assert cycles(imports(src)) == [["grouprl.train.a", "grouprl.train.b", "grouprl.train.c"]]


@pytest.mark.parametrize(
    ("module", "text", "message"),
    [
        ("grouprl/train/sinks.py", "from grouprl.report import write_run_report\n",
         "grouprl.train.sinks -> grouprl.report (trainer -> report)"),
        ("grouprl/advantages/x.py", "import grouprl.train.loop\n",
         "grouprl.advantages.x -> grouprl.train.loop (math -> trainer)"),
        ("grouprl/train/loop.py", "def f():\n    from grouprl.integrations import trl\n",
         "grouprl.train.loop -> grouprl.integrations.trl (trainer -> adapters)"),
        ("grouprl/report/run.py", "from grouprl.train.config import RunConfig\n",
         "grouprl.report.run -> grouprl.train.config (report -> trainer)"),
    ],
    ids=["train-report", "math-train", "core-adapter", "report-train"],
)  # fmt: skip
def test_a_planted_import_against_the_flow_is_found(tmp_path, module, text, message):
    files = {
        "grouprl/__init__.py": "",
        "grouprl/report/__init__.py": "",
        "grouprl/advantages/__init__.py": "",
        "grouprl/integrations/__init__.py": "",
        "grouprl/integrations/trl.py": "",
        "grouprl/train/__init__.py": "",
        "grouprl/train/loop.py": "",
        "grouprl/train/config.py": "",
    }
    src = _plant(tmp_path, {**files, module: text})
    assert against_the_flow(imports(src)) == [message]
