"""bf16 rollouts with fp32 updates on the maze: what rollout correction does here.

The mismatch a vLLM-bf16 + FSDP-fp32 stack has, in miniature: the tiny maze policy samples
under bf16 autocast (``model.rollout_precision=bfloat16``) and trains in fp32; the trainer
recomputes the behaviour log-probs in fp32 (verl's decoupled mode), logs the mismatch every
step and applies the arm's correction (ALGORITHMS.md §3c). Arms, otherwise identical (the
``grpo`` preset, token-mean, one on-policy update per step, the same lr, seeds and prompt
streams, the same SFT start):

- ``fp32``: rollouts at the training precision (no mismatch; the reference);
- ``bf16``: bf16 rollouts, no correction;
- ``bf16 + TIS``: token truncated IS, cap 2 (Yao et al. 2025; verl's default threshold);
- ``bf16 + MIS``: sequence masked IS, cap 3 (TRL's default ``sequence_mask``);
- ``bf16 + IcePop``: the two-sided token mask [0.5, 5] (Ring-1T; verl's preset);
- ``bf16 + IcePop tight`` [0.97, 1.03] and ``bf16 + MIS tight`` (cap 1.05): the same methods
  with bounds at about this mismatch's 1st / 99th percentiles, so that they act.

Per step: ``mismatch/*`` (KL k1/k3, token ratio min / p01 / p99 / max before any correction)
and the share of tokens the correction truncated or zeroed. At the end: pass@k on held-out
mazes (fp32 sampling: the policy, not the engine) and the mean training reward of the last
steps, compared by paired differences per seed (arm − ``bf16``; ``bf16`` − ``fp32``).

    python reproductions/rollout_correction/run.py              # 3 seeds (resumable: runs/)
    python reproductions/rollout_correction/run.py --quick      # seconds: schema check
    python reproductions/rollout_correction/run.py --readme-only

Each run is saved under ``runs/`` as it finishes; a rerun skips the runs already there with the
same settings.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common as C
from maze import run as maze  # the maze setting's policy, evaluation and paired statistics

HERE = Path(__file__).resolve().parent

ARMS: dict[str, tuple[str, str]] = {
    "fp32": ("same", "none"),
    "bf16": ("bfloat16", "none"),
    "bf16 + TIS": ("bfloat16", "token_tis:cap=2"),
    "bf16 + MIS": ("bfloat16", "seq_mis:cap=3"),
    "bf16 + IcePop": ("bfloat16", "icepop:low=0.5,high=5"),
    # the published bounds never act on this mismatch (token ratios within ~[0.9, 1.1]):
    # the same methods with bounds that do, at about the 1st / 99th percentile [OURS]
    "bf16 + IcePop tight": ("bfloat16", "icepop:low=0.97,high=1.03"),
    "bf16 + MIS tight": ("bfloat16", "seq_mis:cap=1.05"),
}
"""Arm -> (model.rollout_precision, algorithm.rollout_correction)."""

TRACKED = (
    "mismatch/kl_k1",
    "mismatch/kl_k3",
    "mismatch/logp_diff_max",
    "mismatch/ratio_min",
    "mismatch/ratio_p01",
    "mismatch/ratio_p99",
    "mismatch/ratio_max",
    "mismatch/seq_log_ratio_p01",
    "mismatch/seq_log_ratio_p99",
    "corr/weight_mean",
    "corr/zeroed_frac",
    "reward/mean",
    "time/correction",
    "time/logprobs",
    "time/step",
)
"""Per-step metrics kept for every run."""


def _args(argv: list[str] | None):
    p = C.parser(__doc__.splitlines()[0], default_seeds=3)
    p.add_argument("--size", type=int, default=4, help="maze side (cells)")
    p.add_argument("--min-path", type=int, default=1)
    p.add_argument("--max-path", type=int, default=5)
    p.add_argument("--sft-steps", type=int, default=1000, help="supervised warm start (cached)")
    p.add_argument("--prompts", type=int, default=16, help="mazes per step")
    p.add_argument("--group", type=int, default=8, help="completions per maze")
    p.add_argument("--steps", type=int, default=150, help="RL steps per run")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-new", type=int, default=10)
    p.add_argument("--last", type=int, default=50, help="steps of the final mean reward")
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--eval-samples", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="runs in parallel (one thread each)")
    a = p.parse_args(argv)
    if a.quick:
        a.size, a.min_path, a.max_path, a.sft_steps = 2, 1, 1, 15
        a.prompts, a.group, a.steps, a.max_new, a.last = 4, 4, 4, 4, 2
        a.eval_prompts, a.eval_samples, a.workers = 4, 8, 1
    a.eval_every = a.steps  # what maze.evaluate reads
    # the maze setting's policy: the tiny model, its SFT (batch 64, lr 2e-3, cached)
    a.model, a.sft_batch, a.sft_lr = "tiny", 64, 2e-3
    return a


def overrides(a, arm: str, seed: int) -> list[str]:
    """The config of one arm: only the rollout precision and the correction differ."""
    precision, spec = ARMS[arm]
    return [
        "model.name=tiny",
        "model.warm_start=false",
        f"model.rollout_precision={precision}",
        "task.name=maze",
        f"sampling.prompts_per_step={a.prompts}",
        f"sampling.group_size={a.group}",
        f"sampling.max_new_tokens={a.max_new}",
        "sampling.verify_timeout_s=0",
        "algorithm.preset=grpo",
        "algorithm.aggregation=token_mean",
        f"algorithm.rollout_correction={spec}",
        f"optim.steps={a.steps}",
        f"optim.lr={a.lr}",
        "optim.ppo_epochs=1",
        "optim.minibatches=1",
        "eval.every=0",
        f"run.seed={seed}",
        "run.progress=false",
        "run.tensorboard=false",
        "run.report=false",
        "run.threads=1",
    ]


def job(a, arm: str, seed: int) -> dict[str, Any]:
    """One run: ``a.steps`` steps of the arm, the tracked metrics per step, pass@k at the end."""
    import tempfile

    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from grouprl.train import loop
    from grouprl.train.config import load_config

    model, tok, task = maze._policy(a)
    t0, c0 = time.perf_counter(), time.process_time()
    if arm == "base":
        return {"arm": "base", "seed": 0, "eval": maze.evaluate(model, tok, task, a),
                "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}  # fmt: skip
    curve: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [*overrides(a, arm, seed), f"run.out={tmp}"])
        run = loop.setup(cfg, model=model, tokenizer=tok, task=task)
        run.sinks = maze._Capture()
        while run.step < a.steps:
            run.step += 1
            m = loop.train_step(run)
            row = {k: m[k] for k in TRACKED if k in m}
            row.update(
                {k: v for k, v in m.items() if k.startswith("corr/") and k.endswith("_frac")}
            )
            curve.append(row)
        ev = maze.evaluate(run.model, tok, task, a)
    ev.pop("correct", None)
    print(f"  {arm} seed {seed}: pass@1 {ev['pass@1']:.3f} ({time.perf_counter() - t0:.0f} s)",
          flush=True)  # fmt: skip
    return {"arm": arm, "seed": seed, "eval": ev, "curve": curve,
            "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}  # fmt: skip


# ---- statistics ---------------------------------------------------------------------------------


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else float("nan")


def run_summary(run: dict[str, Any], last: int) -> dict[str, float]:
    """One run's numbers: its step means of the tracked metrics, the extremes of the ratio,
    the last steps' mean reward, and the final pass@k."""
    c = run["curve"]
    out = {f"pass@{k}": run["eval"][f"pass@{k}"] for k in maze._ks(len_samples(run))}
    out["reward_last"] = _mean([r["reward/mean"] for r in c[-last:]])
    for key in ("mismatch/kl_k1", "mismatch/kl_k3", "mismatch/ratio_p01", "mismatch/ratio_p99",
                "corr/zeroed_frac", "time/correction", "time/step"):  # fmt: skip
        out[key] = _mean([r.get(key) for r in c])
    out["mismatch/ratio_min"] = min((r["mismatch/ratio_min"] for r in c if "mismatch/ratio_min" in r), default=float("nan"))  # fmt: skip
    out["mismatch/ratio_max"] = max((r["mismatch/ratio_max"] for r in c if "mismatch/ratio_max" in r), default=float("nan"))  # fmt: skip
    trunc = [
        v for r in c for k, v in r.items() if k.startswith("corr/") and k.endswith("truncated_frac")
    ]
    out["corr/truncated_frac"] = _mean(trunc) if trunc else float("nan")
    kl = [r["mismatch/kl_k3"] for r in c if "mismatch/kl_k3" in r]
    if len(kl) >= 2:  # does the mismatch grow? first vs last tenth of the run
        n = max(1, len(kl) // 10)
        out["kl_k3_first"], out["kl_k3_last"] = _mean(kl[:n]), _mean(kl[-n:])
    return out


def len_samples(run: dict[str, Any]) -> int:
    return max(int(k.split("@")[1]) for k in run["eval"] if k.startswith("pass@"))


def summarise(runs: list[dict], cfg: dict[str, Any]) -> dict[str, Any]:
    by = {
        arm: sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"]) for arm in ARMS
    }
    sums = {arm: [run_summary(r, cfg["last"]) for r in rs] for arm, rs in by.items()}
    ks = maze._ks(cfg["eval_samples"])
    base = next(r for r in runs if r["arm"] == "base")["eval"]
    final = [{"arm": "SFT start", **{f"pass@{k}": C.ms([base[f"pass@{k}"]]) for k in ks}}]
    for arm, ss in sums.items():
        row: dict[str, Any] = {"arm": arm}
        for key in ("reward_last", *[f"pass@{k}" for k in ks]):
            row[key] = C.ms([s[key] for s in ss])
        final.append(row)
    mismatch = []
    for arm, ss in sums.items():
        row = {"arm": arm}
        for key in ("mismatch/kl_k1", "mismatch/kl_k3", "kl_k3_first", "kl_k3_last",
                    "mismatch/ratio_min", "mismatch/ratio_p01", "mismatch/ratio_p99",
                    "mismatch/ratio_max", "corr/truncated_frac", "corr/zeroed_frac"):  # fmt: skip
            row[key.split("/")[-1]] = C.ms([s.get(key, float("nan")) for s in ss])
        mismatch.append(row)
    pairs = [(arm, "bf16") for arm in ARMS if arm.startswith("bf16 +")] + [("bf16", "fp32")]
    paired = []
    for x, y in pairs:
        row = {"difference": f"{x} − {y}"}
        for key in ("reward_last", *[f"pass@{k}" for k in ks]):
            p = maze.paired([s[key] for s in sums[x]], [s[key] for s in sums[y]])
            row[key] = maze.fmt_paired(p)
            row[f"_{key}"] = p
        paired.append(row)
    cost = []
    for arm, ss in sums.items():
        step, corr = _mean([s["time/step"] for s in ss]), _mean([s["time/correction"] for s in ss])
        cost.append({"arm": arm, "s/step": step, "correction s/step": corr,
                     "correction share": corr / step if step == step and corr == corr else float("nan")})  # fmt: skip
    return {"final": final, "mismatch": mismatch, "paired": paired, "cost": cost}


def checks(tables: dict[str, Any], cfg: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    mm = {r["arm"]: r for r in tables["mismatch"]}
    kl = mm["bf16"]["kl_k3"]["mean"]
    out.append({"name": "bf16_rollouts_are_off_policy", "holds": bool(kl > 0),
                "detail": f"mean per-step KL(rollout‖train) k3 under bf16 rollouts: {kl:.3g} "
                          f"(token ratio range {mm['bf16']['ratio_min']['mean']:.4f}–"
                          f"{mm['bf16']['ratio_max']['mean']:.4f})"})  # fmt: skip
    for row in tables["paired"]:
        for key in ("reward_last", "pass@1"):
            p = row[f"_{key}"]
            beyond = abs(p["mean"]) > 2 * p["se"] if p["se"] == p["se"] else False
            out.append({"name": f"{row['difference']}: {key} within 2 paired SE",
                        "holds": not beyond, "detail": row[key]})  # fmt: skip
    for arm in (a for a in ARMS if a.startswith("bf16 +")):
        touched = [mm[arm][k]["mean"] for k in ("truncated_frac", "zeroed_frac")]
        touched = max(t for t in touched if t == t) if any(t == t for t in touched) else 0.0
        out.append({"name": f"{arm} truncated or zeroed a token", "holds": bool(touched > 0),
                    "detail": f"mean share of tokens (sequences for MIS) truncated or zeroed: {touched:.3g}"})  # fmt: skip
    return out


def plot(tables: dict[str, Any], runs: list[dict], cfg: dict[str, Any]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for arm in ARMS:
        rs = [r for r in runs if r["arm"] == arm]
        if not rs:
            continue
        steps = range(1, len(rs[0]["curve"]) + 1)
        if arm != "fp32":
            kl = [
                _mean([r["curve"][i].get("mismatch/kl_k3") for r in rs]) for i in range(len(steps))
            ]
            ax[0].plot(steps, kl, label=arm, lw=1)
        rew = [_mean([r["curve"][i]["reward/mean"] for r in rs]) for i in range(len(steps))]
        ax[1].plot(steps, rew, label=arm, lw=1)
    ax[0].set(title="KL(rollout‖train), k3, per step", xlabel="step", yscale="log")
    ax[1].set(title="training reward (mean over seeds)", xlabel="step")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    return fig


def readme_block(payload: dict[str, Any]) -> str:
    t = payload["tables"]
    cols = [c for c in t["final"][0] if c != "arm"]
    final = [{k: C.fmt(v) if isinstance(v, dict) else v for k, v in r.items()} for r in t["final"]]
    mm = [
        {k: C.fmt(v, 3) if isinstance(v, dict) else v for k, v in r.items()} for r in t["mismatch"]
    ]
    # each cell from the per-seed differences kept beside it ("_" + column), so the rendering
    # follows the shared paired statistics (the bootstrap interval included)
    paired = [
        {k: maze.fmt_paired(r[f"_{k}"]) if f"_{k}" in r else v
         for k, v in r.items() if not k.startswith("_")}
        for r in t["paired"]
    ]  # fmt: skip
    cost = [{k: "–" if v is None else C.fmt(v, 3) for k, v in r.items()} for r in t["cost"]]
    c = payload["config"]
    return "\n\n".join([
        "**Mismatch and what the corrections touched** (per-step means, mean ± std over seeds; "
        "ratio_min / ratio_max: the run's extremes; kl_k3_first / _last: first and last tenth "
        "of the run):",
        C.markdown_table(mm),
        "**Final** (pass@k on the held-out mazes at fp32 sampling; reward_last: training reward "
        f"of the last {c['last']} steps):",
        C.markdown_table(final, ["arm", *cols]),
        "**Paired differences** (mean ± paired SE over seeds, sign count, 95 % percentile "
        "bootstrap interval of the mean; `grouprl.diagnostics.compare.paired_stats`):",
        C.markdown_table(paired),
        "**Cost** (seconds per step, under the machine's load at the time):",
        C.markdown_table(cost),
        C.checks_block(payload["checks"]),
        f"({len(payload['seeds'])} seeds; {c['size']}×{c['size']} mazes, path {c['min_path']}–"
        f"{c['max_path']} moves, SFT {c['sft_steps']} steps; {c['steps']} RL steps × "
        f"{c['prompts']} mazes × {c['group']}, lr {c['lr']:g}; eval {c['eval_prompts']} mazes × "
        f"{c['eval_samples']} samples; {payload.get('cpu_seconds', float('nan')) / 60:.0f} "
        f"CPU-min of runs, {payload['seconds'] / 60:.0f} min of wall time summed over runs)",
    ])  # fmt: skip


# ---- driver -------------------------------------------------------------------------------------


CURVE_KEYS = ("reward/mean", "mismatch/kl_k3", "mismatch/ratio_min", "mismatch/ratio_max")
"""Per-step series kept in results.json (runs/ keeps every tracked metric)."""


def _compact(run: dict[str, Any]) -> dict[str, Any]:
    """A run for results.json: its evaluation and, per step, a few series as space-separated
    numbers (4 significant digits), the correction's truncated / zeroed shares included."""
    out = {k: v for k, v in run.items() if k not in ("key", "curve")}
    if "curve" in run:
        c = run["curve"]
        keys = [*CURVE_KEYS, *sorted({k for row in c for k in row if k.startswith("corr/")
                                      and k.endswith("_frac")})]  # fmt: skip
        out["per_step"] = {
            k: " ".join(f"{row[k]:.4g}" if k in row else "nan" for row in c)
            for k in keys
            if any(k in row for row in c)
        }
    return out


def _key(a) -> dict[str, Any]:
    names = ("size", "min_path", "max_path", "sft_steps", "prompts", "group", "steps", "lr",
             "max_new", "eval_prompts", "eval_samples")  # fmt: skip
    return {k: getattr(a, k) for k in names}


def _file(runs_dir: Path, arm: str, seed: int) -> Path:
    return runs_dir / f"{arm.replace(' + ', '_').replace(' ', '_')}_s{seed}.json"


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    out = C.output_folder(a, HERE, readme_block)
    if out is None:
        return 0
    runs_dir = out / ("runs_quick" if a.quick else "runs")
    runs_dir.mkdir(parents=True, exist_ok=True)
    key = _key(a)
    todo_all = [("base", 0)] + [(arm, s) for s in range(a.seeds) for arm in ARMS]
    runs, todo = [], []
    for arm, seed in todo_all:
        f = _file(runs_dir, arm, seed)
        saved = json.loads(f.read_text()) if f.exists() else None
        (runs.append(saved) if saved and saved.get("key") == key else todo.append((arm, seed)))

    def done(spec: tuple[str, int], r: dict[str, Any]) -> None:
        r["key"] = key
        _file(runs_dir, *spec).write_text(json.dumps(r), encoding="utf-8")
        runs.append(r)

    if a.workers <= 1 or len(todo) <= 1:
        for spec in todo:
            done(spec, job(a, *spec))
    else:
        with ProcessPoolExecutor(a.workers, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(job, a, *spec): spec for spec in todo}
            for fut in as_completed(futures):
                done(futures[fut], fut.result())
    cfg = {k: v for k, v in vars(a).items() if k not in ("out", "readme_only", "workers", "quick")}
    tables = summarise(runs, cfg)
    payload = {
        "name": "rollout_correction",
        "claim": "Rollout correction (TIS, MIS, IcePop) keeps RL on bf16 rollouts with fp32 "
        "updates as good as matched precision (Yao et al. 2025; Liu et al. 2025; Ring-1T).",
        "command": "python reproductions/rollout_correction/run.py"
        + (" --quick" if a.quick else f" --seeds {a.seeds}"),
        "quick": a.quick,
        "seeds": list(range(a.seeds)),
        "config": cfg,
        "arms": {
            k: {"model.rollout_precision": p, "algorithm.rollout_correction": s}
            for k, (p, s) in ARMS.items()
        },
        "table": tables["final"],
        "tables": tables,
        "checks": checks(tables, cfg),
        "seconds": sum(r["seconds"] for r in runs),
        "cpu_seconds": sum(r.get("cpu_seconds", float("nan")) for r in runs),
        "runs": [_compact(r) for r in runs],
    }
    return C.publish(out, payload, plot(tables, runs, cfg), readme_block)


if __name__ == "__main__":
    raise SystemExit(main())
