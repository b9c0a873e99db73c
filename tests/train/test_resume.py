"""--resume continues the same experiment: changed experiment fields are refused (or, with
--resume-anyway, recorded); bookkeeping fields may change; no checkpoint is said clearly."""

from __future__ import annotations

import json
import math
import warnings

import pytest
from train_toy import make

from grouprl import models
from grouprl.train import resume
from grouprl.train.api import write_report
from grouprl.train.config import RunConfig
from grouprl.train.loop import train
from grouprl.train.sinks import read_jsonl

LOGGING_ONLY = ("time/", "eval/", "balance/", "policy/entropy")
"""Metric prefixes that a bookkeeping field may add or remove (they are measured, not used)."""


def _rows(run_dir):
    return read_jsonl(run_dir / "metrics.jsonl")


def _files(run_dir):
    return {
        p.relative_to(run_dir).as_posix(): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != ".grouprl.lock"
    }


def test_every_config_field_is_classified_exactly_once():
    """A new RunConfig field fails here until it is put in one of the two tuples."""
    every = resume.config_fields()
    experiment, bookkeeping = set(resume.EXPERIMENT_FIELDS), set(resume.BOOKKEEPING_FIELDS)
    assert len(experiment) == len(resume.EXPERIMENT_FIELDS)  # no duplicates
    assert len(bookkeeping) == len(resume.BOOKKEEPING_FIELDS)
    assert not experiment & bookkeeping, experiment & bookkeeping
    assert set(every) - experiment - bookkeeping == set(), "classify in train/resume.py"
    assert (experiment | bookkeeping) - set(every) == set(), "no such RunConfig field"
    flat = [f"{s}.{k}" for s, section in RunConfig().to_dict().items() for k in section]
    assert every == flat  # two derivations of the field list agree


def test_changes_lists_differing_experiment_fields_with_both_values():
    before = RunConfig().to_dict()
    now = json.loads(json.dumps(before))
    now["optim"]["lr"], now["optim"]["steps"], now["eval"]["ks"] = 1e-4, 999, [1, 2]
    assert resume.changes(before, now) == {
        "optim.lr": (5e-5, 1e-4),
        "eval.ks": ([1, 8, 16], [1, 2]),
    }
    assert resume.changes(before, now, resume.BOOKKEEPING_FIELDS) == {"optim.steps": (300, 999)}
    # a field the checkpoint does not record (older grouprl): changed only when not default
    del before["sampling"]["top_p"]
    assert "sampling.top_p" not in resume.changes(before, now)
    now["sampling"]["top_p"] = 0.9
    assert resume.changes(before, now)["sampling.top_p"] == ("not recorded", 0.9)


def test_issue_example_grpo_4x4_then_dapo_4x8_is_refused_listing_both_values(tmp_path):
    cfg, inj = make(tmp_path, "optim.steps=2", "run.every=1")
    train(cfg, **inj)
    before = _files(tmp_path)
    cfg, inj = make(
        tmp_path,
        "optim.steps=4",
        "run.resume=true",
        "algorithm.preset=dapo",
        "sampling.group_size=8",
    )
    with pytest.raises(resume.ResumeError) as info:
        train(cfg, **inj)
    message = str(info.value)
    assert "--resume would change the experiment" in message
    assert "algorithm.preset: grpo (checkpoint) -> dapo (now)" in message
    assert "sampling.group_size: 4 (checkpoint) -> 8 (now)" in message
    assert "--set sampling.group_size=4 --set algorithm.preset=grpo" in message
    assert "--resume-anyway" in message and "optim.steps" not in message
    assert _files(tmp_path) == before  # nothing in the folder was touched


