"""Why GRPO needs normalisation, in miniature: per-prompt std vs homogeneous/heterogeneous pools.

The claim ["Why GRPO needs normalization", Ge et al., arXiv 2601.23135, the seed abstract]:
per-prompt std normalisation acts as an adaptive step size; GRPO's convergence gain over
unnormalised REINFORCE is governed by the within-prompt reward std across prompts and
iterations, and "the gains require heterogeneity" (at 1.5B, per-prompt normalisation beat
unnormalised and globally normalised baselines in the phase "where per-prompt variances become
heterogeneous"; at 7B the schemes were indistinguishable while IS-GRPO kept a small lead). The
paper's own synthetic task was not reachable (only the abstract and v1's opening), so the model
below is ours [OURS throughout, stated so it can be argued with].

**Model.** A pool of X prompts, each with K answers of which answer 0 is correct (reward 1, the
rest 0). A softmax policy with logits z_{x,a} = b_{x,a} + θ·φ_{x,a}: fixed offsets b set each
prompt's initial success probability J_x(0) exactly (b_{x,0} = log(J(K − 1)/(1 − J)), the
others 0) and θ = 0 at the start. ``features``:

- ``"tabular"``: φ_{x,a} = the unit vector of (x, a), θ ∈ R^{X·K}: every prompt has its own
  logits. Every update below is group-centred (Σ_i A_i = 0 in a group), so an unsampled answer's
  logit never moves, the correct one only rises and a sampled wrong one only falls: J_x never
  decreases, whatever the step. A larger lr is then never worse, and the lr grid's top wins for
  every method (measured; see the reproduction) — the comparison would measure the grid.
- ``"shared"`` (default): φ_{x,a} ~ N(0, I_d / d) (norm ≈ 1, like the tabular vectors),
  θ ∈ R^d shared by all prompts, d = ``dim``. A step on one prompt moves every other prompt's
  logits by ~1/√d of it, so too large a step undoes progress elsewhere: the step size has an
  optimum, which is what the paper's smoothness argument is about. Per-prompt gradients are
  near-orthogonal (|cos| ~ 1/√d), the regime where the abstract says adaptive scaling helps.
- ``"blocks"`` [OURS]: φ_{x,a} = e_x ⊗ ψ_a (:func:`block_features`), θ ∈ R^{X·m}: every prompt
  its own parameter block (prompts share nothing, as in ``tabular``) over one answer table
  ψ ∈ R^{K×m} of unit rows, m = ``block_dim`` = 4 < K − 1. The answers of a prompt share
  directions, so pushing a sampled wrong answer down moves the unsampled ones and too large a
  step can lock a prompt onto a wrong answer: the step size has an optimum without any
  coupling between prompts. The prompts of a pool are exact copies but for J(0), so whatever
  spreads their σ apart is the sampling, not the features.

**Pools** (the same mean reward std σ̄ = mean_x √(J_x(1 − J_x)) at the start):
``heterogeneous`` = half the prompts at J(0) = ``het_success[0]`` (0.5, σ = 0.5), half at
``het_success[1]`` (0.02, σ = 0.14); ``homogeneous`` = every prompt at the J ≤ 0.5 with
√(J(1 − J)) = σ̄ (:func:`homogeneous_success`; 0.1158 for the defaults). Binary rewards cannot
also match the mean J: σ is concave in J, so mean σ(J) < σ(mean J) for any spread. With shared
features the homogeneous pool is homogeneous only at the start: its prompts drift apart, so σ
becomes heterogeneous across prompts as training goes on (measured: the coefficient of
variation of σ_x over the pool goes from 0 to ≈ 0.6 within ~2,000 rollouts, as high as the
heterogeneous pool's); with ``blocks`` (copies that share nothing) faster still, so the
sampling alone spreads them: a prompt whose group drew a success jumps, one drawn all-wrong
stays. ``identical`` is the control that stays homogeneous [OURS]: the homogeneous pool with
every prompt given prompt 0's features (``tabular``: one table for all prompts), so all prompts
share one policy and one σ at every step (CV 0 exactly, tested). Any pool whose prompts are
learned separately from sampled groups drifts apart, so a pool that stays homogeneous must tie
its prompts, which makes it one effective prompt. Measured: that prompt is degenerate — as
with tabular features a larger step is never worse, every method's best lr is the top of its
grid and 80 % is reached in one or two steps.

**Methods** (advantages from :func:`grouprl.advantages.compute`, prompts from
:mod:`grouprl.sampling`): ``reinforce`` = ``dr_grpo`` (r − r̄_q); ``batch_std`` = global
normalisation (r − r̄_q)/σ_batch; ``grpo`` = (r − r̄_q)/(σ_q + eps); these three draw P prompts
uniformly without replacement (the ``uniform`` sampler). ``is_grpo`` = ``grpo`` advantages with
the ``sigma`` sampler (p_x ∝ max(σ̂_x, σ_floor), σ̂ an EMA of each visit's group std, with
replacement; ALGORITHMS.md §1); ``is_grpo_exact`` = the same sampler with Dr.GRPO's r − r̄_q
times the draw's importance weight 1/(X·p_x) (:data:`WEIGHTED`; passed to
``advantages.compute`` as ``group_weight``), so the σ that draws is the one that divides and
the expected update is ((G − 1)/G)·∇J at every G (ALGORITHMS.md §1, "One σ, exact"). Each step: P prompts × G answers, then plain SGD
θ ← θ + lr · (1/(P·G)) Σ_{x,i} A_{x,i} ∇_θ log π(a_i | x), with
∇_θ log π(a | x) = Σ_k (1[a = k] − π_k) φ_{x,k} (:func:`logit_gradient` gives the logit-space
sum Σ_i A_i (e_{a_i} − π), :func:`param_gradient` maps it through φ).

**Metric.** Rollouts (steps · P · G) until the pool's accuracy mean_x J_x first reaches
``target`` (80 %); NaN when the run does not get there within ``max_steps``. The lr is tuned
per (pool, method) on ``lrs`` (8 values): the best lr minimises the mean over seeds of the
rollouts, a run that never reaches the target counting as the budget (censored) [OURS].

**Common random numbers.** Seed s fixes the features, the uniform prompt draws and the uniforms
that pick answers, for every method and lr: the three uniform-sampler methods see the same
prompts, and all runs of seed s start from the same stream, so per-seed differences between
methods are paired (the reproduction reports paired SEs). All (lr, seed) runs of a (pool,
method) are batched as rows.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from grouprl.report.html import figure
from grouprl.simulate._common import Claim, SimResult

__all__ = [
    "FEATURES",
    "METHODS",
    "POOLS",
    "WEIGHTED",
    "NormalizationConfig",
    "block_features",
    "first_crossing",
    "homogeneous_success",
    "identical_features",
    "initial_offsets",
    "logit_gradient",
    "make_features",
    "param_gradient",
    "pool_lrs",
    "pool_success",
    "reward_std",
    "run_pool_method",
    "sample_answers",
    "simulate",
]

METHODS: dict[str, tuple[str, str]] = {
    "reinforce": ("dr_grpo", "uniform"),
    "batch_std": ("batch_std", "uniform"),
    "grpo": ("grpo", "uniform"),
    "is_grpo": ("grpo", "sigma"),
    "is_grpo_exact": ("dr_grpo", "sigma"),
}
"""Method -> (advantage estimator in grouprl.advantages, prompt sampler in grouprl.sampling)."""

WEIGHTED = frozenset({"is_grpo_exact"})
"""Methods whose advantages are multiplied by the draw's importance weight 1/(|X|·p_x)
(``sampling.PromptSampler.importance_weights`` passed as ``advantages.compute``'s
``group_weight``): the σ that draws is the σ that divides (ALGORITHMS.md §1, "One σ, exact")."""

POOLS = ("homogeneous", "heterogeneous", "identical")
FEATURES = ("shared", "tabular", "blocks")


@dataclass(frozen=True)
class NormalizationConfig:
    """Parameters of the normalisation simulation (all [OURS]; see the module docstring)."""

    prompts: int = 64
    answers: int = 8
    features: str = "shared"
    dim: int = 512
    """d, the shared feature dimension (``features="shared"`` only); X·K = 512 at the defaults.
    [OURS, measured] at d = 128 no method reached 80 % in 2000 steps (X(K − 1) = 448 margins
    in 128 dimensions), at d = 512 every method's best lr lies inside the grid."""
    batch: int = 16
    """P, prompts per step."""
    group_size: int = 8
    het_success: tuple[float, float] = (0.5, 0.02)
    """J(0) of the two halves of the heterogeneous pool."""
    pools: tuple[str, ...] = POOLS[:2]
    """Default: the two pools of the comparison; ``identical`` is the optional control."""
    methods: tuple[str, ...] = tuple(METHODS)
    lrs: tuple[float, ...] = tuple(20.0 * 2.0 ** (k / 2) for k in range(8))
    """The lr grid: 20 · √2^k, k = 0..7 (20 … 226) [OURS: placed by pilots on 4 … 512 (factor
    2; 10 seeds for reinforce and grpo, 3 for all four) whose best lrs were 32 (is_grpo) to 128
    (reinforce)]."""
    seeds: int = 10
    target: float = 0.8
    max_steps: int = 2000
    """The budget: max_steps · P · G rollouts per run."""
    log_every: int = 10
    block_dim: int = 4
    """m, each prompt's parameter block (``features="blocks"`` only) [OURS]: below K − 1 = 7 the
    answers share directions, so a step that pushes a sampled wrong answer down moves the
    unsampled ones and too large a step can lock a prompt onto a wrong answer."""
    seed: int = 0


