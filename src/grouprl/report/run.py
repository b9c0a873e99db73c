"""The report of a training run: ``run_dir/report.html`` from ``metrics.jsonl`` (+ config.yaml).

Every panel is drawn only when its metrics exist (:func:`plan_panels`), so a run that logs
fewer keys (an old run, a run without evaluation) still gets a report, and a line under the
figure says what was left out. The KL panel is left out when the run's β is 0 (no KL term);
the evaluation panel starts at step 0 when the trainer logged the evaluation before the first
update; a log axis is used only for a series with every value > 0. Per-step curves are drawn
thin as logged, under their debiased exponential moving average (``glance.ema``, α =
``glance.EMA_ALPHA``), and every legend sits under its panel, off the data. The page opens on
``glance.glance``: what improved, by how much, and what to look at. Health conditions are
recomputed by replaying :class:`grouprl.diagnostics.RunHealth` over the logged steps, so the
report shows them even though the trainer only printed them, each once with its span.

[OURS] The ACR paper's fit of final accuracy on ACR_100 (51.4 − 29.6·ACR_100) is not shown:
it was fitted on that paper's models and benchmarks, and on a maze or arithmetic run its
number (e.g. 30.8 at ACR_100 = 0.7) predicts nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grouprl._json import jsonl_lines, read_jsonl
from grouprl.diagnostics.health import Episode, RunHealth
from grouprl.report import html as H
from grouprl.report.glance import EMA_ALPHA, distinct_series, ema, glance

__all__ = [
    "Panel",
    "plan_panels",
    "read_metrics",
    "read_run_config",
    "replay_episodes",
    "replay_health",
    "run_beta",
    "run_blocks",
    "training_figure",
    "write_run_report",
]


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
    for no, obj, error in jsonl_lines(path, errors="replace"):
        try:
            if error is not None:
                raise ValueError(error)
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


def _replay(rows: list[dict[str, float]]) -> tuple[RunHealth, list[str]]:
    health = RunHealth()
    out: list[str] = []
    for r in rows:
        out += health.update(int(r["step"]), {k: v for k, v in r.items() if k != "step"})
    return health, out


def replay_health(rows: list[dict[str, float]]) -> list[str]:
    """The lines :class:`RunHealth` prints when fed the logged steps in order."""
    return _replay(rows)[1]


def replay_episodes(rows: list[dict[str, float]]) -> list[Episode]:
    """Each health condition of the logged steps once, with its span (``RunHealth.episodes``)."""
    return _replay(rows)[0].episodes()


def _series(rows, key):
    pts = [(r["step"], r[key]) for r in rows if key in r and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def _has(rows, key) -> bool:
    return any(key in r and math.isfinite(r[key]) for r in rows)


def run_beta(config: Any) -> float | None:
    """β of the run's resolved preset (``algorithm.preset`` + ``algorithm.overrides`` of its
    config.yaml); None when the config does not say (no config, an older layout, a preset
    this grouprl does not know)."""
    algo = config.get("algorithm") if isinstance(config, dict) else None
    if not isinstance(algo, dict) or "preset" not in algo:
        return None
    from grouprl import presets

    try:  # as train.config.AlgorithmConfig.resolve: the preset with its overrides
        preset = presets.get(str(algo["preset"])).with_(**dict(algo.get("overrides") or {}))
        return float(preset.beta)
    except (ValueError, TypeError):
        return None


@dataclass(frozen=True)
class Panel:
    """One plot of the training-curves figure: its title and the metric keys it draws."""

    title: str
    keys: tuple[str, ...]
    log_y: bool = False
    """Log-scale the y axis, which only happens when every plotted value is > 0 and they span
    more than a decade (a log axis over less prints labels like 3.4×10⁰)."""


def plan_panels(rows: list[dict[str, float]], beta: float | None) -> tuple[list[Panel], list[str]]:
    """The panels to draw (those with a logged finite value), and one line per panel left out.

    The KL panel and the ``loss/kl`` curve are left out when β = 0: the run has no KL term,
    and the zeros the trainer logs for it would only look like a KL that stays at 0; so is
    ``loss/pg``, then the same curve as ``loss/total``.
    """
    no_kl = beta == 0
    evals = distinct_series(rows, sorted({k for r in rows for k in r if k.startswith("eval/")}))
    loss_keys = ("loss/total", "loss", "loss/pg") + (() if no_kl else ("loss/kl",))
    if no_kl and _has(rows, "loss/total"):  # without a KL term the total is the pg loss
        loss_keys = tuple(k for k in loss_keys if k != "loss/pg")
    wanted = [
        Panel("evaluation", evals),
        Panel("reward", ("reward/mean",)),
        Panel("advantage-collapse rate", ("acr/rate", "health/acr_cumulative")),
        Panel("KL", ("kl/mean", "kl/p95")),
        Panel("1/scale over updated groups", ("scale/inv_p95", "scale/inv_p99"), log_y=True),
        Panel("loss", tuple(k for k in loss_keys if _has(rows, k))[:3]),
    ]
    drawn, left_out = [], []
    loss = [v for k in wanted[-1].keys for v in _series(rows, k)[1]]
    for panel in wanted:
        if panel.title == "KL" and no_kl:
            left_out.append("KL: β = 0, the run has no KL term")
        elif panel.title == "loss" and loss and max(map(abs, loss)) < LOSS_ZERO:
            left_out.append(
                f"loss: below {LOSS_ZERO:g} at every step (an on-policy surrogate's value is 0 "
                "up to rounding; its gradient is not)"
            )
        elif any(_has(rows, k) for k in panel.keys):
            drawn.append(panel)
        else:
            left_out.append(f"{panel.title}: not logged")
    return drawn, left_out


LOSS_ZERO = 1e-5
"""A loss curve whose every value is smaller than this is noise around 0, not drawn."""


def training_figure(rows: list[dict[str, float]], beta: float | None) -> tuple[Any, list[str]]:
    """The training-curves figure (None when no panel has data) and the panels left out."""
    panels, left_out = plan_panels(rows, beta)
    if not panels:
        return None, left_out
    ncols = min(2, len(panels))  # two columns: the page shows the PNG near its own size
    fig, ax = H.figure(ncols, math.ceil(len(panels) / ncols), width=5.4, height=3.6)
    for i, a in enumerate(ax.flat):
        if i < len(panels):
            _draw(a, rows, panels[i])
        else:
            a.set_axis_off()
    return fig, left_out


SMOOTH_FROM = 20
"""Series with at least this many points are drawn raw (thin) under their EMA (thick); shorter
ones (evaluations, a short run) as measured, with markers."""


def _draw(ax, rows, panel: Panel) -> None:
    if panel.title == "advantage-collapse rate":
        _acr_stack(ax, rows)
    values = []
    for key in panel.keys:
        x, y = _series(rows, key)
        if not y:
            continue
        values += y
        if len(y) < SMOOTH_FROM:
            ax.plot(x, y, label=key, lw=1.4, marker="o", ms=3.5)
            continue
        smooth = key not in _SMOOTHED_ALREADY
        (raw,) = ax.plot(x, y, lw=0.7, alpha=0.35 if smooth else 1.0)
        if smooth:
            ax.plot(x, ema(y), lw=1.8, color=raw.get_color(), label=f"{key} (EMA)")
        else:
            raw.set_label(key)
    if panel.title == "advantage-collapse rate":
        ax.axhline(0.35, color="grey", ls=":", lw=1, label="stall 0.35")
    title = panel.title
    if panel.log_y:
        if min(values) > 0:
            if max(values) > 10 * min(values):  # less than a decade reads better linear
                ax.set_yscale("log")
        else:  # a log axis has no place for 0 (1/scale is logged as 0 when nothing updated)
            title += " (linear: some values are 0)"
    ax.set_title(title)
    ax.set_xlabel("step")
    _legend_below(ax)


_SMOOTHED_ALREADY = frozenset({"health/acr_cumulative"})
"""Running means the trainer logs: drawn as they are, never smoothed again."""


def _legend_below(ax) -> None:
    """The legend under the panel, outside the data area (constrained layout makes room)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(
            handles, labels, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2),
            ncol=min(2, len(handles)), frameon=False,
        )  # fmt: skip


