"""Rollout and training-forward speed, this tree against a baseline commit, same inputs; prints JSON.

    python benchmarks/rollout_speed.py                          # SmolLM2 and the tiny maze
    python benchmarks/rollout_speed.py --models tiny --repeats 3
    python benchmarks/rollout_speed.py --baseline 4666acf       # "before" = that commit

"Before" is ``grouprl.rollout.hf`` and ``grouprl.train.logprobs`` as they are at
``--baseline`` (read with ``git show``, loaded as modules next to this tree's); "after" is this
tree. Both run in one process on the same model, prompts and seeds, alternating (A B A B ...)
so that a change in the machine's load hits both; the best and the median of ``--repeats``
are reported, with the load average before and after.

- ``generate``: ``hf.generate`` of P prompts × G samples (SmolLM2: basic_arithmetic with the
  chat template, 8 × 8, 64 new tokens, the vs_trl setting; tiny: 32 mazes × 8 after the
  cached SFT, 32 new tokens); tokens/s counts generated tokens. Exactness: the tokens of
  before and after for the same seed are compared, and the largest |Δ old_logp|.
- ``train_forward``: ``completion_logprobs`` with gradient plus the backward of their sum, in
  micro-batches (SmolLM2: 16 sequences, chunk 1024; tiny: the whole batch), on the "after"
  rollouts; tokens/s counts completion tokens. Exactness: max |Δ logp| and the largest
  gradient difference relative to the largest gradient. ``after_recompute`` forces the
  lm-head recomputation in the backward (``recompute=True``; the default keeps the
  probabilities below 1 GiB): ``recompute_cost_median`` is how much faster keeping is.
- ``hf_generate``: ``model.generate(do_sample=True)`` on the prompts repeated G times, the
  sampler TRL uses.
- ``compiled_generate`` (``--compile``): "after" with ``model.forward`` under
  ``torch.compile(dynamic=True)``: the first call (compilation included), the calls after it,
  and whether the tokens equal the eager ones: where compiling the decode step pays.

Run on an idle machine: another busy process slows torch 4–10×.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
MODULES = {"hf": "src/grouprl/rollout/hf.py", "logprobs": "src/grouprl/train/logprobs.py"}

SETTINGS: dict[str, dict[str, Any]] = {
    "smollm2": {"task": "basic_arithmetic", "prompts": 8, "group": 8, "max_new": 64,
                "micro": 16, "chunk": 1024},
    "tiny": {"task": "maze", "prompts": 32, "group": 8, "max_new": 32, "micro": 0,
             "chunk": 2048},
}  # fmt: skip


def baseline_modules(ref: str) -> dict[str, Any]:
    """``hf`` and ``logprobs`` as they are at git revision ``ref``, imported under new names."""
    out = {}
    folder = Path(tempfile.mkdtemp(prefix="grouprl-baseline-"))
    for name, path in MODULES.items():
        source = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{ref}:{path}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        file = folder / f"baseline_{name}.py"
        file.write_text(source)
        spec = importlib.util.spec_from_file_location(f"baseline_{name}", file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        out[name] = module
    return out


def _load(model_name: str, cfg: dict[str, Any]):
    from grouprl import models, tasks

    task = tasks.get(cfg["task"])
    model, tok = models.load(model_name, task=task, attn_implementation="sdpa")
    if model_name == "tiny":
        from grouprl.train.sft import warm_start

        model = warm_start(model, tok, task, steps=1400, progress=False)  # cached
    prompts = [task.render(e, tok) for e in task.examples("train", cfg["prompts"], 0)]
    return model.eval(), tok, prompts


def _generate(hf: Any, model, tok, prompts, cfg) -> tuple[Any, float]:
    sampling = hf.Sampling(1.0, 1.0, cfg["max_new"])
    t0 = time.perf_counter()
    roll = hf.generate(
        model, tok, prompts, cfg["group"], sampling, torch.Generator().manual_seed(0)
    )
    return roll, time.perf_counter() - t0


def _train_forward(
    logprobs: Any, model, roll, cfg, **options: Any
) -> tuple[torch.Tensor, list, float]:
    n = roll.completion_ids.shape[0]
    micro = cfg["micro"] or n
    parts = []
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    for start in range(0, n, micro):
        m = slice(start, start + micro)
        lp = logprobs.completion_logprobs(
            model, roll.prompt_ids[m], roll.prompt_mask[m], roll.completion_ids[m],
            roll.completion_mask[m].float(), chunk=cfg["chunk"], group_size=cfg["group"],
            entropy=True, **options,
        )  # fmt: skip
        lp.logp.sum().backward()
        parts.append(lp.logp.detach())
    seconds = time.perf_counter() - t0
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return torch.cat(parts), grads, seconds


def _hf_generate(model, tok, prompts, cfg) -> float:
    tok.padding_side = "left"
    enc = tok([p for p in prompts for _ in range(cfg["group"])], return_tensors="pt",
              padding=True, add_special_tokens=False)  # fmt: skip
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                       max_new_tokens=cfg["max_new"], pad_token_id=tok.pad_token_id)  # fmt: skip
    return time.perf_counter() - t0


def _compiled(model, tok, prompts, cfg, repeats: int, eager) -> dict[str, Any]:
    from grouprl.rollout import hf

    forward = model.forward
    model.forward = torch.compile(forward, dynamic=True)
    try:
        rolls, seconds = zip(*(_generate(hf, model, tok, prompts, cfg) for _ in range(repeats + 1)))
    finally:
        model.forward = forward
    tokens = int(rolls[0].completion_mask.sum())
    return {
        "first_call_s": round(seconds[0], 3),
        "after_first": _summary(list(seconds[1:]), tokens),
        "same_tokens_as_eager": all(torch.equal(r.completion_ids, eager) for r in rolls),
    }


def _summary(seconds: list[float], tokens: int) -> dict[str, Any]:
    best, median = min(seconds), statistics.median(seconds)
    return {
        "seconds": [round(s, 3) for s in seconds],
        "tokens": tokens,
        "tokens_per_s_best": round(tokens / best, 2),
        "tokens_per_s_median": round(tokens / median, 2),
    }


def measure(
    model_name: str, base: dict[str, Any], repeats: int, reference: bool, compiled: bool = False
) -> dict:
    from grouprl.rollout import hf
    from grouprl.train import logprobs

    cfg = SETTINGS[model_name]
    model, tok, prompts = _load(model_name, cfg)
    now = {"hf": hf, "logprobs": logprobs}
    gen: dict[str, list[float]] = {"before": [], "after": []}
    fwd: dict[str, list[float]] = {"before": [], "after": [], "after_recompute": []}
    rolls, outs = {}, {}
    _generate(hf, model, tok, prompts[:1], {**cfg, "max_new": 2})  # warm-up
    load0 = os.getloadavg()[0]
    for _ in range(repeats):
        for side, mods in (("before", base), ("after", now)):
            rolls[side], dt = _generate(mods["hf"], model, tok, prompts, cfg)
            gen[side].append(dt)
    roll = rolls["after"]
    roll = replace(roll, **{k: getattr(roll, k).clone() for k in
                            ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")})  # fmt: skip
    sides = (
        ("before", base, {}),
        ("after", now, {}),
        ("after_recompute", now, {"recompute": True}),
    )
    for _ in range(repeats):
        for side, mods, options in sides:
            logp, grads, dt = _train_forward(mods["logprobs"], model, roll, cfg, **options)
            outs[side] = (logp, grads)
            fwd[side].append(dt)
    same = torch.equal(rolls["before"].completion_ids, rolls["after"].completion_ids)
    gen_tokens = int(roll.completion_mask.sum())
    (lb, gb), (la, ga) = outs["before"], outs["after"]
    top = max(float(g.abs().max()) for g in gb)
    out = {
        "setting": cfg,
        "generate": {side: _summary(gen[side], gen_tokens) for side in gen},
        "train_forward": {side: _summary(fwd[side], gen_tokens) for side in fwd},
        "exactness": {
            "same_tokens": same,
            "old_logp_max_abs_diff": float(
                (rolls["before"].old_logp - rolls["after"].old_logp).abs().max()
            )
            if same
            else None,
            "train_logp_max_abs_diff": float((lb - la).abs().max()),
            "grad_max_abs_diff_rel": max(float((x - y).abs().max()) for x, y in zip(gb, ga)) / top,
        },
        "load_average": [load0, os.getloadavg()[0]],
    }
    for part in ("generate", "train_forward"):
        before, after = out[part]["before"], out[part]["after"]
        out[part]["speedup_best"] = round(
            after["tokens_per_s_best"] / before["tokens_per_s_best"], 3
        )
        out[part]["speedup_median"] = round(
            after["tokens_per_s_median"] / before["tokens_per_s_median"], 3
        )
    again = out["train_forward"]["after_recompute"]
    out["train_forward"]["recompute_cost_median"] = round(
        out["train_forward"]["after"]["tokens_per_s_median"] / again["tokens_per_s_median"], 3
    )
    if compiled:
        out["compiled_generate"] = _compiled(
            model, tok, prompts, cfg, repeats, rolls["after"].completion_ids
        )
    if reference:
        dt = _hf_generate(model, tok, prompts, cfg)
        out["hf_generate"] = {"seconds": round(dt, 3), "max_new_tokens_per_row": cfg["max_new"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "tiny"], choices=list(SETTINGS))
    parser.add_argument("--baseline", default="4666acf", help="git revision of 'before'")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-reference", action="store_true", help="skip HF model.generate")
    parser.add_argument("--compile", action="store_true", help="also torch.compile the decode")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = baseline_modules(args.baseline)
    result: dict[str, Any] = {
        "benchmark": "rollout_speed",
        "baseline": args.baseline,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
    }
    for name in args.models:
        result[name] = measure(name, base, args.repeats, not args.no_reference, args.compile)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