QUICK = NormalizationConfig(prompts=16, batch=4, dim=128, lrs=(32.0, 64.0), seeds=2, max_steps=300)
"""``--quick``: 16 prompts (d = X·K = 128), 2 step sizes, 2 seeds, at most 300 steps."""


# ----------------------------------------------------------------------------- the pool
def homogeneous_success(het_success: tuple[float, float]) -> float:
    """The J ≤ 0.5 whose reward std √(J(1 − J)) equals the mean std of the two halves.

    √(J(1 − J)) = σ̄  ⇔  J = (1 − √(1 − 4σ̄²)) / 2.
    """
    sigma = sum(math.sqrt(j * (1 - j)) for j in het_success) / len(het_success)
    return (1.0 - math.sqrt(1.0 - 4.0 * sigma * sigma)) / 2.0


def pool_success(cfg: NormalizationConfig, pool: str) -> torch.Tensor:
    """``[X]`` float64 initial success probabilities J_x(0) of ``pool``."""
    if pool in ("homogeneous", "identical"):
        return torch.full((cfg.prompts,), homogeneous_success(cfg.het_success), dtype=torch.float64)
    if pool == "heterogeneous":
        half = cfg.prompts // 2
        j = torch.full((cfg.prompts,), cfg.het_success[1], dtype=torch.float64)
        j[:half] = cfg.het_success[0]
        return j
    raise ValueError(f"unknown pool {pool!r}; valid pools: {', '.join(POOLS)}")


