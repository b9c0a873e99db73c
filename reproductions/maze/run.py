"""The F-GRPO maze in miniature: seven presets at equal rollout budget, pass@1 and pass@k ≤ 64.

Every run starts from the same policy — the tiny maze Llama (205k parameters) after the
cached SFT warm start that ``grouprl train`` uses (1400 steps, seed 0) — and trains with
grouprl's trainer (``grouprl.train.loop.setup`` + ``train_step``, the loop ``grouprl train``
runs) on 5×5 perfect mazes until it has *generated* the same number of rollouts (DAPO-style
presets spend part of theirs on groups that dynamic sampling drops, so they take fewer
optimizer steps). The final policy is evaluated on one fixed set of held-out mazes with
``--eval-samples`` samples each at temperature 1 (the same sampler and random stream for every
run), pass@k by the unbiased estimator (``grouprl.diagnostics.pass_at_k``).

Seeds change the RL run (prompt stream, sampling); the SFT start and the evaluation set are
shared, so the seed std is the spread of the RL runs themselves.

    python reproductions/maze/run.py                        # full (see --help for sizes)
    python reproductions/maze/run.py --quick                # seconds: schema check only
    python reproductions/maze/run.py --readme-only          # re-render the README table

Each (preset, seed) run is saved under ``runs/`` as it finishes; a rerun skips the runs
already there (delete the folder to start over), so an interrupted sweep can be continued.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common as C

HERE = Path(__file__).resolve().parent
PRESETS = ("grpo", "f_grpo", "dapo", "f_dapo", "cispo", "avspo", "maxnorm_rloo")
KS = (1, 2, 4, 8, 16, 32, 64)
EVAL_SEED = 20261130
"""Seed of the held-out maze set and of the evaluation sampler (shared by every run)."""


def _args(argv: list[str] | None):
    p = C.parser(__doc__.splitlines()[0], default_seeds=5)
    p.add_argument("--presets", nargs="+", default=list(PRESETS), help="presets to compare")
    p.add_argument("--prompts", type=int, default=16, help="mazes per step (P)")
    p.add_argument("--group", type=int, default=8, help="completions per maze (G)")
    p.add_argument("--budget-steps", type=int, default=100, help="budget = this × P × G rollouts")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--eval-samples", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="runs in parallel (one thread each)")
    p.add_argument("--sft-steps", type=int, default=1400)
    a = p.parse_args(argv)
    if a.quick:
        a.presets = a.presets if argv and "--presets" in argv else ["grpo", "dapo"]
        a.prompts, a.group, a.budget_steps, a.max_new = 2, 4, 2, 8
        a.eval_prompts, a.eval_samples, a.sft_steps, a.workers = 4, 4, 0, 1
    return a


def _policy(sft_steps: int):
    import torch

    from grouprl import models, tasks
    from grouprl.train import sft

    task = tasks.get("maze")
    model, tok = models.load("tiny", task=task, dtype=torch.float32, seed=0)
    if sft_steps > 0:
        model = sft.warm_start(model, tok, task, steps=sft_steps, seed=0, progress=False)
    return model.eval(), tok, task


def evaluate(model, tok, task, prompts: int, samples: int, max_new: int) -> dict[str, Any]:
    """pass@k for k in KS (k ≤ samples) and the mean reward on the fixed held-out set."""
    import numpy as np
    import torch

    from grouprl.diagnostics import pass_at_k
    from grouprl.rollout import hf

    examples = task.examples("eval", prompts, EVAL_SEED)
    gen = torch.Generator().manual_seed(EVAL_SEED)
    sampling = hf.Sampling(temperature=1.0, top_p=1.0, max_new_tokens=max_new)
    per_call = max(1, 1024 // samples)
    correct = []
    with torch.no_grad():
        for i in range(0, len(examples), per_call):
            chunk = examples[i : i + per_call]
            roll = hf.generate(
                model, tok, [task.render(e, tok) for e in chunk], samples, sampling, gen
            )
            r = [task.verify(t, e.reference) for t, e in zip(roll.texts, _rep(chunk, samples))]
            correct += np.asarray(r).reshape(len(chunk), samples).sum(1).tolist()
    c = np.asarray(correct)
    out = {f"pass@{k}": float(np.mean(pass_at_k(samples, c, k))) for k in KS if k <= samples}
    out["solved_any"] = float((c > 0).mean())
    return out


def _rep(items: list, n: int) -> list:
    return [x for x in items for _ in range(n)]


def _config(a, preset: str, seed: int, out: Path):
    from grouprl.train.config import load_config

    return load_config(
        None,
        [
            "model.name=tiny",
            "model.warm_start=false",
            "task.name=maze",
            f"sampling.prompts_per_step={a.prompts}",
            f"sampling.group_size={a.group}",
            f"sampling.max_new_tokens={a.max_new}",
            "sampling.verify_timeout_s=0",
            f"algorithm.preset={preset}",
            f"optim.steps={10 * a.budget_steps}",
            f"optim.lr={a.lr}",
            "eval.every=0",
            f"run.out={out}",
            f"run.seed={seed}",
            "run.progress=false",
            "run.tensorboard=false",
            "run.report=false",
            "run.threads=1",
        ],
    )


def job(a, preset: str, seed: int) -> dict[str, Any]:
    """One run: train ``preset`` with ``seed`` until the rollout budget is spent; evaluate."""
    import tempfile

    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from grouprl.train import loop

    model, tok, task = _policy(a.sft_steps)
    if preset == "base":
        t0 = time.perf_counter()
        ev = evaluate(model, tok, task, a.eval_prompts, a.eval_samples, a.max_new)
        return {"preset": "base", "seed": seed, "eval": ev, "seconds": time.perf_counter() - t0}
    budget = a.budget_steps * a.prompts * a.group
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        run = loop.setup(_config(a, preset, seed, Path(tmp)), model=model, tokenizer=tok, task=task)
        used, curve = 0, []
        while used < budget:
            run.step += 1
            m = loop.train_step(run)
            used += int(m.get("dynamic/drawn", a.prompts)) * a.group
            curve.append(
                {
                    "step": run.step,
                    "rollouts": used,
                    "reward": m.get("reward/mean"),
                    "acr": m.get("acr/rate"),
                    "length": m.get("length/mean"),
                }
            )
    train_s = time.perf_counter() - t0
    ev = evaluate(run.model, tok, task, a.eval_prompts, a.eval_samples, a.max_new)
    return {
        "preset": preset,
        "seed": seed,
        "eval": ev,
        "steps": run.step,
        "rollouts": used,
        "train_seconds": train_s,
        "seconds": time.perf_counter() - t0,
        "curve": curve,
    }


def _finite_mean(xs: list[float | None]) -> float:
    v = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(v) / len(v) if v else float("nan")


def summarise(runs: list[dict], presets: list[str], seeds: int) -> list[dict]:
    base = next(r for r in runs if r["preset"] == "base")
    ks = [k for k in KS if f"pass@{k}" in base["eval"]]
    rows = [
        {
            "preset": "SFT start (base)",
            **{f"pass@{k}": C.ms([base["eval"][f"pass@{k}"]]) for k in ks},
            "steps": C.ms([0]),
            "train ACR": C.ms([float("nan")]),
        }
    ]
    for p in presets:
        rs = [r for r in runs if r["preset"] == p]
        if not rs:
            continue
        rows.append(
            {
                "preset": p,
                **{f"pass@{k}": C.ms([r["eval"][f"pass@{k}"] for r in rs]) for k in ks},
                "steps": C.ms([r["steps"] for r in rs]),
                "train ACR": C.ms([_finite_mean([c["acr"] for c in r["curve"]]) for r in rs]),
            }
        )
    return rows


def _diff(a: dict, b: dict) -> tuple[float, float]:
    """Mean difference a − b and its standard error from the seed stds (independent runs)."""
    se = math.sqrt(a["std"] ** 2 / max(a["n"], 1) + b["std"] ** 2 / max(b["n"], 1))
    return a["mean"] - b["mean"], se


def checks(rows: list[dict]) -> list[dict]:
    """The paper's statements; a difference counts only beyond 2 standard errors."""
    by = {r["preset"]: r for r in rows}
    base, out = by["SFT start (base)"], []
    kmax = max(int(k[5:]) for k in base if k.startswith("pass@"))
    top = f"pass@{kmax}"
    if "grpo" in by:
        g = by["grpo"]
        d1, se1 = _diff(g["pass@1"], base["pass@1"])
        dk, sek = _diff(g[top], base[top])
        out.append(
            {
                "name": "grpo_sharpens",
                "holds": d1 > 2 * se1 and dk < d1,
                "detail": f"grpo vs SFT start: pass@1 {d1:+.3f} (SE {se1:.3f}), {top} "
                f"{dk:+.3f} (SE {sek:.3f})",
            }
        )
    for focal, plain in (("f_grpo", "grpo"), ("f_dapo", "dapo")):
        if focal in by and plain in by:
            dk, sek = _diff(by[focal][top], by[plain][top])
            d1, se1 = _diff(by[focal]["pass@1"], by[plain]["pass@1"])
            out.append(
                {
                    "name": f"{focal}_keeps_more_{top.replace('@', '_at_')}_than_{plain}",
                    "holds": dk > 2 * sek,
                    "detail": f"{focal} − {plain}: {top} {dk:+.3f} (SE {sek:.3f}), pass@1 "
                    f"{d1:+.3f} (SE {se1:.3f}); holds only beyond 2 SE",
                }
            )
    return out