def _acr_stack(ax, rows):
    """The collapsed groups' split, stacked; smoothed like the curves when long enough."""
    parts = [k for k in ("acr/all_wrong", "acr/all_correct", "acr/other") if _has(rows, k)]
    logged = [r for r in rows if any(k in r for k in parts)]
    if parts and logged:
        ys = [[r[k] if math.isfinite(r.get(k, math.nan)) else 0.0 for r in logged] for k in parts]
        steps = [r["step"] for r in logged]
        smooth = len(steps) >= SMOOTH_FROM
        labels = [k.split("/")[1] + (" (EMA)" if smooth else "") for k in parts]
        ax.stackplot(steps, *([ema(y) for y in ys] if smooth else ys), labels=labels, alpha=0.45)


CLIP_KEYS = (
    "policy/clip_frac_low",
    "policy/clip_frac_high",
    "policy/clip_frac_region",
    "policy/clip_frac_dual",
)
"""The surrogates' clip fractions as the trainer logs them (means over the step's minibatches;
``grouprl.losses.surrogates``: low = A < 0 and ρ < 1 − ε_low, high = A > 0 and ρ > 1 + ε_high,
region = either, dual = verl's ``pg_clipfrac_lower``)."""


def _clip_blocks(rows, config: Any = None) -> list[str]:
    """The clip-fraction panel and the ratio range, when the run logged them (ALGORITHMS.md §5).

    A run whose clip fractions are all 0 gets a sentence saying why: with one optimizer step
    per generation batch every step sees ρ = 1, so no clip can act (ALGORITHMS.md §3). It is
    a plain note when the run kept its preset's own schedule (``optim.minibatches`` and
    ``optim.ppo_epochs`` null: the sources' schedule), a warning when the config set it.
    """
    keys = [k for k in CLIP_KEYS if _has(rows, k)]
    if not keys:
        return []
    panels = [Panel("clip fractions (mean over minibatches)", tuple(keys))]
    ratio = tuple(k for k in ("policy/ratio_min", "policy/ratio_max") if _has(rows, k))
    if ratio:
        panels.append(Panel("importance ratio min / max (mean over minibatches)", ratio))
    blocks = ["<h2>Policy update: clipping</h2>"]
    flat = all(v == 0 for k in keys for v in _series(rows, k)[1]) and all(
        abs(v - 1) < 1e-4
        for k in ratio
        for v in _series(rows, k)[1]  # float noise
    )
    if not flat:  # a panel of flat lines at 0 and 1 says less than the sentence below
        fig, ax = H.figure(len(panels), 1, width=5.4, height=3.2)
        for a, panel in zip(ax.flat, panels):
            _draw(a, rows, panel)
        blocks[0] += H.img(fig, "clip fractions")
    _, region = _series(rows, "policy/clip_frac_region")
    if region:
        acted = sum(v > 0 for v in region)
        line = (
            f"The clip acted in {acted} of {len(region)} logged steps "
            f"(mean region fraction {sum(region) / len(region):.4g}, max {max(region):.4g})."
        )
        chosen = any(_config_value(config, "optim", k) is not None for k in _SCHEDULE_KEYS)
        if acted == 0:
            line += (
                " Every step was on-policy (ratio 1): with one minibatch and one epoch per "
                "generation batch no clip can act, and a clip-based surrogate is REINFORCE"
            )
            line += "." if chosen else ", as the preset's sources run it (its own schedule)."
        blocks.append(H.text(line, "warn" if acted == 0 and chosen else "sub"))
    return blocks