def initial_offsets(success: torch.Tensor, answers: int) -> torch.Tensor:
    """``[X, K]`` offsets b with softmax(b_x)[0] = success_x: b_{x,0} = log(J(K − 1)/(1 − J))."""
    b = torch.zeros(success.shape[0], answers, dtype=torch.float64)
    b[:, 0] = torch.log(success * (answers - 1) / (1.0 - success))
    return b


def make_features(cfg: NormalizationConfig, generator: torch.Generator) -> torch.Tensor | None:
    """``[X, K, d]`` shared Gaussian features N(0, I/d), or None for ``tabular``."""
    if cfg.features == "tabular":
        return None
    if cfg.features == "blocks":
        return block_features(cfg, generator)
    shape = (cfg.prompts, cfg.answers, cfg.dim)
    return torch.randn(shape, generator=generator, dtype=torch.float64) / math.sqrt(cfg.dim)


def block_features(cfg: NormalizationConfig, generator: torch.Generator) -> torch.Tensor:
    """``[X, K, X·m]`` features φ_{x,a} = e_x ⊗ ψ_a, m = ``block_dim``: every prompt its own
    parameter block θ_x ∈ R^m, all prompts one answer table ψ ∈ R^{K×m} of unit rows drawn
    N(0, I) then normalised (unit rows are all extreme points, so every answer, the correct
    one included, can be made the argmax)."""
    x_n, k_n, m = cfg.prompts, cfg.answers, cfg.block_dim
    psi = torch.randn(k_n, m, generator=generator, dtype=torch.float64)  # [K, m]
    psi = psi / psi.norm(dim=-1, keepdim=True)
    eye = torch.eye(x_n, dtype=torch.float64)  # [X, X]
    return torch.einsum("xy,km->xkym", eye, psi).reshape(x_n, k_n, x_n * m)


