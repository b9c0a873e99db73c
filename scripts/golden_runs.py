#!/usr/bin/env python
"""Golden tiny runs: record every logged number of a few short runs, then check a change against them.

    python scripts/golden_runs.py record golden.json          # on the code before a change
    python scripts/golden_runs.py check golden.json           # after it: bit for bit, or a diff
    python scripts/golden_runs.py check golden.json --only grpo,agpo
    python scripts/golden_runs.py record bf16.json --set model.autocast=bfloat16

A refactor of the trainer must leave these runs bit-identical: each run below is
trained a few steps with a tiny random Llama on :class:`GoldenTask` at ``run.threads=1``, and
what is compared is every row of ``metrics.jsonl`` (``time/*`` left out), every row of
``rewards.jsonl`` and a SHA-256 of the final parameters (names, dtypes, shapes and bytes, in
``named_parameters`` order). The runs cover the trainer's paths: plain GRPO; DAPO (dynamic
sampling, soft overlong penalty, clip-higher, 16 minibatches); AVSPO (a virtual-sample
trigger with state); AGPO (the controller: probe, per-prompt τ and ε, drift, β, 4 epochs);
a MaxNorm preset with β > 0 (a frozen reference) and two minibatches; CISPO with
micro-batches; GRPO with the overlong *mask*; and a run with evaluation (pass@k at steps 0,
2 and 4). Every run starts from the same freshly built policy (seed 0).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from grouprl.tasks.base import Example, Task

MODEL = "tiny:d=16,layers=2,heads=2,ctx=32"

BASE = [
    f"model.name={MODEL}",
    "model.warm_start=false",
    "sampling.prompts_per_step=4",
    "sampling.group_size=4",
    "sampling.max_new_tokens=5",
    "sampling.verify_timeout_s=0",
    "optim.steps=3",
    "optim.lr=0.03",
    "eval.every=0",
    "run.threads=1",
    "run.every=0",
    "run.save_final=false",
    "run.progress=false",
    "run.tensorboard=false",
    "run.report=false",
]
"""Every golden run's settings before its own."""

RUNS: dict[str, list[str]] = {
    "grpo": [],
    "dapo": ["algorithm.preset=dapo"],
    "avspo": ["algorithm.preset=avspo"],
    "agpo": ["algorithm.preset=agpo"],
    "maxnorm": ["algorithm.preset=maxnorm_rloo", "algorithm.beta=0.05", "optim.minibatches=2"],
    "cispo": ["algorithm.preset=cispo", "optim.micro_batch_size=4", "optim.minibatches=1"],
    "overlong_mask": ["algorithm.overlong=mask", "sampling.max_new_tokens=4"],
    "eval": ["optim.steps=4", "eval.every=2", "eval.prompts=4", "eval.samples=4", "eval.ks=[1,4]"],
}
"""Name -> the run's overrides (``--set`` syntax)."""


class GoldenTask(Task):
    """Prompts of 1-3 words (so prompts are left-padded); reward 1 when the completion starts
    with ``a``, 0.5 with ``b``, else 0 (groups of a random tiny model are mostly mixed)."""

    name = "golden"
    reward_range = (0.0, 1.0)

    def __init__(self) -> None:
        self.config: dict[str, Any] = {}

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        return [
            Example(f"{split}/{seed}/{i}", " ".join(["q"] * (1 + i % 3)), "a") for i in range(n)
        ]

    def verify(self, completion: str, reference: Any) -> float:
        first = (completion.split() or [""])[0]
        return {"a": 1.0, "b": 0.5}.get(first, 0.0)

    def vocabulary(self) -> list[str]:
        return ["a", "b", "c", "d", "q"]

    def render(self, example: Example, tokenizer: Any) -> str:
        return f"<bos> {example.prompt} <sep>"


def param_hash(model: Any) -> str:
    """SHA-256 over every parameter's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def one_run(name: str, extra: list[str], policy: tuple[Any, Any], task: Any) -> dict[str, Any]:
    from grouprl.train.config import load_config
    from grouprl.train.loop import train
    from grouprl.train.sinks import read_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / name
        cfg = load_config(None, [*BASE, *RUNS[name], *extra, f"run.out={out}"], validate=False)
        model = copy.deepcopy(policy[0])
        train(cfg, model=model, tokenizer=policy[1], task=task)
        metrics = [
            {k: v for k, v in row.items() if not k.startswith("time/")}
            for row in read_jsonl(out / "metrics.jsonl")
        ]
        rewards = read_jsonl(out / "rewards.jsonl")
    return {"metrics": metrics, "rewards": rewards, "params": param_hash(model)}


def record(names: list[str], extra: list[str]) -> dict[str, Any]:
    from grouprl import models

    task = GoldenTask()
    policy = models.load(MODEL, task=task, seed=0)
    out = {}
    for name in names:
        out[name] = one_run(name, extra, policy, task)
        print(f"{name}: {len(out[name]['metrics'])} rows, params {out[name]['params'][:12]}")
    return out


def _diff_rows(kind: str, old: list[dict], new: list[dict]) -> list[str]:
    lines = []
    if len(old) != len(new):
        lines.append(f"  {kind}: {len(old)} rows recorded, {len(new)} now")
    for i, (a, b) in enumerate(zip(old, new)):
        for key in sorted(set(a) | set(b)):
            if a.get(key, "<absent>") != b.get(key, "<absent>"):
                lines.append(
                    f"  {kind}[{i}] {key}: {a.get(key, '<absent>')} -> {b.get(key, '<absent>')}"
                )
    return lines


def compare(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[str]]:
    """Per run, the differences (empty: bit-identical)."""
    out = {}
    for name, now in new.items():
        was = old.get(name)
        if was is None:
            out[name] = ["  not in the recorded file"]
            continue
        lines = _diff_rows("metrics", was["metrics"], now["metrics"])
        lines += _diff_rows("rewards", was["rewards"], now["rewards"])
        if was["params"] != now["params"]:
            lines.append(f"  params: {was['params'][:16]} -> {now['params'][:16]}")
        out[name] = lines
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("record", "check"))
    parser.add_argument("file", type=Path)
    parser.add_argument("--only", default="", help="comma-separated run names (default: all)")
    parser.add_argument("--set", action="append", default=[], help="an extra override for all")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(RUNS)
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        parser.error(f"unknown run(s) {unknown}; valid: {', '.join(RUNS)}")
    result = record(names, args.set)
    if args.mode == "record":
        args.file.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(result)} runs in {args.file}")
        return 0
    diffs = compare(json.loads(args.file.read_text()), result)
    for name, lines in diffs.items():
        print(f"{name}: {'bit-identical' if not lines else f'{len(lines)} difference(s)'}")
        for line in lines[:40]:
            print(line)
    return 1 if any(diffs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
