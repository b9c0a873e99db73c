"""Base pass rates of a model on a task at T = 1: pass@1, group mix (all-right/all-wrong/mixed); JSON.

    .venv/bin/python benchmarks/base_pass_rates.py --model smollm2 --task basic_arithmetic

Whether RL can start: groups of G samples need mixed rewards for a group-relative
advantage to be non-zero (ACR, ALGORITHMS.md §5).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--task", default="basic_arithmetic")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from grouprl import models, tasks
    from grouprl.rollout.hf import Sampling, generate

    task = tasks.get(args.task)
    model, tok = models.load(args.model, task=task)
    examples = task.examples("eval", args.prompts, args.seed)
    prompts = [task.render(e, tok) for e in examples]
    t0 = time.perf_counter()
    out = generate(
        model,
        tok,
        prompts,
        args.group,
        Sampling(1.0, 1.0, args.max_new_tokens),
        torch.Generator().manual_seed(args.seed),
    )
    seconds = time.perf_counter() - t0
    refs = [e.reference for e in examples for _ in range(args.group)]
    r = torch.tensor(task.verify_batch(out.texts, refs)).view(args.prompts, args.group)
    right, wrong = (r == 1).all(1), (r == 0).all(1)
    print(
        json.dumps(
            {
                "model": args.model,
                "task": args.task,
                "prompts": args.prompts,
                "group": args.group,
                "pass@1": float(r.nanmean()),
                "all_right": float(right.float().mean()),
                "all_wrong": float(wrong.float().mean()),
                "mixed": float((~right & ~wrong).float().mean()),
                "nan": int(r.isnan().sum()),
                "stop_rate": out.finish_reason.count("stop") / len(out.texts),
                "mean_tokens": float(out.completion_mask.sum(1).float().mean()),
                "seconds": round(seconds, 1),
                "example": [prompts[0][-60:], out.texts[:3]],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
