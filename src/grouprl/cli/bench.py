"""``grouprl bench``: run the benchmark scripts (each prints JSON) and print one table.

    grouprl bench                         # advantages, train_step, vs_trl at their full sizes
    grouprl bench --quick                 # small sizes (about a minute in all)
    grouprl bench advantages vs_trl       # a subset, by script name
    grouprl bench --json bench.json       # also write every script's JSON

The scripts live in the repository's ``benchmarks/`` folder, not in the installed package: it is
found in the working directory, next to a source checkout, or given with ``--dir``; each runs in its own process, so that one's memory and threads do not
affect the next. A script that is missing, fails or times out is a row saying so, not a crash.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["BENCHMARKS", "QUICK_ARGS", "add_arguments", "rows_for", "run", "run_script"]


BENCHMARKS: tuple[str, ...] = ("advantages", "train_step", "vs_trl")
"""The default benchmark scripts (``benchmarks/<name>.py``), in the order they run."""

QUICK_ARGS: dict[str, list[str]] = {
    "advantages": ["--prompts", "8192", "--repeat", "3", "--no-verl-loop"],
    "train_step": ["--models", "tiny", "--steps", "2", "--warmup", "1"],
    "vs_trl": ["--quick"],
}
"""``--quick`` arguments per script [OURS]: sizes that finish in seconds on a laptop CPU."""

Row = dict[str, Any]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``grouprl bench`` flags."""
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"benchmarks to run (default: {' '.join(BENCHMARKS)}); any benchmarks/NAME.py works",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds each)")
    parser.add_argument("--dir", type=Path, default=None, help="benchmarks folder")
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds per script (default 1800)"
    )
    parser.add_argument(
        "--arg",
        dest="extra",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="extra arguments for one script, e.g. --arg 'vs_trl=--steps 10' (repeatable)",
    )


def find_dir(explicit: Path | None = None) -> Path:
    """The ``benchmarks/`` folder: ``explicit``, ``./benchmarks`` or the repository's."""
    candidates = [explicit] if explicit else []
    candidates += [Path.cwd() / "benchmarks", Path(__file__).resolve().parents[3] / "benchmarks"]
    for c in candidates:
        if c is not None and c.is_dir():
            return c
    raise SystemExit(
        "grouprl bench: no benchmarks/ folder found. The benchmark scripts are not part of the "
        "installed package: they live in the repository's benchmarks/ folder. Clone the "
        "repository and run grouprl bench from its root, or pass --dir PATH/TO/benchmarks."
    )


def _last_json(text: str) -> dict[str, Any] | None:
    """The last top-level JSON object on stdout: one starting at a line's first column."""
    starts = ([0] if text.startswith("{") else []) + [
        m.start() + 1 for m in re.finditer(r"\n\{", text)
    ]
    for start in reversed(starts):
        try:
            obj = json.loads(text[start:])
        except json.JSONDecodeError:
            continue
        return obj if isinstance(obj, dict) else None
    return None


