"""Prompt samplers on the maze miniature, paired seeds: uniform vs sigma vs curriculum.

Every arm is the default run (maze, grpo, 16 x 16) on the same prompt pool (``--pool``,
default 128: each prompt is drawn about every 8 steps, so the curriculum sees revisits), only
``algorithm.sampler`` differs. Per run: informative (non-collapsed) groups per generated
token, the pass@1 of the final evaluation and its gain over the step-0 one, and the run's
CPU seconds (user + sys of the training process). Usage:

    nice -n 10 python scripts/curriculum_maze.py OUT_DIR [--steps 60] [--seeds 0 1 2] [--pool 128]

prints one JSON line per run and a Markdown table of the per-arm means.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ARMS = ("uniform", "sigma", "curriculum")


def run_timed(argv: list[str]) -> float:
    """Run ``argv`` to completion (its stdout dropped); the CPU seconds (user + sys) it took."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env={**os.environ})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run(out: Path, arm: str, seed: int, steps: int, pool: int) -> dict:
    folder = out / f"{arm}_s{seed}"
    argv = [sys.executable, "-m", "grouprl", "train", "--out", str(folder), "--overwrite",
            "--steps", str(steps), "--seed", str(seed), "--no-progress",
            "--set", f"algorithm.sampler={arm}", "--set", f"sampling.pool_size={pool}",
            "--set", f"eval.every={steps}", "--set", "run.threads=1",
            "--set", "run.save_final=false", "--set", "run.report=false"]  # fmt: skip
    cpu = run_timed(argv)
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x]
    train = [r for r in rows if "acr/sampled_rate" in r]
    evals = [r for r in rows if "eval/pass@1" in r]
    groups = sum((1 - r["acr/sampled_rate"]) * r.get("acr/groups", 16) for r in train)
    g = 16  # the default group size
    tokens = sum(r["length/mean"] * r.get("acr/groups", 16) * g for r in train)
    return {
        "arm": arm,
        "seed": seed,
        "steps": len(train),
        "informative_groups": groups,
        "generated_tokens": tokens,
        "informative_per_ktok": 1000 * groups / tokens,
        "pass1_start": evals[0]["eval/pass@1"],
        "pass1_end": evals[-1]["eval/pass@1"],
        "cpu_s": cpu,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--pool", type=int, default=128, help="prompts in the pool (all arms)")
    args = ap.parse_args()
    results = []
    for seed in args.seeds:
        for arm in ARMS:
            r = run(args.out, arm, seed, args.steps, args.pool)
            print(json.dumps(r), flush=True)
            results.append(r)
    print("| sampler | informative groups / 1k tokens | pass@1 end | Δ pass@1 | CPU s | "
          "Δ pass@1 per CPU h |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for arm in ARMS:
        rs = [r for r in results if r["arm"] == arm]
        n = len(rs)
        ipk = sum(r["informative_per_ktok"] for r in rs) / n
        end = sum(r["pass1_end"] for r in rs) / n
        gain = sum(r["pass1_end"] - r["pass1_start"] for r in rs) / n
        cpu = sum(r["cpu_s"] for r in rs) / n
        print(
            f"| {arm} | {ipk:.3f} | {end:.3f} | {gain:+.3f} | {cpu:.0f} | "
            f"{3600 * gain / cpu:+.3f} |"
        )


if __name__ == "__main__":
    main()
