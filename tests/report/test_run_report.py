"""write_run_report: robust to missing keys and bad lines; health warnings replayed; panels
chosen from what was logged (no KL panel at β = 0, evaluation from step 0, no log axis for
zeros); no matplotlib warning on a short run."""

import json
import warnings

import pytest
import yaml

from grouprl.report import read_metrics, replay_health, write_run_report
from grouprl.report.glance import ema, glance
from grouprl.report.run import plan_panels, replay_episodes, run_beta, training_figure


def _write(run, rows, extra=""):
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n" + extra)


def _config(preset="grpo", **overrides):
    # the layout the trainer writes (RunConfig.to_dict), trimmed to what the report reads
    return {
        "model": {"name": "tiny", "dtype": "float32"},
        "task": {"name": "maze", "params": {}},
        "algorithm": {"preset": preset, "overrides": overrides},
    }


def _step(s, **extra):
    return {
        "step": s,
        "reward/mean": s / 100,
        "acr/rate": 0.5,
        "acr/all_wrong": 0.4,
        "acr/all_correct": 0.1,
        "acr/other": 0.0,
        "kl/mean": 0.01,
        "scale/inv_p95": 3.0,
        "scale/inv_p99": 2000.0 if s == 10 else 3.0,
        "loss/total": 0.2,
        "loss/pg": 0.2,
        "loss/kl": 0.0,
        "health/acr_cumulative": 0.5,
        "health/acr_100": 0.5,
        **extra,
    }


def test_full_report(tmp_path):
    evals = {"eval/pass@1": 0.2, "eval/pass@8": 0.5}
    rows = [{"step": 0, "eval/pass@1": 0.1, "eval/pass@8": 0.4}]  # before the first update
    rows += [_step(s, **(evals if s % 20 == 0 else {})) for s in range(1, 61)]
    run = tmp_path / "run"
    _write(run, rows)
    (run / "config.yaml").write_text(yaml.safe_dump(_config("dapo", beta=0.04)))
    path = write_run_report(run)
    assert path == run / "report.html"
    page = path.read_text()
    assert page.count("data:image/png;base64,") == 1
    # each health condition once, with its span (the stall holds from step 50 to the end)
    assert page.count("acr_stall") == 2  # the Health entry and its line under "At a glance"
    assert "<b>acr_stall, steps 50–60 (still on at the end)</b>" in page
    assert "<b>inv_scale_tail, step 10</b>" in page
    assert "health: acr_stall over steps 50–60, still on at the end" in page
    # 60 steps: the step-0 evaluation row is not a step
    assert "<td>steps logged</td><td>60</td>" in page
    # the first and last evaluation are in "At a glance" (start, end, change, when)
    assert "<td>pass@8</td><td>0.4</td><td>0.5</td><td>0.1</td><td>step 0 → step 60</td>" in page
    assert "eval/pass@8 (step 0)" not in page
    assert "<td>config algorithm</td><td>dapo</td>" in page
    assert "<td>config task</td><td>maze</td>" in page
    assert "<td>β (KL coefficient)</td><td>0.04</td>" in page
    assert "Not drawn" not in page  # every panel has data
    # The ACR paper's accuracy fit (51.4 − 29.6·ACR_100 = 36.6 here) is not shown.
    assert "36.6" not in page and "51.4" not in page


def test_panels_follow_what_was_logged(tmp_path):
    rows = [{"step": 1.0, "loss": 0.5}, {"step": 2.0, "loss": 0.25}]
    panels, left_out = plan_panels(rows, beta=None)
    assert [(p.title, p.keys) for p in panels] == [("loss", ("loss",))]
    assert left_out == [
        "evaluation: not logged",
        "reward: not logged",
        "advantage-collapse rate: not logged",
        "KL: not logged",
        "1/scale over updated groups: not logged",
    ]
    fig, _ = training_figure(rows, None)
    assert len([a for a in fig.axes if a.get_visible() and a.axison]) == 1
    assert training_figure([{"step": 1.0, "x": 1.0}], None)[0] is None


