"""``grouprl list``: every estimator, transform, loss axis, preset, task and simulation."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Iterable

from rich.console import Console
from rich.table import Table
from rich.text import Text

#: keyword -> (section title, module, dict attribute), in the order of the data flow.
SECTIONS: dict[str, tuple[str, str, str]] = {
    "estimators": ("Advantage estimators", "grouprl.advantages", "ESTIMATORS"),
    "token_estimators": (
        "Token-level estimators (advantages.compute_tokens)",
        "grouprl.advantages",
        "TOKEN_ESTIMATORS",
    ),
    "reward_combinations": (
        "Reward combinations of K reward functions (compute(combine=...))",
        "grouprl.advantages",
        "REWARD_COMBINATIONS",
    ),
    "kl_controllers": (
        "KL-in-reward coefficient controllers",
        "grouprl.control",
        "KL_CONTROLLERS",
    ),
    "transforms": (
        "Advantage transforms (keywords of advantages.compute; registered ones: a preset's transforms)",
        "grouprl.advantages",
        "TRANSFORMS",
    ),
    "surrogates": ("Surrogates", "grouprl.losses", "SURROGATES"),
    "aggregations": ("Aggregations", "grouprl.losses", "AGGREGATIONS"),
    "kl": ("KL estimators", "grouprl.losses", "KL_ESTIMATORS"),
    "kl_names": (
        "KL names: verl's aliases and + (straight-through) forms",
        "grouprl.losses",
        "KL_VARIANTS",
    ),
    "kl_corrections": (
        "KL importance corrections (objective's kl_correction)",
        "grouprl.losses",
        "KL_CORRECTIONS",
    ),
    "corrections": (
        "Rollout corrections (algorithm.rollout_correction)",
        "grouprl.losses",
        "CORRECTIONS",
    ),
    "presets": ("Presets", "grouprl.presets", "PRESETS"),
    "tasks": ("Tasks", "grouprl.tasks", "TASKS"),
    "simulations": ("Simulations", "grouprl.simulate", "SIMULATIONS"),
}


def first_line(obj: object) -> str:
    """One-line description of a registry entry: a preset's description or a docstring's first line."""
    if isinstance(obj, str):  # registries of plain descriptions (KL_VARIANTS...)
        return obj
    text = getattr(obj, "description", None) or (getattr(obj, "__doc__", None) or "")
    text = text.strip().splitlines()[0] if text.strip() else ""
    return text.replace("``", "")


def catalogue(keys: Iterable[str] = tuple(SECTIONS)) -> dict[str, dict[str, str]]:
    """Section title -> {name: one-line description}, for the section keywords ``keys``."""
    out: dict[str, dict[str, str]] = {}
    for key in keys:
        title, module, attr = SECTIONS[key]
        mod = importlib.import_module(module)
        registry: dict[str, Callable] = getattr(mod, attr)
        aliases: dict[str, str] = getattr(mod, "ALIASES", {})
        out[title] = {
            name: f"alias of {aliases[name]}" if name in aliases else first_line(obj)
            for name, obj in registry.items()
        }
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "section",
        nargs="?",
        default=None,
        choices=list(SECTIONS),
        help="only this section",
    )
    parser.add_argument(
        "--plugin",
        dest="plugins",
        action="append",
        default=[],
        metavar="FILE.py|MODULE",
        help="load a plugin first: its methods and presets are listed too (repeatable)",
    )


def run(args: argparse.Namespace) -> int:
    from grouprl import plugins

    plugins.load_all(getattr(args, "plugins", None) or [])
    console = Console()
    keys = [args.section] if args.section else list(SECTIONS)
    for title, entries in catalogue(keys).items():
        table = Table(
            title=title, title_justify="left", show_header=False, box=None, pad_edge=False
        )
        table.add_column("name", style="bold cyan", no_wrap=True)
        table.add_column("description")
        for name, text in entries.items():
            table.add_row(name, Text(text))  # plain text: "[low, high]" is not markup
        console.print(table)
        console.print()
    return 0
