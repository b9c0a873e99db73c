"""``grouprl sweep FILE``: run arms × seeds as local ``grouprl train`` processes, N at a time,
one run folder each, from the sweep file that ``grouprl compare --sweep FILE`` then reads.

Sweep file (YAML or JSON; docs/compare.md)::

    arms:
      grpo: {runs: runs/grpo/seed{seed}, overrides: [algorithm.preset=grpo]}
      dapo: {runs: runs/dapo/seed{seed}, overrides: [algorithm.preset=dapo]}
    seeds: [0, 1, 2]
    common: [optim.steps=200, eval.every=50]     # --set for every run

Each run is ``python -m grouprl train --out <runs> --set run.seed=<seed> --set
run.threads=<threads> --set <common...> --set <overrides...>``, under ``nice``, its output in
``<runs>.log``. A run folder that already holds ``metrics.jsonl`` is skipped (delete it to run
again), so a sweep can be continued or widened to more seeds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Job:
    """One run of a sweep: its arm, seed, run folder and command line."""

    arm: str
    seed: int
    out: Path
    argv: tuple[str, ...]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="the sweep file (arms × seeds, docs/compare.md)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    parser.add_argument(
        "--threads", type=int, default=1, help="run.threads of every run (default 1)"
    )
    parser.add_argument("--nice", type=int, default=10, help="niceness of the runs (default 10)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")


class SweepError(ValueError):
    """A sweep file that cannot be run; the message says what and how to fix it."""


def plan(data: Mapping, threads: int = 1) -> list[Job]:
    """The jobs of a parsed sweep file, seed-major (every arm of seed 0 first)."""
    arms, seeds = data.get("arms"), data.get("seeds")
    if not isinstance(arms, Mapping) or not arms:
        raise SweepError("a sweep file needs an 'arms' mapping: arm -> {runs, overrides}")
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise SweepError("a sweep file to run needs 'seeds': a list of integers, e.g. [0, 1, 2]")
    common = list(data.get("common") or [])
    jobs = []
    for seed in seeds:
        for arm, spec in arms.items():
            if not isinstance(spec, Mapping) or not isinstance(spec.get("runs"), str):
                raise SweepError(
                    f"arm {arm!r}: to run it, give a mapping with 'runs' (a folder pattern with "
                    "{seed}) and 'overrides' (a list of key=value)"
                )
            pattern = spec["runs"]
            if "{seed}" not in pattern:
                raise SweepError(
                    f"arm {arm!r}: runs {pattern!r} has no {{seed}}: seeds would share it"
                )
            out = Path(pattern.replace("{seed}", str(seed)))
            sets = [
                f"run.seed={seed}",
                f"run.threads={threads}",
                *common,
                *spec.get("overrides", []),
            ]
            bad = [s for s in sets if "=" not in str(s)]
            if bad:
                raise SweepError(f"arm {arm!r}: overrides {bad} are not key=value")
            argv = [sys.executable, "-m", "grouprl", "train", "--out", str(out)]
            for s in sets:
                argv += ["--set", str(s)]
            jobs.append(Job(str(arm), seed, out, tuple(argv)))
    return jobs


def launch(jobs: Sequence[Job], n: int = 1, niceness: int = 10, say=print) -> list[Job]:
    """Run the jobs, at most ``n`` at a time, each with OMP_NUM_THREADS=1 under ``niceness``;
    skip those whose folder holds metrics.jsonl. Returns the jobs that failed."""
    todo = []
    for j in jobs:
        if (j.out / "metrics.jsonl").is_file():
            say(f"skip {j.arm} seed {j.seed}: {j.out} holds a run (delete it to run again)")
        else:
            todo.append(j)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    running: list[tuple[Job, subprocess.Popen, object]] = []
    failed: list[Job] = []

    def reap(block: bool) -> None:
        while running and (block or any(p.poll() is not None for _, p, _ in running)):
            for item in list(running):
                j, p, log = item
                if p.poll() is not None:
                    log.close()
                    running.remove(item)
                    ok = p.returncode == 0
                    say(f"{'done' if ok else 'FAILED'} {j.arm} seed {j.seed} (exit {p.returncode})")
                    if not ok:
                        failed.append(j)
            if block and running:
                time.sleep(0.2)
            if not block:
                break

    for j in todo:
        while len(running) >= max(1, n):
            reap(block=False)
            time.sleep(0.2)
        j.out.parent.mkdir(parents=True, exist_ok=True)
        log = open(f"{j.out}.log", "w", encoding="utf-8")  # noqa: SIM115 (closed in reap)
        argv = ["nice", "-n", str(niceness), *j.argv] if niceness else list(j.argv)
        say(f"start {j.arm} seed {j.seed} -> {j.out}")
        running.append(
            (j, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env), log)
        )
    reap(block=True)
    return failed


def run(args: argparse.Namespace) -> int:
    import json

    import yaml

    try:
        text = args.file.read_text(encoding="utf-8")
        data = json.loads(text) if args.file.suffix == ".json" else yaml.safe_load(text)
        jobs = plan(data if isinstance(data, Mapping) else {}, threads=args.threads)
    except (OSError, SweepError, ValueError, yaml.YAMLError) as e:
        print(f"error: {args.file}: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for j in jobs:
            print(" ".join(j.argv))
        return 0
    failed = launch(jobs, args.jobs, args.nice)
    if failed:
        names = ", ".join(f"{j.arm} seed {j.seed} ({j.out}.log)" for j in failed)
        print(f"error: {len(failed)} run(s) failed: {names}", file=sys.stderr)
        return 1
    print(f"all runs done; compare them with: grouprl compare --sweep {args.file}")
    return 0