def identical_features(
    phi: torch.Tensor | None, seeds: int, prompts: int, answers: int
) -> torch.Tensor:
    """``[S, X, K, d]`` features of the ``identical`` pool: every prompt gets prompt 0's
    (``shared``), or one table e_a ∈ R^K common to all prompts (``tabular``, d = K)."""
    if phi is None:
        eye = torch.eye(answers, dtype=torch.float64)  # [K, K]
        return eye.expand(seeds, prompts, answers, answers)
    return phi[:, :1].expand(-1, prompts, -1, -1)


def pool_lrs(cfg: NormalizationConfig, pool: str) -> tuple[float, ...]:
    """The lr grid of ``pool``: ``cfg.lrs``, divided by P for ``identical`` [OURS]: there all P
    groups of a step update the same logits, so the per-prompt step is P times larger (on the
    shared grid every method reached 80 % in one step, measured)."""
    return tuple(lr / cfg.batch for lr in cfg.lrs) if pool == "identical" else tuple(cfg.lrs)


def reward_std(success: torch.Tensor) -> torch.Tensor:
    """σ_x = √(J_x(1 − J_x)): the std of a prompt's binary reward under the policy."""
    return (success * (1.0 - success)).clamp_min(0.0).sqrt()


def sample_answers(pi: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``[..., G]`` answers drawn from ``pi [..., K]`` by inverse CDF of uniforms ``u [..., G]``.

    Explicit uniforms let every method and lr of a seed share them (common random numbers).
    """
    cdf = pi.cumsum(-1)  # [..., K]
    return torch.searchsorted(cdf, u * cdf[..., -1:]).clamp_max(pi.shape[-1] - 1)


# ----------------------------------------------------------------------------- the gradient
def logit_gradient(pi: torch.Tensor, actions: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` Σ_i A_i (e_{a_i} − π): the gradient of Σ_i A_i log π(a_i) w.r.t. the logits.

    ``pi [..., K]`` the policy of each group's prompt, ``actions [..., G]``, ``adv [..., G]``.
    """
    counts = torch.zeros_like(pi).scatter_add_(-1, actions, adv)  # [..., K] Σ_{i: a_i = k} A_i
    return counts - pi * adv.sum(-1, keepdim=True)


def param_gradient(grad_logits: torch.Tensor, phi: torch.Tensor | None) -> torch.Tensor:
    """Map ``[L, S, X, K]`` logit-space gradients to θ: ``[L, S, d]`` via Σ_{x,k} g_{x,k} φ_{x,k}
    with ``phi [S, X, K, d]``, or ``[L, S, X·K]`` (the logits themselves) when ``phi`` is None."""
    if phi is None:
        return grad_logits.flatten(-2)
    return torch.einsum("lsxk,sxkd->lsd", grad_logits, phi)


def _logits(b: torch.Tensor, phi: torch.Tensor | None, theta: torch.Tensor) -> torch.Tensor:
    """``[L, S, X, K]`` z = b + θ·φ for θ ``[L, S, d]`` (or ``[L, S, X·K]`` tabular)."""
    if phi is None:
        return b + theta.view(*theta.shape[:2], *b.shape)
    return b + torch.einsum("sxkd,lsd->lsxk", phi, theta)


def first_crossing(acc: torch.Tensor, target: float) -> torch.Tensor:
    """``[R]`` the first index t with ``acc[r, t] >= target``, NaN when there is none."""
    hit = acc >= target  # [R, T]
    first = hit.double().argmax(dim=1).double()  # [R] 0 when no hit, so mask below
    return first.masked_fill(~hit.any(dim=1), math.nan)


# ----------------------------------------------------------------------------- one batch of runs
def _advantages(
    estimator: str, rewards: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """``[R, P, G]`` advantages of each run's batch from grouprl.advantages.compute.

    ``batch_std`` is called per run (its σ is over one run's batch); the per-group estimators
    once on all runs' groups stacked (the same numbers, one call). ``weight [R, P]``: each
    group's ``group_weight`` (the draw's importance weight; None: 1).
    """
    from grouprl import advantages

    r, p, g = rewards.shape
    if estimator == "batch_std":
        return torch.stack([advantages.compute(estimator, x).values for x in rewards])
    w = None if weight is None else weight.reshape(r * p)
    return advantages.compute(estimator, rewards.reshape(r * p, g), group_weight=w).values.view(
        r, p, g
    )


def _generators(cfg: NormalizationConfig, tag: int, count: int) -> list[torch.Generator]:
    """Per-seed generators for stream ``tag`` (0 features, 1 prompts, 2 answers)."""
    return [
        torch.Generator().manual_seed(1_000_003 * (cfg.seed + s) + 7919 * tag) for s in range(count)
    ]


def run_pool_method(
    cfg: NormalizationConfig, pool: str, method: str, phi: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Train every (lr, seed) of ``method`` on ``pool``; rows are lr-major (r = l·S + s).

    ``phi [S, X, K, d]`` the seeds' features (None: built from the seeds' feature streams).
    Returns ``accuracy [R, T + 1]`` (pool mean J after each step, step 0 first),
    ``rollouts [R]`` to the target (NaN: not reached), ``sigma_mean`` / ``sigma_cv``
    ``[R, T'']`` (mean and coefficient of variation of √(J(1 − J)) over the pool, every
    ``log_every`` steps), ``collapsed [R]`` (share of drawn groups with zero std, over the steps
    before the run reached the target) and ``steps``.
    """
    from grouprl import advantages, sampling

    estimator, sampler_name = METHODS[method]
    n_lr, n_seed, x_n, k_n = len(cfg.lrs), cfg.seeds, cfg.prompts, cfg.answers
    p_n, g_n = cfg.batch, cfg.group_size
    b = initial_offsets(pool_success(cfg, pool), k_n)  # [X, K]
    if phi is None and cfg.features != "tabular":
        phi = torch.stack([make_features(cfg, g) for g in _generators(cfg, 0, n_seed)])
    if pool == "identical":
        phi = identical_features(phi, n_seed, x_n, k_n)
    dim = x_n * k_n if phi is None else phi.shape[-1]
    theta = torch.zeros(n_lr, n_seed, dim, dtype=torch.float64)  # [L, S, d]
    lr = torch.tensor(pool_lrs(cfg, pool), dtype=torch.float64).view(n_lr, 1, 1) / (p_n * g_n)
    gen_prompt, gen_answer = _generators(cfg, 1, n_seed), _generators(cfg, 2, n_seed)
    if sampler_name == "uniform":
        samplers = [sampling.make("uniform", x_n)]
    else:  # one σ̂ state per run; each run's draws from its own copy of the seed's stream
        samplers = [sampling.make("sigma", x_n) for _ in range(n_lr * n_seed)]
        gen_prompt = [
            torch.Generator().manual_seed(g.initial_seed()) for _ in range(n_lr) for g in gen_prompt
        ]
    acc = torch.full((n_lr * n_seed, cfg.max_steps + 1), math.nan, dtype=torch.float64)
    sig_mean, sig_cv = [], []
    collapsed = torch.full((n_lr * n_seed, cfg.max_steps), math.nan, dtype=torch.float64)
    rows = torch.arange(n_lr * n_seed)
    reached = torch.zeros(n_lr * n_seed, dtype=torch.bool)
    for t in range(cfg.max_steps + 1):
        pi_all = torch.softmax(_logits(b, phi, theta), dim=-1)  # [L, S, X, K]
        j = pi_all[..., 0].reshape(n_lr * n_seed, x_n)  # [R, X]
        acc[:, t] = j.mean(1)
        reached |= acc[:, t] >= cfg.target
        if t % cfg.log_every == 0 or t == cfg.max_steps:
            sd = reward_std(j)  # [R, X]
            sig_mean.append(sd.mean(1)), sig_cv.append(sd.std(1) / sd.mean(1).clamp_min(1e-12))
        if t == cfg.max_steps or bool(reached.all()):
            break
        if sampler_name == "uniform":  # the same draws for every lr of a seed
            idx = torch.stack([samplers[0].sample(p_n, g) for g in gen_prompt])  # [S, P]
            idx = idx.expand(n_lr, -1, -1).reshape(-1, p_n)  # [R, P]
        else:
            idx = torch.stack([sm.sample(p_n, g) for sm, g in zip(samplers, gen_prompt)])
        pi = pi_all.reshape(n_lr * n_seed, x_n, k_n)[rows[:, None], idx]  # [R, P, K]
        u = torch.stack(
            [torch.rand(p_n, g_n, generator=g, dtype=torch.float64) for g in gen_answer]
        )
        u = u.expand(n_lr, -1, -1, -1).reshape(-1, p_n, g_n)  # [R, P, G] common per seed
        a = sample_answers(pi, u)  # [R, P, G]
        rewards = (a == 0).double()  # [R, P, G]
        weight = None
        if method in WEIGHTED:  # the probabilities this draw was made with, before observe
            weight = torch.stack([sm.importance_weights(i) for sm, i in zip(samplers, idx)])
        adv = _advantages(estimator, rewards, weight)
        std = advantages.group_std(rewards.reshape(-1, g_n)).view(-1, p_n)  # [R, P]
        collapsed[:, t] = (std == 0).double().mean(1)  # [R] share of zero-std groups
        if sampler_name == "sigma":
            for sm, i, s in zip(samplers, idx, std):
                sm.observe(i, s)
        g_logit = torch.zeros(n_lr * n_seed, x_n, k_n, dtype=torch.float64)
        g_logit.scatter_add_(1, idx[..., None].expand(-1, -1, k_n), logit_gradient(pi, a, adv))
        grad = param_gradient(g_logit.view(n_lr, n_seed, x_n, k_n), phi)  # [L, S, d]
        theta.add_(lr * grad)
    steps = t
    crossing = first_crossing(acc[:, : steps + 1], cfg.target)  # [R]
    until = torch.where(crossing.isnan(), float(steps), crossing).long()  # [R] steps counted
    before = torch.arange(cfg.max_steps)[None, :] < until[:, None]  # [R, max_steps]
    coll = torch.where(before, collapsed, 0.0).sum(1) / until.clamp_min(1)
    return {
        "accuracy": acc[:, : steps + 1],
        "rollouts": crossing * (p_n * g_n),
        "sigma_mean": torch.stack(sig_mean, 1),
        "sigma_cv": torch.stack(sig_cv, 1),
        "collapsed": coll,
        "steps": torch.tensor(steps),
    }


# ----------------------------------------------------------------------------- summary
def censored(rollouts: torch.Tensor, budget: float) -> torch.Tensor:
    """Rollouts with the runs that never reached the target counted as the budget."""
    return torch.where(rollouts.isnan(), torch.full_like(rollouts, budget), rollouts)


def best_lr(cfg: NormalizationConfig, rollouts: torch.Tensor, seeds: slice = slice(None)) -> int:
    """Index of the lr with the lowest mean censored rollouts over ``seeds`` (ties: smaller lr)."""
    budget = cfg.max_steps * cfg.batch * cfg.group_size
    r = censored(rollouts, budget).view(len(cfg.lrs), cfg.seeds)[:, seeds]  # [L, S']
    return int(r.mean(1).argmin())


def _rows(cfg: NormalizationConfig, runs: dict) -> list[dict]:
    budget = cfg.max_steps * cfg.batch * cfg.group_size
    rows = []
    for (pool, method), out in runs.items():
        gain = (
            paired_gain(cfg, runs, pool, method)
            if "reinforce" in cfg.methods
            else {"gain": math.nan, "log_gain": math.nan, "se": math.nan}
        )
        li = best_lr(cfg, out["rollouts"])
        r = out["rollouts"].view(len(cfg.lrs), cfg.seeds)[li]  # [S]
        c = censored(r, budget)
        rows.append(
            {
                "pool": pool,
                "method": method,
                "best lr": pool_lrs(cfg, pool)[li],
                "rollouts to target (mean)": float(c.mean()),
                "se": float(c.std() / cfg.seeds**0.5) if cfg.seeds > 1 else 0.0,
                "reached": f"{int((~r.isnan()).sum())}/{cfg.seeds}",
                "collapsed groups": float(out["collapsed"].view(len(cfg.lrs), -1)[li].mean()),
                "best lr at grid edge": li in (0, len(cfg.lrs) - 1),
                "gain vs reinforce": gain["gain"],
                "log gain": gain["log_gain"],
                "log gain se (paired)": gain["se"],
            }
        )
    return rows


def _best_rollouts(cfg, rollouts, select: slice, evaluate: slice) -> torch.Tensor:
    """``[S']`` censored rollouts on seeds ``evaluate`` at the lr that is best on ``select``."""
    budget = cfg.max_steps * cfg.batch * cfg.group_size
    li = best_lr(cfg, rollouts, select)
    return censored(rollouts.view(len(cfg.lrs), cfg.seeds)[li], budget)[evaluate]


def paired_gain(
    cfg: NormalizationConfig,
    runs: dict,
    pool: str,
    method: str,
    base: str = "reinforce",
    select: slice = slice(None),
    evaluate: slice = slice(None),
) -> dict[str, float]:
    """Per seed, log(rollouts of ``base`` / rollouts of ``method``), each at its best lr.

    Positive = ``method`` needs fewer rollouts. Mean over the seeds ``evaluate`` with the paired
    SE (std of the per-seed log ratios / √n: both runs of a seed share its features and streams),
    lrs chosen on the seeds ``select`` (``select`` ≠ ``evaluate``: a held-out check of the
    selection's optimism). Censored runs count as the budget.
    """
    d = (
        _best_rollouts(cfg, runs[(pool, base)]["rollouts"], select, evaluate)
        / _best_rollouts(cfg, runs[(pool, method)]["rollouts"], select, evaluate)
    ).log()  # [S']
    se = float(d.std() / d.numel() ** 0.5) if d.numel() > 1 else 0.0
    return {"log_gain": float(d.mean()), "se": se, "gain": math.exp(float(d.mean())), "per_seed": d}


def heterogeneity_effect(cfg: NormalizationConfig, runs: dict, method: str = "grpo") -> dict:
    """The log gain over REINFORCE on the heterogeneous pool minus that on the homogeneous one,
    per seed (a seed's features and streams are shared by both pools): mean and paired SE."""
    d = (
        paired_gain(cfg, runs, "heterogeneous", method)["per_seed"]
        - paired_gain(cfg, runs, "homogeneous", method)["per_seed"]
    )
    se = float(d.std() / d.numel() ** 0.5) if d.numel() > 1 else 0.0
    return {"diff": float(d.mean()), "se": se}


def _claims(cfg: NormalizationConfig, runs: dict) -> list[Claim]:
    if not {"reinforce", "grpo"} <= set(cfg.methods):
        return []
    claims = [] if not set(POOLS[:2]) <= set(cfg.pools) else _heterogeneity_claims(cfg, runs)
    if "identical" in cfg.pools:
        ide = paired_gain(cfg, runs, "identical", "grpo")
        claims.append(
            Claim(
                "no_grpo_gain_on_identical_prompts",
                abs(ide["log_gain"]) <= 2 * ide["se"],
                f"identical prompts (one σ for the whole pool at every step): "
                f"{ide['gain']:.3f}× (log {ide['log_gain']:+.3f} ± {ide['se']:.3f}) "
                "(needs |log gain| <= 2 SE)",
            )
        )
    return claims


def _heterogeneity_claims(cfg: NormalizationConfig, runs: dict) -> list[Claim]:
    het = paired_gain(cfg, runs, "heterogeneous", "grpo")
    hom = paired_gain(cfg, runs, "homogeneous", "grpo")
    eff = heterogeneity_effect(cfg, runs)
    fmt = lambda g: f"{g['gain']:.3f}× (log {g['log_gain']:+.3f} ± {g['se']:.3f})"  # noqa: E731
    return [
        Claim(
            "grpo_beats_reinforce_from_a_heterogeneous_start",
            het["log_gain"] > 2 * het["se"],
            f"heterogeneous start: REINFORCE/GRPO rollouts to {cfg.target:.0%} = {fmt(het)}, "
            "paired over seeds, each at its best lr (needs log gain > 2 SE)",
        ),
        Claim(
            "no_grpo_gain_from_a_homogeneous_start",
            abs(hom["log_gain"]) <= 2 * hom["se"],
            f"homogeneous start: {fmt(hom)} (needs |log gain| <= 2 SE)",
        ),
        Claim(
            "grpo_gain_larger_from_a_heterogeneous_start",
            eff["diff"] > 2 * eff["se"],
            f"log gain heterogeneous − homogeneous = {eff['diff']:+.3f} ± {eff['se']:.3f} "
            "(paired by seed; needs > 2 SE)",
        ),
    ]


def _figures(cfg: NormalizationConfig, runs: dict):
    fig, ax = figure(len(cfg.pools), 2, width=4.6)
    budget = cfg.max_steps * cfg.batch * cfg.group_size
    for j, pool in enumerate(cfg.pools):
        for method in cfg.methods:
            out = runs[(pool, method)]
            li = best_lr(cfg, out["rollouts"])
            acc = out["accuracy"].view(len(cfg.lrs), cfg.seeds, -1)[li].mean(0)
            x = torch.arange(acc.numel()) * cfg.batch * cfg.group_size
            ax[0, j].plot(x, acc, label=f"{method} (lr {pool_lrs(cfg, pool)[li]:.3g})")
            c = censored(out["rollouts"], budget).view(len(cfg.lrs), cfg.seeds).mean(1)
            ax[1, j].plot(pool_lrs(cfg, pool), c, "o-", ms=3, label=method)
        ax[0, j].axhline(cfg.target, color="grey", ls=":")
        ax[0, j].set_title(f"{pool}: pool accuracy at the best lr", fontsize=9)
        ax[0, j].set_xlabel("rollouts"), ax[0, j].legend(fontsize=7)
        ax[1, j].set_xscale("log", base=2), ax[1, j].set_xlabel("lr")
        ax[1, j].set_title(f"{pool}: rollouts to {cfg.target:.0%} (budget if not)", fontsize=9)
        ax[1, j].legend(fontsize=7)
    return {"main": fig}


def _check(cfg: NormalizationConfig) -> None:
    if cfg.features not in FEATURES:
        raise ValueError(f"unknown features {cfg.features!r}; valid: {', '.join(FEATURES)}")
    bad = [m for m in cfg.methods if m not in METHODS]
    if bad:
        raise ValueError(f"unknown method(s) {bad}; valid methods: {', '.join(METHODS)}")
    for pool in cfg.pools:
        pool_success(cfg, pool)  # raises on an unknown pool
    if not all(0.0 < j < 1.0 for j in cfg.het_success) or len(cfg.het_success) != 2:
        raise ValueError(f"het_success must be two probabilities in (0, 1), got {cfg.het_success}")
    if cfg.batch > cfg.prompts or min(cfg.batch, cfg.group_size, cfg.answers) < 2:
        raise ValueError("need 2 <= batch <= prompts, group_size >= 2 and answers >= 2")
    if not cfg.lrs or any(not (lr > 0 and math.isfinite(lr)) for lr in cfg.lrs):
        raise ValueError(f"lrs must be finite and > 0, got {cfg.lrs}")
    if cfg.seeds < 1 or cfg.max_steps < 1 or cfg.dim < 1 or not 0 < cfg.target < 1:
        raise ValueError("seeds, max_steps and dim must be positive and target in (0, 1)")


def simulate(quick: bool = False, seed: int = 0, **overrides) -> SimResult:
    """Rollouts to 80 % pool accuracy: REINFORCE, global norm, GRPO, IS-GRPO × two pools."""
    base = QUICK if quick else NormalizationConfig()
    cfg = NormalizationConfig(**{**asdict(base), "seed": seed, **overrides})
    _check(cfg)
    t0 = time.perf_counter()
    phi = None
    if cfg.features != "tabular":
        phi = torch.stack([make_features(cfg, g) for g in _generators(cfg, 0, cfg.seeds)])
    runs = {
        (pool, m): run_pool_method(cfg, pool, m, phi) for pool in cfg.pools for m in cfg.methods
    }
    data = {
        f"{pool}/{m}": {
            "rollouts": out["rollouts"].view(len(cfg.lrs), cfg.seeds),
            "collapsed": out["collapsed"].view(len(cfg.lrs), cfg.seeds),
            "accuracy_best": out["accuracy"]
            .view(len(cfg.lrs), cfg.seeds, -1)[best_lr(cfg, out["rollouts"])]
            .mean(0),
            "sigma_mean": out["sigma_mean"].view(len(cfg.lrs), cfg.seeds, -1).mean(1),
            "sigma_cv": out["sigma_cv"].view(len(cfg.lrs), cfg.seeds, -1).mean(1),
        }
        for (pool, m), out in runs.items()
    }
    result = SimResult(
        name="normalization",
        title="Why GRPO needs normalisation: rollouts to 80 % accuracy, homogeneous vs "
        "heterogeneous reward std",
        config={**asdict(cfg), "homogeneous_success": homogeneous_success(cfg.het_success)},
        rows=_rows(cfg, runs),
        claims=_claims(cfg, runs),
        figures=_figures(cfg, runs),
        data=data,
        notes=[
            f"features {cfg.features!r}; pools with the same mean reward std: heterogeneous "
            f"J(0) ∈ {cfg.het_success}, homogeneous J(0) = "
            f"{homogeneous_success(cfg.het_success):.4f}.",
            "lr tuned per (pool, method) on the grid; a run that never reaches the target "
            "counts as the budget. Seeds share features and random streams across methods.",
        ],
    )
    result.seconds = time.perf_counter() - t0
    return result
