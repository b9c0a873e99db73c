"""bf16 rollouts with fp32 master weights and the rollout correction, against fp32 rollouts.

    python benchmarks/bf16_rollouts.py                        # SmolLM2, 3 steps per setting
    python benchmarks/bf16_rollouts.py --model tiny --steps 5 # the default maze's model
    python benchmarks/bf16_rollouts.py --settings fp32 bf16_token_tis

The set-up GPU stacks use for speed: the rollout engine samples in bf16
while the trainer keeps fp32 weights, gradients and AdamW state; the trainer recomputes the
behaviour log-probs in fp32 (one forward without gradient, verl's decoupled mode) and corrects
the mismatch between the two (``algorithm.rollout_correction``). Here the engine is
``model.rollout_precision=bfloat16``: generation under ``torch.autocast(cpu, bfloat16)`` with
the fp32 weights (autocast casts each weight once per generate call and keeps the copy).

Each setting (:data:`SETTINGS`) runs grouprl's loop in its own process on the vs_trl setting
of the model (SmolLM2: basic_arithmetic with the chat template, 8 prompts × 8, 64 new tokens,
micro-batch 16, lr 2e-6; tiny: the default maze run), one thread, same seed. Reported per
setting: the CPU seconds of the training loop in the child (``time.process_time`` around
``train``: a shared machine's wall clock counts other processes; ``process_cpu_s``, the whole
child with its imports and model load, beside it), samples per CPU second and its ratio to
``fp32``, the loop's mean
per-step times (``time/generate``, ``time/logprobs`` — the fp32 recomputation included —,
``time/step``), ``reward/mean`` at every step, and the mean of every ``mismatch/*`` metric
(k1 / k3 KL, χ², ESS, |Δ logp|, ...) over the steps. Prints JSON; the load average before and
after each child is in it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SETTINGS: dict[str, tuple[str, str]] = {
    "fp32": ("same", "none"),
    "bf16_none": ("bfloat16", "none"),
    "bf16_token_tis": ("bfloat16", "token_tis"),
    "bf16_icepop": ("bfloat16", "icepop"),
}
"""Setting name -> (``model.rollout_precision``, ``algorithm.rollout_correction``)."""

MODELS: dict[str, list[str]] = {
    "smollm2": [
        "model.name=smollm2", "model.warm_start=false", "task.name=basic_arithmetic",
        "sampling.prompts_per_step=8", "sampling.group_size=8", "sampling.max_new_tokens=64",
        "optim.lr=2e-6", "optim.micro_batch_size=16", "optim.logprob_chunk=1024",
        "sampling.verify_timeout_s=0",
    ],
    "tiny": ["model.name=tiny", "model.warm_start=false", "task.name=maze"],
}  # fmt: skip
"""The model's settings (SmolLM2: benchmarks/vs_trl.py's; tiny: the default maze step)."""


def _child(model: str, setting: str, steps: int) -> dict[str, Any]:
    from grouprl.train.config import load_config
    from grouprl.train.loop import train
    from grouprl.train.sinks import read_jsonl

    precision, corr = SETTINGS[setting]
    with tempfile.TemporaryDirectory() as out:
        overrides = [
            *MODELS[model],
            "model.dtype=float32",
            f"model.rollout_precision={precision}",
            f"algorithm.rollout_correction={corr}",
            f"optim.steps={steps}",
            "eval.every=0",
            "run.every=0",
            "run.progress=false",
            "run.tensorboard=false",
            "run.report=false",
            "run.save_final=false",
            "run.threads=1",
            "run.seed=0",
            f"run.out={out}",
        ]
        cfg = load_config(None, overrides)
        c0 = time.process_time()
        train(cfg)
        train_cpu = time.process_time() - c0
        rows = read_jsonl(Path(out) / "metrics.jsonl")
    samples = cfg.sampling.prompts_per_step * cfg.sampling.group_size * len(rows)
    times = {
        k: sum(r.get(f"time/{k}", 0.0) for r in rows) / len(rows)
        for k in ("step", "generate", "logprobs", "correction")
    }
    keys = sorted({k for r in rows for k in r if k.startswith("mismatch/")})
    mismatch = {k: sum(r[k] for r in rows if k in r) / sum(k in r for r in rows) for k in keys}
    return {
        "setting": setting,
        "rollout_precision": precision,
        "rollout_correction": corr,
        "steps": len(rows),
        "samples": samples,
        "train_cpu_s": round(train_cpu, 2),
        "samples_per_cpu_s": round(samples / train_cpu, 4),
        "seconds_per_step": {k: round(v, 3) for k, v in times.items()},
        "reward_mean": [round(r.get("reward/mean", float("nan")), 4) for r in rows],
        "mismatch": mismatch,
    }


def run(model: str, settings: list[str], steps: int) -> list[dict[str, Any]]:
    """Each setting in a subprocess, one after the other; its CPU seconds from ``resource``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    out = []
    for setting in settings:
        load0 = os.getloadavg()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        cmd = [sys.executable, __file__, "--model", model, "--steps", str(steps),
               "--child", setting]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            out.append({"setting": setting, "error": proc.stderr.strip().splitlines()[-5:]})
            continue
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        res["process_cpu_s"] = round(cpu, 2)  # the loading of the model and imports included
        res["load_average"] = [list(load0), list(os.getloadavg())]
        out.append(res)
    return out


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Samples per CPU second and per-step generation time of each setting against ``fp32``."""
    base = next((r for r in results if r.get("setting") == "fp32" and "train_cpu_s" in r), None)
    if base is None:
        return {}
    out = {}
    for r in results:
        if "train_cpu_s" not in r or r is base:
            continue
        out[r["setting"]] = {
            "samples_per_cpu_s_vs_fp32": round(
                r["samples_per_cpu_s"] / base["samples_per_cpu_s"], 3
            ),
            "generate_s_vs_fp32": round(
                r["seconds_per_step"]["generate"] / base["seconds_per_step"]["generate"], 3
            ),
            "mismatch_kl_k3": r["mismatch"].get("mismatch/kl_k3"),
            "final_reward_minus_fp32": round(r["reward_mean"][-1] - base["reward_mean"][-1], 4),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(MODELS), default="smollm2")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--settings", nargs="+", choices=list(SETTINGS),
                   default=["fp32", "bf16_none", "bf16_token_tis"])  # fmt: skip
    p.add_argument("--child", choices=list(SETTINGS), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(_child(a.model, a.child, a.steps)))
        return 0
    results = run(a.model, a.settings, a.steps)
    print(json.dumps({
        "benchmark": "bf16_rollouts",
        "model": a.model,
        "steps": a.steps,
        "threads": 1,
        "clock": "cpu (process_time of the training loop in each child)",
        "results": results,
        "summary": summary(results),
        "cpus": os.cpu_count(),
    }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
