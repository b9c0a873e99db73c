"""``grouprl compare``: runs grouped by arm, paired by seed: paired differences of any logged
metric at chosen steps and at the end, with SE, sign counts and a bootstrap interval; an HTML
report (curves with ±SE bands) and a JSON (``grouprl.diagnostics.compare``, docs/compare.md)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="NAME=GLOB",
        help="an arm and a glob of its run folders (repeat; the same NAME twice adds a glob); "
        "quote the glob",
    )
    parser.add_argument(
        "--sweep",
        type=Path,
        default=None,
        metavar="FILE",
        help="a sweep file (YAML/JSON) naming arms × seeds (docs/compare.md)",
    )
    parser.add_argument(
        "--metric",
        action="append",
        default=[],
        metavar="KEY",
        help="a logged metric, e.g. eval/pass@1 (repeat or comma-separate; default: the "
        "eval/pass@k keys every run logs)",
    )
    parser.add_argument(
        "--at",
        default="",
        metavar="STEPS",
        help="steps to compare at besides the end, e.g. 100,200",
    )
    parser.add_argument("--baseline", default=None, help="the arm the others are compared to")
    parser.add_argument(
        "--vary",
        action="append",
        default=[],
        metavar="FIELD",
        help="a config field allowed to differ between the runs of an arm (repeat)",
    )
    parser.add_argument(
        "--resamples", type=int, default=None, help="bootstrap resamples (default 10000)"
    )
    parser.add_argument("--level", type=float, default=0.95, help="interval level (default 0.95)")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    parser.add_argument(
        "--out", type=Path, default=Path("compare.html"), help="HTML report (default compare.html)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the result as JSON")
    parser.add_argument("--no-report", action="store_true", help="print only (no HTML)")


def _arm_specs(args: argparse.Namespace):
    """(``{arm: [glob]}``, the sweep file's settings) from --arm and --sweep."""
    from grouprl.diagnostics.compare import CompareError, load_sweep

    spec: dict[str, list[str]] = {}
    rest: dict = {}
    if args.sweep is not None:
        spec, rest = load_sweep(args.sweep)
    for item in args.arm:
        name, sep, pattern = item.partition("=")
        if not sep or not name or not pattern:
            raise CompareError(f"--arm {item!r}: expected NAME=GLOB, e.g. --arm grpo='runs/grpo/*'")
        spec.setdefault(name, []).append(pattern)
    return spec, rest


def _steps(text: str) -> list[int]:
    from grouprl.diagnostics.compare import CompareError

    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not part.isdigit():
            raise CompareError(f"--at {text!r}: {part!r} is not a step (comma-separated integers)")
        out.append(int(part))
    return out


def _fmt_stats(st: dict) -> tuple[str, str, str]:
    se = "–" if math.isnan(st["se"]) else f"{st['se']:.4f}"
    return (
        f"{st['mean']:+.4f} ± {se}",
        f"{st['positive']}/{st['n']} > 0, {st['negative']}/{st['n']} < 0",
        f"[{st['ci_low']:+.4f}, {st['ci_high']:+.4f}]",
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from grouprl._json import json_safe
    from grouprl.diagnostics.compare import BOOTSTRAP_RESAMPLES, CompareError, compare, load_arms

    console = Console(width=None if sys.stdout.isatty() else 140)
    try:
        spec, rest = _arm_specs(args)
        metrics = [m for item in args.metric for m in item.split(",") if m] or rest.get("metrics")
        vary = rest.get("vary", {}) if not args.vary else args.vary
        result = compare(
            load_arms(spec),
            metrics=metrics,
            baseline=args.baseline or rest.get("baseline"),
            at=_steps(args.at),
            resamples=args.resamples or BOOTSTRAP_RESAMPLES,
            level=args.level,
            seed=args.seed,
            vary=vary,
        )
    except (CompareError, OSError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    level = f"{100 * args.level:g}% CI"
    t = Table(title=f"paired by seed, against {result['baseline']!r}")
    for col in ("arm", "metric", "at", "mean ± SE", "signs", level):
        t.add_column(col, justify="left" if col in ("arm", "metric") else "right")
    for c in result["comparisons"]:
        for where, st in [*c["steps"].items(), ("end", c["end"])]:
            t.add_row(c["arm"], c["metric"], where, *_fmt_stats(st))
    console.print(t)
    for note in result["notes"]:
        print(f"note: {note}", file=sys.stderr)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(json_safe(result), indent=1) + "\n", encoding="utf-8")
        console.print(f"wrote {args.json}")
    if not args.no_report:
        from grouprl.report.compare import write_compare_report

        console.print(f"wrote {write_compare_report(args.out, result)}")
    return 0
