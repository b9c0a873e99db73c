"""Truncated sampling on the maze miniature, paired seeds: full-softmax vs truncated log-probs.

Both arms are the default run (maze, grpo, 16 x 16) sampling at ``--top-p`` (0.9) and
``--top-k`` (20); only ``sampling.logprob_support`` differs: ``full`` reads every log-prob on
the full softmax (the gradient of the untruncated policy), ``truncated`` on the distribution
renormalised over the tokens the sampler kept (the gradient of the policy that was sampled).
The held-out evaluation samples with the same top-p / top-k in both arms. Per run: the
sampler's mean kept mass and mean log kept mass (the ratio bias a full-softmax reading of
renormalised behaviour log-probs would carry), the on-policy ratio of the update
(``policy/ratio_*``: 1 in both arms up to rounding), the mean training reward of the last 20
steps, pass@1 / 8 / 16 at the end and the run's CPU seconds. Usage:

    nice -n 10 python scripts/truncated_maze.py OUT_DIR [--steps 150] [--seeds 0 1 2]

prints one JSON line per run and a Markdown table: per-arm means, and truncated − full
paired by seed (mean ± standard error over the seeds).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from curriculum_maze import run_timed

ARMS = ("full", "truncated")
KS = (1, 8, 16)


def run(out: Path, arm: str, seed: int, steps: int, top_p: float, top_k: int) -> dict:
    folder = out / f"{arm}_s{seed}"
    argv = [sys.executable, "-m", "grouprl", "train", "--out", str(folder), "--overwrite",
            "--steps", str(steps), "--seed", str(seed), "--no-progress",
            "--set", f"sampling.logprob_support={arm}", "--set", f"sampling.top_p={top_p}",
            "--set", f"sampling.top_k={top_k}",
            "--set", f"eval.every={steps}", "--set", "run.threads=1",
            "--set", "run.save_final=false", "--set", "run.report=false"]  # fmt: skip
    cpu = run_timed(argv)
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x]
    train = [r for r in rows if "acr/sampled_rate" in r]
    evals = [r for r in rows if "eval/pass@1" in r]

    def mean(key: str, rs: list[dict]) -> float:
        return sum(r[key] for r in rs) / len(rs)

    out_row = {
        "arm": arm,
        "seed": seed,
        "steps": len(train),
        "kept_mass": mean("sampling/kept_mass_mean", train),
        "log_kept_mass": mean("sampling/log_kept_mass_mean", train),
        "kept_tokens": mean("sampling/kept_tokens_mean", train) if arm == "truncated" else None,
        "ratio_dev_max": max(
            max(abs(r["policy/ratio_max"] - 1), abs(r["policy/ratio_min"] - 1)) for r in train
        ),
        "reward_last20": mean("reward/mean", train[-20:]),
        "cpu_s": cpu,
    }
    for k in KS:
        out_row[f"pass{k}_start"] = evals[0][f"eval/pass@{k}"]
        out_row[f"pass{k}_end"] = evals[-1][f"eval/pass@{k}"]
    return out_row


def _paired(values: list[float]) -> str:
    n = len(values)
    m = sum(values) / n
    se = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1) / n) if n > 1 else float("nan")
    return f"{m:+.3f} ± {se:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=20)
    args = ap.parse_args()
    results = []
    for seed in args.seeds:
        for arm in ARMS:
            r = run(args.out, arm, seed, args.steps, args.top_p, args.top_k)
            print(json.dumps(r), flush=True)
            results.append(r)
    cols = ["kept_mass", "log_kept_mass", "ratio_dev_max", "reward_last20"]
    cols += [f"pass{k}_end" for k in KS] + ["cpu_s"]
    print("| arm | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for arm in ARMS:
        rs = [r for r in results if r["arm"] == arm]
        cells = [f"{sum(r[c] for r in rs) / len(rs):.4g}" for c in cols]
        print(f"| {arm} | " + " | ".join(cells) + " |")
    by_seed = {(r["arm"], r["seed"]): r for r in results}
    print("\n| quantity | truncated − full, paired by seed |\n|---|---|")
    for c in ("reward_last20", *(f"pass{k}_end" for k in KS)):
        d = [by_seed["truncated", s][c] - by_seed["full", s][c] for s in args.seeds]
        print(f"| {c} | {_paired(d)} |")


if __name__ == "__main__":
    main()
