"""AGPO in miniature: the ablation rows on the 4×4 maze at an equal generated-token budget.

AGPO (arXiv 2605.20722; code github.com/wandugu/paper_agpo) claims that AGPO beats GRPO at the
same generated-token budget and that "ablations confirm both modules are complementary". The
arms, every one the ``agpo`` preset (k1 KL β = 0.03, per-sequence token mean, 4 epochs of one
optimizer step, PPO clip ε = 0.2) with only the controller changed:

- ``grpo``: no controller, fixed ε = 0.2 and τ = 1; **twice the prompts per step** (2P × G
  completions), which is what the AGPO arms generate with their probe (P × G probe + P × G
  training completions): the same generated completions and the same optimizer steps per RL
  step, so the arms are compared step for step at an equal budget (the AGPO code counts the
  probe's tokens in the budget, ``agpo_count_probe_tokens_in_budget`` default True);
- ``clip``: the adaptive clip alone (the probe's statistics set ε; training groups at τ_base);
- ``temperature``: the adaptive temperature alone (each prompt's training group at its τ_t;
  ε = 0.2);
- ``agpo``: both, with the authors' code defaults (ζ = 0, w_k = 0: no skewness term);
- ``grpo_batch``: GRPO at the probe arms' batch (P prompts, no probe: half their
  completions), so that what the probe costs is measured apart from what the controllers do;
- ``agpo+skew``: both, with the skewness term on in both controllers, as the abstract lists
  it ("sets the trust-region size from reward dispersion and skewness"): ζ = ``ZETA`` in the
  clip's denominator and w_k = ``W_K`` in the temperature's uncertainty. The paper's text
  available to us gives no values; these are ours.

All arms of one seed start from the same SFT policy and evaluate on the same held-out mazes
and sampler stream (the trainer's ``evaluate``, re-seeded from ``run.seed``), so arms are
compared by paired differences per seed with ``grouprl compare`` (its JSON is kept in
results.json): paired mean, SE, sign count and a bootstrap interval, at the end.

    python reproductions/agpo/run.py                 # the sweep (resumable: runs/ keeps each run)
    python reproductions/agpo/run.py --quick         # seconds: schema check only
    python reproductions/agpo/run.py --readme-only   # re-render the README block
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common as C

HERE = Path(__file__).resolve().parent
ZETA = 0.2
"""[OURS] ζ of the skewness arm: the value of ALGORITHMS.md §4's clip test vector."""
W_K = 0.2
"""[OURS] w_k of the skewness arm (the temperature's uncertainty weight on |κ|)."""

ARMS: dict[str, dict[str, Any]] = {
    "grpo": {"controller": None, "prompts": 2},
    "clip": {"controller": "agpo_clip_only"},
    "temperature": {"controller": "agpo_temperature_only"},
    "agpo": {"controller": "agpo"},
    "agpo+skew": {"controller": "agpo_skew"},
    "grpo_batch": {"controller": None},
}
"""Arm -> its controller (``prompts``: the multiple of the AGPO arms' prompts per step)."""

SETTINGS = {
    "full": {"steps": 100, "prompts": 16, "group": 8, "lr": 1e-4, "eval_every": 50,
             "eval_prompts": 100, "eval_samples": 32, "ks": "1,8,32", "sft_steps": 1000},
    "quick": {"steps": 2, "prompts": 2, "group": 4, "lr": 1e-4, "eval_every": 1,
              "eval_prompts": 4, "eval_samples": 4, "ks": "1,4", "sft_steps": 20},
}  # fmt: skip