def test_resume_anyway_continues_and_records_the_change_in_metrics_and_report(tmp_path, capsys):
    cfg, inj = make(tmp_path, "optim.steps=2", "run.every=1")
    train(cfg, **inj)
    changed = ["algorithm.preset=dapo", "sampling.group_size=8", "optim.lr=0.01"]
    cfg, inj = make(
        tmp_path,
        *changed,
        "optim.steps=3",
        "run.resume=true",
        "run.resume_anyway=true",
        "run.report=true",
    )
    with warnings.catch_warnings():  # the report of a short run raises no warning
        warnings.simplefilter("error")
        result = train(cfg, **inj)
        assert result.step == 3
        write_report(cfg, result)  # what grouprl train does after train()
    out = capsys.readouterr().out
    assert "resume: --resume-anyway: continuing" in out
    assert "optim.steps: 2 (checkpoint) -> 3 (now)" in out  # bookkeeping, printed
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert "resume/changed" not in rows[0] and "resume/changed" not in rows[1]
    note = rows[2]["resume/changed"]
    assert note["after_step"] == 2 and note["checkpoint"].endswith("step_00000002")
    assert note["fields"] == {
        "sampling.group_size": [4, 8],
        "algorithm.preset": ["grpo", "dapo"],
        "optim.lr": [0.03, 0.01],
    }
    page = (tmp_path / "report.html").read_text()
    assert "Configuration changed on resume" in page
    assert "<td>algorithm.preset</td><td>grpo</td><td>dapo</td>" in page
    # the new checkpoint records the new configuration: resuming with it needs no flag
    cfg, inj = make(tmp_path, *changed, "optim.steps=4", "run.resume=true")
    assert train(cfg, **inj).step == 4
    assert "resume/changed" not in _rows(tmp_path)[3]


@pytest.mark.slow
def test_bookkeeping_fields_do_not_change_the_training_numbers(tmp_path):
    """The classification checked by running: the bookkeeping fields changed, same numbers
    (exactly, or to rounding for the chunk size, thread count and attention kernel).
    optim.micro_batch_size
    failed this check (kl/mean 1.2 % apart at step 3), so it is an experiment field."""
    common = [
        "algorithm.beta=0.04",  # KL on, so the R/KL balance runs
        "eval.prompts=2",
        "eval.samples=4",
        "eval.ks=[1,4]",
    ]
    cfg, inj = make(tmp_path / "base", *common)
    train(cfg, **inj)
    exact = [
        "eval.every=1",
        "eval.balance_every=1",
        "run.every=1",
        "run.keep_last=1",
        "optim.entropy=false",
        "optim.max_nonfinite_steps=9",
        "sampling.max_unscorable_frac=0.9",
    ]
    cfg, inj = make(tmp_path / "exact", *common, *exact)
    train(cfg, **inj)
    rounding = ["optim.logprob_chunk=3", "run.threads=2", "model.attention=eager"]
    cfg, inj = make(tmp_path / "rounding", *common, *rounding)
    inj["model"], inj["tokenizer"] = models.load(  # model.attention applies when grouprl loads
        cfg.model.name, task=inj["task"], seed=cfg.run.seed, attn_implementation="eager"
    )
    train(cfg, **inj)

    def training(run):  # the step rows (a step-0 row holds only the first evaluation)
        return [
            {k: v for k, v in r.items() if not k.startswith(LOGGING_ONLY)}
            for r in _rows(run)
            if r["step"] > 0
        ]

    base = training(tmp_path / "base")
    assert training(tmp_path / "exact") == base
    step1 = next(r for r in _rows(tmp_path / "exact") if r["step"] == 1)
    assert any(k.startswith("eval/") for k in step1)  # it did evaluate
    assert any(k.startswith("balance/") for k in step1)  # and measure R/KL
    for got, want in zip(training(tmp_path / "rounding"), base, strict=True):
        assert got.keys() == want.keys()
        for k in want:
            a, b = got[k], want[k]
            assert (a is None and b is None) or math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6), k


def test_a_checkpoint_without_a_recorded_configuration_resumes_with_a_note(tmp_path, capsys):
    cfg, inj = make(tmp_path, "optim.steps=2")
    train(cfg, **inj)
    manifest = tmp_path / "checkpoints/step_00000002/manifest.json"
    data = json.loads(manifest.read_text())
    assert data["config"] == cfg.to_dict() and data["grouprl"]
    del data["config"]  # as written by grouprl before this change
    manifest.write_text(json.dumps(data))
    cfg, inj = make(tmp_path, "optim.steps=3", "run.resume=true", "optim.lr=0.5")
    assert train(cfg, **inj).step == 3
    assert "records no configuration" in capsys.readouterr().out


