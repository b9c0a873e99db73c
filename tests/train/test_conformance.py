"""The normalisation conformance matrix in grouprl's trainer: for every surrogate, each paired
with one of the aggregations that claim exactness (each aggregation used at least twice), the
gradient AdamW receives at every optimizer step is the same whether the minibatch runs as one
micro-batch, one group per micro-batch, or uneven micro-batches (3 groups + 1), under two PPO
epochs, truncated completions masked out of the loss (overlong="mask") and unscorable
(NaN-reward) samples; and for minibatches per generation batch. The loss-level matrix (every
surrogate x every exact aggregation x micro-batch slices) is tests/losses/test_methods.py."""

from __future__ import annotations

import pytest
import torch
from train_toy import ToyTask, make

from grouprl import losses
from grouprl.train.loop import train
from grouprl.train.sinks import read_jsonl

AGGS = sorted(losses.EXACT_UNDER_ACCUMULATION)
CASES = [(s, AGGS[i % len(AGGS)]) for i, s in enumerate(losses.SURROGATES)]
PARAMS = {"dro": "{beta: 0.2}"}


def _grads(tmp_path, monkeypatch, surrogate, aggregation, micro, *extra):
    seen: list[list[torch.Tensor]] = []
    real_step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    out = tmp_path / f"{surrogate}_{aggregation}_{micro}_{len(extra)}"
    cfg, inj = make(
        out, "optim.steps=1", f"algorithm.surrogate={surrogate}",
        f"algorithm.surrogate_params={PARAMS.get(surrogate, '{}')}",
        f"algorithm.aggregation={aggregation}", "algorithm.overlong=mask",
        "optim.ppo_epochs=2", f"optim.micro_batch_size={micro}", "optim.grad_clip=0",
        "run.progress=false", "run.seed=1", *extra, task=ToyTask(nan_word="c"),
    )  # fmt: skip
    train(cfg, **inj)
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    return seen, read_jsonl(out / "metrics.jsonl")[-1]


@pytest.mark.parametrize(("surrogate", "aggregation"), CASES)
def test_step_gradients_do_not_depend_on_the_micro_batches(
    tmp_path, monkeypatch, surrogate, aggregation
):
    ref, row = _grads(tmp_path, monkeypatch, surrogate, aggregation, 0)
    assert len(ref) == 2  # two epochs: two optimizer steps, the second off-policy
    # the cases the matrix is about were there: NaN rewards, and masked truncated tokens
    assert row["reward/nan_count"] > 0 and row["length/truncated_frac"] > 0
    assert max(float(g.abs().max()) for g in ref[0]) > 1e-4
    for micro in (4, 12):  # one group a micro-batch; 3 groups + 1
        got, _ = _grads(tmp_path, monkeypatch, surrogate, aggregation, micro)
        assert len(got) == 2
        for step, (a, b) in enumerate(zip(got, ref)):
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5, msg=f"step {step}")


def test_minibatches_per_generation_batch_accumulate_exactly(tmp_path, monkeypatch):
    ref, _ = _grads(tmp_path, monkeypatch, "ppo_clip", "token_mean", 0, "optim.minibatches=2")
    got, _ = _grads(tmp_path, monkeypatch, "ppo_clip", "token_mean", 4, "optim.minibatches=2")
    assert len(ref) == len(got) == 4  # 2 minibatches x 2 epochs
    for a, b in zip(got, ref):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