_SCHEDULE_KEYS = ("minibatches", "ppo_epochs")


def _config_value(config: Any, section: str, key: str) -> Any:
    """``config[section][key]`` (config.yaml's layout), or a flat ``config[section]``."""
    value = config.get(section) if isinstance(config, dict) else None
    return value.get(key) if isinstance(value, dict) else value


def _summary(rows, config, beta) -> list[dict[str, Any]]:
    out = [{"quantity": "steps logged", "value": sum(r["step"] >= 1 for r in rows)}]
    for key, label in (
        ("reward/mean", "last reward/mean"),
        ("acr/rate", "last ACR"),
        ("health/acr_cumulative", "cumulative ACR"),
        ("health/acr_100", "ACR_100"),
        ("scale/inv_p99", "last 1/scale P99"),
        ("kl/mean", "last KL mean"),
    ):
        _, y = _series(rows, key)
        if y and not (key == "kl/mean" and beta == 0):
            out.append({"quantity": label, "value": y[-1]})
    for k in sorted({k for r in rows for k in r if k.startswith("eval/")}):
        x, y = _series(rows, k)
        if len(y) == 1:  # a first and a last value are in "At a glance"
            out.append({"quantity": f"{k} (step {int(x[-1])})", "value": y[-1]})
    for section, key in (("algorithm", "preset"), ("task", "name"), ("model", "name")):
        v = _config_value(config, section, key)
        if v is not None:
            out.append({"quantity": f"config {section}", "value": str(v)})
    if beta is not None:
        out.append({"quantity": "β (KL coefficient)", "value": beta})
    return out


