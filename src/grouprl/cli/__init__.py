"""The ``grouprl`` command line: ``grouprl train | simulate | diagnose | compare | sweep | bench | list``.

Each subcommand lives in its own module of this package, imported only when it runs, so
``grouprl list`` stays fast. A command module defines ``add_arguments(parser)`` and
``run(args) -> int``; its one-line help is :data:`HELP` here, the only copy.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS: dict[str, str] = {
    "train": "grouprl.cli.train",
    "simulate": "grouprl.cli.simulate",
    "diagnose": "grouprl.cli.diagnose",
    "compare": "grouprl.cli.compare",
    "sweep": "grouprl.cli.sweep",
    "bench": "grouprl.cli.bench",
    "list": "grouprl.cli.listing",
}
"""Subcommand name -> module that implements it."""

HELP: dict[str, str] = {
    "train": "train a policy with a preset on a verifiable task (default: the maze miniature)",
    "simulate": "run a simulation that reproduces a paper's analysis (categorical, tail-miss, ...)",
    "diagnose": "training-health report for a JSONL of reward groups or a grouprl run folder",
    "compare": "paired comparison of runs across seeds: arms × seeds, SE, signs, bootstrap CI",
    "sweep": "run a sweep file's arms × seeds as local grouprl train processes, N at a time",
    "bench": "run the benchmarks (advantages, train step, vs TRL) and print one table",
    "list": "list every estimator, transform, loss axis, preset, task and simulation",
}


PROCESS_ENV: dict[str, str] = {"THP_MEM_ALLOC_ENABLE": "1"}
"""Environment the command line sets for its own process before torch's first allocation,
unless the caller set the variable: PyTorch's ``THP_MEM_ALLOC_ENABLE=1`` places CPU tensors
of 2 MiB or more on transparent huge pages, so a block mapped anew (``run.mmap_threshold_kib``)
faults in 2 MiB at a time instead of 4 KiB: the same peak at less CPU time (docs/results.md,
"Peak memory, where it goes"). The library sets nothing: an importing program owns its
process."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grouprl",
        description="Group-relative RL with verifiable rewards: estimators, losses, "
        "diagnostics, simulations and a compact trainer.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        sub.add_parser(name, help=HELP[name], add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    for key, value in PROCESS_ENV.items():
        os.environ.setdefault(key, value)
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    name = argv[0]
    if name not in COMMANDS:
        parser.error(f"unknown command {name!r}; choose one of: {', '.join(COMMANDS)}")
    module = importlib.import_module(COMMANDS[name])
    sub = argparse.ArgumentParser(prog=f"grouprl {name}", description=HELP[name])
    module.add_arguments(sub)
    args = sub.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
