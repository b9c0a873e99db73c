"""Doubles for the TRL tests: a reward function and a trainer that record what they saw.

Imported by ``test_trl.py`` (one process) and by ``trl_two_ranks.py`` (under torchrun).
"""

from __future__ import annotations

import torch
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


class InjectedVLLM:
    """TRL's vLLM branches without vLLM: a mixin for a ``GRPOTrainer`` subclass.

    Completions come from TRL's transformers path; the "sampling" log-probs that vLLM would
    return are the model's own log-probs of the sampled tokens plus Gaussian noise of std
    ``noise`` (a rollout engine that disagrees with the trainer), and the second completion's
    first token is unscorable (None, which TRL turns into NaN). ``use_vllm`` is set after
    TRL's ``__init__`` (which would start vLLM), so every IS-correction branch of TRL's own
    ``_generate_and_score_completions`` and ``_compute_loss`` runs. The noise stream is
    seeded, so two trainers that generate the same completions see the same log-probs.
    """

    def __init__(self, *a, noise=0.3, nan_token=True, **kw):
        super().__init__(*a, **kw)
        self.use_vllm = True
        self.injected_noise = noise
        self.injected_nan = nan_token
        self._noise_gen = torch.Generator().manual_seed(1234)
        self.injected = []

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, **kw):
        self.use_vllm = False
        try:
            completion_ids, _ = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, **kw
            )
        finally:
            self.use_vllm = True
        logprobs = []
        with torch.no_grad():
            for p, c in zip(prompt_ids, completion_ids):
                ids = torch.tensor([list(p) + list(c)], device=self.accelerator.device)
                logits = self.model(input_ids=ids).logits[0, len(p) - 1 : -1].float()
                logits = logits / self.temperature
                tok = torch.tensor(list(c), device=logits.device)[:, None]
                lp = logits.log_softmax(-1).gather(-1, tok)[:, 0].cpu()
                lp = lp + self.injected_noise * torch.randn(lp.shape, generator=self._noise_gen)
                logprobs.append(lp.tolist())
        if self.injected_nan and len(logprobs) > 1:
            logprobs[1][0] = None
        self.injected.append(logprobs)
        return completion_ids, logprobs
