"""``sampling.logprob_support=truncated`` in the trainer: every pass on the sampler's support.

Known answers: at step 1 the policy is the behaviour policy and the reference, so on one
support the ratio is 1 and the KL 0 (fp32 rounding, ``TOL``: the measured max |ratio − 1| of
these runs is ~5e-6). The planted bug, behaviour log-probs of the truncated distribution scored
against a full-softmax training forward, puts every ratio at the kept mass M < 1: here
max |ratio − 1| ≥ 0.02 (the toy model's vocabulary is 10 tokens, nearly flat, so top-p 0.9 and
top-k 3 both drop mass).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from train_toy import make, off_policy, to_reference

from grouprl.train import loop
from grouprl.train import policy as policy_module
from grouprl.train.batch import sample_groups, sampling_at
from grouprl.train.config import ConfigError, load_config
from grouprl.train.loop import train
from grouprl.train.policy import Policy
from grouprl.train.sinks import read_jsonl
from grouprl.train.state import setup

MODEL = "model.name=tiny:d=64,layers=2,heads=4,ctx=32"
BIG = [MODEL, "sampling.prompts_per_step=8", "sampling.group_size=8", "sampling.max_new_tokens=8"]
TOL = 1e-5
KL_TOL = TOL * TOL / 2
TRUNCATIONS = [("0.9", "20"), ("1.0", "3"), ("0.9", "3")]
"""(top_p, top_k): on a 10-token vocabulary top-k 20 keeps everything, so top-p bites alone,
then top-k alone, then both."""


def _run(tmp_path, *extra):
    cfg, inj = make(tmp_path, *BIG, "algorithm.beta=0.1", *extra)
    run = setup(cfg, **inj)
    run.step = 1
    return run


def _truncated(top_p: str, top_k: str) -> list[str]:
    return [f"sampling.top_p={top_p}", f"sampling.top_k={top_k}",
            "sampling.logprob_support=truncated"]  # fmt: skip


@pytest.mark.parametrize(("top_p", "top_k"), TRUNCATIONS)
def test_step_one_is_on_policy_and_at_the_reference_on_the_truncated_support(
    tmp_path, top_p, top_k
):
    m = loop.train_step(_run(tmp_path, *_truncated(top_p, top_k)))
    assert off_policy(m) <= TOL, m
    assert to_reference(m) <= KL_TOL, m
    assert m["sampling/kept_mass_mean"] < 0.98 and m["sampling/log_kept_mass_mean"] < -0.02


@pytest.mark.parametrize(("top_p", "top_k"), TRUNCATIONS)
def test_the_planted_full_softmax_scoring_of_truncated_behaviour_is_off_policy(
    tmp_path, monkeypatch, top_p, top_k
):
    """Behaviour log-probs renormalised over the kept tokens, the training forward on the
    full softmax: ρ = M ≤ 1 at every token, as a renormalising engine's (TRL #6789)."""
    real = Policy.logprobs

    def full_training_forward(self, seqs, *a, **k):
        if torch.is_grad_enabled():
            seqs = dataclasses.replace(seqs, kept_ids=None)
        return real(self, seqs, *a, **k)

    monkeypatch.setattr(Policy, "logprobs", full_training_forward)
    m = loop.train_step(_run(tmp_path, *_truncated(top_p, top_k)))
    assert off_policy(m) >= 0.02, m
    assert m["policy/ratio_max"] <= 1 + TOL  # every ratio at a kept mass ≤ 1


def test_every_log_prob_pass_of_a_step_reads_the_kept_sets(tmp_path, monkeypatch):
    """AGPO's step runs every kind of pass (entropy, training forwards, reference, drift);
    each receives the batch's kept sets."""
    seen: list[bool] = []
    real = policy_module.completion_logprobs

    def spy(*a, kept_ids=None, **k):
        seen.append(kept_ids is not None)
        return real(*a, kept_ids=kept_ids, **k)

    monkeypatch.setattr(policy_module, "completion_logprobs", spy)
    loop.train_step(_run(tmp_path, "algorithm.preset=agpo", *_truncated("0.9", "3")))
    assert len(seen) >= 4 and all(seen), seen


def _rows(run_dir):
    return [
        {k: v for k, v in r.items() if not k.startswith("time/")}
        for r in read_jsonl(run_dir / "metrics.jsonl")
    ]


