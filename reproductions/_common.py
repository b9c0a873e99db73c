"""Shared plumbing of the reproductions: seeds, mean ± std, results.json and the README table.

Every ``reproductions/<claim>/run.py`` measures over several seeds, then calls
:func:`write_results` (``results.json`` + the figure) and :func:`update_readme`, which rewrites
only the block between ``<!-- results:start -->`` and ``<!-- results:end -->`` of its README,
so that every number in a README is the one in the ``results.json`` next to it.

``results.json`` schema (checked by ``tests/reproductions``)::

    {"name": str, "claim": str, "command": str, "quick": bool, "seeds": [int, ...],
     "config": {...}, "table": [{"<label>": str | int | float | {"mean", "std", "n", "values"}}],
     "checks": [{"name": str, "holds": bool, "detail": str}], "figure": str, "seconds": float}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grouprl._json import json_safe

os.environ.setdefault("HF_HUB_OFFLINE", "1")

START, END = "<!-- results:start -->", "<!-- results:end -->"
SCHEMA_KEYS = ("name", "claim", "command", "quick", "seeds", "config", "table", "checks")


def parser(description: str, default_seeds: int = 3) -> argparse.ArgumentParser:
    """The common command line: ``--quick``, ``--seeds N``, ``--out DIR``, ``--threads``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny setting (seconds), for tests")
    p.add_argument("--seeds", type=int, default=default_seeds, help="number of seeds (>= 1)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: next to run.py)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--readme-only",
        action="store_true",
        help="only rewrite the README's results block from the existing results.json",
    )
    return p


def load_results(out: Path) -> dict[str, Any]:
    """The ``results.json`` under ``out`` (for ``--readme-only``)."""
    path = out / "results.json"
    if not path.exists():
        raise SystemExit(f"{path} does not exist: run without --readme-only first")
    return json.loads(path.read_text(encoding="utf-8"))


def ms(values: Sequence[float]) -> dict[str, Any]:
    """Mean, sample std (ddof = 1; 0 with one value), count and the values themselves."""
    vals = [float(v) for v in values]
    finite = [v for v in vals if math.isfinite(v)]
    mean = statistics.fmean(finite) if finite else float("nan")
    std = statistics.stdev(finite) if len(finite) > 1 else 0.0
    return {"mean": mean, "std": std, "n": len(finite), "values": vals}


def paired(xs: Sequence[float], ys: Sequence[float]) -> dict[str, Any]:
    """Paired differences x − y per seed, through ``grouprl compare``'s statistics
    (:func:`grouprl.diagnostics.compare.paired_stats`): mean, SE = sd (ddof 1)/√n (NaN for one
    seed), the sign counts, the 95 % percentile bootstrap interval of the mean, and the
    differences themselves as ``values`` (the key results.json files have always held)."""
    from grouprl.diagnostics.compare import paired_stats

    d = [float(x) - float(y) for x, y in zip(xs, ys, strict=True)]
    if not d:
        nan = float("nan")
        return {"mean": nan, "se": nan, "n": 0, "positive": 0, "negative": 0, "zero": 0,
                "ci_low": nan, "ci_high": nan, "values": []}  # fmt: skip
    st = paired_stats(d)
    keys = ("mean", "se", "n", "positive", "negative", "zero", "ci_low", "ci_high")
    return {**{k: st[k] for k in keys}, "values": st["diffs"]}


def paired_interval(p: dict[str, Any]) -> tuple[float, float] | None:
    """The 95 % bootstrap interval of a :func:`paired` dict; for a dict saved before the
    interval was stored, recomputed from its per-seed ``values`` with the same function and
    seed (None when fewer than two seeds)."""
    if p.get("n", 0) < 2:
        return None
    if "ci_low" in p:
        return float(p["ci_low"]), float(p["ci_high"])
    from grouprl.diagnostics.compare import bootstrap_ci

    return bootstrap_ci([float(v) for v in p["values"]])


def fmt_paired(p: dict[str, Any], digits: int = 4) -> str:
    """``+0.0120 ± 0.0040 (5/5 +; 95 % [+0.0051, +0.0190])``: the paired mean ± SE, how many
    seeds share the mean's sign, and the bootstrap interval (:func:`paired_interval`)."""
    if not p["n"]:
        return "–"
    sign, count = ("+", p["positive"]) if p["mean"] >= 0 else ("−", p["negative"])
    se = "–" if not math.isfinite(p["se"]) else f"{p['se']:.{digits}f}"
    ci = paired_interval(p)
    band = "" if ci is None else f"; 95 % [{ci[0]:+.{digits}f}, {ci[1]:+.{digits}f}]"
    return f"{p['mean']:+.{digits}f} ± {se} ({count}/{p['n']} {sign}{band})"