def test_resume_in_a_new_folder_starts_a_new_run_and_says_so(tmp_path, capsys):
    cfg, inj = make(tmp_path / "new", "optim.steps=1", "run.resume=true")
    assert train(cfg, **inj).step == 1
    assert "nothing logged there yet: starting a new run from step 0" in capsys.readouterr().out
    # a run stopped after its step-0 evaluation, before step 1: nothing to lose either
    (tmp_path / "early").mkdir()
    (tmp_path / "early/metrics.jsonl").write_text('{"step": 0, "eval/pass@1": 0.25}\n')
    cfg, inj = make(tmp_path / "early", "optim.steps=1", "run.resume=true")
    assert train(cfg, **inj).step == 1
    assert "starting a new run from step 0" in capsys.readouterr().out


def test_resume_in_a_folder_with_a_run_but_no_checkpoint_is_refused(tmp_path):
    cfg, inj = make(tmp_path, "optim.steps=2")
    train(cfg, **inj)
    for p in sorted((tmp_path / "checkpoints").rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()  # as if killed before its first checkpoint
    before = _files(tmp_path)
    cfg, inj = make(tmp_path, "optim.steps=3", "run.resume=true")
    with pytest.raises(resume.ResumeError, match=r"holds a run \(2 steps in metrics.jsonl\)"):
        train(cfg, **inj)
    assert _files(tmp_path) == before  # its metrics were not replaced


def test_resume_when_every_checkpoint_is_corrupt_is_refused(tmp_path, capsys):
    cfg, inj = make(tmp_path, "optim.steps=2")
    train(cfg, **inj)
    (tmp_path / "checkpoints/step_00000002/model.pt").write_bytes(b"cut")
    cfg, inj = make(tmp_path, "optim.steps=3", "run.resume=true")
    with pytest.raises(resume.ResumeError, match=r"1 checkpoint\(s\) rejected"):
        train(cfg, **inj)
    assert "checkpoint rejected" in capsys.readouterr().err


def test_a_new_run_in_a_folder_that_holds_a_run_is_refused_and_touches_nothing(tmp_path):
    """Without the guard the earlier run's step-4 checkpoint outranked the new run's step 2:
    keep-last pruning deleted the new checkpoints and --resume continued the old run."""
    cfg, inj = make(tmp_path, "optim.steps=4", "run.every=2")
    train(cfg, **inj)
    before = _files(tmp_path)
    cfg, inj = make(tmp_path, "optim.steps=2", "run.every=2", "run.seed=1")
    with pytest.raises(resume.ResumeError) as info:
        train(cfg, **inj)
    message = str(info.value)
    assert f"{tmp_path} already holds a run (2 checkpoints, 4 logged steps)" in message
    assert "--resume" in message and "--overwrite" in message and "--out" in message
    assert _files(tmp_path) == before


def test_overwrite_deletes_the_earlier_run_and_starts_clean(tmp_path, capsys):
    cfg, inj = make(tmp_path, "optim.steps=4", "run.every=2")
    train(cfg, **inj)
    (tmp_path / "notes.txt").write_text("mine")  # not a run output: left alone
    cfg, inj = make(tmp_path, "optim.steps=2", "run.every=2", "run.overwrite=true")
    assert train(cfg, **inj).step == 2
    assert "--overwrite: deleted the earlier run" in capsys.readouterr().out
    assert [r["step"] for r in _rows(tmp_path) if r["step"] >= 1] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002"]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    # and --resume now continues the new run, not the deleted one
    capsys.readouterr()
    cfg, inj = make(tmp_path, "optim.steps=3", "run.every=2", "run.resume=true")
    assert train(cfg, **inj).step == 3
    assert [r["step"] for r in _rows(tmp_path) if r["step"] >= 1] == [1, 2, 3]
    assert "run.overwrite" not in capsys.readouterr().out  # how a run started is no change


def test_a_new_run_after_only_the_step0_evaluation_needs_no_overwrite(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/pass@1": 0.25}\n')
    cfg, inj = make(tmp_path, "optim.steps=1")
    assert train(cfg, **inj).step == 1
