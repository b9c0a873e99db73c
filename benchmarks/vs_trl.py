"""grouprl's trainer vs TRL's GRPOTrainer on the same model, task, batch and budget; prints JSON.

    python benchmarks/vs_trl.py [--steps 20] [--prompts 16] [--group 8] [--max-new 32] [--quick]

Both trainers start from the same weights (the tiny maze Llama, 205k parameters, built from a
config, after the cached SFT warm start grouprl's ``train`` uses), train on the maze task with
the ``grpo`` preset (TRL: the equivalent ``GRPOConfig`` from
``grouprl.integrations.trl.trl_loss_settings``: loss_type "grpo", ε = 0.2, β = 0), P prompts ×
G completions per step, one AdamW step per generation batch (lr, betas, eps, weight decay, grad
clip 1.0 equal), temperature 1, top-p 1, the same completion length and number of steps, one
torch thread each. Each trainer runs in its own child process (so that its peak RSS is its own),
one after the other. Measured per trainer:

- ``samples_per_s`` / ``tokens_per_s``: completions and generated completion tokens per second
  of the ``train()`` call (rollout + scoring + update + logging; model building excluded;
  TRL's trainer construction is reported separately as ``init_s``);
- ``peak_rss_mib``: the child's peak resident set size (``resource.getrusage``);
- ``train_reward_last``: mean training reward over the last quarter of the steps;
- ``eval``: mean reward and pass@1 of the final policy on the same held-out mazes with the same
  sampler and random stream (grouprl's HF rollout for both), and of the starting policy.

Ratios are grouprl / TRL. Target (issue 8): samples/s ratio >= 1.5 with eval reward at least
TRL's minus two standard errors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")


def _rss_mib() -> float:
    """Peak RSS of this process in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def build(args: argparse.Namespace):
    """The starting policy, its tokenizer and the maze task (identical in both children)."""
    import torch

    from grouprl import models, tasks
    from grouprl.train import sft

    task = tasks.get("maze")
    # [OURS] the start is fixed (init and SFT seed 0: the cached warm start `grouprl train`
    # uses); --seed changes only the RL runs (prompt order, sampling).
    model, tok = models.load("tiny", task=task, dtype=torch.float32, seed=0)
    if args.sft_steps > 0:
        model = sft.warm_start(model, tok, task, steps=args.sft_steps, seed=0, progress=False)
    return model.eval(), tok, task


def evaluate(model, tok, task, args: argparse.Namespace) -> dict[str, float]:
    """Mean reward and pass@1 on ``--eval-prompts`` held-out mazes × ``--eval-samples``."""
    import torch

    from grouprl.rollout import hf

    examples = task.examples("eval", args.eval_prompts, 12345)
    prompts = [task.render(ex, tok) for ex in examples]
    gen = torch.Generator().manual_seed(999)
    sampling = hf.Sampling(temperature=1.0, top_p=1.0, max_new_tokens=args.max_new)
    with torch.no_grad():
        roll = hf.generate(model, tok, prompts, args.eval_samples, sampling, gen)
    refs = [ex.reference for ex in examples for _ in range(args.eval_samples)]
    r = torch.tensor([task.verify(t, ref) for t, ref in zip(roll.texts, refs)], dtype=torch.float64)
    per_prompt = r.view(len(examples), -1).mean(1)  # [P]
    return {
        "reward": float(r.mean()),
        "reward_se": float(per_prompt.std() / math.sqrt(len(examples))),
        "pass@1": float(r.mean()),
    }


# ---- the two trainers ----------------------------------------------------------------------


