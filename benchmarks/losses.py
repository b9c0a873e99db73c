"""Time grouprl's loss path against verl's policy loss on the same tensors; prints JSON.

    .venv/bin/python benchmarks/losses.py [--n 256] [--t 1024] [--repeats 5]

For each surrogate: forward + backward of ``losses.objective`` (surrogate + aggregation + k3
KL, stats included) and, when verl is installed, of verl's ``compute_policy_loss_*`` +
``kl_penalty_forward`` + ``agg_loss``. Median wall time in milliseconds, one thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch

from grouprl import losses

VERL_NAME = {"ppo_clip": "vanilla", "cispo": "cispo", "gspo": "gspo"}
PARAMS = {
    "ppo_clip": {"eps_low": 0.2, "eps_high": 0.28},
    "cispo": {"eps_low": 1.0, "eps_high": 5.0},
    "gspo": {"eps_low": 3e-4, "eps_high": 4e-4},
}


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _verl():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from verl.trainer.ppo import core_algos
            from verl.workers.config import ActorConfig
    except ImportError:
        return None
    return core_algos, ActorConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--t", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    n, t = args.n, args.t
    lengths = torch.randint(t // 4, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    old = -torch.rand(n, t, generator=g) * 2
    base = old + 0.1 * torch.randn(n, t, generator=g)
    ref = base + 0.1 * torch.randn(n, t, generator=g)
    adv = torch.randn(n, generator=g)
    verl = _verl()
    results: dict[str, dict[str, float]] = {}
    for name, params in PARAMS.items():

        def ours(name=name, params=params):
            lp = base.clone().requires_grad_()
            out = losses.objective(
                lp,
                old,
                adv,
                mask,
                surrogate=name,
                surrogate_params=params,
                aggregation="token_mean",
                ref_logp=ref,
                kl="k3",
                beta=0.01,
            )
            out.loss.backward()

        row = {"grouprl_ms": _median_ms(ours, args.repeats)}
        if verl is not None:
            core, actor_config = verl
            cfg = actor_config(
                strategy="fsdp",
                rollout_n=1,
                clip_ratio=params["eps_low"],
                clip_ratio_low=params["eps_low"],
                clip_ratio_high=params["eps_high"],
                ppo_micro_batch_size_per_gpu=1,
            )
            fn = core.get_policy_loss_fn(VERL_NAME[name])
            adv_tok = adv[:, None].expand(n, t)

            def theirs(fn=fn, cfg=cfg, core=core, adv_tok=adv_tok):
                lp = base.clone().requires_grad_()
                pg, _ = fn(old, lp, adv_tok, mask, loss_agg_mode="token-mean", config=cfg)
                kl = core.agg_loss(core.kl_penalty_forward(lp, ref, "k3"), mask, "token-mean")
                (pg + 0.01 * kl).backward()

            row["verl_ms"] = _median_ms(theirs, args.repeats)
        results[name] = row
    print(json.dumps({"n": n, "t": t, "threads": 1, "results": results}, indent=2))


if __name__ == "__main__":
    main()
