"""The HTML report of ``grouprl diagnose``: a reward-groups diagnosis and, for a run folder,
the logged run metrics (``grouprl.report.run``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grouprl.report import html as H
from grouprl.report.run import read_run_config, run_blocks

__all__ = ["write_diagnosis_report"]


def write_diagnosis_report(
    out: Path,
    d: Any,
    gf: Any,
    run_dir: Path | None,
    metrics_rows: Any,
    metrics_errors: Any,
    mismatch: Any = None,
    mismatch_warnings: Any = (),
) -> Path:
    """``report.html`` of ``grouprl diagnose``: totals, warnings, figures, tails, advice, steps,
    and the rollout-vs-trainer mismatch of the logged metrics (``external.MismatchLog``)."""
    blocks = []
    if d is not None:
        blocks.append(
            "<h2>Totals</h2>" + H.table([{"quantity": k, "value": v} for k, v in d.totals.items()])
        )
        blocks.append("<h2>Warnings</h2>")
        blocks += [H.text(w, "warn", "div") for w in d.warnings] or [
            H.text("No health rule fired.", "ok")
        ]
        blocks.append(_figure(d))
        blocks.append("<h2>Inverse-scale tails</h2>" + H.table(d.scale))
        if d.advice is not None:
            rows = [
                {"N": n, "expected active": a, "expected tail miss": m}
                for n, a, m in d.advice.rows()
            ]
            blocks.append(
                "<h2>Group size advice</h2>"
                + H.table(rows)
                + H.text(f"Advised G = {d.advice.recommended}: {d.advice.reason}")
            )
        blocks.append("<h2>Per step</h2>" + H.table(d.steps))
        if gf.n_errors:
            errs = [H.text(f"line {no}: {msg}", "bad") for no, msg in gf.errors[:200]]
            blocks.append(f"<h2>Malformed lines ({gf.n_errors}, skipped)</h2>" + "".join(errs))
    if metrics_rows is not None:
        blocks.append("<h1>Logged run metrics</h1>")
        config = read_run_config(run_dir)[0] if run_dir is not None else None
        blocks += run_blocks(metrics_rows, config)
        if metrics_errors:
            blocks += [H.text(e, "bad") for e in metrics_errors[:50]]
    if mismatch is not None:
        from grouprl.diagnostics.mismatch import summarize

        blocks.append(f"<h2>Rollout vs trainer mismatch ({mismatch.source} log)</h2>")
        blocks += [H.text(n) for n in mismatch.notes]
        if mismatch.rows:
            blocks.append(H.table(summarize(mismatch.rows)))
        blocks += [H.text(w, "warn", "div") for w in mismatch_warnings]
    src = str(run_dir or (gf.path if gf is not None else mismatch.path))
    return H.write_page(out, "grouprl diagnose", blocks, src)


def _figure(d: Any) -> str:
    fig, ax = H.figure(3, 1, width=4.6)
    labels = [r["step"] for r in d.steps]
    numeric = all(isinstance(x, int) for x in labels)
    steps = labels if numeric else list(range(len(d.steps)))
    parts = ("acr/all_wrong", "acr/all_correct", "acr/other")
    ax[0, 0].stackplot(
        steps,
        *[[r[k] for r in d.steps] for k in parts],
        labels=[p.split("/")[1] for p in parts],
        alpha=0.7,
    )
    ax[0, 0].axhline(0.35, color="grey", ls=":", label="stall 0.35")
    ax[0, 0].set_title("ACR per step"), ax[0, 0].legend(fontsize=7)
    ax[0, 0].set_xlabel("step" if numeric else "batch")
    ax[0, 1].plot(steps, [r["reward/mean"] for r in d.steps], "o-", ms=3)
    ax[0, 1].set_title("mean reward")
    if d.advice is not None:
        n = list(d.advice.candidates)
        ax[0, 2].plot(n, d.advice.active, "o-", label="expected active")
        ax[0, 2].plot(n, d.advice.tail_miss, "o-", label="expected tail miss")
        ax[0, 2].axvline(
            d.advice.recommended, color="green", ls="--", label=f"advised {d.advice.recommended}"
        )
        ax[0, 2].axvline(d.group_size, color="grey", ls=":", label=f"current {d.group_size}")
        (
            ax[0, 2].set_xscale("log", base=2),
            ax[0, 2].set_xlabel("group size N"),
            ax[0, 2].legend(fontsize=7),
        )
        ax[0, 2].set_title("group size")
    return "<h2>Figures</h2>" + H.img(fig, "diagnosis")
