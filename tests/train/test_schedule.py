"""The update schedule the trainer runs (the preset's unless optim sets it) and AGPO's wiring:
per-prompt temperatures, log-probs at T = 1, per-prompt ε, four epochs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from train_toy import make

from grouprl.train.config import ConfigError, load_config
from grouprl.train.loop import Timer, collect_batch, train
from grouprl.train.sinks import read_jsonl
from grouprl.train.state import setup

NOTE = (
    "note: grpo takes one optimizer step per generation batch, as its sources do: every step "
    "is on-policy (ratio 1), so the ppo_clip clip does not act"
)


def test_one_update_per_batch_is_on_policy_and_noted_once(tmp_path, capsys):
    # grpo's schedule (DeepSeekMath: one update per exploration stage): ratio 1, no clip
    cfg, inj = make(tmp_path, "algorithm.preset=grpo", "optim.steps=3")
    train(cfg, **inj)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    for r in rows:
        assert r["optim/steps"] == 1.0
        assert r["policy/clip_frac_region"] == 0.0
        assert abs(r["policy/ratio_max"] - 1) < 1e-4 and abs(r["policy/ratio_min"] - 1) < 1e-4
    # the preset's own schedule: a one-line note, not a warning
    out = capsys.readouterr().out
    assert out.count(NOTE) == 1 and "warning" not in out


def test_the_presets_schedule_runs_and_its_clip_acts(tmp_path, capsys):
    # gspo: 4 minibatches (GSPO §5.1) of one group each at P = 4; ε = 3e-4/4e-4 is so tight
    # that from the second minibatch on some sequence ratios leave the clip range
    cfg, inj = make(tmp_path, "algorithm.preset=gspo", "optim.steps=3")
    train(cfg, **inj)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["optim/steps"] for r in rows] == [4.0, 4.0, 4.0]
    assert max(r["policy/clip_frac_region"] for r in rows) > 0
    assert "schedule:" not in capsys.readouterr().out
    # optim.* set explicitly wins over the preset: one update, ratio 1, and the warning
    cfg, inj = make(tmp_path / "b", "algorithm.preset=gspo", "optim.minibatches=1",
                    "optim.ppo_epochs=1", "optim.steps=2")  # fmt: skip
    train(cfg, **inj)
    rows = read_jsonl(tmp_path / "b/metrics.jsonl")
    assert [r["optim/steps"] for r in rows] == [1.0, 1.0]
    assert all(r["policy/clip_frac_region"] == 0.0 for r in rows)
    out = capsys.readouterr().out
    assert "warning: surrogate 'gspo' runs one optimizer step" in out and "note:" not in out


def test_a_preset_count_above_the_prompts_is_lowered_with_a_note(tmp_path, capsys):
    # cispo takes 16 minibatches (MiniMax-M1 §3.1); 4 prompts split into at most 4 groups
    cfg, inj = make(tmp_path, "algorithm.preset=cispo", "optim.steps=1")
    train(cfg, **inj)
    (row,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert row["optim/steps"] == 4.0
    out = capsys.readouterr().out
    assert "schedule: preset 'cispo' takes 16 minibatches" in out and "takes 4" in out


def test_agpo_samples_per_prompt_and_takes_log_probs_at_t_1(tmp_path):
    # τ_base 0.7: the probe runs at 0.7, and the first prompt's τ_t is 0.7 (c = 0 on the
    # controller's first call): that group is sampled at 0.7, not at 1
    cfg, inj = make(tmp_path, "algorithm.preset=agpo", "sampling.temperature=0.7")
    run = setup(cfg, **inj)
    run.step = 1
    batch, metrics = collect_batch(run, Timer(run.device))
    assert batch.temperature == 1.0  # every log-prob of the step at T = 1 (the AGPO code)
    assert metrics["agpo/temperature_min"] <= 0.7 + 1e-6
    # the behaviour log-probs are the policy's at T = 1: ratio 1 before the update ...
    logp_1 = run.policy.batch_logprobs(batch).logp
    valid = batch.mask.bool()
    assert (logp_1 - batch.old_logp)[valid].abs().max() < 1e-5
    # ... which dividing by the sampling temperature would not give
    hot = run.policy.batch_logprobs(dataclasses.replace(batch, temperature=0.7)).logp
    assert (hot - batch.old_logp)[valid].abs().max() > 1e-3
    # ε per prompt, on the policy's device, one bound per row of the batch
    clip, _ = run.controller.clip_params(run.policy, batch, {"eps_low": 0.2, "eps_high": 0.2})
    assert clip["eps_low"].shape == (batch.size,)
    eps = clip["eps_low"].view(batch.num_prompts, batch.group_size)
    assert torch.equal(eps, eps[:, :1].expand_as(eps))  # constant within each group


def test_agpo_step_runs_four_epochs_with_per_prompt_eps(tmp_path):
    cfg, inj = make(tmp_path, "algorithm.preset=agpo", "optim.steps=2")
    train(cfg, **inj)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    for r in rows:
        assert r["optim/steps"] == 4.0  # agpo_update_epochs = 4, one step per epoch
        assert r["agpo/eps_min"] <= r["clip/eps_low"] <= r["agpo/eps_max"]
        assert r["agpo/eps_min"] >= 0.05 and r["agpo/eps_max"] <= 0.4


def test_agpo_with_dynamic_sampling_is_refused():
    with pytest.raises(ConfigError, match=r"algorithm\.dynamic_sampling=false"):
        load_config(None, ["algorithm.preset=agpo", "algorithm.dynamic_sampling=true"])
    # also when the names are not checked (a run with an injected model and task)
    cfg = load_config(None, ["algorithm.preset=agpo", "algorithm.dynamic_sampling=true"],
                      validate=False)  # fmt: skip
    with pytest.raises(ConfigError, match="the agpo controller sets each prompt's temperature"):
        cfg.validate(check_names=False)
