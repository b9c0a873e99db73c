"""Supervised warm start on a task's demonstrations, cached on disk by everything that shapes it.

    model, tok = models.load("tiny", task=maze)
    model = warm_start(model, tok, maze, steps=1400)     # ~3 min on one core the first time,
                                                         # a ~0.1 s reload every time after

F-GRPO's maze experiment (§5.2, after MaxRL) starts RL from a model supervised on
solved mazes; RL from a random init never sees a reward. The warm start trains on
freshly drawn examples every step (``task.examples`` on a stream of its own), with the
loss on the demonstration tokens and EOS only. [OURS] recipe after a prototype
on the 5 × 5 maze (docs/models.md): the 205k-parameter tiny model, batch 64, lr 2e-3,
1,400 steps reaches pass@1 0.117, pass@16 0.373, pass@64 0.495 on 200 held-out mazes
(reproductions/maze/results.json): a policy with mixed groups, the regime RL needs.

The cache key is the SHA-256 of: the task class and config, the model config, the
tokenizer vocabulary size, the seed, the steps (or seconds), batch size, learning rate,
and the initial weights' checksum; a hit loads the stored weights into ``model``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from grouprl._progress import ProgressLines, use_bar

__all__ = ["SFT_VERSION", "cache_key", "sft_batch", "warm_start"]

SFT_VERSION = 1
"""Bumped when the training recipe changes, so stale cached weights are not reused."""


def _model_config(model: Any) -> str:
    config = getattr(model, "config", None)
    if config is None:
        return type(model).__name__
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


def _weights_checksum(model: Any) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        flat = tensor.detach().float().reshape(-1)
        digest.update(f"{flat.sum().item():.6e}|{flat.abs().sum().item():.6e}".encode())
    return digest.hexdigest()


def cache_key(model: Any, tokenizer: Any, task: Any, **recipe: Any) -> str:
    """Hex SHA-256 of the task, the model config and initial weights, the vocabulary and the recipe."""
    payload = {
        "version": SFT_VERSION,
        "task": [type(task).__name__, getattr(task, "config", {})],
        "model": _model_config(model),
        "weights": _weights_checksum(model),
        "vocab": len(tokenizer),
        "recipe": recipe,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def sft_batch(tokenizer: Any, task: Any, examples: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, L], labels [B, L])``: rendered prompt + demonstration + EOS, right-padded.

    Labels are -100 on the prompt and the padding, so the loss covers the demonstration
    and its EOS only. Right padding keeps every real token's position id equal to its
    index, so no attention mask is needed with a causal model.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token: the model could never learn to stop")
    rows, targets = [], []
    # one batched call each for the prompts and the answers: the same ids as one call per
    # text, without the per-call overhead that otherwise costs a tiny model's step ~10 % [OURS]
    prompts = tokenizer([task.render(ex, tokenizer) for ex in examples], add_special_tokens=False)
    answers = tokenizer([task.demonstration(ex) for ex in examples], add_special_tokens=False)
    for prompt, answer in zip(prompts["input_ids"], answers["input_ids"]):
        answer = [*answer, tokenizer.eos_token_id]
        rows.append(prompt + answer)
        targets.append([-100] * len(prompt) + answer)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows], dtype=torch.long)
    labels = torch.tensor([t + [-100] * (width - len(t)) for t in targets], dtype=torch.long)
    return ids, labels


SCHEDULES = ("cosine", "constant")
"""Learning-rate shapes after the linear warm-up: cosine decay to 10 % of the peak, or flat."""


def _lr_factor(step: int, total: int, warmup: int, schedule: str = "cosine") -> float:
    # [OURS] linear warm-up, then cosine decay to 10 % of the peak (or constant).
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _train(model: Any, tokenizer: Any, task: Any, plan: dict[str, Any], progress: bool) -> dict:
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=plan["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    total = plan["steps"] or 10**9
    warmup = min(plan["warmup"], max(1, total // 10)) if plan["steps"] else plan["warmup"]
    start, losses, step = time.perf_counter(), [], 0
    bar = _progress(use_bar(progress))
    job = bar.add_task("SFT warm start", total=plan["steps"] or plan["seconds"]) if bar else None
    # without a terminal: a plain line every tenth or 30 s
    lines = None if bar or not plan["steps"] else ProgressLines("SFT warm start", total)
    model.train()
    while step < total:
        stream = 1_000_003 * (plan["seed"] + 1) + step  # [OURS] a stream the RL loop never asks for
        ids, labels = sft_batch(tokenizer, task, task.examples("train", plan["batch_size"], stream))
        ids, labels = ids.to(device), labels.to(device)
        for group in opt.param_groups:
            group["lr"] = plan["lr"] * _lr_factor(
                step, total, warmup, plan.get("schedule", "cosine")
            )
        logits = model(input_ids=ids).logits[:, :-1]  # [B, L-1, V]
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        elapsed = time.perf_counter() - start
        if plan["seconds"] and step == 20:  # fix the schedule's length from the measured speed
            total = max(step + 1, int(plan["seconds"] / (elapsed / step)))
            lines = None if bar else ProgressLines("SFT warm start", total)
        if lines is not None:
            lines.update(step, f"loss {sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if bar:
            bar.update(
                job,
                completed=step if plan["steps"] else min(elapsed, plan["seconds"]),
                description=f"SFT warm start  loss {sum(losses[-20:]) / len(losses[-20:]):.3f}",
            )
    if bar:
        bar.stop()
    opt.zero_grad(set_to_none=True)  # the last step's gradient must not reach the RL's first
    model.eval()
    tail = losses[-50:]
    return {
        "steps": step,
        "seconds": time.perf_counter() - start,
        "final_loss": sum(tail) / len(tail),
    }


def _progress(enabled: bool) -> Any:
    if not enabled:
        return None
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), transient=True
    )
    bar.start()
    return bar


def warm_start(
    model: Any,
    tokenizer: Any,
    task: Any,
    *,
    steps: int | None = None,
    seconds: float | None = None,
    batch_size: int = 64,
    lr: float = 2e-3,
    warmup: int = 50,
    schedule: str = "cosine",
    seed: int = 0,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    say: Any = print,
) -> Any:
    """Supervise ``model`` on ``task.demonstration`` for ``steps`` (or ``seconds``); cached; returns the model.

    Args:
        steps: optimizer steps (reproducible; preferred). Exactly one of steps/seconds.
        seconds: a wall-clock budget instead; the number of steps is fixed after 20 steps
            from the measured speed, so it depends on the machine (the cache key holds the
            budget, not the step count, and the first run's weights are reused).
        schedule: ``cosine`` (default) or ``constant`` after the warm-up.
        batch_size, lr, warmup: AdamW (β = 0.9, 0.95, no weight decay), [OURS] linear warm-up
            over ``warmup`` steps then cosine decay to 10 % of ``lr``; grad-norm clip 1.0.
            Defaults after the maze prototype (batch 64, lr 2e-3; docs/models.md).
        seed: picks the stream of training examples (and is part of the cache key).
        cache_dir: where the weights go (default ``models.cache_dir() / "sft"``); None
            and ``GROUPRL_NO_SFT_CACHE=1`` disables reading and writing the cache.
        progress: a bar on a terminal; plain progress lines otherwise either way.
        say: prints one line when the warm start starts (or loads its cache) and ends
            (None: silent).

    The weights are stored as ``<cache_dir>/<task>-<key[:16]>/model.safetensors`` with a
    ``meta.json`` (steps run, seconds, final loss); the write is atomic (temp folder + rename).
    """
    from safetensors.torch import load_model, save_model

    from grouprl.models import cache_dir as default_cache

    if (steps is None) == (seconds is None):
        raise ValueError("warm_start needs exactly one of steps= or seconds=")
    if steps is not None and (int(steps) != steps or steps < 1):
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if seconds is not None and not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    if not callable(getattr(task, "demonstration", None)):
        raise ValueError(
            f"task {getattr(task, 'name', task)!r} has no demonstration(): no SFT possible"
        )
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of: {', '.join(SCHEDULES)}")
    plan = {
        "steps": steps,
        "seconds": seconds,
        "batch_size": batch_size,
        "lr": lr,
        "warmup": warmup,
        "seed": seed,
    }
    if schedule != "cosine":  # cosine runs keep the cache keys they had before this option
        plan["schedule"] = schedule
    use_cache = os.environ.get("GROUPRL_NO_SFT_CACHE", "") not in ("1", "true")
    root = Path(cache_dir) if cache_dir is not None else default_cache() / "sft"
    folder = (
        root / f"{getattr(task, 'name', 'task')}-{cache_key(model, tokenizer, task, **plan)[:16]}"
    )
    say = say or (lambda _: None)
    if use_cache and (folder / "model.safetensors").is_file():
        load_model(model, str(folder / "model.safetensors"))
        say(f"SFT warm start: cached weights loaded ({folder})")
        return model.eval()
    length = f"{steps} steps" if steps else f"{seconds:g} s"
    where = f"once: cached in {root}" if use_cache else "not cached"
    say(
        f"SFT warm start: {length} of supervised training on {getattr(task, 'name', 'the task')} ({where})"
    )
    meta = _train(model, tokenizer, task, plan, progress)
    say(f"SFT warm start: done in {meta['seconds']:.0f} s, final loss {meta['final_loss']:.3f}")
    if use_cache:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp", dir=root))
        try:
            save_model(model, str(tmp / "model.safetensors"))
            (tmp / "meta.json").write_text(json.dumps({**plan, **meta}, indent=1))
            tmp.chmod(0o755)  # mkdtemp makes it private
            if not folder.exists():
                os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return model
