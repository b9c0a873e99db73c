"""write_run_report: robust to missing keys and bad lines; health warnings replayed; panels
chosen from what was logged (no KL panel at β = 0, evaluation from step 0, no log axis for
zeros); no matplotlib warning on a short run."""

import json
import warnings

import pytest
import yaml

from grouprl.report import read_metrics, replay_health, write_run_report
from grouprl.report.run import plan_panels, run_beta, training_figure


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
    assert "[acr_stall] step 50" in page and "[inv_scale_tail] step 10" in page
    # 60 steps: the step-0 evaluation row is not a step
    assert "<td>steps logged</td><td>60</td>" in page
    assert "eval/pass@8 (step 0)</td><td>0.4<" in page
    assert "eval/pass@8 (step 60)</td><td>0.5<" in page
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
        "reward: not logged",
        "advantage-collapse rate: not logged",
        "KL: not logged",
        "evaluation: not logged",
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
    assert "Not drawn: reward: not logged; advantage-collapse rate: not logged;" in page
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
    assert [p.keys for p in off if p.title == "loss"] == [("loss/total", "loss/pg")]
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
    positive = training_figure([_step(s) for s in range(1, 4)], beta=0.0)[0]
    (ax,) = [a for a in positive.axes if a.get_title().startswith("1/scale")]
    assert ax.get_yscale() == "log"


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
    # a run that logged no clip fraction has no such section
    _write(run, [{"step": 1, "reward/mean": 0.5}])
    assert "Policy update: clipping" not in write_run_report(run).read_text()
