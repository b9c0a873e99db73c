"""``grouprl simulate NAME``: run a paper-reproducing simulation, print a table, write results."""

from __future__ import annotations

import argparse
from pathlib import Path

_CHOICES = ("categorical", "tail-miss", "low-variance", "acr", "normalization")


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers such as 1e3,3e3, got {text!r}"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=_CHOICES, help="which simulation")
    parser.add_argument("--quick", action="store_true", help="small setting (under a minute)")
    parser.add_argument("--seed", type=int, default=0, help="base random seed (default 0)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("simulations"),
        help="output folder (default ./simulations)",
    )
    parser.add_argument(
        "--lr", type=float, default=None, help="override the learning rate (categorical, acr)"
    )
    parser.add_argument("--steps", type=int, default=None, help="override the steps (categorical)")
    parser.add_argument(
        "--lr-sweep",
        type=_floats,
        default=None,
        metavar="η,η,...",
        help="categorical: more step sizes after --lr (the paper's 1e-2), e.g. 1e-3,3e-2",
    )
    parser.add_argument(
        "--surrogate",
        choices=("prob", "logprob"),
        default=None,
        help="categorical: the paper's (1/N)Σ r̃ π(a) (prob, default) or the log-prob variant",
    )
    parser.add_argument(
        "--optimizer",
        choices=("adamw", "plain"),
        default=None,
        help="categorical: AdamW as Hu et al. §4.1 / F-GRPO App. J (default) or plain gradient "
        "ascent (ours, labelled; needs η ≈ 1e3 to move)",
    )
    parser.add_argument(
        "--beta",
        type=float,
        default=None,
        help="low-variance: the KL coefficient β (default: calibrated so that RLOO + Protocol's "
        "mean KL is 0.017)",
    )
    parser.add_argument(
        "--features",
        choices=("shared", "tabular", "blocks"),
        default=None,
        help="normalization: shared random features (default), one table per prompt, or one "
        "parameter block per prompt over a shared low-dimensional answer table",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when a claim does not hold")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")


def _print(result) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    table = Table(title=result.title, show_lines=False)
    cols = list(result.rows[0]) if result.rows else []
    for c in cols:
        table.add_column(c, justify="left" if c in ("method",) else "right")
    for row in result.rows:
        cells = []
        for c in cols:
            v = row.get(c)
            cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
        table.add_row(*cells)
    console.print(table)
    for c in result.claims:
        mark = "[green]✓[/green]" if c.holds else "[red]✗[/red]"
        console.print(f"{mark} [bold]{c.name}[/bold]: {c.detail}")
    for n in result.notes:
        console.print(f"[dim]note: {n}[/dim]")
    console.print(f"[dim]{result.seconds:.1f} s[/dim]")


def run(args: argparse.Namespace) -> int:
    import torch

    from grouprl.simulate import get, write_result

    torch.set_num_threads(max(1, args.threads))
    overrides = {}
    if args.lr is not None:
        if args.name not in ("categorical", "acr"):
            raise SystemExit(f"--lr applies to categorical and acr, not {args.name}")
        overrides["lr"] = args.lr
    for flag, key in (
        ("steps", "steps"),
        ("lr_sweep", "lr_sweep"),
        ("surrogate", "surrogate"),
        ("optimizer", "optimizer"),
    ):
        value = getattr(args, flag)
        if value is not None:
            if args.name != "categorical":
                raise SystemExit(f"--{flag.replace('_', '-')} applies to categorical only")
            overrides[key] = value
    if args.beta is not None:
        if args.name != "low-variance":
            raise SystemExit(f"--beta applies to low-variance only, not {args.name}")
        if args.beta < 0:
            raise SystemExit(f"--beta must be >= 0, got {args.beta}")
        overrides["beta"] = args.beta
    if args.features is not None:
        if args.name != "normalization":
            raise SystemExit("--features applies to normalization only")
        overrides["features"] = args.features
    result = get(args.name)(quick=args.quick, seed=args.seed, **overrides)
    _print(result)
    paths = write_result(result, args.out)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 1 if args.strict and not result.ok else 0
