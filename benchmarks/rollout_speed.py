"""Sampling speed of grouprl.rollout.hf.generate against transformers' model.generate; prints JSON.

    .venv/bin/python benchmarks/rollout_speed.py [--smollm2] [--threads 1]

Tiny maze model: 32 mazes × G = 8 (256 sequences, 27-token prompts, up to 32 new tokens).
SmolLM2-135M (``--smollm2``): a ~76-token chat prompt, 64 new tokens, batch 8 / 32 / 64
as G = 8 samples of 1 / 4 / 8 prompts. Tokens/s counts generated tokens (mask sum). The
reference is ``model.generate(do_sample=True)`` on the same prompts repeated G times (no
shared prefill). Run on an idle machine: another busy process slows torch 4–10×.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def ours(model, tok, prompts, g, sampling, repeats=2):
    from grouprl.rollout.hf import generate

    generate(model, tok, prompts[:1], 1, sampling)  # warm-up
    best = float("inf")
    for r in range(repeats):
        t0 = time.perf_counter()
        out = generate(model, tok, prompts, g, sampling, torch.Generator().manual_seed(r))
        best = min(best, time.perf_counter() - t0)
    tokens = int(out.completion_mask.sum())
    return {"seconds": round(best, 3), "tokens": tokens, "tokens_per_s": round(tokens / best, 1)}


def reference(model, tok, prompts, g, sampling):
    tok.padding_side = "left"
    enc = tok(
        [p for p in prompts for _ in range(g)],
        return_tensors="pt",
        padding=True,
        add_special_tokens=False,
    )
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=sampling.temperature,
            top_p=1.0,
            max_new_tokens=sampling.max_new_tokens,
            pad_token_id=tok.pad_token_id,
        )
    dt = time.perf_counter() - t0
    new = out[:, enc["input_ids"].shape[1] :]
    tokens = int((new != tok.pad_token_id).sum())
    return {"seconds": round(dt, 3), "tokens": tokens, "tokens_per_s": round(tokens / dt, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smollm2", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from grouprl import models, tasks
    from grouprl.rollout.hf import Sampling
    from grouprl.tasks.base import chat_render

    result = {"threads": args.threads, "load_avg": os.getloadavg()[0]}
    task = tasks.get("maze")
    model, tok = models.load("tiny", task=task)
    from grouprl.train.sft import warm_start

    warm_start(model, tok, task, steps=1400, progress=False)  # cached; realistic lengths
    prompts = [task.render(e, tok) for e in task.examples("eval", 32, 0)]
    s = Sampling(1.0, 1.0, 32)
    result["tiny_maze_256"] = {
        "ours": ours(model, tok, prompts, 8, s),
        "hf_generate": reference(model, tok, prompts, 8, s),
    }
    if args.smollm2:
        model, tok = models.load("smollm2")
        q = (
            "A farmer has 7 cows and buys 5 more, then sells 3 of them at the market on "
            "Sunday. How many cows does the farmer have now? Answer with a number."
        )
        prompt = chat_render(q, tok)
        result["smollm2_prompt_tokens"] = len(tok(prompt, add_special_tokens=False)["input_ids"])
        s = Sampling(1.0, 1.0, 64)
        for p in (1, 4, 8):
            result[f"smollm2_batch{8 * p}"] = {"ours": ours(model, tok, [prompt] * p, 8, s, 1)}
        result["smollm2_batch32"]["hf_generate"] = reference(model, tok, [prompt] * 4, 8, s)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
