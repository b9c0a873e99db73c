"""Doubles for the TRL tests: a reward function and a trainer that record what they saw.

Imported by ``test_trl.py`` (one process) and by ``trl_two_ranks.py`` (under torchrun).
"""

from __future__ import annotations

from datasets import Dataset
from tiny_lm import tiny_model, tiny_tokenizer
from trl import GRPOConfig

from grouprl.integrations import trl as gt


class RecordingReward:
    """Reward = share of 'a'/'b' tokens in the completion; every call's outputs are kept.

    ``nan_every=k``: the completion at local index ``i % k == 1`` is unscorable (None).
    """

    __name__ = "ab_share"

    def __init__(self, nan_every=0):
        self.calls = []
        self.nan_every = nan_every

    def __call__(self, prompts, completions, **kwargs):
        out = []
        for i, c in enumerate(completions):
            toks = c.split()
            r = sum(t in ("a", "b") for t in toks) / max(len(toks), 1)
            out.append(None if self.nan_every and i % self.nan_every == 1 else r)
        self.calls.append(out)
        return out


class Recording(gt.GroupRLGRPOTrainer):
    """Keeps what the advantage step produced, what the loss consumed and what a resume loaded."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.produced, self.consumed, self.kl_weights = [], [], []
        self.loaded_state = None

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        grid, out = self.grouprl_last
        self.produced.append((grid.clone(), output["advantages"].detach().clone(), out))
        return output

    def _compute_loss(self, model, inputs):
        self.consumed.append(inputs["advantages"].detach().clone())
        if "grouprl_kl_weight" in inputs:
            self.kl_weights.append(inputs["grouprl_kl_weight"].clone())
        return super()._compute_loss(model, inputs)

    def grouprl_load_state_dict(self, state):
        self.loaded_state = state
        super().grouprl_load_state_dict(state)


def config(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=4,
        max_steps=3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        learning_rate=1e-2,
    )
    return GRPOConfig(**{**base, **kw})


def dataset():
    return Dataset.from_dict({"prompt": ["a b", "c d", "e f", "g h"] * 6})


def run(tmp_path, reward=None, trainer_cls=Recording, model=None, resume=None, **kw):
    targs = kw.pop("args", None) or config(tmp_path)
    reward = reward or RecordingReward()
    trainer = trainer_cls(
        model=model or tiny_model(),
        reward_funcs=reward,
        args=targs,
        train_dataset=dataset(),
        processing_class=tiny_tokenizer(),
        **kw,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer, reward
