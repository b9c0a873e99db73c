"""Advantage collapse over training: GRPO vs AVSPO (each virtual mode) vs dynamic sampling.

Learning model [OURS, stated so it can be argued with]: a pool of Q prompts, prompt q solved
with probability p_q = sigmoid(θ_q), initial p_q ~ Beta(m·κ, (1 − m)·κ) (mean m, concentration
κ = ``pool_concentration`` = 1.5). Each step draws P prompts without replacement, samples G
Bernoulli(p_q) rewards per prompt, computes advantages with ``grouprl.advantages.compute`` and
takes the exact score-function step of the Bernoulli policy, θ_q += η · (1/G) Σ_i A_i (r_i − p_q).
No generalisation across prompts: a prompt learns only when its own group carries a signal,
which isolates what collapse costs.

**The paper's regime** [ACR paper abstract and §1: GRPO at G = 8 has 28–45 % of its
groups collapsed]: ``pool_mean`` m is calibrated (:func:`calibrate_pool`, bisection) so that
GRPO's raw ACR over the run is the middle of that range, 0.365, on the hard side (m < 0.5:
all-wrong groups outnumber all-correct ones at the start, as early in RLVR training). The pool
(4096 prompts, 600 rounds of 32 groups: each prompt drawn ~4.7 times) is large enough that it
is not solved during the run, so the ACR stays in the range instead of climbing towards 1.

Methods at **equal rollouts** (every method spends P·G rollouts per generation round):

- ``grpo``; ``avspo_symmetric`` / ``avspo_paper`` / ``avspo_code``: GRPO with virtual samples
  in that mode and the adaptive trigger (``VirtualTrigger``) carried across steps, the P
  groups of a round forming one generation batch;
- ``avspo_code_g1``: the code mode as its authors run it, **one group per generation batch**
  [CODE: hexixiang/ACR train_grpo.sh runs TRL with ``per_device_train_batch_size 1`` (TRL counts
  completions), 4 processes, ``num_generations 4`` and the default ``steps_per_generation`` =
  ``gradient_accumulation_steps`` = 1, so a generation batch is 4 completions = one group of
  G = 4; trl_scope/trainer/grpo_trainer.py:1515 fires when *every* reward of that batch is 0
  (or 1) and adds one virtual reward of the opposite value to each group (1518-1536)]. So it
  fires on every all-wrong or all-correct group, where ``avspo_code`` with 32 groups per batch
  essentially never fires. Each round's P groups are P generation batches of one group; as
  prompts do not share parameters in this model, that is the same update as one step on all
  P with the per-group rule [OURS]. Same eps (1e-6) as the other methods [OURS: the authors
  divide by std + 1e-4, grpo_trainer.py:1578; kept equal here to isolate the batch size];
- ``dynamic_sampling`` (DAPO): generate rounds of P groups, keep the mixed ones until P are
  collected or ``max_rounds`` rounds are spent, then step on them; the dropped groups are
  rollouts spent for nothing, and the run takes fewer steps for the same budget.

Per round: the paper's metric, ACR of the **raw** rewards (collapsed share of the generated
groups before any virtual sample is injected; the authors' code logs it there,
grpo_trainer.py:1452-1498), split into all-wrong and all-correct, next to the share of groups
left without gradient (collapsed and not rescued, or dropped by dynamic sampling), and the share
of groups that received virtual samples; per logged point, mean p over the pool (the learning
outcome). Every method of a seed starts from the same pool and draws the same prompt and
reward uniforms (common random numbers), so differences between methods are paired by seed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from grouprl.diagnostics.acr import collapse_split
from grouprl.report.html import figure
from grouprl.simulate._common import Claim, SimResult

__all__ = ["METHODS", "AcrConfig", "calibrate_pool", "initial_pool", "run_method", "simulate"]

METHODS = (
    "grpo",
    "avspo_symmetric",
    "avspo_paper",
    "avspo_code",
    "avspo_code_g1",
    "dynamic_sampling",
)
"""The compared methods (see the module docstring)."""


@dataclass(frozen=True)
class AcrConfig:
    """Parameters of the ACR simulation."""

    prompts: int = 4096
    batch: int = 32
    group_size: int = 8
    pool_mean: float | None = None
    """Mean m of the initial Beta pool; None: calibrated by :func:`calibrate_pool`."""
    pool_concentration: float = 1.5
    lr: float = 1.0
    rounds: int = 600
    """Generation rounds of P·G rollouts each (the rollout budget is rounds·P·G)."""
    max_rounds: int = 3
    """Dynamic sampling gives up after this many rounds per step (DAPO's max_num_gen_batches)."""
    seeds: int = 5
    seed: int = 0
    acr_range: tuple[float, float] = (0.28, 0.45)
    """GRPO's ACR at G = 8 in the ACR paper; the calibration aims at its middle."""
    pool_mean_bracket: tuple[float, float] = (0.1, 0.5)
    calib_iters: int = 7


QUICK = AcrConfig(prompts=512, rounds=100, seeds=2, calib_iters=4)
"""``--quick``: 512 prompts, 100 rounds, 2 seeds, 4 bisection steps."""


def initial_pool(cfg: AcrConfig, seed: int) -> torch.Tensor:
    """``[Q]`` float64 initial θ = logit(p), p ~ Beta(m·κ, (1 − m)·κ) drawn with numpy's
    generator of ``seed`` (torch's Beta sampler has no generator), clamped to [1e-4, 1 − 1e-4]."""
    if cfg.pool_mean is None or not 0 < cfg.pool_mean < 1:
        raise ValueError(
            f"pool_mean must be in (0, 1), got {cfg.pool_mean!r}: pass it, or calibrate it "
            "with acr.calibrate_pool(cfg)"
        )
    a, b = cfg.pool_mean * cfg.pool_concentration, (1 - cfg.pool_mean) * cfg.pool_concentration
    p0 = np.random.default_rng(seed).beta(a, b, size=cfg.prompts)
    return torch.logit(torch.from_numpy(p0).clamp(1e-4, 1 - 1e-4))


def _step_update(theta, idx, rewards, adv_values, lr):
    p = torch.sigmoid(theta[idx])  # [B]
    grad = (adv_values * (rewards - p[:, None])).mean(dim=1)  # [B]
    theta.index_add_(0, idx, lr * grad)


def _generate(theta, cfg, gen):
    idx = torch.randperm(cfg.prompts, generator=gen)[: cfg.batch]  # [P]
    p = torch.sigmoid(theta[idx])
    rewards = (
        torch.rand(cfg.batch, cfg.group_size, generator=gen, dtype=torch.float64) < p[:, None]
    ).double()
    return idx, rewards


def method_advantages(method: str, rewards: torch.Tensor, trigger) -> tuple[torch.Tensor, float]:
    """``[P, G]`` advantages of a round's groups under ``method`` (not dynamic sampling), and
    the share of groups that received virtual samples.

    ``avspo_code_g1`` applies the code mode to each group as its own generation batch.
    """
    from grouprl import advantages

    if method == "avspo_code_g1":
        adv = advantages.compute("grpo", rewards, virtual="code", virtual_batch_groups=1)
        return adv.values, adv.stats["virtual/triggered_frac"]
    virtual = None if method == "grpo" else method.split("_", 1)[1]
    adv = advantages.compute("grpo", rewards, virtual=virtual, trigger=trigger if virtual else None)
    return adv.values, adv.stats.get("virtual/triggered_frac", 0.0)


def run_method(method: str, cfg: AcrConfig, seed: int) -> dict[str, list[float]]:
    """One seeded run; per round ``acr`` (raw rewards), ``all_wrong`` / ``all_correct`` (its
    split), ``wasted`` (share of groups without gradient), ``virtual`` (share given virtual
    samples) and ``accuracy`` (pool mean p); ``accuracy0`` and ``steps``. ``seed`` fixes the
    initial pool and the stream, the same for every method."""
    from grouprl import advantages

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid methods: {', '.join(METHODS)}")
    gen = torch.Generator().manual_seed(seed)
    theta = initial_pool(cfg, seed)
    trigger = advantages.VirtualTrigger()
    out = {"acr": [], "all_wrong": [], "all_correct": [], "wasted": [], "virtual": []}
    out.update(accuracy=[], steps=0)
    out["accuracy0"] = float(torch.sigmoid(theta).mean())
    pending_idx, pending_r = [], []
    rounds_in_step = 0
    for _ in range(cfg.rounds):
        idx, rewards = _generate(theta, cfg, gen)
        split = collapse_split(rewards)
        collapsed = split["collapsed"]
        for key, flag in (("acr", collapsed), ("all_wrong", split["all_wrong"])):
            out[key].append(float(flag.double().mean()))
        out["all_correct"].append(float(split["all_correct"].double().mean()))
        if method == "dynamic_sampling":
            keep = ~collapsed
            pending_idx.append(idx[keep]), pending_r.append(rewards[keep])
            rounds_in_step += 1
            have = sum(len(i) for i in pending_idx)
            out["wasted"].append(float(collapsed.double().mean()))
            out["virtual"].append(0.0)
            if have >= cfg.batch or rounds_in_step >= cfg.max_rounds:
                bi, br = torch.cat(pending_idx)[: cfg.batch], torch.cat(pending_r)[: cfg.batch]
                # groups beyond P are dropped too (DAPO truncates the filtered batch)
                extra = have - len(bi)
                out["wasted"][-1] += extra / cfg.batch
                if len(bi):
                    adv = advantages.compute("grpo", br)
                    _step_update(theta, bi, br, adv.values, cfg.lr)
                    out["steps"] += 1
                pending_idx, pending_r, rounds_in_step = [], [], 0
        else:
            values, fired = method_advantages(method, rewards, trigger)
            nonzero = values.abs().amax(dim=1) > 0
            out["wasted"].append(float((~nonzero).double().mean()))
            out["virtual"].append(fired)
            _step_update(theta, idx, rewards, values, cfg.lr)
            out["steps"] += 1
        out["accuracy"].append(float(torch.sigmoid(theta).mean()))
    return out


def calibrate_pool(cfg: AcrConfig) -> float:
    """The pool mean m at which GRPO's raw ACR over the run is the middle of ``acr_range``.

    Bisection [OURS] on log m over ``pool_mean_bracket`` (the hard side, m < 0.5, where the
    ACR falls as m grows), ``calib_iters`` steps, each a GRPO run on the first seed's pool and
    stream (``seed·1000``). Returns ``cfg.pool_mean`` unchanged when it is set.
    """
    from grouprl.simulate.low_variance import bisect_log

    if cfg.pool_mean is not None:
        return cfg.pool_mean
    target = 0.5 * (cfg.acr_range[0] + cfg.acr_range[1])

    def acr_at(m: float) -> float:
        run = run_method("grpo", replace(cfg, pool_mean=m), cfg.seed * 1000)
        return sum(run["acr"]) / len(run["acr"])

    return bisect_log(acr_at, target, *cfg.pool_mean_bracket, cfg.calib_iters)


_RAW, _NOGRAD = "ACR, raw rewards (paper's metric)", "groups without gradient"
_CUT, _GAIN = "raw ACR cut vs grpo", "accuracy gain vs grpo (points)"


def _claims(cfg: AcrConfig, by: dict[str, dict]) -> list[Claim]:
    g, sym = by["grpo"], by["avspo_symmetric"]
    code, code1 = by["avspo_code"], by["avspo_code_g1"]
    lo, hi = cfg.acr_range
    rel = 1.0 - sym[_NOGRAD] / max(g[_NOGRAD], 1e-12)
    first = g["ACR_100 (first 100 rounds)"]
    return [
        Claim(
            "grpo_in_paper_regime",
            lo <= first <= hi and lo <= g[_RAW] <= hi,
            f"grpo raw ACR {first:.1%} over the first 100 rounds, {g[_RAW]:.1%} over the run "
            f"(ACR paper: {lo:.0%}-{hi:.0%} at G = 8)",
        ),
        Claim(
            "avspo_cuts_raw_acr_58_63",
            max(sym[_CUT], code1[_CUT]) >= 0.58,
            f"raw ACR, relative cut vs grpo: avspo_symmetric {sym[_CUT]:.1%}, avspo_code_g1 "
            f"{code1[_CUT]:.1%} (paper: 58-63 %)",
        ),
        Claim(
            "avspo_cuts_groups_without_gradient",
            rel >= 0.3,
            f"avspo_symmetric: {sym[_NOGRAD]:.1%} without gradient vs grpo {g[_NOGRAD]:.1%} "
            f"({rel:.0%} relative cut; the injection does this, not the policy)",
        ),
        Claim(
            "avspo_gains_4_6_points",
            max(sym[_GAIN], code1[_GAIN]) >= 4.0,
            f"pool accuracy after {cfg.rounds} rounds, minus grpo's: avspo_symmetric "
            f"{sym[_GAIN]:+.2f}, avspo_code_g1 {code1[_GAIN]:+.2f} points (paper: +4 to +6)",
        ),
        Claim(
            "paper_mode_defect",
            by["avspo_paper"][_NOGRAD] > sym[_NOGRAD],
            f"avspo_paper leaves all-wrong groups collapsed: {by['avspo_paper'][_NOGRAD]:.1%} "
            f"without gradient > symmetric {sym[_NOGRAD]:.1%}",
        ),
        Claim(
            "code_mode_fires_only_at_one_group_per_batch",
            code["groups given virtual samples"] < 0.01 and code1[_NOGRAD] < 0.01,
            f"avspo_code with {cfg.batch} groups per batch gives virtual samples to "
            f"{code['groups given virtual samples']:.1%} of groups; one group per batch: "
            f"{code1['groups given virtual samples']:.1%}, {code1[_NOGRAD]:.1%} without "
            f"gradient, raw ACR {code1[_RAW]:.1%}",
        ),
    ]


def simulate(quick: bool = False, seed: int = 0, **overrides) -> SimResult:
    """ACR over training for grpo, avspo (symmetric / paper / code at P and at one group per
    batch) and dynamic sampling on a pool calibrated to the paper's regime: the raw-reward ACR
    next to the share of groups without gradient, paired by seed."""
    base = QUICK if quick else AcrConfig()
    cfg = replace(base, **{**overrides, "seed": seed})
    t0 = time.perf_counter()
    cfg = replace(cfg, pool_mean=calibrate_pool(cfg))
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    for s in range(cfg.seeds):
        for m in METHODS:
            runs[m].append(run_method(m, cfg, cfg.seed * 1000 + s))
    g_acr = torch.tensor([sum(r["acr"]) / len(r["acr"]) for r in runs["grpo"]])  # [S]
    g_acc = torch.tensor([r["accuracy"][-1] for r in runs["grpo"]])  # [S]
    rows, curves = [], {}
    for m, rs in runs.items():
        acr = torch.tensor([r["acr"] for r in rs])  # [S, R]
        wasted = torch.tensor([r["wasted"] for r in rs]).clamp_max(1.0)
        fired = torch.tensor([r["virtual"] for r in rs])
        accv = torch.tensor([r["accuracy"] for r in rs])
        curves[m] = {"acr": acr.mean(0), "wasted": wasted.mean(0), "accuracy": accv.mean(0)}
        rows.append(
            {
                "method": m,
                _RAW: float(acr.mean()),
                "all-wrong share": float(torch.tensor([r["all_wrong"] for r in rs]).mean()),
                "all-correct share": float(torch.tensor([r["all_correct"] for r in rs]).mean()),
                _NOGRAD: float(wasted.mean()),
                "ACR_100 (first 100 rounds)": float(acr[:, :100].mean()),
                "without gradient, first 100 rounds": float(wasted[:, :100].mean()),
                "groups given virtual samples": float(fired.mean()),
                "accuracy start": sum(r["accuracy0"] for r in rs) / len(rs),
                "accuracy end": float(accv[:, -1].mean()),
                _CUT: float((1 - acr.mean(1) / g_acr).mean()),
                _GAIN: float(100 * (accv[:, -1] - g_acc).mean()),
                "optimizer steps": sum(r["steps"] for r in rs) / len(rs),
            }
        )
    result_claims = _claims(cfg, {r["method"]: r for r in rows})
    fig, ax = figure(3, 1, width=4.6)
    x = torch.arange(1, cfg.rounds + 1) * cfg.batch * cfg.group_size / 1000  # thousands
    w = max(1, cfg.rounds // 30)
    for m, c in curves.items():
        smooth = lambda v: torch.nn.functional.avg_pool1d(v[None, None].float(), w, 1, 0)[0, 0]  # noqa: E731
        xs = x[w - 1 :]
        ax[0, 0].plot(xs, smooth(c["acr"]), label=m)
        ax[0, 1].plot(xs, smooth(c["wasted"]), label=m)
        ax[0, 2].plot(x, c["accuracy"], label=m)
    for a, t in zip(ax[0], ("ACR of the raw rewards", "groups without gradient", "pool accuracy")):
        a.set_xlabel("rollouts (thousands)"), a.set_title(t)
    for a in ax[0, :2]:
        a.axhspan(*cfg.acr_range, color="grey", alpha=0.15)
    ax[0, 2].legend(fontsize=7)
    result = SimResult(
        name="acr",
        title="Advantage collapse at equal rollouts, in the ACR paper's regime",
        config=asdict(cfg),
        rows=rows,
        claims=result_claims,
        figures={"main": fig},
        data={m: {k: v for k, v in c.items()} for m, c in curves.items()},
        notes=[
            "Learning model is [OURS] (module docstring): per-prompt Bernoulli logits with the "
            "exact score-function step; no transfer across prompts.",
            f"Pool mean calibrated to {cfg.pool_mean:.3f} so that grpo's raw ACR over the run "
            f"is {sum(cfg.acr_range) / 2:.3f} on seed {cfg.seed * 1000}.",
            "avspo_code fires only when every reward of the whole generation batch is 0 (or 1); "
            "avspo_code_g1 runs it as the authors' script does (one group per generation "
            "batch), where it fires on every all-wrong or all-correct group.",
        ],
    )
    result.seconds = time.perf_counter() - t0
    return result
