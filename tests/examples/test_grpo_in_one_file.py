"""examples/grpo_in_one_file.py is the trainer's GRPO: the same parameters after a few steps.

Both start from one warm-started tiny maze model (a short SFT), run ``STEPS`` steps of
``grpo`` at the same settings, and every parameter is compared. With the trainer's forward
(``train.logprobs.completion_logprobs``: each prompt once per group, length buckets, a fused
log-prob head) in the file's stage 5 the parameters are equal bit for bit: the prompts, the
seeded sampler, the rewards, the advantages, the clipped loss, the skipped groups and AdamW
are the trainer's. The file's own stage 5 is one plain forward, which gives the trainer's
log-probabilities to float precision (the second test) and so the parameters to well under
a hundredth of how far they moved; that forward's rounding is the one difference.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from grouprl import models, tasks
from grouprl.train import sft
from grouprl.train.config import load_config
from grouprl.train.logprobs import completion_logprobs
from grouprl.train.loop import train as trainer_train

ROOT = Path(__file__).resolve().parents[2]
STEPS, P, G = 3, 8, 8


def _example():
    spec = importlib.util.spec_from_file_location(
        "grpo_in_one_file", ROOT / "examples" / "grpo_in_one_file.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _trainers_forward(model, roll, rows, temperature):
    """The trainer's stage 5 (``Policy.logprobs``): each prompt once per group, length
    buckets, the fused log-prob head."""
    return completion_logprobs(
        model, roll.prompt_ids[rows], roll.prompt_mask[rows], roll.completion_ids[rows],
        roll.completion_mask[rows].float(), temperature=temperature, group_size=G,
        entropy=True,
    ).logp  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The file, its settings, the task and one warm-started model (a short SFT)."""
    ex = _example()
    s = ex.Settings(steps=STEPS, prompts=P, group=G, sft_steps=40, lr=1e-3, maze=(4, 1, 2))
    size, lo, hi = s.maze
    task = tasks.get("maze", size=size, min_path=lo, max_path=hi)
    model, tok = models.load("tiny", task=task, seed=s.seed)
    cache = tmp_path_factory.mktemp("sft")
    model = sft.warm_start(
        model, tok, task, steps=s.sft_steps, seed=s.seed, progress=False, cache_dir=cache
    )
    return ex, s, task, model, tok


def _trainer(s, task, model, tok, out):
    size, lo, hi = s.maze
    cfg = load_config(
        None,
        [
            "algorithm.preset=grpo", f"optim.steps={s.steps}", f"run.seed={s.seed}",
            f"sampling.prompts_per_step={s.prompts}", f"sampling.group_size={s.group}",
            f"sampling.max_new_tokens={s.max_new_tokens}", f"optim.lr={s.lr}",
            f"task.params={{size: {size}, min_path: {lo}, max_path: {hi}}}",
            "eval.every=0", "run.every=0", "run.save_final=false", "run.progress=false",
            "run.tensorboard=false", "run.threads=1", "model.device=cpu", f"run.out={out}",
        ],
    )  # fmt: skip
    trainer_train(cfg, model=model, tokenizer=tok, task=task)
    return model


@pytest.mark.slow
def test_the_one_file_grpo_ends_with_the_trainers_parameters(setup, tmp_path):
    ex, s, task, model, tok = setup
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    theirs = _trainer(s, task, copy.deepcopy(model), tok, tmp_path / "run")
    ours = ex.train(s, copy.deepcopy(model), tok, task, say=None, forward=_trainers_forward)
    moved = max(float((b.detach() - start[n]).abs().max()) for n, b in theirs.named_parameters())
    assert moved > 1e-3  # the steps moved the weights: the comparison is not of two copies
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert torch.equal(a, b), name  # bit for bit

    # with the file's own plain forward the one difference is that forward's float rounding
    plain = ex.train(s, copy.deepcopy(model), tok, task, say=None)
    diff = max(
        float((a.detach() - b.detach()).abs().max())
        for (_, a), (_, b) in zip(plain.named_parameters(), theirs.named_parameters())
    )
    assert 0 < diff < moved / 100


def test_the_plain_forward_is_the_trainers_to_float_precision(setup):
    ex, s, task, model, tok = setup
    examples = task.examples("train", P, 0)
    roll = ex.behaviour_rollouts(model, tok, task, examples, s, torch.Generator().manual_seed(0))
    rows = torch.arange(P * G)
    with torch.no_grad():
        got = ex.current_logprobs(model, roll, rows, s.temperature)
        want = _trainers_forward(model, roll, rows, s.temperature)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_step_where_every_group_collapsed_moves_nothing(setup):
    # an untrained model solves no maze: every group all-wrong, every advantage 0; the step
    # is AdamW's on a zero gradient, which leaves the weights where they are (m = v = 0)
    ex, s, task, _, tok = setup
    model, _ = models.load("tiny", task=task, seed=s.seed)
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    seen = []
    out = ex.train(s, model, tok, task, say=seen.append)
    assert "reward 0.0000" in seen[-1] and "grad_norm 0.0000" in seen[-1]
    assert all(torch.equal(v, start[k]) for k, v in out.named_parameters())