def plot(rows: list[dict]):
    from grouprl.report.html import figure

    fig, ax = figure(2, 1, width=5.0, height=3.8)
    base = rows[0]
    ks = [int(k[5:]) for k in base if k.startswith("pass@")]
    for r in rows:
        style = "k:" if r is base else "o-"
        m = [r[f"pass@{k}"]["mean"] for k in ks]
        s = [r[f"pass@{k}"]["std"] for k in ks]
        ax[0, 0].errorbar(ks, m, yerr=s, fmt=style, ms=3, capsize=2, label=r["preset"])
        if r is not base:
            d = [r[f"pass@{k}"]["mean"] - base[f"pass@{k}"]["mean"] for k in ks]
            ax[0, 1].errorbar(ks, d, yerr=s, fmt="o-", ms=3, capsize=2, label=r["preset"])
    ax[0, 1].axhline(0.0, color="grey", ls=":")
    for a, t in ((ax[0, 0], "pass@k (mean ± std over seeds)"), (ax[0, 1], "pass@k − SFT start")):
        a.set_xscale("log", base=2), a.set_xlabel("k"), a.set_title(t, fontsize=9)
    ax[0, 0].legend(fontsize=7)
    return fig


def readme_block(payload: dict) -> str:
    c = payload["config"]
    return (
        C.markdown_table(payload["table"]) + f"\n\n{C.checks_block(payload['checks'])}\n\n"
        f"({len(payload['seeds'])} seeds; budget {c['budget_rollouts']:,} rollouts per run "
        f"= {c['budget_steps']} steps × {c['prompts']} mazes × {c['group']}; lr {c['lr']:g}; "
        f"eval {c['eval_prompts']} held-out mazes × {c['eval_samples']} samples; "
        f"{payload['seconds'] / 60:.0f} min of runs)"
    )


