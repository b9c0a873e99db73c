"""The report of a training run: ``run_dir/report.html`` from ``metrics.jsonl`` (+ config.yaml).

Every figure is drawn only when its metrics exist, so a run that logs fewer keys (an old run,
a run without evaluation or KL) still gets a report. Health warnings are recomputed by
replaying :class:`grouprl.diagnostics.RunHealth` over the logged steps, so the report shows
them even though the trainer only printed them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from grouprl.diagnostics.health import RunHealth, acr_100_accuracy_fit
from grouprl.report import html as H

__all__ = ["read_metrics", "replay_health", "run_blocks", "write_run_report"]


def _num(v: Any) -> float:
    """A logged value as float: null/None -> NaN (the trainer writes NaN as null)."""
    if v is None:
        return math.nan
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    raise TypeError(f"not a number: {v!r}")


def read_metrics(path: str | Path) -> tuple[list[dict[str, float]], list[str]]:
    """Rows of a metrics.jsonl (sorted by step; the last row of a repeated step wins) and
    the problems found, one string per skipped line (``"line 7: ..."``)."""
    rows: dict[int, dict[str, float]] = {}
    errors: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError("not a JSON object")
                if "step" not in obj:
                    raise ValueError('no "step" key')
                step = int(obj["step"])
                row = {}
                for k, v in obj.items():
                    if k == "step":
                        continue
                    try:
                        row[k] = _num(v)
                    except TypeError:
                        continue  # strings (e.g. a warning list) are not plotted
                rows[step] = {"step": float(step), **row}
            except (ValueError, TypeError) as err:
                errors.append(f"line {no}: {err}")
    return [rows[s] for s in sorted(rows)], errors


def replay_health(rows: list[dict[str, float]]) -> list[str]:
    """The warnings :class:`RunHealth` raises when fed the logged steps in order."""
    health = RunHealth()
    out: list[str] = []
    for r in rows:
        out += health.update(int(r["step"]), {k: v for k, v in r.items() if k != "step"})
    return out


def _series(rows, key):
    pts = [(r["step"], r[key]) for r in rows if key in r and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def _has(rows, key) -> bool:
    return any(key in r and math.isfinite(r[key]) for r in rows)


def _panel(ax, rows, keys, title, *, logy=False, hline=None):
    drawn = False
    for key in keys:
        if _has(rows, key):
            x, y = _series(rows, key)
            ax.plot(x, y, label=key, lw=1.2)
            drawn = True
    if not drawn:
        ax.text(
            0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey"
        )
    if hline is not None:
        ax.axhline(hline[0], color="grey", ls=":", lw=1, label=hline[1])
    if logy and drawn:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel("step")
    if drawn:
        ax.legend(fontsize=7)
    return drawn


def _acr_panel(ax, rows):
    parts = [k for k in ("acr/all_wrong", "acr/all_correct", "acr/other") if _has(rows, k)]
    if parts:
        steps = [r["step"] for r in rows]
        ys = [
            [r.get(k, math.nan) if math.isfinite(r.get(k, math.nan)) else 0.0 for r in rows]
            for k in parts
        ]
        ax.stackplot(steps, *ys, labels=[k.split("/")[1] for k in parts], alpha=0.6)
    _panel(
        ax,
        rows,
        ["acr/rate", "health/acr_cumulative"],
        "advantage-collapse rate",
        hline=(0.35, "stall 0.35"),
    )


def _summary(rows, config) -> list[dict[str, Any]]:
    last = rows[-1] if rows else {}
    out = [{"quantity": "steps logged", "value": len(rows)}]
    for key, label in (
        ("reward/mean", "last reward/mean"),
        ("acr/rate", "last ACR"),
        ("health/acr_cumulative", "cumulative ACR"),
        ("health/acr_100", "ACR_100"),
        ("scale/inv_p99", "last 1/scale P99"),
        ("kl/mean", "last KL mean"),
    ):
        if key in last and math.isfinite(last[key]):
            out.append({"quantity": label, "value": last[key]})
    if "health/acr_100" in last and math.isfinite(last["health/acr_100"]):
        fit = acr_100_accuracy_fit(last["health/acr_100"])
        out.append(
            {
                "quantity": "ACR paper's accuracy fit 51.4 − 29.6·ACR_100 (their models only)",
                "value": fit,
            }
        )
    for k in sorted({k for r in rows for k in r if k.startswith("eval/")}):
        x, y = _series(rows, k)
        if y:
            out.append({"quantity": f"{k} (step {int(x[-1])})", "value": y[-1]})
    if isinstance(config, dict):
        for key in ("preset", "task", "model"):
            v = config.get(key)
            if v is not None:
                out.append(
                    {
                        "quantity": f"config {key}",
                        "value": v if not isinstance(v, dict) else json.dumps(v),
                    }
                )
    return out


def run_blocks(rows: list[dict[str, float]], config: Any = None) -> list[str]:
    """HTML blocks (summary, figures, warnings, key table) for logged metric rows."""
    blocks = ["<h2>Summary</h2>" + H.table(_summary(rows, config))]
    if not rows:
        return [*blocks, H.text("metrics.jsonl holds no step yet.", "sub")]
    fig, ax = H.figure(3, 2, width=4.8, height=3.2)
    _panel(ax[0, 0], rows, ["reward/mean"], "reward")
    _acr_panel(ax[0, 1], rows)
    _panel(ax[0, 2], rows, ["kl/mean", "kl/p95"], "KL")
    evals = sorted({k for r in rows for k in r if k.startswith("eval/")})
    _panel(ax[1, 0], rows, evals, "evaluation")
    _panel(
        ax[1, 1], rows, ["scale/inv_p95", "scale/inv_p99"], "1/scale over updated groups", logy=True
    )
    losses = [k for k in ("loss/total", "loss", "loss/pg", "loss/kl") if _has(rows, k)]
    _panel(ax[1, 2], rows, losses[:3], "loss")
    blocks.append("<h2>Training curves</h2>" + H.img(fig, "training curves"))
    warnings = replay_health(rows)
    blocks.append("<h2>Health warnings</h2>")
    if warnings:
        blocks += [H.text(w, "warn", "div") for w in warnings]
    else:
        blocks.append(H.text("No health rule fired.", "ok"))
    keys = sorted({k for r in rows for k in r if k != "step"})
    table_rows = []
    for k in keys:
        _, y = _series(rows, k)
        if y:
            table_rows.append(
                {"metric": k, "last": y[-1], "min": min(y), "max": max(y), "mean": sum(y) / len(y)}
            )
    blocks.append("<h2>All logged metrics</h2>" + H.table(table_rows))
    return blocks


def write_run_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``run_dir/report.html`` (or ``out``) from ``metrics.jsonl`` and ``config.yaml``.

    Raises FileNotFoundError when ``run_dir/metrics.jsonl`` is missing; malformed lines are
    skipped and listed in the report.
    """
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path} not found: is {run_dir} a grouprl run folder?")
    rows, errors = read_metrics(metrics_path)
    config = None
    cfg_path = run_dir / "config.yaml"
    if cfg_path.is_file():
        import yaml

        try:
            config = yaml.safe_load(cfg_path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            errors.append(f"config.yaml: {err}")
    blocks = run_blocks(rows, config)
    if errors:
        blocks.append("<h2>Skipped lines</h2>" + "".join(H.text(e, "bad") for e in errors[:50]))
    if config is not None:
        import yaml

        blocks.append(
            "<h2>Config</h2><pre>"
            + H.text(yaml.safe_dump(config, sort_keys=False), tag="code")
            + "</pre>"
        )
    return H.write_page(
        out or run_dir / "report.html", f"grouprl run report: {run_dir.name}", blocks, str(run_dir)
    )
