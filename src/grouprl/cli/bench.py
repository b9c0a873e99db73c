"""``grouprl bench``: run the benchmark scripts (each prints JSON) and print one table.

    grouprl bench                         # advantages, train_step, rollout_correction, vs_trl
    grouprl bench --quick                 # small sizes (about a minute in all)
    grouprl bench advantages vs_trl       # a subset, by script name
    grouprl bench vs_trl --model smollm2  # vs TRL on SmolLM2-135M (default: the tiny maze model)
    grouprl bench --json bench.json       # also write every script's JSON

The scripts live in the repository's ``benchmarks/`` folder, not in the installed package: it is
found in the working directory, next to a source checkout, or given with ``--dir``; each runs in its own process, so that one's memory and threads do not
affect the next. A script that is missing, fails or times out is a row saying so, not a crash.
vs_trl's settings table (every setting read back from both trainers, equal or not) is printed
under the ratios, also when the script stopped because a setting differed.
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

__all__ = [
    "BENCHMARKS",
    "MODEL_FLAGS",
    "QUICK_ARGS",
    "add_arguments",
    "rows_for",
    "run",
    "run_script",
    "settings_rows",
]


BENCHMARKS: tuple[str, ...] = ("advantages", "train_step", "rollout_correction", "vs_trl")
"""The default benchmark scripts (``benchmarks/<name>.py``), in the order they run."""

QUICK_ARGS: dict[str, list[str]] = {
    "advantages": ["--prompts", "8192", "--repeat", "3", "--no-verl-loop"],
    "train_step": ["--models", "tiny", "--steps", "2", "--warmup", "1"],
    "rollout_correction": ["--steps", "1", "--warmup", "1", "--repeat", "3", "--specs", "icepop"],
    "vs_trl": ["--quick"],
}
"""``--quick`` arguments per script [OURS]: sizes that finish in seconds on a laptop CPU."""

MODEL_FLAGS: dict[str, str] = {"vs_trl": "--model", "train_step": "--models"}
"""How ``grouprl bench --model NAME`` reaches each script that takes a model."""

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
    parser.add_argument(
        "--model",
        choices=("tiny", "smollm2"),
        default=None,
        help="model for vs_trl and train_step (vs_trl default: tiny; smollm2 = SmolLM2-135M)",
    )
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
        failed = {
            "ok": False,
            "seconds": seconds,
            "error": f"exit {proc.returncode}: " + " | ".join(tail)[-600:],
        }
        if result is not None:  # e.g. vs_trl's settings table when a setting differed
            failed["result"] = result
        return failed
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
    model = res.get("setting", {}).get("model", "?")

    def pick(d: dict, *keys: str) -> Any:
        for k in keys:
            d = d.get(k, {}) if isinstance(d, dict) else {}
        return d if not isinstance(d, dict) else None

    def row(metric: str, ours: Any, peer: Any, ratio_: Any = None, target: Any = None) -> Row:
        return {"metric": f"{model}: {metric}", "grouprl": ours, "peer": peer,
                "ratio": ratio_, "target": target}  # fmt: skip

    def both(*keys: str) -> tuple[Any, Any]:
        return pick(g, *keys), pick(t, *keys)

    rows = [
        row("samples/s", *both("samples_per_s"), ratio.get("samples_per_s"),
            met.get("samples_per_s")),
        row("tokens/s", *both("tokens_per_s"), ratio.get("tokens_per_s")),
        row("peak RSS (MiB)", *both("peak_rss_mib"), ratio.get("peak_rss"),
            met.get("peak_rss")),
    ]  # fmt: skip
    steps_g, steps_t = g.get("steps") or 1, t.get("steps") or 1
    for phase in ("generate", "forward", "backward", "optimizer"):
        gs, ts = both("phase_s", phase)
        rows.append(
            row(f"{phase} s/step", None if gs is None else gs / steps_g,
                None if ts is None else ts / steps_t)
        )  # fmt: skip
    rows.append(row("train reward (mean)", *both("train_reward_mean")))
    if pick(g, "eval", "reward") is not None:
        rows.append(
            row("eval reward after training", *both("eval", "reward"),
                target=met.get("eval_reward_not_worse"))
        )  # fmt: skip
    rows.append(row("settings equal (table below)", None, None, target=res.get("settings_equal")))
    return rows


def settings_rows(res: dict[str, Any]) -> list[tuple[str, Any, Any, bool | None]]:
    """vs_trl's settings and observed rows: (setting, grouprl, TRL, equal; None = one side
    never observed it)."""
    out = []
    for section in ("settings", "observed"):
        for key, row in (res.get(section) or {}).items():
            if isinstance(row, dict) and "equal" in row:
                label = key if section == "settings" else f"observed: {key}"
                out.append((label, row.get("grouprl"), row.get("trl"), row["equal"]))
    return out


def _train_step_rows(res: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for r in res.get("results", []):
        sec, tgt, m = r.get("seconds", {}), r.get("targets", {}), r.get("model", "?")
        if "threads" in r:
            m = f"{m}, {r.get('threads_used', r['threads'])} thr"
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


def _rollout_correction_rows(res: dict[str, Any]) -> list[Row]:
    def row(metric: str, value: Any, target: Any = None) -> Row:
        return {"metric": metric, "grouprl": value, "peer": None, "ratio": None, "target": target}

    fn = res.get("functions", {})
    n, t = fn.get("batch", ["?", "?"])
    rows = [row(f"{k} (ms, {n}×{t} tokens)", v * 1e3) for k, v in fn.get("seconds", {}).items()]
    limit = res.get("target", {}).get("correction_frac", 0.05)
    for r in res.get("step", []):
        label = f"step, {r.get('precision')} rollouts, {r.get('spec')}"
        if "error" in r:
            rows.append(row(f"{label}: failed", None, False))
            continue
        rows.append(row(f"{label}: s/step", r["seconds"]["step"]))
        if "correction_frac" in r:
            frac = r["correction_frac"]
            rows.append(row(f"{label}: correction share (target <= {limit})", frac, frac <= limit))
            rows.append(row(f"{label}: fp32 recompute share", r.get("recompute_frac")))
    return rows


SUMMARISERS: dict[str, Callable[[dict[str, Any]], list[Row]]] = {
    "advantages": _advantages_rows,
    "train_step": _train_step_rows,
    "rollout_correction": _rollout_correction_rows,
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
    for name, outcome in outcomes.items():
        rows = settings_rows(outcome.get("result") or {})
        if rows:
            console.print(_settings_table(name, rows))


def _show(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True)


def _settings_table(name: str, rows: list[tuple[str, Any, Any, bool | None]]) -> Any:
    """The settings each trainer ran with, read back from its live objects; differences red."""
    from rich.table import Table

    differ = sum(1 for *_, equal in rows if equal is False)
    table = Table(
        title=f"{name}: settings read back from each trainer ({differ} of {len(rows)} differ)"
    )
    for col in ("setting", "grouprl", "TRL", "equal"):
        table.add_column(col, overflow="fold")
    for key, g, t, equal in rows:
        style = "red" if equal is False else None
        table.add_row(key, _show(g), _show(t), _fmt(equal), style=style)
    return table


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
        if getattr(args, "model", None) and name in MODEL_FLAGS:
            script_args += [MODEL_FLAGS[name], args.model]
        print(f"running {name} {' '.join(script_args)}".rstrip(), file=sys.stderr, flush=True)
        outcomes[name] = run_script(path, script_args, args.timeout)
    print_table(outcomes, args.quick)
    if args.json:
        args.json.write_text(json.dumps(outcomes, indent=1), encoding="utf-8")
    return 0 if all(o["ok"] for o in outcomes.values()) else 1
