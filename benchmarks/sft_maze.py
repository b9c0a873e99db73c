"""SFT warm start on the 5 × 5 maze: quality on held-out mazes and the time it took; prints JSON.

    .venv/bin/python benchmarks/sft_maze.py --steps 1400 [--mazes 200 --k 16 --threads 1]

Greedy accuracy, pass@1 (mean success at T = 1) and unbiased pass@k over ``--mazes``
held-out mazes (the "eval" split), ``k`` samples each. The warm start is cached, so a
second run measures evaluation only (``--no-cache`` retrains).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def evaluate(model, tokenizer, task, mazes: int, k: int, seed: int) -> dict[str, float]:
    from grouprl.diagnostics.passk import pass_at_k
    from grouprl.rollout.hf import Sampling, generate

    examples = task.examples("eval", mazes, seed)
    prompts = [task.render(e, tokenizer) for e in examples]
    refs = [e.reference for e in examples]
    greedy = generate(model, tokenizer, prompts, 1, Sampling(0.0, 1.0, 32))
    g_ok = [task.verify(t, r) for t, r in zip(greedy.texts, refs)]
    t0 = time.perf_counter()
    out = generate(
        model, tokenizer, prompts, k, Sampling(1.0, 1.0, 32), torch.Generator().manual_seed(seed)
    )
    dt = time.perf_counter() - t0
    ok = torch.tensor(task.verify_batch(out.texts, [r for r in refs for _ in range(k)]))
    correct = ok.view(mazes, k).sum(1).long().tolist()
    result = {"greedy": sum(g_ok) / mazes, "pass@1": float(ok.mean())}
    for kk in sorted({1, 4, 8, k}):
        if kk <= k:
            result[f"pass@{kk}"] = float(sum(pass_at_k(k, c, kk) for c in correct) / mazes)
    result["sample_tokens_per_s"] = float(out.completion_mask.sum()) / dt
    result["stop_rate"] = sum(r == "stop" for r in out.finish_reason) / len(out.finish_reason)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1400)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--mazes", type=int, default=200)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--schedule", default="cosine")
    parser.add_argument("--no-cache", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from grouprl import models, tasks
    from grouprl.train.sft import warm_start

    task = tasks.get("maze")
    model, tok = models.load(args.model, task=task, seed=args.seed)
    before = evaluate(model, tok, task, 50, 4, args.seed)
    if args.no_cache:
        os.environ["GROUPRL_NO_SFT_CACHE"] = "1"
    t0 = time.perf_counter()
    warm_start(
        model,
        tok,
        task,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        schedule=args.schedule,
        seed=args.seed,
        progress=False,
    )
    sft_s = time.perf_counter() - t0
    after = evaluate(model, tok, task, args.mazes, args.k, args.seed)
    print(
        json.dumps(
            {
                "model": args.model,
                "params": sum(p.numel() for p in model.parameters()),
                "steps": args.steps,
                "batch_size": args.batch_size,
                "lr": args.lr,
                "schedule": args.schedule,
                "sft_seconds": round(sft_s, 1),
                "ms_per_step": round(1000 * sft_s / args.steps, 1),
                "threads": args.threads,
                "before_greedy": before["greedy"],
                "after": after,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
