"""Time grouprl's estimators *through the verl adapter* against verl's own ``grpo`` (a Python
loop over prompt ids) and ``grpo_vectorized``, on the same flat verl batch. Prints JSON.

    python benchmarks/adapters.py [--prompts 131072] [--group 8] [--tokens 16] [--repeat 3]
                                  [--no-verl-loop] [--shuffle]

The batch is what verl's trainer hands an estimator: ``token_level_rewards [N, T]`` with the
score on the last valid token, ``response_mask [N, T]`` and ``index`` = one uuid string per
prompt repeated G times (verl's ``uid``, an object array). Every path is called as verl's
``compute_advantage`` calls it (keyword arguments, ``config`` an OmegaConf algorithm config).
``layout_s`` is the flat -> [P, G] mapping alone (``np.unique`` over the uid strings), the
part of the adapter cost that the direct path (benchmarks/advantages.py) does not pay.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import uuid
import warnings

import numpy as np
import torch
from advantages import timeit  # benchmarks/advantages.py: median of `repeat` after a warm-up


def make_batch(p: int, g: int, t: int, shuffle: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n = p * g
    binary = (torch.rand(p, g, generator=gen) < torch.rand(p, 1, generator=gen)).float()
    partial = torch.rand(p, g, generator=gen)
    scores = torch.where(torch.rand(p, 1, generator=gen) < 0.7, binary, partial).reshape(-1)
    uids = np.array([str(uuid.UUID(int=int(k) + 1)) for k in range(p)], dtype=object)
    index = np.repeat(uids, g)  # verl: batch.repeat(n, interleave=True)
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    if shuffle:
        perm = torch.randperm(n, generator=gen)
        scores, lengths, index = scores[perm], lengths[perm], index[perm.numpy()]
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()  # [N, T]
    tlr = torch.zeros(n, t)
    tlr[torch.arange(n), lengths - 1] = scores
    return tlr, mask, index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=131072)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--estimators", default="grpo,rloo,maxnorm_rloo")
    parser.add_argument("--no-verl-loop", action="store_true", help="skip verl's looped grpo")
    parser.add_argument("--shuffle", action="store_true", help="non-contiguous groups")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")

    from omegaconf import OmegaConf
    from verl.trainer.ppo import core_algos

    from grouprl.integrations import verl as gv

    tlr, mask, index = make_batch(args.prompts, args.group, args.tokens, args.shuffle)
    n = tlr.shape[0]
    cfg = OmegaConf.create({"adv_estimator": "grpo", "grouprl": {"singleton": "verl"}})

    def call(name):
        fn = core_algos.get_adv_estimator_fn(name)
        return lambda: fn(token_level_rewards=tlr, response_mask=mask, index=index, config=cfg)

    results: dict[str, float] = {}
    results["layout_s"] = timeit(lambda: gv.group_layout(index, n), args.repeat)
    for est in args.estimators.split(","):
        results[f"grouprl_{est}_s"] = timeit(call(f"grouprl_{est}"), args.repeat)
    results["verl_grpo_vectorized_s"] = timeit(call("grpo_vectorized"), args.repeat)
    ours, _ = call("grouprl_grpo")()
    theirs_vec, _ = call("grpo_vectorized")()
    diffs = {"max_abs_diff_vs_grpo_vectorized": float((ours - theirs_vec).abs().max())}
    if not args.no_verl_loop:  # a Python loop over N samples: timed once
        t0 = time.perf_counter()
        theirs, _ = call("grpo")()
        results["verl_grpo_s"] = time.perf_counter() - t0
        diffs["max_abs_diff_vs_grpo"] = float((ours - theirs).abs().max())
    ratios = {
        "speedup_vs_grpo_vectorized": results["verl_grpo_vectorized_s"] / results["grouprl_grpo_s"]
    }
    if "verl_grpo_s" in results:
        ratios["speedup_vs_grpo"] = results["verl_grpo_s"] / results["grouprl_grpo_s"]
    import verl

    print(
        json.dumps(
            {
                "benchmark": "verl adapter",
                "prompts": args.prompts,
                "group": args.group,
                "samples": n,
                "tokens": args.tokens,
                "contiguous_groups": not args.shuffle,
                "torch_threads": torch.get_num_threads(),
                "seconds": {k: round(v, 4) for k, v in results.items()},
                "ratios": {k: round(v, 2) for k, v in ratios.items()},
                "parity": diffs,
                "versions": {"torch": torch.__version__, "verl": verl.__version__},
                "machine": platform.processor() or platform.machine(),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
