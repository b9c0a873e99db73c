"""The report of a real short run: built with warnings turned into errors."""

from __future__ import annotations

import warnings

import pytest
from train_toy import ToyTask, make

from grouprl.report import write_run_report
from grouprl.report.run import read_metrics, training_figure
from grouprl.train.loop import train


class NeverRight(ToyTask):
    """Every completion scores 0: every group collapses, so 1/scale is logged as 0."""

    def verify(self, completion, reference):
        return 0.0


@pytest.mark.slow  # a 3-step run with evaluations, ~6 s
def test_report_of_a_short_run_without_updates_raises_no_warning(tmp_path):
    cfg, inj = make(tmp_path, "eval.every=2", "eval.prompts=8", task=NeverRight())
    train(cfg, **inj)
    rows, errors = read_metrics(tmp_path / "metrics.jsonl")
    assert errors == [] and [r["step"] for r in rows if r["step"] >= 1] == [1.0, 2.0, 3.0]
    assert all(r["scale/inv_p99"] == 0.0 and r["acr/rate"] == 1.0 for r in rows if "acr/rate" in r)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "cannot be log-scaled" among them
        page = write_run_report(tmp_path).read_text()
        fig, _ = training_figure(rows, beta=0.0)
    assert "KL: β = 0, the run has no KL term" in page  # grpo: no KL term
    titles = [a.get_title() for a in fig.axes if a.axison]
    assert (
        "KL" not in titles and "1/scale over updated groups (linear: some values are 0)" in titles
    )
    assert all(a.get_yscale() == "linear" for a in fig.axes)
