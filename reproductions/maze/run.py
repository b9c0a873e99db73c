"""The F-GRPO maze in miniature: a fair test of the focal weight in a high-success regime.

Every arm is the ``grpo`` preset with the same overrides (token-mean aggregation, one epoch of
one minibatch per step, the same lr, seeds and prompt streams) except the one axis under test:

- ``grpo``: no focal weight (γ = 0);
- ``f_grpo γ=0.5`` / ``f_grpo γ=1``: the focal weight (1 − μ̂)^γ on every group's advantages
  (F-GRPO §4), nothing else changed;
- ``grpo lr×w̄ (γ)``: F-GRPO §5.6's control, plain GRPO with the learning rate multiplied by
  w̄_γ, the mean focal weight over the *updated* (mixed) groups measured in the finished
  ``f_grpo γ`` runs at the main group size (pooled over their steps and seeds), so that a gain
  from "a smaller step" is not credited to the focal weight. These runs start after the
  ``f_grpo`` runs they are calibrated on.

The task is made easy enough that the warm-started policy solves about half of the mazes
(``--size``, ``--min-path``, ``--max-path``, ``--sft-steps``): the paper's maze policies end at
pass@1 0.66-0.94, where most mixed groups have μ̂ ≥ 0.5 and the focal weight acts. Each step's
rewards are captured and its share of mixed groups with μ̂ ≥ 0.5 is kept in the results.
pass@k (k ≤ ``--eval-samples``) is measured on one fixed set of held-out mazes every
``--eval-every`` steps (the same sampler stream for every run and every evaluation).

Seeds change the RL run (prompt stream, sampling); all arms of one seed draw the same prompt
stream, so arms are compared by paired differences per seed (mean ± standard error of the
differences, and in how many seeds the sign holds).

    python reproductions/maze/run.py                        # full sweep (see --help)
    python reproductions/maze/run.py --seeds 2              # fewer seeds first
    python reproductions/maze/run.py --quick                # seconds: schema check only
    python reproductions/maze/run.py --readme-only          # re-render the README block

Each run is saved under ``runs/`` as it finishes; a rerun skips the runs already there with the
same settings (delete the folder to start over), so an interrupted sweep can be continued and
``--seeds`` can be raised later without redoing the first seeds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common as C

from grouprl.advantages import focal_mean_weight

HERE = Path(__file__).resolve().parent
LEGACY = HERE / "low_success" / "results.json"
"""The earlier sweep (5×5 mazes, SFT pass@1 0.12, 100 steps, grpo with seq-mean-token-mean
against f_grpo with token-mean), kept as its own, labelled row."""
EVAL_SEED = 20261130
"""Seed of the held-out maze set and of the evaluation sampler (shared by every run)."""


# ---- arms ---------------------------------------------------------------------------------------


CONTROLS = ("measured", "closed")
"""The §5.6 lr controls: ``measured`` = lr × w̄_γ, the mean focal weight over the updated groups
of the finished f_grpo γ runs; ``closed`` = lr × m_γ, F-GRPO App. N's closed form
(``advantages.focal_mean_weight``: 0.679 at γ = 0.5, the paper's 6.8e-7 = 0.679 × 1e-6)."""


def arm_name(gamma: float, control: str | bool | None = None) -> str:
    """``grpo``, ``f_grpo γ=0.5``, or an lr control ``grpo lr×w̄(γ=0.5)`` / ``grpo lr×m_γ(γ=0.5)``.

    ``control``: None (no control), ``"measured"`` (True, the older spelling) or ``"closed"``.
    """
    if control in (True, "measured"):
        return f"grpo lr×w̄(γ={gamma:g})"
    if control == "closed":
        return f"grpo lr×m_γ(γ={gamma:g})"
    return "grpo" if gamma == 0 else f"f_grpo γ={gamma:g}"


def overrides(a, gamma: float, group: int, lr: float) -> list[str]:
    """The config overrides of one arm: only ``focal_gamma`` and ``lr`` differ between arms.

    γ = 0 runs the ``f_grpo_baseline`` preset, γ > 0 ``f_grpo`` with ``focal_gamma`` = γ: the
    two are equal in every field but γ (``presets.baseline_of``; token mean, PPO clip 0.2,
    β = 0, F-GRPO App. L.2). One epoch of one minibatch per step (F-GRPO App. K: "one
    parameter update per RL step"), set here explicitly so that no preset default decides it.
    """
    return [
        f"model.name={a.model}",
        "model.warm_start=false",
        "task.name=maze",
        f"sampling.prompts_per_step={a.prompts}",
        f"sampling.group_size={group}",
        f"sampling.max_new_tokens={a.max_new}",
        "sampling.verify_timeout_s=0",
        f"algorithm.preset={'f_grpo' if gamma else 'f_grpo_baseline'}",
        f"algorithm.focal_gamma={gamma}",
        f"optim.steps={a.steps}",
        f"optim.lr={lr}",
        "optim.ppo_epochs=1",
        "optim.minibatches=1",
        "eval.every=0",
        "run.seed={seed}",
        "run.progress=false",
        "run.tensorboard=false",
        "run.report=false",
        "run.threads=1",
    ]


SETTINGS: dict[str, dict[str, Any]] = {
    "small": {
        "size": 4, "min_path": 1, "max_path": 5, "model": "tiny", "sft_steps": 1000,
        "sft_batch": 64, "sft_lr": 2e-3, "prompts": 16, "group": 8, "sweep_groups": [4, 16],
        "gammas": [0.5, 1.0], "sweep_gammas": [0.5], "controls": ["measured"],
        "control_gammas": None, "steps": 400, "lr": 1e-4, "max_new": 10, "eval_every": 100,
        "eval_prompts": 200, "eval_samples": 128, "workers": 2, "ckpt_every": 0,
        "sft_curriculum": [], "sft_schedule": "cosine", "coords": False,
    },
    "appk": {
        "size": 9, "min_path": 1, "max_path": 3, "model": "tiny:d=128,layers=6,heads=4",
        "sft_steps": 300, "sft_batch": 32, "sft_lr": 2e-3, "prompts": 16, "group": 8,
        "sweep_groups": [4, 16], "gammas": [0.5, 1.0], "sweep_gammas": [0.5, 1.0],
        "controls": ["measured", "closed"], "control_gammas": [0.5], "steps": 120,
        "lr": 1e-4, "max_new": 6, "eval_every": 40, "eval_prompts": 64, "eval_samples": 32,
        "workers": 1, "ckpt_every": 20, "sft_curriculum": ["2:300", "3:300", "3:300"],
        "sft_schedule": "constant", "coords": False,
    },
    "converge": {
        "size": 4, "min_path": 1, "max_path": 5, "model": "tiny", "sft_steps": 1000,
        "sft_batch": 64, "sft_lr": 2e-3, "prompts": 16, "group": 8, "sweep_groups": [],
        "gammas": [0.5, 1.0], "sweep_gammas": [], "controls": ["closed"],
        "control_gammas": [0.5], "steps": 4000, "lr": 1e-4, "max_new": 10, "eval_every": 500,
        "eval_prompts": 200, "eval_samples": 128, "workers": 2, "ckpt_every": 500,
        "sft_curriculum": [], "sft_schedule": "cosine", "coords": False,
    },
}  # fmt: skip
"""``--setting``: the defaults of every flag. ``small`` = the fair test of the focal weight (4×4, the 205k
model; its results are this folder's README); ``appk`` = towards F-GRPO App. K on two shared
cores (9×9 mazes with answers of 1-3 moves, a 1.2M-parameter model, SFT batch 32 as App. K,
RL lr 1e-4 as App. K at 16 prompts a step, every N × γ of {4, 8, 16} × {0, 0.5, 1}, both lr
controls at γ = 0.5; results under ``appk/``). Flags override. [OURS, pilot] SFT lr 2e-3, not
App. K's 5e-4: at 1e-3 (paths ≤ 12) the loss sat at 1.32 with pass@1 0 after 500 steps;
[OURS, pilots] answers of 1-3 moves and a curriculum (300 steps on ≤ 2 moves, then
3 × 300 on ≤ 3, constant lr): with 1-6 moves 1,000 cosine steps solved 9.5 % of even the
1-move mazes (appk/README.md). ``converge`` = the ``small`` setting run ten times longer, towards
the converged endpoint of F-GRPO Table 4 (N = 8 only, the closed-form §5.6 control m_γ so that
every arm runs at once; results under ``converge/``); [OURS, pilot] lr 1e-4 kept: at 3e-4 and
1e-3 one seed's pass@128 fell from 0.98 to 0.54 and 0.17 within 1,000 steps."""


def _args(argv: list[str] | None):
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--setting", choices=sorted(SETTINGS), default="small")
    setting = pre.parse_known_args(argv)[0].setting
    d = SETTINGS[setting]
    p = C.parser(__doc__.splitlines()[0], default_seeds=5 if setting == "small" else 3)
    p.add_argument(
        "--setting", choices=sorted(SETTINGS), default="small",
        help="the defaults of every flag below: small (4x4, the fair focal-weight test) or appk "
        "(9x9, a 1.2M model, towards F-GRPO App. K)",
    )  # fmt: skip
    p.add_argument("--size", type=int, default=d["size"], help="maze side (cells)")
    p.add_argument("--min-path", type=int, default=d["min_path"], help="shortest answer (moves)")
    p.add_argument("--max-path", type=int, default=d["max_path"], help="longest answer (moves)")
    p.add_argument("--model", default=d["model"], help="a tiny[:d=..,layers=..] model spec")
    p.add_argument(
        "--coords", action=argparse.BooleanOptionalAction, default=d["coords"],
        help="render the maze with a row token per row and the column in each cell token "
        "(MazeTask coords=True)",
    )  # fmt: skip
    p.add_argument("--sft-steps", type=int, default=d["sft_steps"], help="warm-start steps")
    p.add_argument("--sft-batch", type=int, default=d["sft_batch"], help="warm-start batch")
    p.add_argument("--sft-lr", type=float, default=d["sft_lr"], help="warm-start peak lr")
    p.add_argument(
        "--sft-curriculum", nargs="*", default=d["sft_curriculum"], metavar="MAX_PATH:STEPS",
        help="warm-start stages run before the --sft-steps on the task itself, each on the "
        "mazes with answers of min-path..MAX_PATH moves (e.g. 2:300 3:300)",
    )  # fmt: skip
    p.add_argument(
        "--sft-schedule", choices=("cosine", "constant"), default=d["sft_schedule"],
        help="warm-start lr after its 50-step warm-up, in every stage",
    )  # fmt: skip
    p.add_argument("--prompts", type=int, default=d["prompts"], help="mazes per step (P)")
    p.add_argument("--group", type=int, default=d["group"], help="completions per maze (N)")
    p.add_argument(
        "--sweep-groups", type=int, nargs="*", default=d["sweep_groups"],
        help="extra group sizes for grpo and f_grpo at --sweep-gammas (the paper's N sweep)",
    )  # fmt: skip
    p.add_argument(
        "--gammas", type=float, nargs="*", default=d["gammas"],
        help="focal γ values at the main N (none: grpo only, e.g. for an lr pilot)",
    )  # fmt: skip
    p.add_argument(
        "--sweep-gammas", type=float, nargs="*", default=d["sweep_gammas"],
        help="focal γ values run at the --sweep-groups too",
    )  # fmt: skip
    p.add_argument(
        "--controls", nargs="*", choices=CONTROLS, default=d["controls"],
        help="the §5.6 lr controls: measured (lr × w̄ of the f_grpo runs), closed (lr × m_γ)",
    )  # fmt: skip
    p.add_argument(
        "--control-gammas", type=float, nargs="*", default=d["control_gammas"],
        help="γ values that get lr controls (default: every --gammas)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=d["steps"], help="RL steps per run")
    p.add_argument("--lr", type=float, default=d["lr"])
    p.add_argument(
        "--max-new",
        type=int,
        default=d["max_new"],
        help="generation limit; any answer longer than max-path moves is wrong anyway",
    )
    p.add_argument("--eval-every", type=int, default=d["eval_every"])
    p.add_argument("--eval-prompts", type=int, default=d["eval_prompts"])
    p.add_argument("--eval-samples", type=int, default=d["eval_samples"])
    p.add_argument(
        "--workers", type=int, default=d["workers"], help="runs in parallel (one thread each)"
    )
    p.add_argument(
        "--ckpt-every", type=int, default=d["ckpt_every"],
        help="checkpoint a run every this many steps, so a killed sweep resumes inside the run "
        "(0: only whole runs are kept)",
    )  # fmt: skip
    p.add_argument(
        "--finished-only", action="store_true",
        help="start no run: summarise the runs already saved under runs/ (a sweep still going, "
        "or cut short) and name the planned runs that are missing",
    )  # fmt: skip
    a = p.parse_args(argv)
    if a.control_gammas is None:
        a.control_gammas = list(a.gammas)
    try:
        sft_stages(a)
    except ValueError as e:
        p.error(str(e))
    if a.quick:
        # 2 x 2 mazes with one-move answers and a few SFT steps: some groups are mixed, so
        # the focal weight and the lr controls run too
        a.size, a.min_path, a.max_path, a.sft_steps = 2, 1, 1, 15
        a.model, a.sft_batch, a.sft_lr = "tiny", 64, 2e-3
        a.sft_curriculum, a.sft_schedule, a.coords = [], "cosine", False
        a.prompts, a.group, a.steps, a.max_new, a.eval_every = 4, 4, 4, 4, 2
        a.sweep_groups = [2] if "--sweep-groups" not in (argv or []) else a.sweep_groups
        a.eval_prompts, a.eval_samples, a.workers = 4, 8, 1
    return a


def _ks(samples: int) -> list[int]:
    return [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256) if k <= samples]


# ---- one run ------------------------------------------------------------------------------------


def _task(a):
    from grouprl.tasks.maze import MazeTask

    # other reproductions (rollout_correction) pass their own namespace without these flags
    return MazeTask(a.size, a.min_path, a.max_path, coords=getattr(a, "coords", False))


def sft_stages(a) -> list[tuple[int, int]]:
    """(max_path, steps) of each warm-start stage: ``--sft-curriculum``, then ``--sft-steps`` on
    the task's own range. ValueError (said as a usage error) for a malformed stage.

    [OURS] A stage is one ``sft.warm_start`` call (a fresh AdamW, its own 50-step warm-up, its
    own cache entry keyed by the weights it starts from), on mazes whose answers have
    ``min_path``..MAX_PATH moves: short answers first, as a curriculum."""
    out = []
    for item in getattr(a, "sft_curriculum", []):
        head, sep, tail = str(item).partition(":")
        if not (sep and head.isdigit() and tail.isdigit()) or int(tail) < 1:
            raise ValueError(
                f"--sft-curriculum: {item!r} is not MAX_PATH:STEPS with positive integers "
                "(e.g. 2:300)"
            )
        if int(head) < a.min_path:
            raise ValueError(
                f"--sft-curriculum: {item!r} asks for answers of at most {head} moves, "
                f"below --min-path {a.min_path}"
            )
        out.append((int(head), int(tail)))
    if a.sft_steps > 0:
        out.append((a.max_path, a.sft_steps))
    return out


def _policy(a):
    import torch

    from grouprl import models
    from grouprl.tasks.maze import MazeTask
    from grouprl.train import sft

    task = _task(a)
    model, tok = models.load(a.model, task=task, dtype=torch.float32, seed=0)
    for max_path, steps in sft_stages(a):
        stage = (
            task
            if max_path == a.max_path
            else MazeTask(a.size, a.min_path, max_path, coords=task.coords)
        )
        model = sft.warm_start(
            model, tok, stage, steps=steps, batch_size=a.sft_batch, lr=a.sft_lr,
            schedule=getattr(a, "sft_schedule", "cosine"), seed=0, progress=False,
        )  # fmt: skip
    for q in model.parameters():  # a warm start trained in this process leaves its last .grad
        q.grad = None  # (a cached one does not): the first RL step must not add it in
    return model.eval(), tok, task


def evaluate(model, tok, task, a) -> dict[str, Any]:
    """pass@k on the fixed held-out set, and the per-maze correct counts (for the regime)."""
    import numpy as np
    import torch

    from grouprl.diagnostics import pass_at_k
    from grouprl.rollout import hf

    samples = a.eval_samples
    examples = task.examples("eval", a.eval_prompts, EVAL_SEED)
    gen = torch.Generator().manual_seed(EVAL_SEED)
    sampling = hf.Sampling(temperature=1.0, top_p=1.0, max_new_tokens=a.max_new)
    per_call = max(1, 1024 // samples)
    correct: list[int] = []
    with torch.no_grad():
        for i in range(0, len(examples), per_call):
            chunk = examples[i : i + per_call]
            roll = hf.generate(
                model, tok, [task.render(e, tok) for e in chunk], samples, sampling, gen
            )
            refs = [e.reference for e in chunk for _ in range(samples)]
            r = [task.verify(t, ref) for t, ref in zip(roll.texts, refs)]
            correct += np.asarray(r).reshape(len(chunk), samples).sum(1).astype(int).tolist()
    c = np.asarray(correct)
    out: dict[str, Any] = {
        f"pass@{k}": float(np.mean(pass_at_k(samples, c, k))) for k in _ks(samples)
    }
    out["correct"] = correct
    return out


def group_regime(rewards, gammas: list[float]) -> dict[str, float]:
    """One step's groups ``[P, N]`` (binary rewards): mixed share, μ̂ ≥ 0.5 share, focal weights.

    ``mixed`` = 0 < μ̂ < 1 (the groups GRPO updates); ``hi_of_mixed`` = the share of mixed
    groups with μ̂ ≥ 0.5 (NaN when no group is mixed); ``w_<γ>_sum`` = Σ over mixed groups of
    (1 − μ̂)^γ (sums, so steps and runs pool exactly).
    """
    import torch

    mu = rewards.float().nanmean(dim=1)  # [P]
    mixed = (mu > 0) & (mu < 1)  # [P]
    hi = mixed & (mu >= 0.5)  # [P]
    n_mixed = int(mixed.sum())
    out = {
        "groups": float(len(mu)),
        "mixed": float(n_mixed),
        "mixed_hi": float(hi.sum()),
        "all_correct": float((mu == 1).sum()),
        "hi_of_mixed": float(hi.sum()) / n_mixed if n_mixed else float("nan"),
        "reward": float(mu.mean()),
    }
    for g in gammas:
        w = torch.where(mixed, (1.0 - mu).pow(g), torch.zeros_like(mu))  # [P]
        out[f"w_{g:g}_sum"] = float(w.sum())
    return out


class _Capture:
    """Stands in for the trainer's sinks: keeps each step's rewards (``log_groups``)."""

    def __init__(self) -> None:
        self.rewards = None

    def log_groups(self, step: int, prompt_ids: list[Any], rewards: Any) -> None:
        self.rewards = rewards.detach().cpu()

    def print(self, message: str) -> None:  # health warnings: not needed here
        pass


def _progress_file(folder: Path) -> Path:
    return folder / "job.json"


def _restore(run, folder: Path) -> tuple[list[dict], dict[str, Any]]:
    """The curve and evaluations saved with the checkpoint ``run`` resumed from (``job.json`` is
    written before each checkpoint, so it is never behind it; anything after the checkpoint's
    step is dropped and recomputed)."""
    f = _progress_file(folder)
    if run.step == 0 or not f.exists():
        return [], {}
    saved = json.loads(f.read_text(encoding="utf-8"))
    curve = [r for r in saved["curve"] if r["step"] <= run.step]
    evals = {k: v for k, v in saved["evals"].items() if int(k) <= run.step}
    if len(curve) != run.step:
        raise RuntimeError(f"{f}: {len(curve)} saved steps for a checkpoint at step {run.step}")
    return curve, evals


def job(
    a, arm: str, gamma: float, group: int, lr: float, seed: int, folder: Path | None = None
) -> dict[str, Any]:
    """One run: ``a.steps`` steps of the arm, pass@k every ``a.eval_every`` steps and at the end.

    With ``folder`` and ``a.ckpt_every`` > 0 the run checkpoints there (the trainer's own
    checkpoints: model, AdamW, every generator) every ``a.ckpt_every`` steps with its curve
    and evaluations so far, and a rerun continues from the last checkpoint, ending with what an
    uninterrupted run ends with.
    """
    import tempfile

    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from grouprl.train import loop
    from grouprl.train.checkpoint import list_checkpoints
    from grouprl.train.config import load_config
    from grouprl.train.state import save_checkpoint

    model, tok, task = _policy(a)
    t0 = time.perf_counter()
    if arm == "base":
        ev = evaluate(model, tok, task, a)
        return {
            "arm": "base",
            "seed": seed,
            "evals": {"0": ev},
            "seconds": time.perf_counter() - t0,
        }
    gammas = sorted({*a.gammas, *a.sweep_gammas, *a.control_gammas})
    keep = folder is not None and a.ckpt_every > 0
    with contextlib.ExitStack() as stack:
        out = folder if keep else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        out.mkdir(parents=True, exist_ok=True)
        resume = keep and bool(list_checkpoints(out / "checkpoints"))
        ov = [o.replace("{seed}", str(seed)) for o in overrides(a, gamma, group, lr)]
        cfg = load_config(None, [*ov, f"run.out={out}", f"run.resume={resume}", "run.keep_last=1"])
        run = loop.setup(cfg, model=model, tokenizer=tok, task=task)
        curve, evals = _restore(run, out) if resume else ([], {})
        seconds = json.loads(_progress_file(out).read_text())["seconds"] if resume else 0.0
        run.sinks = _Capture()
        while run.step < a.steps:
            run.step += 1
            m = loop.train_step(run)
            row = {"step": run.step, **group_regime(run.sinks.rewards, gammas)}
            row["grad_norm"] = m.get("optim/grad_norm")
            row["length"] = m.get("length/mean")
            curve.append(row)
            if run.step % a.eval_every == 0 or run.step == a.steps:
                ev = evals[str(run.step)] = evaluate(run.model, tok, task, a)
                kmax = _ks(a.eval_samples)[-1]
                print(
                    f"  {arm} N={group} seed {seed} step {run.step}: pass@1 {ev['pass@1']:.3f} "
                    f"pass@{kmax} {ev[f'pass@{kmax}']:.3f} ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
            if keep and run.step % a.ckpt_every == 0 and run.step < a.steps:
                progress = {"step": run.step, "curve": curve, "evals": evals}
                progress["seconds"] = seconds + time.perf_counter() - t0
                _progress_file(out).write_text(json.dumps(progress), encoding="utf-8")
                save_checkpoint(run)  # after job.json: the checkpoint is never ahead of it
    if keep:
        shutil.rmtree(folder, ignore_errors=True)  # the finished run is kept as one JSON
    return {
        "arm": arm,
        "gamma": gamma,
        "group": group,
        "lr": lr,
        "seed": seed,
        "evals": evals,
        "seconds": seconds + time.perf_counter() - t0,
        "curve": curve,
    }


# ---- statistics ---------------------------------------------------------------------------------


def paired(xs: list[float], ys: list[float]) -> dict[str, Any]:
    """Paired differences x − y per seed: ``grouprl compare``'s mean, SE = sd(ddof 1)/√n, sign
    counts and bootstrap interval (:func:`_common.paired`)."""
    return C.paired(xs, ys)


def fmt_paired(p: dict[str, Any]) -> str:
    """``+0.012 ± 0.004 (5/5 +; 95 % [...])``: mean ± paired SE, how many seeds share the mean's
    sign, and the bootstrap interval (:func:`_common.fmt_paired`)."""
    return C.fmt_paired(p)


def run_regime(run: dict[str, Any], gammas: list[float]) -> dict[str, float]:
    """Pooled over a run's steps: shares of mixed / μ̂ ≥ 0.5 groups, mean focal weight on mixed."""
    c = run["curve"]
    groups = sum(r["groups"] for r in c)
    mixed = sum(r["mixed"] for r in c)
    out = {
        "mixed_share": mixed / groups,
        "hi_of_mixed": sum(r["mixed_hi"] for r in c) / mixed if mixed else float("nan"),
        "all_correct_share": sum(r["all_correct"] for r in c) / groups,
        "steps_hi_ge_half": _share(
            [r["hi_of_mixed"] >= 0.5 for r in c if r["mixed"] > 0]
        ),  # of the steps that had a mixed group
        "grad_norm": _mean([r["grad_norm"] for r in c]),  # before clipping, per step
    }
    for g in gammas:
        out[f"w_{g:g}"] = sum(r[f"w_{g:g}_sum"] for r in c) / mixed if mixed else float("nan")
    return out


def _mean(xs: list[float | None]) -> float:
    v = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(v) / len(v) if v else float("nan")


def _share(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else float("nan")


def control_scale(runs: list[dict], gamma: float, group: int) -> float | None:
    """w̄_γ: the mean focal weight over updated groups, pooled over the f_grpo γ runs at ``group``."""
    rs = [r for r in runs if r["arm"] == arm_name(gamma) and r["group"] == group]
    mixed = sum(x["mixed"] for r in rs for x in r["curve"])
    if not mixed:
        return None
    return sum(x[f"w_{gamma:g}_sum"] for r in rs for x in r["curve"]) / mixed


def predicted_regime(correct: list[int], samples: int, group: int, gammas: list[float]):
    """The same regime numbers predicted from the SFT start's per-maze success rates p_i.

    A group of N samples of maze i has Binomial(N, p_i) correct: P(mixed), P(μ̂ ≥ 0.5 | mixed)
    and E[(1 − μ̂)^γ | mixed], averaged over the held-out mazes.
    """
    mixed = hi = 0.0
    w = dict.fromkeys(gammas, 0.0)
    for c in correct:
        p = c / samples
        for j in range(1, group):
            pr = math.comb(group, j) * p**j * (1 - p) ** (group - j)
            mixed += pr
            hi += pr if j / group >= 0.5 else 0.0
            for g in gammas:
                w[g] += pr * (1 - j / group) ** g
    out = {"mixed_share": mixed / len(correct), "hi_of_mixed": hi / mixed if mixed else 0.0}
    out.update({f"w_{g:g}": (v / mixed if mixed else 0.0) for g, v in w.items()})
    return out


# ---- summary ------------------------------------------------------------------------------------


def _controls(a) -> list[tuple[str, float]]:
    """(kind, γ) of the lr controls of a payload config (older payloads: measured, every γ)."""
    kinds = a.get("controls", ["measured"])
    gammas = a.get("control_gammas") or a["gammas"]
    return [(k, g) for k in CONTROLS if k in kinds for g in gammas]


def _arms(a) -> list[tuple[str, float, bool]]:
    """(name, γ, is an lr control) of the main arms, in table order."""
    out = [(arm_name(0.0), 0.0, False)]
    out += [(arm_name(g), g, False) for g in a["gammas"]]
    out += [(arm_name(g, kind), g, True) for kind, g in _controls(a)]
    return out


def _final(run: dict[str, Any]) -> dict[str, Any]:
    return run["evals"][str(max(int(s) for s in run["evals"]))]


def summarise(runs: list[dict], cfg: dict[str, Any]) -> dict[str, Any]:
    """Tables of the payload: regime, final pass@k, paired differences, curves, N sweep."""
    gammas, ks = cfg["gammas"], _ks(cfg["eval_samples"])
    seeds = list(range(cfg["seeds"]))
    base = next(r for r in runs if r["arm"] == "base")
    b_ev = base["evals"]["0"]
    by = {(r["arm"], r.get("group"), r["seed"]): r for r in runs if r["arm"] != "base"}
    group = cfg["group"]

    def of(arm: str, n: int = group) -> list[dict]:
        return [by[(arm, n, s)] for s in seeds if (arm, n, s) in by]

    regime_rows, final_rows = [], []
    pred = predicted_regime(b_ev["correct"], cfg["eval_samples"], group, gammas)
    regime_rows.append(
        {
            "run": f"SFT start, predicted at N={group}",
            "mixed share": C.ms([pred["mixed_share"]]),
            "μ̂≥0.5 of mixed": C.ms([pred["hi_of_mixed"]]),
            **{f"w̄ γ={g:g}": C.ms([pred[f"w_{g:g}"]]) for g in gammas},
        }
    )
    final_rows.append(
        {"arm": "SFT start", "lr": "–", **{f"pass@{k}": C.ms([b_ev[f"pass@{k}"]]) for k in ks}}
    )
    for name, _g, _ctl in _arms(cfg):
        rs = of(name)
        if not rs:
            continue
        reg = [run_regime(r, gammas) for r in rs]
        regime_rows.append(
            {
                "run": name,
                "mixed share": C.ms([x["mixed_share"] for x in reg]),
                "μ̂≥0.5 of mixed": C.ms([x["hi_of_mixed"] for x in reg]),
                "steps with μ̂≥0.5 of mixed ≥ 0.5": C.ms([x["steps_hi_ge_half"] for x in reg]),
                "grad norm": C.ms([x["grad_norm"] for x in reg]),
                **{f"w̄ γ={g:g}": C.ms([x[f"w_{g:g}"] for x in reg]) for g in gammas},
            }
        )
        final_rows.append(
            {
                "arm": name,
                "lr": f"{rs[0]['lr']:.3g}",
                **{f"pass@{k}": C.ms([_final(r)[f"pass@{k}"] for r in rs]) for k in ks},
            }
        )
    return {
        "regime": regime_rows,
        "final": final_rows,
        "paired": _paired_rows(of, cfg, ks),
        "curves": _curve_rows(of, cfg, b_ev),
        "sweep": _sweep_rows(of, cfg),
        "table4": table4_rows(of, cfg),
        "regime_curves": _regime_curves(of, cfg),
        "dips": _dip_rows(of, cfg, b_ev),
        "lengths": _length_rows(of, cfg, b_ev),
    }


def _common_seeds(xs: list[dict], ys: list[dict]) -> tuple[list[dict], list[dict]]:
    sx, sy = {r["seed"]: r for r in xs}, {r["seed"]: r for r in ys}
    both = sorted(set(sx) & set(sy))
    return [sx[s] for s in both], [sy[s] for s in both]


def _paired_rows(of, cfg: dict[str, Any], ks: list[int]) -> list[dict[str, Any]]:
    rows = []
    comparisons = [(arm_name(g), arm_name(0.0)) for g in cfg["gammas"]]
    comparisons += [(arm_name(g), arm_name(g, kind)) for kind, g in _controls(cfg)]
    for x, y in comparisons:
        xs, ys = _common_seeds(of(x), of(y))
        if not xs:
            continue
        row: dict[str, Any] = {"difference": f"{x} − {y}"}
        for k in ks:
            row[f"pass@{k}"] = paired(
                [_final(r)[f"pass@{k}"] for r in xs], [_final(r)[f"pass@{k}"] for r in ys]
            )
        rows.append(row)
    return rows


def _curve_rows(of, cfg: dict[str, Any], b_ev: dict[str, Any]) -> list[dict[str, Any]]:
    """pass@1 and pass@k_max at every evaluated step, per arm (the dip and the recovery)."""
    kmax = _ks(cfg["eval_samples"])[-1]
    rows = []
    for name, _g, _ctl in _arms(cfg):
        rs = of(name)
        if not rs:
            continue
        steps = sorted({int(s) for r in rs for s in r["evals"]})
        for k in (1, kmax):
            row: dict[str, Any] = {
                "arm": name,
                "metric": f"pass@{k}",
                "0": C.ms([b_ev[f"pass@{k}"]]),
            }
            for s in steps:
                row[str(s)] = C.ms(
                    [r["evals"][str(s)][f"pass@{k}"] for r in rs if str(s) in r["evals"]]
                )
            rows.append(row)
    return rows


BIN = 10
"""Steps per bin of the regime curves in the tables (every step is kept in ``runs``)."""


def _regime_curves(of, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Per arm: the share of mixed groups with μ̂ ≥ 0.5, pooled over seeds in bins of BIN steps."""
    rows = []
    for name, _g, _ctl in _arms(cfg):
        rs = of(name)
        if not rs:
            continue
        steps = len(rs[0]["curve"])
        hi, mixed = [], []
        for b in range(0, steps, BIN):
            part = [x for r in rs for x in r["curve"][b : b + BIN]]
            n_mixed = sum(x["mixed"] for x in part)
            hi.append(sum(x["mixed_hi"] for x in part) / n_mixed if n_mixed else float("nan"))
            mixed.append(n_mixed / sum(x["groups"] for x in part))
        rows.append({"arm": name, "bin": BIN, "hi_of_mixed": hi, "mixed_share": mixed})
    return rows


def _dip_rows(of, cfg: dict[str, Any], b_ev: dict[str, Any]) -> list[dict[str, Any]]:
    """Per arm, paired over seeds: pass@k_max at the first evaluation − the SFT start (the dip)
    and at the end − at the first evaluation (the recovery)."""
    kmax = f"pass@{_ks(cfg['eval_samples'])[-1]}"
    rows = []
    for name, _g, _ctl in _arms(cfg):
        rs = of(name)
        if not rs:
            continue
        first = str(min(int(s) for s in rs[0]["evals"]))
        last = str(max(int(s) for s in rs[0]["evals"]))
        if first == last:
            continue
        at_first = [r["evals"][first][kmax] for r in rs]
        rows.append(
            {
                "arm": name,
                "metric": kmax,
                f"step {first} − start": paired(at_first, [b_ev[kmax]] * len(rs)),
                f"step {last} − step {first}": paired(
                    [r["evals"][last][kmax] for r in rs], at_first
                ),
            }
        )
    return rows


def by_length(correct: list[int], lengths: list[int], samples: int) -> dict[int, dict]:
    """pass@1 per answer length: {moves: {"mazes": n, "pass@1": mean of correct/samples}}.

    ``correct[i]`` of ``samples`` draws were right on the held-out maze ``i`` whose answer has
    ``lengths[i]`` moves."""
    out: dict[int, list[float]] = {}
    for c, n in zip(correct, lengths, strict=True):
        out.setdefault(n, []).append(c / samples)
    return {n: {"mazes": len(v), "pass@1": sum(v) / len(v)} for n, v in sorted(out.items())}


def _eval_lengths(cfg: dict[str, Any]) -> list[int]:
    """The answer length of each held-out maze, in evaluation order."""
    from grouprl.tasks.maze import MazeTask

    task = MazeTask(cfg["size"], cfg["min_path"], cfg["max_path"])
    return [len(e.reference.solve()) for e in task.examples("eval", cfg["eval_prompts"], EVAL_SEED)]


def _length_rows(of, cfg: dict[str, Any], b_ev: dict[str, Any]) -> list[dict[str, Any]]:
    """pass@1 by answer length: the SFT start, and each arm at the end (mean ± std over seeds;
    runs whose final evaluation kept its per-maze counts)."""
    lengths, samples = _eval_lengths(cfg), cfg["eval_samples"]
    base = by_length(b_ev["correct"], lengths, samples)
    row = {"arm": "SFT start", **{f"{n} moves": C.ms([v["pass@1"]]) for n, v in base.items()}}
    rows = [{"arm": "mazes", **{f"{n} moves": v["mazes"] for n, v in base.items()}}, row]
    for name, _g, _ctl in _arms(cfg):
        rs = [r for r in of(name) if "correct" in _final(r)]
        if not rs:
            continue
        per = [by_length(_final(r)["correct"], lengths, samples) for r in rs]
        rows.append(
            {"arm": name} | {f"{n} moves": C.ms([p[n]["pass@1"] for p in per]) for n in base}
        )
    return rows


def _sweep_gammas(cfg: dict[str, Any]) -> list[float]:
    """The γ values run at every N (older payloads: 0.5, or the first γ)."""
    if "sweep_gammas" in cfg:
        return list(cfg["sweep_gammas"])
    return [0.5 if 0.5 in cfg["gammas"] else cfg["gammas"][0]] if cfg["gammas"] else []


def _sweep_rows(of, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Per group size N and swept γ: f_grpo γ − grpo, paired, at pass@1 and pass@k_max."""
    kmax = _ks(cfg["eval_samples"])[-1]
    rows = []
    for n in sorted({cfg["group"], *cfg["sweep_groups"]}):
        for g in _sweep_gammas(cfg):
            xs, ys = _common_seeds(of(arm_name(g), n), of(arm_name(0.0), n))
            if not xs:
                continue
            reg = [run_regime(r, [g]) for r in xs + ys]
            rows.append(
                {
                    "N": n,
                    "comparison": f"{arm_name(g)} − grpo",
                    "pass@1": paired(
                        [_final(r)["pass@1"] for r in xs], [_final(r)["pass@1"] for r in ys]
                    ),
                    f"pass@{kmax}": paired(
                        [_final(r)[f"pass@{kmax}"] for r in xs],
                        [_final(r)[f"pass@{kmax}"] for r in ys],
                    ),
                    "grpo pass@1": C.ms([_final(r)["pass@1"] for r in ys]),
                    "μ̂≥0.5 of mixed": C.ms([x["hi_of_mixed"] for x in reg]),
                }
            )
    return rows


TABLE4 = {
    4: (65.6, 74.4, 79.7),
    8: (72.2, 83.4, 76.3),
    16: (73.9, 83.7, 84.4),
    32: (74.5, 85.1, 84.9),
    64: (73.4, 85.4, 84.8),
    128: (75.8, 93.6, 91.2),
}
"""F-GRPO App. K, Table 4: final pass@1 (%) after 20K RL steps, N -> (GRPO, γ = 0.5, γ = 1)."""


def _verdict(p: dict[str, Any], paper_diff: float) -> str:
    """Our paired difference against the sign of the paper's: agrees / same sign (noise) /
    opposite; a difference counts beyond 2 paired SE."""
    if not p["n"] or not math.isfinite(p["mean"]):
        return "–"
    if p["mean"] == 0:
        return "no difference"
    se = p["se"] if math.isfinite(p["se"]) else math.inf
    if abs(p["mean"]) > 2 * se:
        return "agrees" if (p["mean"] > 0) == (paper_diff > 0) else "opposite"
    return (
        "same sign, within 2 SE"
        if (p["mean"] > 0) == (paper_diff > 0)
        else "opposite sign, within 2 SE"
    )


def table4_rows(of, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Row by row against F-GRPO Table 4 (final pass@1): ours (mean ± std over seeds, in %)
    beside the paper's, and each focal arm's paired difference with the paper's verdict."""
    rows = []
    for n in sorted({cfg["group"], *cfg["sweep_groups"]}):
        if n not in TABLE4:
            continue
        base = of(arm_name(0.0), n)
        if not base:
            continue
        paper = TABLE4[n]
        row: dict[str, Any] = {
            "N": n,
            "GRPO (paper)": paper[0],
            "GRPO (ours)": C.ms([100 * _final(r)["pass@1"] for r in base]),
        }
        for k, g in ((1, 0.5), (2, 1.0)):
            arm = of(arm_name(g), n)
            if not arm:
                continue
            xs, ys = _common_seeds(arm, base)
            d = paired(
                [100 * _final(r)["pass@1"] for r in xs], [100 * _final(r)["pass@1"] for r in ys]
            )
            row[f"γ={g:g} (paper)"] = paper[k]
            row[f"γ={g:g} (ours)"] = C.ms([100 * _final(r)["pass@1"] for r in arm])
            row[f"γ={g:g} − GRPO, paper"] = round(paper[k] - paper[0], 1)
            row[f"γ={g:g} − GRPO, ours"] = d
            row[f"γ={g:g} verdict"] = _verdict(d, paper[k] - paper[0])
        rows.append(row)
    return rows


def legacy(path: Path = LEGACY) -> dict[str, Any] | None:
    """The earlier low-success sweep's f_grpo − grpo, paired by seed, from its results.json."""
    if not path.exists():
        return None
    old = json.loads(path.read_text(encoding="utf-8"))
    runs = {(r["preset"], r["seed"]): r for r in old["runs"]}
    seeds = sorted(s for (p, s) in runs if p == "f_grpo" and ("grpo", s) in runs)
    base = next(r for r in old["runs"] if r["preset"] == "base")["eval"]
    c = old["config"]
    row: dict[str, Any] = {
        "setting": "5×5, SFT start pass@1 {:.3f}, {} steps × {} mazes × {}, lr {:g}".format(
            base["pass@1"], c["budget_steps"], c["prompts"], c["group"], c["lr"]
        ),
        "difference": "f_grpo (token-mean) − grpo (seq-mean-token-mean)",
    }
    for k in (1, 8, 64):
        row[f"pass@{k}"] = paired(
            [runs[("f_grpo", s)]["eval"][f"pass@{k}"] for s in seeds],
            [runs[("grpo", s)]["eval"][f"pass@{k}"] for s in seeds],
        )
    return row


PLATEAU = 0.03
"""[OURS] pass@1 has "stopped rising" when its mean rise over the second half of the run (the
last evaluation − the half-way one, paired by seed) is below 3 points, the same margin as the
other endpoint the paper's Table 4 shows (pass@1 within ~3 points of pass@k)."""


def _endpoint_checks(tables: dict[str, Any], kmax: str) -> list[dict]:
    """Whether each arm reached the endpoint the paper judges at: pass@1 within ``PLATEAU`` of
    pass@kmax at the end, or pass@1 no longer rising over the run's second half."""
    out = []
    curves = {(c["arm"], c["metric"]): c for c in tables.get("curves", [])}
    for (arm, metric), c in curves.items():
        steps = sorted(int(k) for k in c if k.isdigit() and c[k]["n"] > 1)
        if metric != "pass@1" or len(steps) < 3 or (arm, kmax) not in curves:
            continue
        end, mid = steps[-1], steps[(len(steps) - 1) // 2]
        rise = paired(c[str(end)]["values"], c[str(mid)]["values"])
        gap = paired(curves[(arm, kmax)][str(end)]["values"], c[str(end)]["values"])
        out.append(
            {
                "name": f"{arm} converged".replace(" ", "_"),
                "holds": gap["mean"] < PLATEAU or rise["mean"] < PLATEAU,
                "detail": f"{arm}: pass@1 step {end} − step {mid} {fmt_paired(rise)}, "
                f"{kmax} − pass@1 at step {end} {fmt_paired(gap)}; holds when either is below "
                f"{PLATEAU:g} (pass@1 stopped rising, or it met {kmax})",
            }
        )
    return out


def checks(tables: dict[str, Any], cfg: dict[str, Any], old: dict | None) -> list[dict]:
    """The paper's statements and the issue's precondition; a difference counts beyond 2 SE."""
    out = []
    kmax = f"pass@{_ks(cfg['eval_samples'])[-1]}"
    reg = {r["run"]: r for r in tables["regime"]}
    if "grpo" in reg:
        shares = [reg[n]["μ̂≥0.5 of mixed"]["mean"] for n in reg if not n.startswith("SFT")]
        out.append(
            {
                "name": "regime_high_success",
                "holds": min(shares) >= 0.5,
                "detail": "share of mixed groups with μ̂ ≥ 0.5, pooled over each run's steps: "
                f"{min(shares):.3f} (lowest arm) to {max(shares):.3f}; a conclusion needs ≥ 0.5",
            }
        )
    for row in tables["paired"]:
        x, y = row["difference"].split(" − ")
        for k in ("pass@1", kmax):
            p = row[k]
            out.append(
                {
                    "name": f"{x} > {y} at {k}".replace(" ", "_"),
                    "holds": p["n"] > 1 and p["mean"] > 2 * p["se"],
                    "detail": f"{row['difference']} at {k}: {fmt_paired(p)}; holds only when the "
                    "paired mean is above 2 paired SE (F-GRPO: the focal weight raises both)",
                }
            )
    out += _endpoint_checks(tables, kmax)
    for row in tables["dips"][:1]:  # grpo; every arm's row is in the README's table
        dip, rec = (v for k, v in row.items() if k.startswith("step"))
        out.append(
            {
                "name": f"{row['arm']} early dip and recovery at {row['metric']}".replace(" ", "_"),
                "holds": dip["mean"] < -2 * dip["se"] and rec["mean"] > 2 * rec["se"],
                "detail": f"{row['arm']} {row['metric']}: first evaluation − SFT start "
                f"{fmt_paired(dip)}, end − first evaluation {fmt_paired(rec)} (paired over "
                "seeds; the paper reports a dip and a recovery)",
            }
        )
    for g in (0.5, 1.0):
        rows = [r for r in tables.get("table4", []) if f"γ={g:g} verdict" in r]
        if rows:
            agree = [r["N"] for r in rows if r[f"γ={g:g} verdict"] == "agrees"]
            out.append(
                {
                    "name": f"table4_f_grpo_γ={g:g}_raises_pass@1_at_every_N",
                    "holds": len(agree) == len(rows)
                    and all(r[f"γ={g:g} − GRPO, ours"]["n"] > 1 for r in rows),
                    "detail": f"F-GRPO Table 4: γ={g:g} above GRPO at pass@1 at every N; ours "
                    + "; ".join(
                        f"N={r['N']}: {fmt_paired(r[f'γ={g:g} − GRPO, ours'])} points "
                        f"(paper {r[f'γ={g:g} − GRPO, paper']:+.1f})"
                        for r in rows
                    ),
                }
            )
    if old is not None:
        p = old["pass@64"]
        out.append(
            {
                "name": "low_success_setting_f_grpo_below_grpo_at_pass@64",
                "holds": p["n"] > 1 and p["mean"] < -2 * p["se"],
                "detail": f"earlier sweep ({old['setting']}): {old['difference']} at pass@64 "
                f"{fmt_paired(p)}; two axes differ there (aggregation and focal weight)",
            }
        )
    return out


# ---- figure and README ----------------------------------------------------------------------------


def plot(tables: dict[str, Any], cfg: dict[str, Any]):
    """Paired differences vs k; pass@1 / pass@k_max over training; the regime; the N sweep."""
    from grouprl.report.html import figure

    fig, ax = figure(2, 2, width=5.0, height=3.4)
    ks = _ks(cfg["eval_samples"])
    kmax = ks[-1]

    def bars(a, xs, p, label):
        m = [x["mean"] for x in p]
        e = [x["se"] if math.isfinite(x["se"]) else 0.0 for x in p]
        a.errorbar(xs, m, yerr=e, fmt="o-", ms=3, capsize=2, label=label)

    for row in tables["paired"]:
        bars(ax[0, 0], ks, [row[f"pass@{k}"] for k in ks], row["difference"])
    colour = {name: f"C{i}" for i, (name, _g, _c) in enumerate(_arms(cfg))}
    for row in tables["curves"]:
        steps = [int(s) for s in row if s.isdigit()]
        first = row["metric"] == "pass@1"
        ax[0, 1].plot(
            steps, [row[str(s)]["mean"] for s in steps], "o-" if first else "s--", ms=3,
            color=colour[row["arm"]], label=row["arm"] if first else None,
        )  # fmt: skip
    for row in tables["regime_curves"]:
        xs = [row["bin"] * (i + 0.5) for i in range(len(row["hi_of_mixed"]))]
        ax[1, 0].plot(xs, row["hi_of_mixed"], "-", color=colour[row["arm"]], label=row["arm"])
    ax[1, 0].axhline(0.5, color="grey", ls=":")
    sweep = tables["sweep"]
    if sweep:
        ns = [r["N"] for r in sweep]
        bars(ax[1, 1], ns, [r["pass@1"] for r in sweep], "pass@1")
        bars(ax[1, 1], ns, [r[f"pass@{kmax}"] for r in sweep], f"pass@{kmax}")
        ax[1, 1].set_xscale("log", base=2)
    else:  # no N sweep: the endpoint instead, pass@k_max − pass@1 over training per arm
        by = {(r["arm"], r["metric"]): r for r in tables["curves"]}
        for (arm, metric), row in by.items():
            top = by.get((arm, f"pass@{kmax}"))
            if metric != "pass@1" or top is None:
                continue
            steps = [int(s) for s in row if s.isdigit()]
            gap = [top[str(s)]["mean"] - row[str(s)]["mean"] for s in steps]
            ax[1, 1].plot(steps, gap, "o-", ms=3, color=colour[arm], label=arm)
        ax[1, 1].axhline(PLATEAU, color="grey", ls="--", lw=0.8)
    titles = {
        (0, 0): ("k", "arm − arm at the end (paired mean ± SE)"),
        (0, 1): ("RL step", f"pass@1 (solid), pass@{kmax} (dashed); mean over seeds"),
        (1, 0): ("RL step", f"share of mixed groups with μ̂ ≥ 0.5 ({BIN}-step bins)"),
        (1, 1): ("group size N", "f_grpo − grpo by N (paired mean ± SE)")
        if sweep
        else ("RL step", f"pass@{kmax} − pass@1 (the endpoint: ≤ {PLATEAU:g}); mean over seeds"),
    }
    for (i, j), (xl, title) in titles.items():
        a = ax[i, j]
        a.set_xlabel(xl, fontsize=8)
        a.set_title(title, fontsize=8)
        a.tick_params(labelsize=7)
        if (i, j) != (0, 1):
            a.axhline(0.0, color="grey", ls=":", lw=0.8) if (i, j) != (1, 0) else None
        a.legend(fontsize=6)
    ax[0, 0].set_xscale("log", base=2)
    return fig


def _cell(v: Any) -> Any:
    return fmt_paired(v) if isinstance(v, dict) and "se" in v else v


def _sft_text(c: dict[str, Any]) -> str:
    """``1200 steps (300 on ≤ 2 moves, 900 on ≤ 3; constant lr)`` or ``1000 steps``."""
    stages = [tuple(map(int, str(x).split(":"))) for x in c.get("sft_curriculum") or []]
    if c["sft_steps"] > 0:
        stages.append((c["max_path"], c["sft_steps"]))
    total = sum(n for _, n in stages)
    if not c.get("sft_curriculum"):
        return f"{total} steps"
    per: dict[int, int] = {}
    for m, n in stages:
        per[m] = per.get(m, 0) + n
    parts = ", ".join(f"{n} on ≤ {m} moves" for m, n in per.items())
    return f"{total} steps ({parts}; {c.get('sft_schedule', 'cosine')} lr)"


def readme_block(payload: dict[str, Any]) -> str:
    t, c = payload["tables"], payload["config"]
    kmax = _ks(c["eval_samples"])[-1]
    task = f"{c['size']}×{c['size']} mazes, path {c['min_path']}–{c['max_path'] or 'any'} moves"
    parts = [
        "**Regime** (per run, pooled over its steps; mean ± std over seeds):\n",
        C.markdown_table(t["regime"]),
        "\n**Final pass@k** (mean ± std over seeds):\n",
        C.markdown_table(t["final"]),
        "\n**Paired differences at the end** (mean ± paired SE over seeds, in how many seeds "
        "the sign holds, and the 95 % percentile bootstrap interval of the mean, "
        "`grouprl.diagnostics.compare.paired_stats`; coarse with few seeds: 3 seeds give at "
        "most 10 distinct resample means, 5 give 126):\n",
        C.markdown_table([{k: _cell(v) for k, v in r.items()} for r in t["paired"]]),
        "\n**Over training** (mean over seeds; the paper reports an early dip and a recovery):\n",
        C.markdown_table(t["curves"]),
    ]
    if t["dips"]:
        parts += [
            "\n**Dip and recovery** (paired over seeds):\n",
            C.markdown_table([{k: _cell(v) for k, v in r.items()} for r in t["dips"]]),
        ]
    if t.get("lengths"):
        parts += [
            f"\n**pass@1 by answer length** (N = {c['group']}; the held-out mazes of each "
            "length; mean ± std over seeds):\n",
            C.markdown_table(t["lengths"]),
        ]
    if t["sweep"]:
        parts += [
            f"\n**Group size N** (paired, at the end; pass@{kmax}):\n",
            C.markdown_table([{k: _cell(v) for k, v in r.items()} for r in t["sweep"]]),
        ]
    if t.get("table4"):
        parts += [
            "\n**Against F-GRPO Table 4** (final pass@1, %; ours mean ± std over seeds, the "
            "differences paired by seed ± paired SE; verdict: the sign of ours beyond 2 SE "
            "against the paper's):\n",
            C.markdown_table([{k: _cell(v) for k, v in r.items()} for r in t["table4"]]),
        ]
    if payload.get("legacy"):
        parts += [
            "\n**Earlier low-success setting** (kept as its own row; paired by seed):\n",
            C.markdown_table([{k: _cell(v) for k, v in payload["legacy"].items()}]),
        ]
    if payload.get("missing"):
        parts += [
            f"\n**Not finished** ({len(payload['missing'])} planned runs missing; the tables "
            "above hold the finished runs only, each statistic over the seeds it has): "
            + "; ".join(payload["missing"])
        ]
    parts += [
        "\n" + C.checks_block(payload["checks"]),
        f"\n({len(payload['seeds'])} seeds; {task}, SFT {_sft_text(c)}; "
        f"{c['steps']} RL steps × {c['prompts']} mazes × N = {c['group']} (sweep N = "
        f"{', '.join(map(str, c['sweep_groups'])) or 'none'}); lr {c['lr']:g}; control lr × w̄ = "
        + ", ".join(f"{k} {v:.3g}" for k, v in payload["control_scale"].items())
        + f"; eval {c['eval_prompts']} held-out mazes × {c['eval_samples']} samples every "
        f"{c['eval_every']} steps; {payload['seconds'] / 60:.0f} min of runs)",
    ]
    return "\n".join(parts)


# ---- the sweep ------------------------------------------------------------------------------------


def _run_key(a) -> dict[str, Any]:
    """The settings a saved run must share to be reused."""
    keys = (
        "size", "min_path", "max_path", "sft_steps", "prompts", "steps", "max_new",
        "eval_every", "eval_prompts", "eval_samples", "gammas",
    )  # fmt: skip
    key = {k: getattr(a, k) for k in keys}
    extra = (
        "model", "sft_batch", "sft_lr", "sweep_gammas", "control_gammas", "sft_curriculum",
        "sft_schedule", "coords",
    )  # fmt: skip
    small = SETTINGS["small"]
    key.update({k: getattr(a, k) for k in extra if getattr(a, k) != small.get(k, a.gammas)})
    return key


def _file(runs_dir: Path, arm: str, group: int, seed: int) -> Path:
    slug = arm.replace(" ", "_").replace("×", "x").replace("w̄", "w").replace("m_γ", "m")
    slug = slug.replace("γ=", "g")
    for ch in "()=":
        slug = slug.replace(ch, "")
    return runs_dir / f"{slug}_N{group}_s{seed}.json"


def _execute(a, todo: list[tuple], runs: list[dict], runs_dir: Path, key: dict) -> None:
    """Run ``todo`` = [(arm, γ, N, lr, seed)], saving each run as it finishes."""

    def done(spec: tuple, r: dict) -> None:
        r["key"] = {**key, "lr": spec[3], "group": spec[2]}
        _file(runs_dir, spec[0], spec[2], spec[4]).write_text(json.dumps(r), encoding="utf-8")
        runs.append(r)
        last = r["evals"][str(max(int(s) for s in r["evals"]))]
        ks = _ks(a.eval_samples)
        print(
            f"{spec[0]} N={spec[2]} seed {spec[4]}: pass@1 {last['pass@1']:.3f}  "
            f"pass@{ks[-1]} {last[f'pass@{ks[-1]}']:.3f}  ({r['seconds']:.0f} s)",
            flush=True,
        )

    def folder(spec: tuple) -> Path:  # where a run checkpoints (a.ckpt_every > 0)
        return _file(runs_dir, spec[0], spec[2], spec[4]).with_suffix(".partial")

    if a.workers <= 1 or len(todo) <= 1:  # in this process (tests load this file directly)
        for spec in todo:
            done(spec, job(a, *spec, folder=folder(spec)))
        return
    import torch

    torch.set_num_threads(a.threads)
    _policy(a)  # the warm start once, here: the workers then load it from the cache
    with ProcessPoolExecutor(a.workers, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(job, a, *spec, folder=folder(spec)): spec for spec in todo}
        for fut in as_completed(futures):
            done(futures[fut], fut.result())


def _load(runs_dir: Path, spec: tuple, key: dict) -> dict | None:
    f = _file(runs_dir, spec[0], spec[2], spec[4])
    saved = json.loads(f.read_text()) if f.exists() else None
    if saved is not None and saved.get("key") == {**key, "lr": spec[3], "group": spec[2]}:
        return saved
    return None


def _command(a) -> str:
    """The command line that reproduces this payload (the flags that differ from the defaults)."""
    default = _args(["--setting", a.setting] + (["--quick"] if a.quick else []))
    flags = [" --quick"] if a.quick else []
    if a.setting != "small":
        flags.append(f" --setting {a.setting}")
    for name, value in vars(a).items():
        skip = ("out", "readme_only", "quick", "workers", "setting", "finished_only")
        if name in skip or value == getattr(default, name):
            continue
        flag = name.replace("_", "-")
        if isinstance(value, bool):  # --coords / --no-coords
            flags.append(f" --{'' if value else 'no-'}{flag}")
            continue
        shown = " ".join(map(str, value)) if isinstance(value, list) else value
        flags.append(f" --{flag} {shown}".rstrip())
    return "python reproductions/maze/run.py" + "".join(flags)


def _spec_name(spec: tuple) -> str:
    """``grpo N=8 seed 1``: a planned run (arm, γ, N, lr, seed) by name."""
    arm, _gamma, group, _lr, seed = spec
    return "SFT start evaluation" if arm == "base" else f"{arm} N={group} seed {seed}"


def _compact(run: dict[str, Any]) -> dict[str, Any]:
    """A run for results.json: its evaluations, and per step, as space-separated counts out of
    the step's ``groups``: the mixed groups (0 < μ̂ < 1), the mixed groups with μ̂ ≥ 0.5 and the
    all-correct groups (the share of mixed groups with μ̂ ≥ 0.5 at step t is
    ``mixed_hi[t] / mixed[t]``)."""
    out = {k: v for k, v in run.items() if k not in ("key", "curve", "evals")}
    out["evals"] = {
        s: {k: v for k, v in ev.items() if k != "correct" or run["arm"] == "base"}
        for s, ev in run["evals"].items()
    }
    if "curve" in run:
        c = run["curve"]
        out["per_step"] = {"groups": int(c[0]["groups"])} | {
            key: " ".join(str(int(x[key])) for x in c)
            for key in ("mixed", "mixed_hi", "all_correct")
        }
    return out


def plan(a) -> list[tuple[str, float, int, float, int]]:
    """The runs that need no calibration, as (arm, γ, N, lr, seed), in the order they run: the
    SFT start's evaluation, then seed by seed (an interrupted sweep leaves whole seeds, which
    pair) the main N's arms, the other N's arms at ``sweep_gammas``, and the closed-form lr
    controls at lr × m_γ (F-GRPO App. N, rounded to 4 digits)."""
    out = [("base", 0.0, 0, 0.0, 0)]
    closed = [g for g in a.control_gammas if "closed" in a.controls]
    for s in range(a.seeds):
        out += [(arm_name(g), g, a.group, a.lr, s) for g in [0.0, *a.gammas]]
        out += [
            (arm_name(g), g, n, a.lr, s)
            for n in a.sweep_groups
            if n != a.group
            for g in sorted({0.0, *a.sweep_gammas})
        ]
        out += [
            (arm_name(g, "closed"), 0.0, a.group, float(f"{a.lr * focal_mean_weight(g):.4g}"), s)
            for g in closed
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    out = C.output_folder(a, HERE, readme_block)
    if out is None:
        return 0
    runs_dir = out / ("runs_quick" if a.quick else "runs")
    runs_dir.mkdir(parents=True, exist_ok=True)
    key = _run_key(a)
    seeds = range(a.seeds)
    phase1 = plan(a)
    closed = {g: focal_mean_weight(g) for g in a.control_gammas if "closed" in a.controls}
    runs: list[dict] = []
    missing: list[str] = []  # --finished-only: the planned runs not (yet) saved
    scales: dict[str, float] = {f"m_γ(γ={g:g})": m for g, m in closed.items()}
    for phase in (1, 2):
        if phase == 2:  # the measured lr controls: calibrated on the finished f_grpo runs
            todo_specs = []
            for g in a.control_gammas if "measured" in a.controls else []:
                w = control_scale(runs, g, a.group)
                if w is None:
                    continue
                scales[f"γ={g:g}"] = w
                lr = float(f"{a.lr * w:.4g}")
                todo_specs += [(arm_name(g, "measured"), 0.0, a.group, lr, s) for s in seeds]
        else:
            todo_specs = phase1
        todo = []
        for spec in todo_specs:
            saved = _load(runs_dir, spec, key)
            if saved is not None:
                runs.append(saved)
            else:
                todo.append(spec)
        if a.finished_only:
            missing += [_spec_name(spec) for spec in todo]
            if phase == 1 and not any(r["arm"] == "base" for r in runs):
                raise SystemExit(
                    f"--finished-only: no finished SFT-start evaluation under {runs_dir}; run "
                    "the sweep first (the same flags without --finished-only)"
                )
        else:
            _execute(a, todo, runs, runs_dir, key)
    cfg = {
        k: v
        for k, v in vars(a).items()
        if k not in ("out", "readme_only", "threads", "workers", "quick", "finished_only")
    }
    tables = summarise(runs, cfg)
    old = legacy()
    chk = checks(tables, cfg, old)
    payload = {
        "name": "maze",
        "claim": "F-GRPO §5.2 (maze, single solution): the focal weight (1 − μ̂)^γ raises both "
        "pass@1 and pass@k over GRPO at every group size N; §5.6: not because of a smaller "
        "step (GRPO with the lr lowered to the focal weight's mean scale does not match it).",
        "command": _command(a),
        "quick": a.quick,
        "seeds": list(seeds),
        "config": cfg,
        "control_scale": scales,
        "table": tables["final"],
        "tables": tables,
        "legacy": old,
        "checks": chk,
        "missing": missing,
        "seconds": sum(r["seconds"] for r in runs),
        "runs": [_compact(r) for r in runs],
    }
    return C.publish(out, payload, plot(tables, cfg), readme_block)


if __name__ == "__main__":
    sys.exit(main())
