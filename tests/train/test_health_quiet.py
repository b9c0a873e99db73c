"""The hand-written rules (clip direction, entropy trend, length drift, reward hacking, rewards
zeroed by truncation) stay quiet on a short healthy run of the default maze miniature, while
the metrics they read are logged on every step."""

from __future__ import annotations

import pytest

from grouprl import cli
from grouprl.report.run import read_metrics, replay_health

NEW_RULES = ("clip_bound", "entropy_trend", "length_drift", "reward_hacking", "truncation_zeroed")


@pytest.mark.slow
def test_new_rules_are_quiet_on_a_short_default_maze_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GROUPRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    # the default run (maze miniature, grpo, 16 x 16) with a shorter warm start and 24 steps:
    # enough for the trend rules' two 10-step windows
    argv = ["train", "--out", str(out), "--steps", "24", "--set", "model.sft_steps=300",
            "--set", "eval.every=0", "--set", "run.save_final=false",
            "--set", "run.threads=1"]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    rows, errors = read_metrics(out / "metrics.jsonl")
    train_rows = [r for r in rows if "policy/entropy_mean" in r]
    assert not errors and len(train_rows) == 24
    for key in ("policy/clip_frac_low", "policy/clip_frac_high", "length/mean",
                "truncated/trained_frac", "truncated/floor_frac", "reward/mean"):  # fmt: skip
        assert all(key in r for r in train_rows), key
    fired = [w for w in replay_health(rows) if w.startswith(tuple(f"[{r}]" for r in NEW_RULES))]
    assert fired == []
    assert not any(f"[{r}]" in printed for r in NEW_RULES)
