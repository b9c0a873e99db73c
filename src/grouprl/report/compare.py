"""The ``grouprl compare`` report: curves with ±SE bands per arm, and the paired table.

Reads only the dict :func:`grouprl.diagnostics.compare.compare` returns (self-contained HTML,
the figure embedded as PNG, like the run report)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from grouprl.report import html as H

__all__ = ["figure", "table_rows", "write_compare_report"]


def figure(result: dict[str, Any], metrics: list[str] | None = None):
    """One panel per metric: each arm's mean over its runs at every step, with a ±1 SE band."""
    metrics = list(metrics or result["metrics"])
    fig, axes = H.figure(ncols=len(metrics), width=5.0, height=3.4)
    for ax, m in zip(axes[0], metrics, strict=True):
        for arm, per in result["curves"].items():
            c = per.get(m)
            if not c or not c["step"]:
                continue
            lo = [a - b for a, b in zip(c["mean"], c["se"], strict=True)]
            hi = [a + b for a, b in zip(c["mean"], c["se"], strict=True)]
            (line,) = ax.plot(
                c["step"], c["mean"], marker="o", ms=3, label=f"{arm} (n={c['n'][0]})"
            )
            ax.fill_between(c["step"], lo, hi, color=line.get_color(), alpha=0.2, lw=0)
        ax.set_title(f"{m} (mean ± SE over seeds)")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    return fig


def _pm(stats: dict[str, Any]) -> str:
    se = stats["se"]
    se_txt = "–" if math.isnan(se) else f"{se:.4g}"
    return f"{stats['mean']:+.4g} ± {se_txt}"


def table_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (arm, metric, step or end): paired mean ± SE, signs, the bootstrap CI."""
    level = result["bootstrap"]["level"]
    rows = []
    for c in result["comparisons"]:
        points = [*((f"step {s}", st) for s, st in c["steps"].items()), ("end", c["end"])]
        for where, st in points:
            rows.append(
                {
                    "arm − baseline": f"{c['arm']} − {c['baseline']}",
                    "metric": c["metric"],
                    "at": where,
                    "mean ± SE": _pm(st),
                    "> 0": f"{st['positive']}/{st['n']}",
                    "< 0": f"{st['negative']}/{st['n']}",
                    f"{100 * level:g}% CI": f"[{st['ci_low']:+.4g}, {st['ci_high']:+.4g}]",
                }
            )
    return rows


def write_compare_report(
    path: str | Path, result: dict[str, Any], title: str | None = None
) -> Path:
    """Write the HTML report of a comparison to ``path``."""
    b = result["bootstrap"]
    blocks = [
        H.text(
            f"Every arm against {result['baseline']!r}, paired by run.seed: per seed "
            "d = arm − baseline; mean ± SE (sample sd of d, ddof 1, / √n); how many seeds "
            f"have d > 0 and d < 0; a {b['method']} bootstrap interval of the mean "
            f"({b['resamples']} resamples, seed {b['seed']}).",
            "lead",
        ),
        "<h2>Curves</h2>",
        H.img(figure(result), "curves per arm"),
        "<h2>Paired differences</h2>",
        H.table(table_rows(result)),
        "<h2>Arms</h2>",
        H.table(
            [
                {"arm": a, "seeds": ", ".join(map(str, v["seeds"])), "runs": len(v["runs"])}
                for a, v in result["arms"].items()
            ]
        ),
    ]
    for note in result.get("notes", []):
        blocks.insert(1, H.text(note, "warn", "div"))
    return H.write_page(path, title or "grouprl compare", blocks)