def run_script(path: Path, args: list[str], timeout: float) -> dict[str, Any]:
    """Run one benchmark script; ``{"ok", "seconds", "result" | "error"}``."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(path), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "seconds": timeout, "error": f"timed out after {timeout:.0f} s"}
    seconds = time.perf_counter() - t0
    result = _last_json(proc.stdout)
    if proc.returncode != 0 or result is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {
            "ok": False,
            "seconds": seconds,
            "error": f"exit {proc.returncode}: " + " | ".join(tail)[-300:],
        }
    return {"ok": True, "seconds": seconds, "result": result}


# ---- one summariser per known benchmark; anything else is flattened ------------------------


def _advantages_rows(res: dict[str, Any]) -> list[Row]:
    sec, ratios = res.get("seconds", {}), res.get("ratios", {})
    peer = "verl_grpo_vectorized" if "verl_grpo_vectorized" in sec else None
    rows = []
    for name, r in ratios.items():
        speed = r.get("speedup_vs_verl_grpo_vectorized")
        rows.append(
            {
                "metric": f"{name} (ms, {res.get('samples', 0):,} samples)",
                "grouprl": sec[name] * 1e3,
                "peer": sec[peer] * 1e3 if peer else None,
                "ratio": speed,
                "target": None if speed is None else speed >= 2.0,
            }
        )
    return rows


def _vs_trl_rows(res: dict[str, Any]) -> list[Row]:
    r = res.get("results", {})
    g, t = r.get("grouprl", {}), r.get("trl", {})
    ratio = res.get("ratios", {})
    met = res.get("targets_met", {})

    def pick(d: dict, *keys: str) -> Any:
        for k in keys:
            d = d.get(k, {}) if isinstance(d, dict) else {}
        return d if not isinstance(d, dict) else None

    return [
        {
            "metric": "samples/s",
            "grouprl": pick(g, "samples_per_s"),
            "peer": pick(t, "samples_per_s"),
            "ratio": ratio.get("samples_per_s"),
            "target": met.get("samples_per_s_ge_1.5x"),
        },
        {
            "metric": "tokens/s",
            "grouprl": pick(g, "tokens_per_s"),
            "peer": pick(t, "tokens_per_s"),
            "ratio": ratio.get("tokens_per_s"),
            "target": None,
        },
        {
            "metric": "peak RSS (MiB)",
            "grouprl": pick(g, "peak_rss_mib"),
            "peer": pick(t, "peak_rss_mib"),
            "ratio": ratio.get("peak_rss"),
            "target": None,
        },
        {
            "metric": "eval reward after training",
            "grouprl": pick(g, "eval", "reward"),
            "peer": pick(t, "eval", "reward"),
            "ratio": None,
            "target": met.get("eval_reward_not_worse"),
        },
    ]


def _train_step_rows(res: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for r in res.get("results", []):
        sec, tgt, m = r.get("seconds", {}), r.get("targets", {}), r.get("model", "?")
        n = r.get("sequences_per_step", 0)
        rows.append(
            {
                "metric": f"{m}: s/step ({n} sequences)",
                "grouprl": sec.get("step"),
                "peer": None,
                "ratio": None,
                "target": None,
            }
        )
        for stage in ("generate", "logprobs", "backward", "optimizer", "diagnostics"):
            rows.append(
                {
                    "metric": f"{m}: {stage} s",
                    "grouprl": sec.get(stage),
                    "peer": None,
                    "ratio": None,
                    "target": None,
                }
            )
        for key in ("ratio", "diagnostics_frac"):
            if key in r:
                rows.append(
                    {
                        "metric": f"{m}: {key} (target <= {tgt.get(key, '?')})",
                        "grouprl": r[key],
                        "peer": None,
                        "ratio": None,
                        "target": r[key] <= tgt[key] if key in tgt else None,
                    }
                )
        rows.append(
            {
                "metric": f"{m}: peak RSS (MB)",
                "grouprl": r.get("peak_rss_mb"),
                "peer": None,
                "ratio": None,
                "target": None,
            }
        )
    return rows


def _generic_rows(res: dict[str, Any], prefix: str = "") -> list[Row]:
    """Numbers of a JSON object, flattened (``a/b``), booleans under ``targets*`` as targets."""
    rows: list[Row] = []
    for key, value in res.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            rows += _generic_rows(value, name + "/")
        elif isinstance(value, bool):
            rows.append(
                {"metric": name, "grouprl": None, "peer": None, "ratio": None, "target": value}
            )
        elif isinstance(value, (int, float)):
            rows.append(
                {"metric": name, "grouprl": value, "peer": None, "ratio": None, "target": None}
            )
    return rows


SUMMARISERS: dict[str, Callable[[dict[str, Any]], list[Row]]] = {
    "advantages": _advantages_rows,
    "train_step": _train_step_rows,
    "vs_trl": _vs_trl_rows,
}
"""Benchmark name -> rows for the table; other benchmarks are flattened generically."""


def rows_for(name: str, outcome: dict[str, Any]) -> list[Row]:
    """Table rows for one benchmark's outcome (an error row when it did not run)."""
    if not outcome.get("ok"):
        return [
            {
                "metric": outcome.get("error", "failed"),
                "grouprl": None,
                "peer": None,
                "ratio": None,
                "target": False,
            }
        ]
    return SUMMARISERS.get(name, _generic_rows)(outcome["result"])


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "[green]yes[/green]" if v else "[red]no[/red]"
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def print_table(outcomes: dict[str, dict[str, Any]], quick: bool) -> None:
    """One rich table: benchmark, metric, grouprl, peer, ratio, target met."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 140)
    table = Table(title="grouprl bench" + (" (--quick sizes)" if quick else ""))
    for col, justify in (
        ("benchmark", "left"),
        ("metric", "left"),
        ("grouprl", "right"),
        ("peer", "right"),
        ("ratio", "right"),
        ("target met", "center"),
    ):
        table.add_column(col, justify=justify)
    for name, outcome in outcomes.items():
        for i, row in enumerate(rows_for(name, outcome)):
            label = f"{name} ({outcome.get('seconds', 0):.0f} s)" if i == 0 else ""
            table.add_row(
                label,
                str(row["metric"]),
                _fmt(row["grouprl"]),
                _fmt(row["peer"]),
                _fmt(row["ratio"]),
                _fmt(row["target"]),
            )
        table.add_section()
    console.print(table)


def _extra_args(items: list[str]) -> dict[str, list[str]]:
    import shlex

    out: dict[str, list[str]] = {}
    for item in items:
        name, eq, rest = item.partition("=")
        if not eq:
            raise SystemExit(f"--arg expects NAME=ARGS, got {item!r}")
        out.setdefault(name, []).extend(shlex.split(rest))
    return out


def run(args: argparse.Namespace) -> int:
    """Run the selected scripts one after the other; print the table; 1 if any failed."""
    folder = find_dir(args.dir)
    names = list(args.names) or list(BENCHMARKS)
    extra = _extra_args(args.extra)
    outcomes: dict[str, dict[str, Any]] = {}
    for name in names:
        path = folder / f"{name}.py"
        if not path.is_file():
            available = sorted(p.stem for p in folder.glob("*.py"))
            outcomes[name] = {
                "ok": False,
                "seconds": 0.0,
                "error": f"no {path.name} in {folder} (available: {', '.join(available)})",
            }
            continue
        script_args = (QUICK_ARGS.get(name, []) if args.quick else []) + extra.get(name, [])
        print(f"running {name} {' '.join(script_args)}".rstrip(), file=sys.stderr, flush=True)
        outcomes[name] = run_script(path, script_args, args.timeout)
    print_table(outcomes, args.quick)
    if args.json:
        args.json.write_text(json.dumps(outcomes, indent=1), encoding="utf-8")
    return 0 if all(o["ok"] for o in outcomes.values()) else 1
