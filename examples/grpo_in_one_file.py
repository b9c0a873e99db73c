"""GRPO in one file: the tiny maze, top to bottom, with grouprl's pure functions and tensors.

One step of plain GRPO (DeepSeekMath §4.1-4.2) is six stages, each a few lines below:

1. draw P prompts (mazes) and render them;
2. sample G completions per prompt, keeping the sampler's own log-probs of the drawn tokens
   (the behaviour policy π_old: ``grouprl.rollout.hf.generate``);
3. score each completion with the task's verifier (1 = the moves solve the maze, else 0);
4. GRPO's advantage per completion, A = (r − mean_group r)/(std_group r + eps)
   (``grouprl.advantages.compute("grpo", ...)``); a group whose rewards are all equal gets 0;
5. the current policy's log-probs of the same tokens, with gradient (a plain forward);
6. PPO's clipped loss ``−min(ρA, clip(ρ, 0.8, 1.2)A)`` per token (``grouprl.losses.ppo_clip``),
   the mean over each sequence's tokens then over sequences (``seq_mean_token_mean``), one
   AdamW step with the gradient clipped to norm 1.

These are the settings of ``grouprl train --preset grpo`` (the default run): one optimizer
step per batch (so ρ = 1 at that step and the clip never acts), no KL term (β = 0), no
dropout. ``tests/examples/test_grpo_in_one_file.py`` runs this file's :func:`train` and the
trainer at the same settings: with the trainer's forward in stage 5 the parameters come out
equal bit for bit; with the plain forward below they differ by that forward's float rounding
only. The trainer adds checkpoints, evaluation, metrics, health rules, every other method
(docs/ALGORITHMS.md) and a faster forward (each prompt once per group, a fused log-prob
head), none of which changes the update.

Run: ``python examples/grpo_in_one_file.py --steps 50`` (the SFT warm start is cached).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import numpy as np
import torch

from grouprl import advantages, losses, models, tasks
from grouprl.rollout import hf
from grouprl.train.prompts import prompt_seed
from grouprl.train.sft import warm_start


@dataclass(frozen=True)
class Settings:
    """The default run's values (configs/maze.yaml; ``grouprl train --print-config``)."""

    seed: int = 0
    steps: int = 150
    prompts: int = 16  # P mazes a step
    group: int = 16  # G completions a maze
    max_new_tokens: int = 10
    temperature: float = 1.0
    lr: float = 5e-5
    clip_eps: float = 0.2  # PPO / GRPO ε, both sides
    grad_clip: float = 1.0
    sft_steps: int = 700
    maze: tuple[int, int, int] = (4, 1, 5)  # size, min and max moves of the answer


def behaviour_rollouts(model, tokenizer, task, examples, s: Settings, gen: torch.Generator):
    """Stages 1-2: render the prompts, sample ``G`` completions each (no gradient)."""
    texts = [task.render(ex, tokenizer) for ex in examples]
    sampling = hf.Sampling(temperature=s.temperature, max_new_tokens=s.max_new_tokens)
    with torch.no_grad():
        return hf.generate(model, tokenizer, texts, s.group, sampling, gen)  # [N = P·G, ...]


def current_logprobs(model, roll, rows: torch.Tensor, temperature: float) -> torch.Tensor:
    """Stage 5: ``[n, T]`` log π_θ of the sampled tokens of sequences ``rows``, with gradient,
    0 at padding. One forward of prompt + completion; position i's logits predict token i + 1.
    """
    tp = roll.prompt_ids.shape[1]
    completion = roll.completion_ids[rows]  # [n, T] (a copy: the sampler's are inference-mode)
    mask = roll.completion_mask[rows].float()  # [n, T]
    ids = torch.cat([roll.prompt_ids[rows], completion], dim=1)  # [n, Tp + T]
    attn = torch.cat([roll.prompt_mask[rows], roll.completion_mask[rows]], dim=1).long()
    pos = (attn.cumsum(-1) - 1).clamp_min(0)  # left padding: positions start at the prompt
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    logits = logits[:, tp - 1 : -1].float() / temperature  # [n, T, V]
    logp = torch.log_softmax(logits, dim=-1)
    logp = logp.gather(-1, completion[..., None]).squeeze(-1)  # [n, T]
    return logp * mask


def grpo_step(model, optimizer, tokenizer, task, step, s: Settings, gen, forward) -> dict:
    """One GRPO step (stages 1-6); returns what it measured. ``forward``: stage 5."""
    examples = task.examples("train", s.prompts, prompt_seed(s.seed, step, 0))  # 1. prompts
    roll = behaviour_rollouts(model, tokenizer, task, examples, s, gen)  # 2. [N] rollouts
    refs = [ex.reference for ex in examples for _ in range(s.group)]
    rewards = torch.tensor([task.verify(t, r) for t, r in zip(roll.texts, refs)])  # 3. [N]
    rewards = rewards.float().view(s.prompts, s.group)  # [P, G]
    adv = advantages.compute("grpo", rewards).per_sample  # 4. [N]
    # a group whose advantages are all 0 (every reward equal) adds exactly 0 to the loss and
    # its gradient: only the other groups' rows go through the model
    rows = adv.view(s.prompts, s.group).ne(0).any(1).repeat_interleave(s.group).nonzero()[:, 0]
    mask = roll.completion_mask.float()  # [N, T]
    totals = losses.step_totals(mask)  # the mean runs over every sequence, skipped ones too
    optimizer.zero_grad(set_to_none=True)
    stats, loss = {}, torch.zeros(())
    if len(rows):
        logp = forward(model, roll, rows, s.temperature)  # 5. [n, T]
        per_token, stats = losses.ppo_clip(  # 6. [n, T]
            logp, roll.old_logp[rows].float(), adv[rows], mask[rows],
            eps_low=s.clip_eps, eps_high=s.clip_eps,
        )  # fmt: skip
        loss = losses.aggregate("seq_mean_token_mean", per_token, mask[rows], totals)
        loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    if not len(rows):  # every group collapsed: a zero gradient, and AdamW still steps
        for p in params:
            p.grad = torch.zeros_like(p)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
    optimizer.step()
    return {
        "reward": float(rewards.mean()),
        "loss": float(loss.detach()),
        "grad_norm": float(grad_norm),
        "ratio_max": stats.get("ratio_max", 1.0),
    }


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(
    s: Settings, model=None, tokenizer=None, task=None, say=print, forward=current_logprobs
) -> torch.nn.Module:
    """``s.steps`` GRPO steps; builds the task and the warm-started tiny model unless given.
    ``forward``: the current log-probs (stage 5), :func:`current_logprobs` by default."""
    seed_everything(s.seed)
    size, lo, hi = s.maze
    task = task or tasks.get("maze", size=size, min_path=lo, max_path=hi)
    if model is None:
        model, tokenizer = models.load("tiny", task=task, seed=s.seed)
        model = warm_start(model, tokenizer, task, steps=s.sft_steps, seed=s.seed)
    model.eval()  # no dropout: ρ = 1 on-policy
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=s.lr, weight_decay=0.0, fused=True
    )
    gen = torch.Generator().manual_seed(s.seed)  # the sampler's random stream
    for step in range(1, s.steps + 1):
        out = grpo_step(model, optimizer, tokenizer, task, step, s, gen, forward)
        if say and (step % 10 == 0 or step == s.steps):
            say(f"step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in out.items()))
    return model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--steps", type=int, default=Settings.steps)
    ap.add_argument("--seed", type=int, default=Settings.seed)
    args = ap.parse_args(argv)
    train(Settings(steps=args.steps, seed=args.seed))


if __name__ == "__main__":
    main()