def fmt(v: Any, digits: int = 5) -> str:
    """``mean ± std`` for a :func:`ms` dict, ``%.5g`` for floats, ``str`` otherwise."""
    if isinstance(v, dict) and "mean" in v:
        if v["mean"] is None or not math.isfinite(v["mean"]):
            return "–"
        return f"{v['mean']:.{digits}g} ± {v['std']:.2g}"
    if isinstance(v, float):
        return "–" if not math.isfinite(v) else f"{v:.{digits}g}"
    return str(v)


def fmt_se(v: Any, whole_above: float | None = None) -> str:
    """``mean ± SE`` (SE = sample std / √n) for a :func:`ms` dict, else :func:`fmt` (4 digits);
    an SE of at least ``whole_above`` is printed as a whole number."""
    if isinstance(v, dict) and "mean" in v:
        if v["mean"] is None or not math.isfinite(v["mean"]):
            return "–"
        se = v["std"] / math.sqrt(max(v["n"], 1))
        if whole_above is not None and se >= whole_above:
            return f"{v['mean']:.4g} ± {se:.0f}"
        return f"{v['mean']:.4g} ± {se:.2g}"
    return fmt(v, 4)


def markdown_table(rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A GitHub markdown table of rows (columns: the first row's keys unless given)."""
    if not rows:
        return "(no rows)"
    cols = list(columns or dict.fromkeys(k for r in rows for k in r))

    def cell(text: str) -> str:
        return text.replace("|", "\\|")  # a literal pipe would split the cell

    out = [
        "| " + " | ".join(cell(c) for c in cols) + " |",
        "|" + "|".join("---" for _ in cols) + "|",
    ]
    for r in rows:
        out.append("| " + " | ".join(cell(fmt(r.get(c, ""))) for c in cols) + " |")
    return "\n".join(out)


def write_results(out: Path, payload: dict[str, Any], fig=None) -> Path:
    """Write ``results.json`` (and ``figure.png`` when ``fig`` is given) under ``out``."""
    missing = [k for k in SCHEMA_KEYS if k not in payload]
    if missing:
        raise ValueError(f"results payload lacks {missing}")
    out.mkdir(parents=True, exist_ok=True)
    if fig is not None:
        fig.savefig(out / "figure.png", dpi=110)
        payload = {**payload, "figure": "figure.png"}
    path = out / "results.json"
    path.write_text(json.dumps(json_safe(payload), indent=1) + "\n", encoding="utf-8")
    return path


def update_readme(out: Path, block: str) -> None:
    """Replace the generated block of ``out/README.md`` (skipped when the file or markers lack)."""
    readme = out / "README.md"
    if not readme.exists():
        return
    text = readme.read_text(encoding="utf-8")
    if START not in text or END not in text:
        return
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{block.strip()}\n{END}{tail}", encoding="utf-8")


def checks_block(checks: list[dict[str, Any]]) -> str:
    """Markdown list of the checks with ✓/✗."""
    return "\n".join(
        f"- {'✓' if c['holds'] else '✗'} **{c['name']}**: {c['detail']}" for c in checks
    )


def output_folder(args: argparse.Namespace, here: Path, readme_block: Any) -> Path | None:
    """The folder a run writes to (``--out`` or the claim's own); None when ``--readme-only``
    re-rendered the README's results block from the saved results.json instead."""
    out = args.out or here
    if args.readme_only:
        update_readme(out, readme_block(load_results(out)))
        return None
    return out


def publish(out: Path, payload: dict[str, Any], fig: Any, readme_block: Any) -> int:
    """Write results.json and the figure, re-render the README block, print it; exit code 0."""
    write_results(out, payload, fig)
    block = readme_block(payload)
    update_readme(out, block)
    print(block)
    return 0


def simulate_parts(simulate: Any, parts: dict[str, dict[str, Any]], args: Any) -> dict[str, Any]:
    """``{part: simulate(quick, seed=0, seeds, **overrides)}`` for a reproduction that calls a
    ``grouprl.simulate`` entry once per named part (each part its own overrides)."""
    return {
        part: simulate(quick=args.quick, seed=0, seeds=args.seeds, **kw)
        for part, kw in parts.items()
    }


def make_payload(
    name: str, claim: str, args: argparse.Namespace, parts: dict[str, Any], **rest: Any
) -> dict[str, Any]:
    """The results.json payload of a reproduction run on ``parts`` (``simulate_parts``): the
    schema keys from the command line, ``config`` per part, plus ``rest`` (table, checks, ...)."""
    return {
        "name": name,
        "claim": claim,
        "command": f"python reproductions/{name}/run.py" + (" --quick" if args.quick else ""),
        "quick": args.quick,
        "seeds": list(range(args.seeds)),
        "config": {part: res.config for part, res in parts.items()},
        **rest,
    }
