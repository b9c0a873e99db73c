"""Sinks: metrics.jsonl flushed per step, no duplicate steps after resume, rewards.jsonl groups."""

from __future__ import annotations

import json
import math

import torch
import yaml

from grouprl.train.sinks import Sinks, read_jsonl, truncate_jsonl


def _sinks(path, resume_step=0):
    return Sinks(
        path,
        {"optim": {"lr": 1e-3}},
        total_steps=5,
        resume_step=resume_step,
        tensorboard=False,
        progress=False,
    )


def test_metrics_are_on_disk_after_each_step_and_nan_is_null(tmp_path):
    s = _sinks(tmp_path)
    s.log(1, {"reward/mean": 0.5, "x": math.nan})
    # flushed: readable before close
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "reward/mean": 0.5, "x": None}]
    s.log_groups(1, ["a", "b"], torch.tensor([[1.0, 0.0], [math.nan, 1.0]]))
    s.close()
    rows = [json.loads(x) for x in (tmp_path / "rewards.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 1, "prompt_id": "a", "rewards": [1.0, 0.0]},
        {"step": 1, "prompt_id": "b", "rewards": [None, 1.0]},
    ]
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == {"optim": {"lr": 1e-3}}


def test_resume_truncates_after_the_resume_step_and_a_torn_line(tmp_path):
    s = _sinks(tmp_path)
    for step in (1, 2, 3):
        s.log(step, {"v": float(step)})
        s.log_groups(step, ["p"], torch.tensor([[float(step)]]))
    s.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "v": ')  # killed mid-write
    s = _sinks(tmp_path, resume_step=2)
    s.log(3, {"v": 30.0})
    s.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert read_jsonl(tmp_path / "metrics.jsonl")[-1]["v"] == 30.0
    assert [r["step"] for r in read_jsonl(tmp_path / "rewards.jsonl")] == [1, 2]
    assert truncate_jsonl(tmp_path / "absent.jsonl", 3) == 0


def test_fresh_run_replaces_old_logs_and_tensorboard_writes(tmp_path):
    s = _sinks(tmp_path)
    s.log(1, {"v": 1.0})
    s.close()
    s = Sinks(tmp_path, {}, total_steps=2, tensorboard=True, progress=True)
    s.log(1, {"v": 2.0, "reward/mean": 0.25})
    s.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "v": 2.0, "reward/mean": 0.25}]
    assert list((tmp_path / "tb").glob("events.*"))