def run_grouprl(args: argparse.Namespace, model, tok, task, out: Path) -> dict[str, Any]:
    from grouprl.train.config import load_config
    from grouprl.train.loop import train

    cfg = load_config(
        None,
        [
            "model.name=tiny",
            "model.warm_start=false",
            "task.name=maze",
            f"sampling.prompts_per_step={args.prompts}",
            f"sampling.group_size={args.group}",
            f"sampling.max_new_tokens={args.max_new}",
            "sampling.temperature=1.0",
            "sampling.top_p=1.0",
            "sampling.verify_timeout_s=0",
            f"algorithm.preset={args.preset}",
            f"optim.steps={args.steps}",
            f"optim.lr={args.lr}",
            "optim.grad_clip=1.0",
            "eval.every=0",
            f"run.out={out}",
            "run.every=0",
            f"run.seed={args.seed}",
            "run.progress=false",
            "run.tensorboard=false",
            "run.report=false",
            "run.threads=1",
        ],
    )
    t0 = time.perf_counter()
    train(cfg, model=model, tokenizer=tok, task=task)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    rows = [r for r in rows if "reward/mean" in r or "reward_mean" in r]
    n = args.prompts * args.group
    rewards = [r.get("reward/mean", r.get("reward_mean")) for r in rows]
    tokens = sum(r["length/mean"] * n for r in rows)
    phases = {
        k[5:]: sum(r.get(k, 0.0) for r in rows)
        for k in (
            "time/generate",
            "time/score",
            "time/logprobs",
            "time/backward",
            "time/optimizer",
            "time/diagnostics",
            "time/step",
        )
    }
    return {
        "wall_s": wall,
        "init_s": 0.0,
        "steps": len(rows),
        "completion_tokens": tokens,
        "train_rewards": rewards,
        "phase_s": phases,
    }


def run_trl(args: argparse.Namespace, model, tok, task, out: Path) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from grouprl import presets
    from grouprl.integrations.trl import trl_loss_settings

    loss = trl_loss_settings(presets.get(args.preset))
    if loss is None:
        raise SystemExit(f"preset {args.preset} has no TRL-native equivalent")
    examples = task.examples("train", args.steps * args.prompts, args.seed)
    data = Dataset.from_dict(
        {
            "prompt": [task.render(ex, tok) for ex in examples],
            "maze": [ex.prompt for ex in examples],
        }
    )

    def maze_reward(prompts, completions, maze, **kwargs):
        return [task.verify(c, m) for c, m in zip(completions, maze)]

    config = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.max_new,
        temperature=1.0,
        top_p=1.0,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        optim="adamw_torch",
        num_iterations=1,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **loss,
    )
    t0 = time.perf_counter()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=maze_reward,
        args=config,
        train_dataset=data,
        processing_class=tok,
    )
    init = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "reward" in h]
    n = args.prompts * args.group
    return {
        "wall_s": wall,
        "init_s": init,
        "steps": len(logs),
        "completion_tokens": sum(h["completions/mean_length"] * n for h in logs),
        "train_rewards": [h["reward"] for h in logs],
        "model": trainer.model,
    }


_PROFILE_POINTS = {
    "generate (HF generate / grouprl rollout)": ("generate",),
    "reward / verify": ("maze_reward", "score", "verify"),
    "policy forward (log-probs)": ("completion_logprobs", "_get_per_token_logps_and_entropies"),
    "loss": ("_compute_loss", "objective"),
    "backward": ("backward",),
    "optimizer step": ("step",),
}
"""Label -> function names whose cumulative time is reported [OURS: the stages both share]."""


def _top_functions(prof, wall: float) -> dict[str, Any]:
    """Cumulative seconds of the shared stages and the 12 costliest functions (cProfile)."""
    import pstats

    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    stages = {}
    for label, names in _PROFILE_POINTS.items():
        best = 0.0
        for (file, _, name), (_, _, _, ct, _) in stats.items():
            if name in names and ("torch/optim" in file or name != "step"):
                best = max(best, ct)
        stages[label] = best
    top = sorted(stats.items(), key=lambda kv: -kv[1][3])[:40]
    rows = [
        {"function": f"{Path(f).name}:{line}({name})", "cum_s": ct, "self_s": tt}
        for (f, line, name), (_, _, tt, ct, _) in top
        if "profile" not in f and not f.startswith("<") and not name.startswith("<")
    ][:12]
    return {"wall_s_profiled": wall, "stages_cum_s": stages, "top_cumulative": rows}