def _run_key(a) -> dict[str, Any]:
    """The settings a saved run must share to be reused."""
    keys = (
        "prompts",
        "group",
        "budget_steps",
        "lr",
        "max_new",
        "eval_prompts",
        "eval_samples",
        "sft_steps",
    )
    return {k: getattr(a, k) for k in keys}


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    out = C.output_folder(a, HERE, readme_block)
    if out is None:
        return 0
    runs_dir = out / ("runs_quick" if a.quick else "runs")
    runs_dir.mkdir(parents=True, exist_ok=True)
    todo = [("base", 0)] + [(p, s) for s in range(a.seeds) for p in a.presets]
    runs = []
    key = _run_key(a)
    for p, s in list(todo):
        f = runs_dir / f"{p}_s{s}.json"
        saved = json.loads(f.read_text()) if f.exists() else None
        if saved is not None and saved.get("key") == key:
            runs.append(saved)
            todo.remove((p, s))

    def done(p: str, s: int, r: dict) -> None:
        r["key"] = key
        (runs_dir / f"{p}_s{s}.json").write_text(json.dumps(r), encoding="utf-8")
        runs.append(r)
        ev = "  ".join(f"{k} {v:.3f}" for k, v in r["eval"].items())
        print(f"{p} seed {s}: {ev}  ({r['seconds']:.0f} s)", flush=True)

    if a.workers <= 1:  # in this process (tests load this file without a package)
        for p, s in todo:
            done(p, s, job(a, p, s))
    else:
        with ProcessPoolExecutor(a.workers, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(job, a, p, s): (p, s) for p, s in todo}
            for fut in as_completed(futures):
                done(*futures[fut], fut.result())
    rows = summarise(runs, a.presets, a.seeds)
    chk = checks(rows)
    config = {
        k: v
        for k, v in vars(a).items()
        if k not in ("out", "readme_only", "threads", "workers", "quick")
    }
    config["budget_rollouts"] = a.budget_steps * a.prompts * a.group
    payload = {
        "name": "maze",
        "claim": "F-GRPO §5.2 (maze): GRPO sharpens — pass@1 rises while pass@k for large k "
        "gains less or falls; the focal weight keeps more pass@k at large k; compared with "
        "dapo, cispo, avspo and maxnorm_rloo at equal rollout budget.",
        "command": "python reproductions/maze/run.py" + (" --quick" if a.quick else ""),
        "quick": a.quick,
        "seeds": list(range(a.seeds)),
        "config": config,
        "table": rows,
        "checks": chk,
        "seconds": sum(r["seconds"] for r in runs),
        "runs": [{k: v for k, v in r.items() if k not in ("curve", "key")} for r in runs],
    }
    return C.publish(out, payload, plot(rows), readme_block)


if __name__ == "__main__":
    sys.exit(main())