SMOOTHING_NOTE = (
    f"Thin lines: the value logged at each step; thick lines: its exponential moving average "
    f"(α = {EMA_ALPHA:g}: each new step weighs {EMA_ALPHA:g}, the past {1 - EMA_ALPHA:g}, "
    "about a 10-step memory; debiased at the start). Series with fewer than "
    f"{SMOOTH_FROM} points (evaluations) are drawn as measured. The collapse panel stacks the "
    "smoothed split of the collapsed groups under the logged rate."
)


def _glance_block(rows, episodes, config) -> str:
    g = glance(rows, episodes, config)
    items = "".join(H.text(x, tag="li") for x in g.look_at)
    changes = [
        {"quantity": c.label, "start": c.start, "end": c.end, "change": c.delta, "when": c.where}
        for c in g.changes
    ]
    return (
        "<h2>At a glance</h2>"
        + H.text(g.headline, "lead")
        + "<p><b>What to look at</b></p><ul>"
        + items
        + "</ul>"
        + (H.table(changes) if changes else "")
    )


def _health_blocks(episodes: list[Episode]) -> list[str]:
    """Each condition once: its span, its first message, its updates."""
    blocks = ["<h2>Health</h2>"]
    if not episodes:
        return [*blocks, H.text("No health rule fired.", "ok")]
    for ep in episodes:
        head = f"{ep.rule}, {ep.span}" + (" (still on at the end)" if ep.open else "")
        detail = ep.message.split(": ", 1)[-1]
        updates = "".join(H.text(u.split(": ", 1)[-1], tag="li") for u in ep.updates)
        blocks.append(
            '<div class="warn">'
            + H.text(head, tag="b")
            + H.text(detail, tag="p")
            + (f"<ul>{updates}</ul>" if updates else "")
            + "</div>"
        )
    return blocks


def run_blocks(rows: list[dict[str, float]], config: Any = None) -> list[str]:
    """HTML blocks (at a glance, numbers, figures, health, key table) for logged metric rows."""
    beta = run_beta(config)
    if not rows:
        return [
            "<h2>Summary</h2>" + H.table(_summary(rows, config, beta)),
            H.text("metrics.jsonl holds no step yet.", "sub"),
        ]
    episodes = replay_episodes(rows)
    blocks = [_glance_block(rows, episodes, config)]
    blocks.append("<h2>Summary</h2>" + H.table(_summary(rows, config, beta)))
    fig, left_out = training_figure(rows, beta)
    blocks.append("<h2>Training curves</h2>")
    if fig is not None:
        blocks.append(H.img(fig, "training curves") + H.text(SMOOTHING_NOTE, "sub"))
    if left_out:
        blocks.append(H.text("Not drawn: " + "; ".join(left_out) + ".", "sub"))
    blocks += _clip_blocks(rows, config)
    blocks += _health_blocks(episodes)
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


def read_run_config(run_dir: str | Path) -> tuple[Any, list[str]]:
    """``run_dir/config.yaml`` as a dict (None when absent) and the problems found reading it."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None, []
    import yaml

    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")), []
    except yaml.YAMLError as err:
        return None, [f"config.yaml: {err}"]


RESUME_KEY = "resume/changed"
"""The metrics.jsonl entry ``grouprl.train.resume`` writes after a ``--resume-anyway`` (in the
first row after the resume): ``{"after_step", "checkpoint", "fields": {name: [before, now]}}``."""


def resume_blocks(metrics_path: str | Path) -> list[str]:
    """report.html's section on ``--resume-anyway`` changes (none when there were none)."""
    rows = []
    for row in read_jsonl(metrics_path):
        note = row.get(RESUME_KEY) if isinstance(row, dict) else None
        if not isinstance(note, dict):
            continue
        for name, (before, after) in note.get("fields", {}).items():
            rows.append(
                {
                    "resumed after step": note.get("after_step", ""),
                    "field": name,
                    "checkpoint": _shown(before),
                    "now": _shown(after),
                }
            )
    if not rows:
        return []
    return [
        "<h2>Configuration changed on resume</h2>"
        + H.text(
            "This run was resumed with --resume-anyway and a configuration that changes the "
            "experiment: the steps after each resume below ran with the new values.",
            "warn",
            "div",
        )
        + H.table(rows)
    ]


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


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
    config, config_errors = read_run_config(run_dir)
    errors += config_errors
    blocks = run_blocks(rows, config)
    blocks[1:1] = resume_blocks(metrics_path)  # after "At a glance"
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