def _maze():
    """The maze reproduction's module (its SFT warm start, shared with it)."""
    spec = importlib.util.spec_from_file_location("maze_run", HERE.parent / "maze" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def register() -> None:
    """The ablation controllers and the fixed-controller preset, registered for this process."""
    from grouprl import presets
    from grouprl.control.agpo import AGPO
    from grouprl.train import controllers

    class Ablated(controllers.AGPOController):
        """AGPO's probe every step; ``clip`` / ``temperature`` say which controller acts."""

        def __init__(self, base_temperature, *, clip=True, temperature=True, skew=False):
            super().__init__(base_temperature)
            if skew:
                self.agpo = AGPO(
                    base_temperature=base_temperature,
                    temperature_params={"w_k": W_K},
                    clip_params={"zeta": ZETA},
                )
            self.adapt_clip, self.adapt_temperature = clip, temperature

        def temperature(self, examples, probe):
            taus, metrics = super().temperature(examples, probe)
            if not self.adapt_temperature:  # the probe's statistics still feed the clip
                taus = taus.new_full(taus.shape, self.base_temperature)
            return taus, metrics

        def clip_params(self, policy, batch, params):
            return super().clip_params(policy, batch, params) if self.adapt_clip else (params, {})

        def after_update(self, policy, batch):
            return super().after_update(policy, batch) if self.adapt_clip else {}

    def factory(**kw):
        return lambda cfg: Ablated(cfg.sampling.temperature, **kw)

    controllers.CONTROLLERS.update(
        agpo_clip_only=factory(temperature=False),
        agpo_temperature_only=factory(clip=False),
        agpo_skew=factory(skew=True),
    )
    base = presets.get("agpo")
    for name, arm in ARMS.items():
        pname = _preset(name)
        if pname == "agpo" or pname in presets.names():
            continue
        presets.register_preset(
            base.with_(
                name=pname, description=f"AGPO ablation: {name}", controller=arm["controller"]
            )
        )


def _preset(arm: str) -> str:
    return "agpo" if arm == "agpo" else f"agpo_ablation_{arm.replace('+', '_')}"


def overrides(s: dict[str, Any], arm: str, seed: int, out: Path) -> list[str]:
    return [
        "model.name=tiny",
        "model.warm_start=false",
        "task.name=maze",
        f"sampling.prompts_per_step={s['prompts'] * ARMS[arm].get('prompts', 1)}",
        f"sampling.group_size={s['group']}",
        "sampling.max_new_tokens=10",
        "sampling.verify_timeout_s=0",
        f"algorithm.preset={_preset(arm)}",
        f"optim.steps={s['steps']}",
        f"optim.lr={s['lr']}",
        f"eval.every={s['eval_every']}",
        f"eval.prompts={s['eval_prompts']}",
        f"eval.samples={s['eval_samples']}",
        f"eval.ks=[{s['ks']}]",
        f"run.seed={seed}",
        f"run.out={out}",
        "run.progress=false",
        "run.tensorboard=false",
        "run.report=false",
        "run.save_final=false",
        "run.every=0",
        "run.threads=1",
    ]


def job(s: dict[str, Any], arm: str, seed: int, out: Path) -> float:
    """One run into ``out`` (config.yaml + metrics.jsonl); its seconds."""
    import torch

    torch.set_num_threads(1)
    from grouprl.train import loop
    from grouprl.train.config import load_config

    register()
    maze = _maze()
    a = SimpleNamespace(
        size=4,
        min_path=1,
        max_path=5,
        model="tiny",
        sft_steps=s["sft_steps"],
        sft_batch=64,
        sft_lr=2e-3,
        sft_curriculum=[],
        sft_schedule="cosine",
        coords=False,
    )  # fmt: skip  (the maze reproduction's small setting)
    model, tok, task = maze._policy(a)
    t0 = time.perf_counter()
    cfg = load_config(None, [*overrides(s, arm, seed, out), "run.overwrite=true"])
    loop.train(cfg, model=model, tokenizer=tok, task=task)
    return time.perf_counter() - t0


def _done(folder: Path, steps: int) -> bool:
    m = folder / "metrics.jsonl"
    if not m.is_file():
        return False
    rows = [json.loads(x) for x in m.read_text().splitlines() if x.strip()]
    return any(r.get("step") == steps and "eval/pass@1" in r for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = C.parser(__doc__.split("\n")[0])
    p.add_argument("--runs", type=Path, default=HERE / "runs", help="run folders (kept)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2)")
    p.add_argument(
        "--arms", nargs="+", choices=list(ARMS), default=list(ARMS), help="run only these arms"
    )
    args = p.parse_args(argv)
    out = C.output_folder(args, HERE, readme_block)
    if out is None:
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    s = SETTINGS["quick" if args.quick else "full"]
    runs = args.runs if not args.quick else out / "runs_quick"
    todo = [
        (arm, seed, runs / arm / f"seed{seed}")
        for seed in range(args.seeds)
        for arm in args.arms
        if not _done(runs / arm / f"seed{seed}", s["steps"])
    ]

    def done(arm: str, seed: int, folder: Path, sec: float) -> None:
        print(f"{arm} seed {seed}: {sec:.0f} s", flush=True)
        (folder / "seconds.json").write_text(json.dumps({"seconds": sec}))

    if args.jobs <= 1:  # in this process (the tests' way: a loaded module cannot be pickled)
        for arm, seed, folder in todo:
            done(arm, seed, folder, job(s, arm, seed, folder))
        return summarise(args, s, runs, out)
    ctx = get_context("spawn")  # a fresh interpreter per run: torch threads and registry set there
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as pool:
        futures = {pool.submit(job, s, *t): t for t in todo}
        for f in as_completed(futures):
            arm, seed, folder = futures[f]
            done(arm, seed, folder, f.result())
    return summarise(args, s, runs, out)


def _seconds(runs: Path) -> float:
    return sum(json.loads(f.read_text())["seconds"] for f in runs.glob("*/seed*/seconds.json"))


def summarise(args, s, runs: Path, out: Path) -> int:
    missing = [
        f"{arm}/seed{seed}"
        for arm in ARMS
        for seed in range(args.seeds)
        if not _done(runs / arm / f"seed{seed}", s["steps"])
    ]
    if missing:
        print(
            f"not summarised: runs still missing ({', '.join(missing)}); rerun when they are done"
        )
        return 0
    from grouprl.diagnostics.compare import compare, load_arms
    from grouprl.report.compare import figure

    arms = load_arms({arm: [str(runs / arm / "seed*")] for arm in ARMS})
    ks = [int(k) for k in s["ks"].split(",")]
    metrics = [f"eval/pass@{k}" for k in ks]
    at = list(range(s["eval_every"], s["steps"], s["eval_every"]))
    res = {b: compare(arms, metrics=metrics, baseline=b, at=at) for b in BASELINES}
    rows, checks = verdicts(res, metrics)
    payload = {
        "name": "agpo",
        "claim": "AGPO beats GRPO at the same generated-token budget; its two modules "
        "(adaptive clip, adaptive temperature) are complementary (AGPO abstract).",
        "command": "python reproductions/agpo/run.py"
        + (" --quick" if args.quick else "")
        + f" --seeds {args.seeds}",
        "quick": args.quick,
        "seeds": list(range(args.seeds)),
        "config": {**s, "zeta": ZETA, "w_k": W_K, "arms": ARMS},
        "table": rows,
        "checks": checks,
        "compare": res["grpo"],
        "compare_vs": {b: res[b]["comparisons"] for b in BASELINES[1:]},
        "seconds": _seconds(runs),
    }
    fig = figure(res["grpo"], metrics[:1] + metrics[-1:])
    return C.publish(out, payload, fig, readme_block)


BASELINES = ("grpo", "grpo_batch", "clip", "temperature")
"""The arms each arm is compared with: GRPO at the equal budget (the claim), GRPO at the
equal batch (the probe's cost apart), and each module alone (complementarity)."""

ROWS = {
    "clip": "adaptive clip alone beats GRPO",
    "temperature": "adaptive temperature alone beats GRPO",
    "agpo": "AGPO (both, authors' defaults ζ = 0, w_k = 0) beats GRPO",
    "agpo+skew": f"AGPO with the skewness term (ζ = {ZETA:g}, w_k = {W_K:g}) beats GRPO",
}


def _word(d: dict[str, Any]) -> str:
    """A paired difference's verdict: beyond 2 SE with every seed agreeing, or not."""
    if d["n"] < 2:
        return "one seed: no verdict"
    lo, hi = d["mean"] - 2 * d["se"], d["mean"] + 2 * d["se"]
    if lo > 0 and d["positive"] == d["n"]:
        return "holds"
    if hi < 0 and d["negative"] == d["n"]:
        return "reversed"
    return "not shown (within 2 SE or signs disagree)"


def _cell(d: dict[str, Any]) -> str:
    return (
        f"{d['mean']:+.4f} ± {d['se']:.4f} ({d['positive']}/{d['n']} > 0; "
        f"CI [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}])"
    )


def verdicts(res: dict[str, Any], metrics: list[str]) -> tuple[list[dict], list[dict]]:
    """One row per ablation (arm − GRPO at the end, paired) and the complementarity rows
    (both modules − each module alone)."""

    def end(base: str, arm: str, m: str) -> dict[str, Any]:
        for c in res[base]["comparisons"]:
            if c["arm"] == arm and c["metric"] == m:
                return c["end"]
        raise KeyError((base, arm, m))

    rows, checks = [], []
    for arm, claim in ROWS.items():
        row = {"row": claim}
        for m in metrics:
            row[m.split("/")[-1]] = _cell(end("grpo", arm, m))
        row["verdict (pass@1)"] = _word(end("grpo", arm, metrics[0]))
        row["pass@1 vs grpo_batch (equal batch)"] = _cell(end("grpo_batch", arm, metrics[0]))
        rows.append(row)
        checks.append({"name": claim, "holds": row["verdict (pass@1)"] == "holds",
                       "detail": row[metrics[0].split("/")[-1]]})  # fmt: skip
    claim = "the probe's cost: GRPO on half the completions (P, no probe) − GRPO at 2P"
    d = {m.split("/")[-1]: _cell(end("grpo", "grpo_batch", m)) for m in metrics}
    rows.append({"row": claim, **d, "verdict (pass@1)": "context, not a claim"})
    for both in ("agpo", "agpo+skew"):
        parts = [(alone, end(alone, both, metrics[0])) for alone in ("clip", "temperature")]
        holds = all(_word(d) == "holds" for _, d in parts)
        detail = "; ".join(f"{both} − {alone}: {_cell(d)}, {_word(d)}" for alone, d in parts)
        claim = f"the modules are complementary: {both} beats each module alone (pass@1)"
        rows.append({"row": claim, "verdict (pass@1)": "holds" if holds else "not shown",
                     "detail": detail})  # fmt: skip
        checks.append({"name": claim, "holds": holds, "detail": detail})
    return rows, checks


def readme_block(payload: dict[str, Any]) -> str:
    cols = [k for k in payload["table"][0]]
    extra = [k for r in payload["table"] for k in r if k not in cols]
    return "\n\n".join(
        [
            C.markdown_table(payload["table"], [*cols, *dict.fromkeys(extra)]),
            C.checks_block(payload["checks"]),
            f"Seeds: {len(payload['seeds'])}; run time {payload['seconds'] / 60:.1f} min in all "
            "(the sum of the runs' seconds).",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