def test_missing_keys_and_bad_lines(tmp_path):
    run = tmp_path / "run"
    _write(
        run,
        [{"step": 1, "loss": 0.5}, {"step": 2, "loss": None, "note": "text"}],
        extra='{bad\n[1]\n{"loss": 1}\n',
    )
    rows, errors = read_metrics(run / "metrics.jsonl")
    assert len(rows) == 2 and len(errors) == 3 and errors[0].startswith("line 3")
    page = write_run_report(run).read_text()
    assert page.count("data:image/png;base64,") == 1  # the loss panel alone
    assert "Not drawn: evaluation: not logged; reward: not logged;" in page
    assert "Skipped lines" in page and "line 5" in page
    # Only step keys: still a page.
    _write(run, [])
    assert "no step yet" in write_run_report(run).read_text()


def test_beta_zero_hides_the_kl_panel():
    assert run_beta(_config("grpo")) == 0.0  # grpo's preset has no KL term
    assert run_beta(_config("grpo", beta=0.04)) == 0.04
    assert run_beta(_config("no_such_preset")) is None
    assert run_beta({"preset": "grpo"}) is None and run_beta(None) is None
    rows = [_step(s) for s in range(1, 4)]
    off, left_off = plan_panels(rows, beta=0.0)
    on, left_on = plan_panels(rows, beta=0.04)
    assert "KL" not in [p.title for p in off] and "KL: β = 0, the run has no KL term" in left_off
    assert [p.keys for p in off if p.title == "loss"] == [("loss/total",)]  # = loss/pg
    assert "KL" in [p.title for p in on] and not any("KL" in x for x in left_on)
    assert [p.keys for p in on if p.title == "loss"] == [("loss/total", "loss/pg", "loss/kl")]


def test_evaluation_is_plotted_from_step_0():
    rows = [{"step": 0.0, "eval/pass@1": 0.1}] + [
        _step(s, **({"eval/pass@1": 0.3} if s == 4 else {})) for s in range(1, 5)
    ]
    fig, _ = training_figure(rows, beta=0.0)
    (ax,) = [a for a in fig.axes if a.get_title() == "evaluation"]
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [0.0, 4.0] and list(line.get_ydata()) == [0.1, 0.3]
    # the stacked ACR split starts at step 1: the step-0 row has no ACR
    (acr,) = [a for a in fig.axes if a.get_title() == "advantage-collapse rate"]
    assert min(v[0] for c in acr.collections for v in c.get_paths()[0].vertices) == 1.0


