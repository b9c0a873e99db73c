"""The default run's warm start at each thread count: CPU and wall seconds per 100 steps; JSON.

    python benchmarks/sft_threads.py [--threads 1 2] [--steps 100] [--repeat 2]

Each count runs in a fresh child process that sets ``OMP_NUM_THREADS`` and
``OMP_WAIT_POLICY=PASSIVE`` before torch loads (as ``grouprl train`` does), builds the tiny
maze model of the default run (4×4 mazes, 1–5 moves) and trains ``--steps`` warm-start steps
with the cache off. ``cpu_s`` is the child's CPU time over all its threads (``time.process_time``:
what the machine's other processes take does not count, as it does in ``wall_s``); the runs
alternate between the counts so that a change of the machine's load hits every count alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, os, sys, time
n, steps = int(sys.argv[1]), int(sys.argv[2])
os.environ["OMP_NUM_THREADS"] = str(n)
os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
os.environ["GROUPRL_NO_SFT_CACHE"] = "1"
import torch
torch.set_num_threads(n)
from grouprl import models, tasks
from grouprl.train import sft
task = tasks.get("maze", size=4, min_path=1, max_path=5)
model, tok = models.load("tiny", task=task)
c0, w0 = time.process_time(), time.perf_counter()
sft.warm_start(model, tok, task, steps=steps, progress=False, say=lambda *a, **k: None)
print(json.dumps({"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - w0}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    runs = []
    for _ in range(args.repeat):
        for n in args.threads:
            load0 = os.getloadavg()[0]
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, str(n), str(args.steps)],
                capture_output=True,
                text=True,
            )
            if proc.returncode:
                raise SystemExit(f"child at {n} threads failed:\n{proc.stderr[-3000:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            runs.append({"threads": n, **row, "load_average": [load0, os.getloadavg()[0]]})
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"benchmark": "sft_threads", "steps": args.steps, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
