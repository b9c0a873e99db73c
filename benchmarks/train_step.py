"""Where a training step's time goes: generate, score, log-probs, backward, optimizer, diagnostics.

    python benchmarks/train_step.py                       # tiny maze model and SmolLM2
    python benchmarks/train_step.py --models tiny --steps 10 --threads 1 0

Each model runs in its own subprocess (so peak memory is that model's), through the real
loop (``grouprl.train.loop.train``) with sinks reduced to metrics.jsonl, for ``--warmup``
+ ``--steps`` steps; the per-stage times the loop records (``time/*``) are averaged over
the measured steps. Printed as JSON:

- ``seconds``: mean per stage; ``step`` is the whole step (collect → metrics);
- ``ratio = step / (generate + logprobs + backward)``: the loop's overhead over the work
  that any trainer must do (target ≤ 1.15); ``logprobs`` is the training forward pass;
- ``diagnostics_frac = diagnostics / step`` (target ≤ 0.01);
- ``peak_rss_mb``: the subprocess's peak resident memory (``ru_maxrss``).

``--threads`` runs every model once per thread count (default ``1 0``: one thread, and
``run.threads=0``, torch's own default, which is ``torch_default_threads`` in the JSON), so
the default of ``run.threads`` can be judged on the machine at hand; ``load_average`` is
recorded before and after each child. Benchmark on an idle machine: another busy process
slows torch 4–10× (docs/models.md).
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

import loadguard  # benchmarks/loadguard.py: headline files only from idle runs

SETTINGS: dict[str, list[str]] = {
    # the maze miniature's step: 32 mazes x 8, untrained tiny model (longest completions)
    "tiny": ["model.name=tiny", "model.warm_start=false", "task.name=maze"],
    # SmolLM2-135M on one-digit arithmetic, a small step that fits 2 CPU cores
    "smollm2": [
        "model.name=smollm2",
        "task.name=basic_arithmetic",
        "sampling.prompts_per_step=4",
        "sampling.group_size=4",
        "sampling.max_new_tokens=32",
        "optim.micro_batch_size=8",
        "algorithm.preset=f_grpo",
    ],
}
"""Model name -> config overrides of its benchmark run."""

STAGES = ("generate", "score", "logprobs", "backward", "optimizer", "diagnostics", "step")


def _child(model: str, steps: int, warmup: int, threads: int) -> dict:
    import torch

    from grouprl.train.config import load_config
    from grouprl.train.loop import train
    from grouprl.train.sinks import read_jsonl

    with tempfile.TemporaryDirectory() as out:
        overrides = [
            *SETTINGS[model],
            f"optim.steps={warmup + steps}",
            "eval.every=0",
            "run.every=0",
            "run.progress=false",
            "run.tensorboard=false",
            "run.report=false",
            f"run.threads={threads}",
            f"run.out={out}",
        ]
        cfg = load_config(None, overrides)
        t0 = time.perf_counter()
        train(cfg)
        wall = time.perf_counter() - t0
        rows = read_jsonl(Path(out) / "metrics.jsonl")[warmup:]
    mean = {s: sum(r[f"time/{s}"] for r in rows) / len(rows) for s in STAGES}
    work = mean["generate"] + mean["logprobs"] + mean["backward"]
    return {
        "model": model,
        "steps_measured": len(rows),
        "sequences_per_step": cfg.batch_size,
        "mean_completion_tokens": sum(r["length/mean"] for r in rows) / len(rows),
        "seconds": {k: round(v, 5) for k, v in mean.items()},
        "ratio": round(mean["step"] / work, 4),
        "diagnostics_frac": round(mean["diagnostics"] / mean["step"], 6),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "wall_seconds_incl_load": round(wall, 2),
        "threads": threads,
        "threads_used": torch.get_num_threads(),
        "targets": {"ratio": 1.15, "diagnostics_frac": 0.01},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--threads", type=int, nargs="+", default=[1, 0], help="run.threads values (0 = torch's)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    loadguard.add_arguments(parser)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.steps, args.warmup, args.threads[0])))
        return
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    load_before = loadguard.load_average()
    results = []
    for model in args.models:
        for threads in args.threads:
            cmd = [sys.executable, __file__, "--child", model, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--threads", str(threads)]  # fmt: skip
            load = os.getloadavg()[0]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = proc.stderr.strip().splitlines()[-3:]
                results.append({"model": model, "threads": threads, "error": tail})
                continue
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            res["load_average"] = [load, os.getloadavg()[0]]
            results.append(res)
    import torch

    out = {
        "benchmark": "train_step",
        "torch_default_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "results": results,
    }
    loadguard.write(out, load_before, out=args.out, allow_loaded=args.allow_loaded)


if __name__ == "__main__":
    main()
