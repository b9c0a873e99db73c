"""Issue-22 methods and TRL: GDPO against TRL's own ``normalize_then_sum`` (a plain
``GRPOTrainer`` step with two reward functions, one of which returns None at times), and the
adapter on GDPO and OPO (per-function rewards and completion lengths reach the estimator);
what TRL cannot feed (a greedy baseline, per-token advantages) is refused up front.
"""

import os
import warnings

import pytest
import torch

pytestmark = pytest.mark.peer

os.environ["HF_HUB_OFFLINE"] = "1"
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    trl = pytest.importorskip("trl")
from tiny_lm import tiny_model, tiny_tokenizer  # noqa: E402
from trl_doubles import Recording, RecordingReward, config, dataset  # noqa: E402

from grouprl import advantages  # noqa: E402
from grouprl.integrations import trl as gt  # noqa: E402

G = 4


class LengthReward:
    """Reward = 1 for a completion of at most 2 words; None for every third completion."""

    __name__ = "short"

    def __call__(self, prompts, completions, **kwargs):
        return [
            None if i % 3 == 2 else float(len(c.split()) <= 2) for i, c in enumerate(completions)
        ]


class PlainRecording(trl.GRPOTrainer):
    """TRL's own trainer, recording the per-function rewards and the advantages it made."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.per_func, self.made, self.lengths = [], [], []

    def _calculate_rewards(self, *a, **kw):
        out = super()._calculate_rewards(*a, **kw)
        self.per_func.append(out.detach().clone())
        return out

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.made.append(out["advantages"].detach().clone())
        return out


def _train(cls, tmp_path, **kw):
    args = kw.pop("args", None) or config(tmp_path, max_steps=2)
    trainer = cls(
        model=tiny_model(),
        reward_funcs=[RecordingReward(), LengthReward()],
        args=args,
        train_dataset=dataset(),
        processing_class=tiny_tokenizer(),
        **kw,
    )
    trainer.train()
    return trainer


@pytest.mark.slow
def test_gdpo_equals_trls_normalize_then_sum(tmp_path):
    args = config(
        tmp_path,
        max_steps=2,
        multi_objective_aggregation="normalize_then_sum",
        reward_weights=[1.0, 0.5],
    )
    trainer = _train(PlainRecording, tmp_path, args=args)
    assert len(trainer.per_func) == len(trainer.made) == 2
    for per_func, made in zip(trainer.per_func, trainer.made):
        assert torch.isnan(per_func[:, 1]).any()  # the None path was exercised
        r3 = per_func.view(-1, G, 2)
        ours = advantages.compute(
            "gdpo", r3, reward_weights=[1.0, 0.5], eps=1e-4, zero_collapsed=False
        ).values.reshape(-1)
        torch.testing.assert_close(ours, made.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_adapter_runs_gdpo_on_per_function_rewards_and_opo_on_lengths(tmp_path):
    t = _train(Recording, tmp_path / "gdpo", estimator="gdpo")
    assert t.args.multi_objective_aggregation == "normalize_then_sum"  # mapped onto TRL's knob
    assert all(out.stats["combine/normalize_then_sum"] == 1.0 for _, _, out in t.produced)
    # the same per-function rewards through compute() give what TRL trained on
    per_func = t._grouprl_rewards_per_func
    want = advantages.compute(
        "gdpo", per_func.view(-1, G, 2), reward_weights=t.reward_weights
    ).values.reshape(-1)
    torch.testing.assert_close(t.produced[-1][1], want, atol=1e-6, rtol=1e-6)

    class Lengths(Recording):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            self.lengths = out["completion_mask"].sum(1)
            return out

    o = _train(Lengths, tmp_path / "opo", estimator="opo")
    grid, adv, _ = o.produced[-1]
    want = advantages.compute("opo", grid, lengths=o.lengths.view(-1, G)).values.reshape(-1)
    torch.testing.assert_close(adv, want, atol=1e-6, rtol=1e-6)


def test_what_trl_cannot_feed_is_refused(tmp_path):
    common = dict(
        model=tiny_model(),
        reward_funcs=RecordingReward(),
        train_dataset=dataset(),
        processing_class=tiny_tokenizer(),
    )
    with pytest.raises(ValueError, match="greedy completion per prompt"):
        gt.GroupRLGRPOTrainer(estimator="remax", args=config(tmp_path), **common)
    with pytest.raises(ValueError, match="token-level estimators need per-token inputs"):
        gt.GroupRLGRPOTrainer(estimator="optimal_token_baseline", args=config(tmp_path), **common)
    kl_in_reward = gt.resolve_preset("grpo", None).with_(reward_kl_coef=0.01)
    with pytest.raises(ValueError, match="KL folded into the reward"):
        gt.GroupRLGRPOTrainer(preset=kl_in_reward, args=config(tmp_path), **common)
    mismatch = config(tmp_path, multi_objective_aggregation="normalize_then_sum")
    with pytest.raises(ValueError, match="for GDPO use preset='gdpo' or estimator='gdpo'"):
        gt.GroupRLGRPOTrainer(estimator="grpo", args=mismatch, **common)