def test_truncated_with_nothing_truncated_equals_full_bit_for_bit(tmp_path):
    common = ["optim.steps=3", "algorithm.beta=0.05"]
    cfg, inj = make(tmp_path / "full", *common)
    train(cfg, **inj)
    cfg, inj = make(tmp_path / "trunc", *common, "sampling.logprob_support=truncated")
    train(cfg, **inj)
    full, trunc = _rows(tmp_path / "full"), _rows(tmp_path / "trunc")
    assert full == trunc and not any(k.startswith("sampling/kept") for k in full[-1])


def test_truncated_support_changes_the_training_and_resumes_exactly(tmp_path):
    common = ["optim.steps=4", "run.every=2", "algorithm.beta=0.05", *_truncated("0.9", "0")]
    cfg, inj = make(tmp_path / "whole", *common)
    train(cfg, **inj)
    whole = {n: p.detach().clone() for n, p in inj["model"].named_parameters()}
    cfg, inj = make(tmp_path / "parts", *common, "optim.steps=2")
    train(cfg, **inj)
    cfg, inj = make(tmp_path / "parts", *common, "run.resume=true")
    train(cfg, **inj)
    assert _rows(tmp_path / "parts") == _rows(tmp_path / "whole")
    for name, p in inj["model"].named_parameters():
        assert torch.equal(p, whole[name]), name
    assert _rows(tmp_path / "whole")[0]["acr/rate"] < 1  # groups with a reward signal
    # the same sampler read on the full softmax: the same first batch, other weights after it
    cfg, inj = make(tmp_path / "full", *common[:-1], "sampling.logprob_support=full")
    train(cfg, **inj)
    assert _rows(tmp_path / "full")[0]["reward/mean"] == _rows(tmp_path / "whole")[0]["reward/mean"]
    assert not all(torch.equal(p, whole[n]) for n, p in inj["model"].named_parameters())


def test_rollouts_without_kept_sets_are_refused(tmp_path, monkeypatch):
    run = _run(tmp_path, *_truncated("0.9", "3"))
    real = Policy.generate

    def engine_without_sets(self, *a, **k):
        return dataclasses.replace(real(self, *a, **k), kept_ids=None)

    monkeypatch.setattr(Policy, "generate", engine_without_sets)
    settings, _ = sampling_at(run.cfg.sampling, 1.0)
    with pytest.raises(ValueError, match="logprob_support=truncated needs the sampler's kept"):
        sample_groups(run.policy, run.scorer, run.task.examples("train", 2, 0), 2, settings,
                      torch.Generator().manual_seed(0))  # fmt: skip


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sampling.top_k=-2", "sampling.top_k must be an integer >= 0"),
        (
            "sampling.logprob_support=nucleus",
            "sampling.logprob_support must be one of full, truncated",
        ),
    ],
)
def test_bad_settings_are_refused_with_the_field_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_a_bf16_engine_on_the_same_support_is_not_truncated_sampling_and_the_planted_mix_is(
    tmp_path, monkeypatch
):
    """Rollouts at bf16 (another engine), the trainer at fp32, truncated support on both
    sides: ratios scatter on both sides of 1 and the ``truncated_sampling`` rule stays quiet.
    Planted: the trainer's recomputation of the behaviour log-probs on the full softmax
    against the engine's renormalised ones: every ratio is the kept mass, the rule fires and
    ``mismatch/ratio_mean`` is the sampler's own ``sampling/kept_mass_mean`` (bf16 noise
    ~3e-3 in log-prob, tests/train/test_policy.py)."""
    from grouprl.diagnostics.health import RunHealth

    extra = ["model.rollout_precision=bfloat16", *_truncated("0.9", "3")]
    m = loop.train_step(_run(tmp_path / "same", *extra))
    assert m["mismatch/ratio_max"] > 1 > m["mismatch/ratio_min"]
    assert not [x for x in RunHealth().update(1, m) if x.startswith("[truncated_sampling]")]
    real = Policy.batch_logprobs

    def full_recomputation(self, seqs, **k):
        return real(self, dataclasses.replace(seqs, kept_ids=None), **k)

    monkeypatch.setattr(Policy, "batch_logprobs", full_recomputation)
    m = loop.train_step(_run(tmp_path / "mixed", *extra))
    assert m["mismatch/ratio_max"] <= 1 and m["mismatch/ratio_le1_frac"] == 1.0
    assert m["mismatch/ratio_mean"] == pytest.approx(m["sampling/kept_mass_mean"], abs=5e-3)
    (line,) = [x for x in RunHealth().update(1, m) if x.startswith("[truncated_sampling]")]
    assert "= the mean kept mass" in line