def worker(args: argparse.Namespace) -> None:
    """Child process: build, (eval before), train with one library, eval after; JSON to stdout."""
    import torch

    torch.set_num_threads(1)
    model, tok, task = build(args)
    before = evaluate(model, tok, task, args) if args.eval_before else None
    rss0 = _rss_mib()
    with tempfile.TemporaryDirectory() as tmp:
        fn = run_grouprl if args.worker == "grouprl" else run_trl
        if args.profile:
            import cProfile

            prof = cProfile.Profile()
            res = prof.runcall(fn, args, model, tok, task, Path(tmp))
            res["profile"] = _top_functions(prof, res["wall_s"])
        else:
            res = fn(args, model, tok, task, Path(tmp))
    trained = res.pop("model", model)
    peak = _rss_mib()
    after = evaluate(trained.eval(), tok, task, args)
    n = args.prompts * args.group
    k = max(1, len(res["train_rewards"]) // 4)
    out = {
        **res,
        "samples_per_s": res["steps"] * n / res["wall_s"],
        "tokens_per_s": res["completion_tokens"] / res["wall_s"],
        "peak_rss_mib": peak,
        "rss_before_train_mib": rss0,
        "train_reward_last": sum(res["train_rewards"][-k:]) / k,
        "eval": after,
        "eval_before": before,
    }
    print("@@RESULT@@" + json.dumps(out))


def _child(args: argparse.Namespace, which: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", which, *args.passthrough]
    if which == "grouprl":
        cmd.append("--eval-before")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("@@RESULT@@"):
            return json.loads(line[len("@@RESULT@@") :])
    raise SystemExit(f"{which} worker failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (P)")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--max-new", type=int, default=32, help="max completion tokens")
    ap.add_argument(
        "--lr", type=float, default=5e-5, help="AdamW lr (grouprl train's maze default)"
    )
    ap.add_argument("--preset", default="grpo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sft-steps", type=int, default=1400, help="SFT warm start (0 = none)")
    ap.add_argument("--eval-prompts", type=int, default=128)
    ap.add_argument("--eval-samples", type=int, default=8)
    ap.add_argument("--only", choices=("grouprl", "trl"), help="run one trainer only")
    ap.add_argument("--profile", action="store_true", help="cProfile each trainer (slower)")
    ap.add_argument(
        "--quick", action="store_true", help="3 steps of 4 x 4, no SFT, 16 eval prompts (smoke)"
    )
    ap.add_argument("--worker", choices=("grouprl", "trl"), help=argparse.SUPPRESS)
    ap.add_argument("--eval-before", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.prompts, args.group, args.max_new = 3, 4, 4, 16
        args.sft_steps, args.eval_prompts, args.eval_samples = 0, 16, 4
    args.passthrough = [
        f"--steps={args.steps}",
        f"--prompts={args.prompts}",
        f"--group={args.group}",
        f"--max-new={args.max_new}",
        f"--lr={args.lr}",
        f"--preset={args.preset}",
        f"--seed={args.seed}",
        f"--sft-steps={args.sft_steps}",
        f"--eval-prompts={args.eval_prompts}",
        f"--eval-samples={args.eval_samples}",
    ] + (["--profile"] if args.profile else [])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    import torch
    import trl

    import grouprl

    which = [args.only] if args.only else ["grouprl", "trl"]
    res = {w: _child(args, w) for w in which}
    out: dict[str, Any] = {
        "benchmark": "vs_trl",
        "setting": {
            "model": "tiny maze Llama (models.load('tiny', task=maze))",
            "sft_steps": args.sft_steps,
            "task": "maze 5x5",
            "preset": args.preset,
            "prompts_per_step": args.prompts,
            "group_size": args.group,
            "samples_per_step": args.prompts * args.group,
            "max_new_tokens": args.max_new,
            "steps": args.steps,
            "lr": args.lr,
            "threads": 1,
            "eval": f"{args.eval_prompts} held-out mazes x {args.eval_samples} samples, T=1",
        },
        "versions": {
            "grouprl": getattr(grouprl, "__version__", "?"),
            "trl": trl.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "load_average_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
        "results": {
            w: {k: v for k, v in r.items() if k != "train_rewards"} for w, r in res.items()
        },
        "train_rewards": {w: r["train_rewards"] for w, r in res.items()},
    }
    if len(res) == 2:
        g, t = res["grouprl"], res["trl"]
        se = math.hypot(g["eval"]["reward_se"], t["eval"]["reward_se"])
        out["ratios"] = {
            "samples_per_s": g["samples_per_s"] / t["samples_per_s"],
            "tokens_per_s": g["tokens_per_s"] / t["tokens_per_s"],
            "peak_rss": g["peak_rss_mib"] / t["peak_rss_mib"],
            "eval_reward_diff": g["eval"]["reward"] - t["eval"]["reward"],
            "eval_reward_diff_se": se,
        }
        out["targets_met"] = {
            "samples_per_s_ge_1.5x": out["ratios"]["samples_per_s"] >= 1.5,
            "eval_reward_not_worse": out["ratios"]["eval_reward_diff"] >= -2 * se,
        }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
