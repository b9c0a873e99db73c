"""``grouprl diagnose PATH``: training-health report for a JSONL of reward groups, a run folder,
or the rollout logs of TRL (``log_completions=True``) and verl (``trainer.rollout_data_dir``);
with the rollout-vs-trainer mismatch metrics where the logs hold them (our ``metrics.jsonl``,
TRL's ``trainer_state.json``, verl's file-logger JSONL)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

_STEP_COLS = (
    "step",
    "groups",
    "G",
    "reward/mean",
    "acr/rate",
    "acr/all_correct",
    "acr/all_wrong",
    "acr/other",
    "reward/nan_count",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path",
        type=Path,
        help="groups JSONL ({prompt_id, rewards, step}), a run folder, TRL's output_dir / "
        "completions_<step>.parquet / trainer_state.json, verl's rollout_data_dir, or verl's "
        "file-logger <experiment>.jsonl (rollout-vs-trainer mismatch metrics)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="report path (default: RUN/report.html, or ./report.html for a file)",
    )
    parser.add_argument(
        "--reward-range",
        nargs=2,
        type=float,
        default=(0.0, 1.0),
        metavar=("LO", "HI"),
        help="what wrong and correct score (default 0 1)",
    )
    parser.add_argument(
        "--tau", type=float, default=1e-6, help="collapse threshold on the group std (default 1e-6)"
    )
    parser.add_argument(
        "--rho",
        type=float,
        default=0.1,
        help="share of a prompt's correct mass in rare modes, for the tail-miss advice (default 0.1)",
    )
    parser.add_argument(
        "--max-rows",
        type=int,
        default=12,
        help="step rows printed (first and last half; the report has all)",
    )
    parser.add_argument("--no-report", action="store_true", help="print only")
    parser.add_argument(
        "--reward-columns",
        nargs="+",
        default=None,
        metavar="NAME",
        help="TRL logs: the reward-function columns (default: the numeric ones between "
        "'completion' and 'advantage')",
    )
    parser.add_argument(
        "--reward-weights",
        nargs="+",
        type=float,
        default=None,
        metavar="W",
        help="TRL logs: GRPOConfig.reward_weights, one per reward column (default 1 each)",
    )
    parser.add_argument(
        "--correct-key",
        default=None,
        metavar="NAME",
        help="TRL / verl logs: the reward function (TRL) or reward extra info (verl) that holds "
        "the verifier's correctness, for the reward-hacking rule (default: one named acc, "
        "accuracy, correct, correctness, is_correct or accuracy_reward)",
    )


def _fmt(v) -> str:
    if isinstance(v, float):
        return "–" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def _table(console, title, rows, cols=None):
    from rich.table import Table

    if not rows:
        return
    cols = list(cols or rows[0])
    t = Table(title=title)
    for c in cols:
        t.add_column(c, justify="left" if c in ("estimator", "quantity") else "right")
    for r in rows:
        t.add_row(*(_fmt(r.get(c, "")) for c in cols))
    console.print(t)


def _resolve(path: Path):
    """(groups file or None, run folder or None) for PATH."""
    from grouprl.diagnostics.external import detect

    if path.is_dir() and not (path / "rewards.jsonl").is_file() and detect(path):
        return path, None  # a TRL / verl log folder
    if path.is_dir():
        groups = path / "rewards.jsonl"
        metrics = path / "metrics.jsonl"
        if not groups.is_file() and not metrics.is_file():
            raise ValueError(
                f"{path} is not a grouprl run folder (rewards.jsonl, metrics.jsonl), a TRL "
                "completions log (completions_<step>.parquet) or a verl rollout_data_dir "
                "(<step>.jsonl)"
            )
        return (groups if groups.is_file() and groups.stat().st_size > 0 else None), path
    if not path.exists():
        raise ValueError(f"{path}: no such file or folder")
    return path, None


def _print_diagnosis(console, d, gf, max_rows) -> None:
    for note in getattr(gf, "notes", ()):  # how a TRL / verl log was read
        console.print(note, style="dim", markup=False)
    rows = d.steps
    if len(rows) > max_rows:
        half = max(1, max_rows // 2)
        shown = [*rows[:half], {"step": "…"}, *rows[-half:]]
    else:
        shown = rows
    _table(
        console, f"Per-step collapse ({len(rows)} steps, {gf.n_groups} groups)", shown, _STEP_COLS
    )
    _table(console, "Totals", [{"quantity": k, "value": v} for k, v in d.totals.items()])
    _table(console, "Inverse-scale tails (1/scale over updated groups, all steps)", d.scale)
    if d.advice is not None:
        adv_rows = [
            {
                "N": n,
                "expected active": a,
                "expected tail miss": m,
                "": "◀ current"
                if n == d.group_size
                else ("◀ advised" if n == d.advice.recommended else ""),
            }
            for n, a, m in d.advice.rows()
        ]
        _table(
            console, f"Group size (ρ = {d.advice.targets['rho']:g}, {len(d.mu)} prompts)", adv_rows
        )
        if d.current:
            console.print(
                f"current G = {d.current['G']}: expected active {d.current['expected active']:.2f}, "
                f"tail miss {d.current['expected tail miss']:.2f}"
            )
        console.print(f"advised G = {d.advice.recommended}: {d.advice.reason}", markup=False)


def _print_mismatch(console, mlog, replay: bool) -> list[str]:
    """The rollout-vs-trainer mismatch table of a run's logged metrics (or where they are);
    returns the health warnings a live run would have raised from them."""
    from rich.markup import escape

    from grouprl.diagnostics.mismatch import summarize
    from grouprl.report.run import replay_health

    if mlog is None:
        return []
    for note in mlog.notes:
        console.print(note, style="dim", markup=False)
    if not mlog.rows:
        if not mlog.notes:
            console.print(
                f"{mlog.path}: no rollout-vs-trainer mismatch metrics logged", style="dim"
            )
        return []
    summary = summarize(mlog.rows)
    if summary:
        title = f"Rollout vs trainer mismatch ({mlog.source} log, {len(mlog.rows)} steps)"
        _table(console, title, summary, ("quantity", "steps", "first", "last", "max"))
    else:  # the trainer's metrics without mismatch keys: only the health rules read them
        console.print(
            f"{mlog.path}: {len(mlog.rows)} logged steps, no rollout-vs-trainer mismatch metrics",
            style="dim",
        )
    warnings = replay_health(mlog.rows)
    if replay:
        for w in warnings:
            console.print(f"[yellow]warning[/yellow] {escape(w)}")
    return warnings


def _load(path: Path, args: argparse.Namespace, load_groups):
    """Our groups JSONL, or a TRL / verl log through :mod:`grouprl.diagnostics.external`."""
    from grouprl.diagnostics import external

    if external.detect(path) is None:
        return load_groups(path)
    return external.load(
        path,
        reward_columns=args.reward_columns,
        reward_weights=args.reward_weights,
        correct=args.correct_key,
    )


def _open(args: argparse.Namespace):
    """``(mismatch log or None, groups or None, diagnosis or None, run folder or None)``."""
    from grouprl.diagnostics.diagnose import diagnose_groups, load_groups
    from grouprl.diagnostics.external import load_mismatch

    mlog = load_mismatch(
        args.path, correct=args.correct_key
    )  # rollout-vs-trainer metrics, where the logs hold them
    if mlog is not None and mlog.metrics_only:
        return mlog, None, None, None
    groups_path, run_dir = _resolve(args.path)
    gf = d = None
    if groups_path is not None:
        gf = _load(groups_path, args, load_groups)
        d = diagnose_groups(gf, reward_range=tuple(args.reward_range), tau=args.tau, rho=args.rho)
    return mlog, gf, d, run_dir


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from grouprl.report.diagnosis import write_diagnosis_report
    from grouprl.report.run import read_metrics, replay_health

    console = Console(width=None if sys.stdout.isatty() else 140)

    def err(msg: str) -> None:  # plain stderr: never wrapped, easy to grep
        print(msg, file=sys.stderr, flush=True)

    try:
        mlog, gf, d, run_dir = _open(args)
    except (ValueError, FileNotFoundError) as e:
        err(f"error: {e}")
        return 2
    if gf is not None and gf.n_errors:
        err(f"{gf.n_errors} malformed line(s) skipped in {gf.path}:")
        for no, msg in gf.errors[:20]:
            err(f"  line {no}: {msg}")
        if gf.n_errors > 20:
            err(f"  ... and {gf.n_errors - 20} more (the report lists up to 200)")
    if d is not None:
        _print_diagnosis(console, d, gf, args.max_rows)
    metrics_rows = metrics_errors = None
    if run_dir is not None and (run_dir / "metrics.jsonl").is_file():
        metrics_rows, metrics_errors = read_metrics(run_dir / "metrics.jsonl")
        console.print(f"metrics.jsonl: {len(metrics_rows)} steps ({len(metrics_errors)} bad lines)")
        if d is None:
            for w in replay_health(metrics_rows):
                console.print(f"[yellow]warning[/yellow] {escape(w)}")
    if d is not None:
        for w in d.warnings:
            console.print(f"[yellow]warning[/yellow] {escape(w)}")
        if not d.warnings:
            console.print("[green]no health rule fired[/green]")
    replayed = metrics_rows is not None and d is None  # our run's warnings: printed above
    mismatch_warnings = _print_mismatch(console, mlog, replay=not replayed)
    if not args.no_report:
        out = args.out or (
            (run_dir / "report.html") if run_dir is not None else Path("report.html")
        )
        path = write_diagnosis_report(
            out, d, gf, run_dir, metrics_rows, metrics_errors, mlog, mismatch_warnings
        )
        console.print(f"wrote {path}")
    return 0
