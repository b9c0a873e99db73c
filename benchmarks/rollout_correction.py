"""What rollout correction and its mismatch metrics cost: alone, and as a share of a step.

    python benchmarks/rollout_correction.py                  # the default maze step, 5 steps
    python benchmarks/rollout_correction.py --steps 2 --repeat 5

Two measurements, printed as JSON:

- ``functions``: each correction of ``grouprl.losses.CORRECTIONS`` (default parameters; the
  rejections and ``opsm`` with a threshold), a chain, and ``diagnostics.mismatch_metrics``, on
  one batch of the default run's shape (``sampling.prompts_per_step × group_size`` sequences ×
  ``max_new_tokens``), median seconds over ``--repeat`` calls;
- ``step``: the real loop (``grouprl.train.loop``) on the default maze step (the tiny model,
  32 mazes × 8, as ``benchmarks/train_step.py``), fp32 training with bf16 rollouts
  (``model.rollout_precision=bfloat16``) and each ``--specs`` correction, ``--steps`` steps
  after ``--warmup``, in a subprocess per setting; ``correction_frac = time/correction /
  time/step`` (the correction and its metrics; target <= 0.05). The trainer's fp32
  recomputation of the behaviour log-probs (one forward without gradient, what verl's
  decoupled mode and TRL's vLLM correction also pay) is reported apart: ``recompute_frac`` =
  the extra ``time/logprobs`` over a matched-precision run of the same seed, / ``time/step``.

Load average before and after each child is recorded; on a busy machine the step times
stretch (docs/models.md), the fractions less so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT = ["model.name=tiny", "model.warm_start=false", "task.name=maze"]
"""The default maze step of benchmarks/train_step.py (untrained tiny model: longest outputs)."""

SPECS = ("none", "icepop", "seq_mis", "token_tis+rejection:stat=k3,level=seq_mean,threshold=0.01")
"""Corrections timed inside the step (``none``: the mismatch metrics alone)."""


def _functions(repeat: int) -> dict:
    import torch

    from grouprl import diagnostics
    from grouprl.losses import correction
    from grouprl.train.config import RunConfig

    torch.set_num_threads(1)
    s = RunConfig().sampling
    n, t = s.prompts_per_step * s.group_size, s.max_new_tokens
    g = torch.Generator().manual_seed(0)
    train = -torch.rand(n, t, generator=g) * 3
    rollout = train + 1e-2 * torch.randn(n, t, generator=g)
    mask = (torch.arange(t)[None, :] < torch.randint(1, t + 1, (n,), generator=g)[:, None]).float()
    adv = torch.randn(n, generator=g)
    specs = {name: name for name in correction.CORRECTIONS}
    specs["rejection"] = "rejection:stat=k3,level=seq_max,threshold=0.01"
    specs["opsm"] = "opsm:threshold=0.5"
    specs["chain: seq_tis+geo_rs"] = "seq_tis+geo_rs"

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from advantages import timeit  # benchmarks/advantages.py: median after a warm-up

    out = {
        name: timeit(lambda s=spec: correction.compute(s, train, rollout, mask, adv=adv), repeat)
        for name, spec in specs.items()
    }
    out["mismatch_metrics"] = timeit(
        lambda: diagnostics.mismatch_metrics(train, rollout, mask), repeat
    )
    return {"batch": [n, t], "seconds": {k: round(v, 6) for k, v in out.items()}}


def _child(spec: str, precision: str, steps: int, warmup: int) -> dict:
    import torch

    from grouprl.train.config import load_config
    from grouprl.train.loop import train
    from grouprl.train.sinks import read_jsonl

    with tempfile.TemporaryDirectory() as out:
        overrides = [
            *DEFAULT,
            f"model.rollout_precision={precision}",
            f"algorithm.rollout_correction={spec}",
            f"optim.steps={warmup + steps}",
            "eval.every=0",
            "run.every=0",
            "run.progress=false",
            "run.tensorboard=false",
            "run.report=false",
            "run.threads=1",
            f"run.out={out}",
        ]
        train(load_config(None, overrides))
        rows = read_jsonl(Path(out) / "metrics.jsonl")[warmup:]
    mean = {
        k: sum(r.get(f"time/{k}", 0.0) for r in rows) / len(rows)
        for k in ("step", "correction", "logprobs", "generate")
    }
    return {"spec": spec, "precision": precision, "seconds": mean,
            "threads": torch.get_num_threads(), "steps": len(rows)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeat", type=int, default=20, help="calls per function timing")
    p.add_argument("--specs", nargs="+", default=list(SPECS))
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(_child(a.child[0], a.child[1], a.steps, a.warmup)))
        return
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    steps = []
    for spec, precision in [("none", "same"), *((s, "bfloat16") for s in a.specs)]:
        load = os.getloadavg()[0]
        cmd = [sys.executable, __file__, "--child", spec, precision, "--steps", str(a.steps),
               "--warmup", str(a.warmup)]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            steps.append({"spec": spec, "precision": precision,
                          "error": proc.stderr.strip().splitlines()[-3:]})  # fmt: skip
            continue
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        res["load_average"] = [load, os.getloadavg()[0]]
        steps.append(res)
    matched = next((r for r in steps if r.get("precision") == "same" and "seconds" in r), None)
    for r in steps:
        if r.get("precision") == "bfloat16" and "seconds" in r:
            sec = r["seconds"]
            r["correction_frac"] = round(sec["correction"] / sec["step"], 5)
            if matched is not None:
                extra = sec["logprobs"] - matched["seconds"]["logprobs"]
                r["recompute_frac"] = round(extra / sec["step"], 5)
    fracs = [r["correction_frac"] for r in steps if "correction_frac" in r]
    out = {
        "benchmark": "rollout_correction",
        "functions": _functions(a.repeat),
        "step": steps,
        "target": {"correction_frac": 0.05},
        "target_met": bool(fracs) and max(fracs) <= 0.05,
        "cpus": os.cpu_count(),
        "load_average_end": os.getloadavg(),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