def test_short_run_without_updates_draws_without_warnings(tmp_path):
    # A short run where every group collapsed: 1/scale is logged as 0 (nothing updated), KL
    # as 0 (β = 0). matplotlib warned "Data has no positive values, and therefore cannot be
    # log-scaled" on every such run; now the axis stays linear and says why.
    zero = {"scale/inv_p95": 0.0, "scale/inv_p99": 0.0, "kl/mean": 0.0, "acr/rate": 1.0}
    rows = [{**_step(s), **zero} for s in range(1, 4)]
    run = tmp_path / "run"
    _write(run, rows)
    (run / "config.yaml").write_text(yaml.safe_dump(_config("grpo")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        page = write_run_report(run).read_text()
        fig, _ = training_figure(rows, beta=0.0)
    (ax,) = [a for a in fig.axes if a.get_title().startswith("1/scale")]
    assert ax.get_yscale() == "linear" and ax.get_title().endswith("(linear: some values are 0)")
    assert "last KL mean" not in page
    # a log axis only where the values span more than a decade (3 to 2000 at step 10)
    positive = training_figure([_step(s) for s in range(1, 12)], beta=0.0)[0]
    (ax,) = [a for a in positive.axes if a.get_title().startswith("1/scale")]
    assert ax.get_yscale() == "log"
    narrow = training_figure([_step(s) for s in range(1, 4)], beta=0.0)[0]
    (ax,) = [a for a in narrow.axes if a.get_title().startswith("1/scale")]
    assert ax.get_yscale() == "linear" and "(linear" not in ax.get_title()


def test_missing_metrics_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="run folder"):
        write_run_report(tmp_path)


def test_replay_health_matches_live_feed():
    rows = [{"step": float(s), "acr/rate": 0.6, "acr/all_wrong": 0.6} for s in range(50)]
    warnings_ = replay_health(rows)
    assert len(warnings_) == 1 and warnings_[0].startswith("[acr_stall] step 49")
    # an evaluation-only step-0 row changes nothing
    assert replay_health([{"step": 0.0, "eval/pass@1": 0.1}, *rows]) == warnings_


def test_clip_fraction_panel(tmp_path):
    # three steps, the clip acted in two (region > 0): the panel and the count are shown
    rows = [
        {"step": s, "policy/clip_frac_low": lo, "policy/clip_frac_high": hi,
         "policy/clip_frac_region": lo + hi, "policy/ratio_min": 0.9, "policy/ratio_max": 1.2}
        for s, lo, hi in ((1, 0.0, 0.0), (2, 0.01, 0.02), (3, 0.0, 0.05))
    ]  # fmt: skip
    run = tmp_path / "run"
    _write(run, rows)
    page = write_run_report(run).read_text()
    assert "Policy update: clipping" in page and 'alt="clip fractions"' in page
    # mean region fraction (0 + 0.03 + 0.05) / 3 = 0.02667, max 0.05
    assert "The clip acted in 2 of 3 logged steps (mean region fraction 0.02667, max 0.05)" in page
    assert "on-policy" not in page


def test_clip_fraction_panel_says_why_all_zero(tmp_path):
    rows = [{"step": s, "policy/clip_frac_region": 0.0} for s in range(1, 5)]
    run = tmp_path / "run"
    _write(run, rows)
    page = write_run_report(run).read_text()
    assert "The clip acted in 0 of 4 logged steps" in page
    assert "Every step was on-policy (ratio 1)" in page
    assert 'alt="clip fractions"' not in page  # flat lines at 0 say less than the sentence
    # a run that logged no clip fraction has no such section
    _write(run, [{"step": 1, "reward/mean": 0.5}])
    assert "Policy update: clipping" not in write_run_report(run).read_text()


def test_ema_known_answers():
    assert ema([3.0, 3.0, 3.0]) == pytest.approx([3.0, 3.0, 3.0])  # debiased: no ramp from 0
    # m1 = 0.1·0 = 0 -> 0/0.1; m2 = 0.9·0 + 0.1·1 = 0.1 -> 0.1/(1 − 0.81) = 0.526316
    # m3 = 0.09 + 0.1 = 0.19 -> 0.19/(1 − 0.729) = 0.701107
    assert ema([0.0, 1.0, 1.0]) == pytest.approx([0.0, 0.1 / 0.19, 0.19 / 0.271])
    assert ema([2.0, 4.0], alpha=1.0) == [2.0, 4.0]
    with pytest.raises(ValueError, match="alpha"):
        ema([1.0], alpha=0.0)


def _long_run(n=60):
    rows = [{"step": 0.0, "eval/pass@1": 0.40, "eval/pass@8": 0.80}]
    for s in range(1, n + 1):
        rows.append(
            {"step": float(s), "reward/mean": 0.3 + 0.2 * s / n + 0.1 * (-1) ** s,
             "acr/rate": 0.3, "acr/all_wrong": 0.2, "acr/all_correct": 0.1}
        )  # fmt: skip
    rows[-1].update({"eval/pass@1": 0.47, "eval/pass@8": 0.77})
    return rows


def test_glance_says_what_improved_and_what_to_look_at():
    rows = _long_run()
    g = glance(rows, replay_episodes(rows), {"eval": {"prompts": 200, "samples": 16}})
    assert g.headline == (
        "Held-out pass@1 0.400 → 0.470 (+0.070), pass@8 0.800 → 0.770 (-0.030), "
        "step 0 → step 60 (200 held-out prompts × 16 samples)."
    )
    # train reward: mean of steps 1–6 against steps 55–60 (a tenth of 60 steps each)
    (reward,) = [c for c in g.changes if c.key == "reward/mean"]
    assert reward.where == "steps 1–6 → steps 55–60"
    head = sum(0.3 + 0.2 * s / 60 + 0.1 * (-1) ** s for s in range(1, 7)) / 6
    assert reward.start == pytest.approx(head)
    # 2 SE of a share of 0.8 over 200 prompts: 2·sqrt(0.8·0.2/200) = 0.057
    assert g.look_at == [
        "pass@8 fell by 0.030 (200 held-out prompts: a change under ~0.06 may be noise): the "
        "policy sharpened onto fewer answers; a lower optim.lr or fewer steps keep more of it"
    ]
    # nothing fell, no health condition: it says so
    rows[-1]["eval/pass@8"] = 0.85
    assert glance(rows).look_at == [
        "nothing stands out: no health rule fired; every held-out number rose"
    ]
    rows[-1]["eval/pass@8"] = 0.79  # -0.01: not pointed out, but not called a rise either
    assert glance(rows).look_at == [
        "nothing stands out: no health rule fired; pass@8 moved by less than 0.02"
    ]
    rows[-1]["eval/pass@8"] = 0.85
    # a collapse rate that rose by 0.1 or more is pointed out before any rule fires
    risen = [{**r, "acr/rate": 0.2 + 0.15 * r["step"] / 60} if r["step"] >= 1 else r for r in rows]
    assert glance(risen).look_at[0].startswith("collapsed groups rose 0.21 → 0.34 (steps 1–6")
    rows[-1]["eval/pass@1"] = 0.405
    assert glance(rows).look_at[0].startswith("pass@1 did not improve (+0.005)")


def test_curves_are_smoothed_over_the_raw_values_and_legends_sit_below(tmp_path):
    rows = _long_run()
    fig, _ = training_figure(rows, beta=0.0)
    (ax,) = [a for a in fig.axes if a.get_title() == "reward"]
    raw, smooth = ax.get_lines()
    y = [r["reward/mean"] for r in rows[1:]]
    assert list(raw.get_ydata()) == y and raw.get_alpha() < 1
    assert list(smooth.get_ydata()) == pytest.approx(ema(y))
    assert (
        smooth.get_label() == "reward/mean (EMA)" and smooth.get_linewidth() > raw.get_linewidth()
    )
    # the evaluation (2 points) is drawn as measured
    (ev,) = [a for a in fig.axes if a.get_title() == "evaluation"]
    assert all(len(line.get_ydata()) == 2 for line in ev.get_lines())
    # no legend overlaps the data area of any panel
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # lays the figure out (constrained layout) as the PNG will be
    renderer = canvas.get_renderer()
    legends = [a for a in fig.axes if a.get_legend() is not None]
    assert len(legends) >= 3
    for a in legends:
        box, area = a.get_legend().get_window_extent(renderer), a.get_window_extent(renderer)
        assert box.y1 <= area.y0, a.get_title()
    _write(tmp_path / "r", rows)
    page = write_run_report(tmp_path / "r").read_text()
    assert "exponential moving average (α = 0.1" in page
    assert page.index("At a glance") < page.index("Summary") < page.index("Training curves")


def test_the_clip_note_is_a_warning_only_when_the_config_chose_the_schedule(tmp_path):
    rows = [{"step": s, "policy/clip_frac_region": 0.0} for s in range(1, 5)]
    run = tmp_path / "run"
    _write(run, rows)
    cfg = _config("grpo")
    for optim, warn in (({"minibatches": None, "ppo_epochs": None}, False),
                        ({"minibatches": 1, "ppo_epochs": None}, True)):  # fmt: skip
        (run / "config.yaml").write_text(yaml.safe_dump({**cfg, "optim": optim}))
        page = write_run_report(run).read_text()
        assert ('<p class="warn">The clip acted in 0' in page) is warn
        assert ("sources run it (its own schedule)" in page) is not warn


def test_a_repeated_series_and_a_loss_of_rounding_noise_are_not_drawn():
    # a binary reward's eval/reward_mean is eval/pass@1; an on-policy loss is 0 ± 1e-7
    rows = _long_run()
    for r in rows:
        if "eval/pass@1" in r:
            r["eval/reward_mean"] = r["eval/pass@1"] + 1e-4  # the same up to rounding
        if r["step"] >= 1:
            r["loss/total"] = 1e-7 * (-1) ** int(r["step"])
    panels, left_out = plan_panels(rows, beta=0.0)
    (ev,) = [p for p in panels if p.title == "evaluation"]
    assert ev.keys == ("eval/pass@1", "eval/pass@8")
    assert "loss" not in [p.title for p in panels]
    assert left_out[-1].startswith("loss: below 1e-05 at every step")
    assert [c.label for c in glance(rows).changes][:2] == ["pass@1", "pass@8"]
    rows[5]["loss/total"] = 0.3  # a real loss is drawn
    assert "loss" in [p.title for p in plan_panels(rows, beta=0.0)[0]]
