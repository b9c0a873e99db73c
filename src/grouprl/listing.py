"""``grouprl list``: every estimator, transform, loss axis, preset, task and simulation."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Iterable

from rich.console import Console
from rich.table import Table

#: (section title, module, dict attribute) for each axis, in the order of the data flow.
SECTIONS: list[tuple[str, str, str]] = [
    ("Advantage estimators", "grouprl.advantages", "ESTIMATORS"),
    ("Advantage transforms (keywords of advantages.compute)", "grouprl.advantages", "TRANSFORMS"),
    ("Surrogates", "grouprl.losses", "SURROGATES"),
    ("Aggregations", "grouprl.losses", "AGGREGATIONS"),
    ("KL estimators", "grouprl.losses", "KL_ESTIMATORS"),
    ("Presets", "grouprl.presets", "PRESETS"),
    ("Tasks", "grouprl.tasks", "TASKS"),
    ("Simulations", "grouprl.simulate", "SIMULATIONS"),
]

HELP = "list every estimator, transform, loss axis, preset, task and simulation"


def first_line(obj: object) -> str:
    """One-line description of a registry entry: a preset's description or a docstring's first line."""
    text = getattr(obj, "description", None) or (getattr(obj, "__doc__", None) or "")
    text = text.strip().splitlines()[0] if text.strip() else ""
    return text


def catalogue(sections: Iterable[tuple[str, str, str]] = SECTIONS) -> dict[str, dict[str, str]]:
    """Section title -> {name: one-line description}."""
    out: dict[str, dict[str, str]] = {}
    for title, module, attr in sections:
        registry: dict[str, Callable] = getattr(importlib.import_module(module), attr)
        out[title] = {name: first_line(obj) for name, obj in registry.items()}
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "section",
        nargs="?",
        default=None,
        help="only this section (a word of its title, e.g. 'presets', 'estimators', 'tasks')",
    )


def run(args: argparse.Namespace) -> int:
    sections = SECTIONS
    if args.section:
        sections = [s for s in SECTIONS if args.section.lower() in s[0].lower()]
        if not sections:
            words = ", ".join(s[0].split()[0].lower() for s in SECTIONS)
            raise SystemExit(f"no section matches {args.section!r}; try one of: {words}")
    console = Console()
    for title, entries in catalogue(sections).items():
        table = Table(
            title=title, title_justify="left", show_header=False, box=None, pad_edge=False
        )
        table.add_column("name", style="bold cyan", no_wrap=True)
        table.add_column("description")
        for name, text in entries.items():
            table.add_row(name, text)
        console.print(table)
        console.print()
    return 0
