"""F-GRPO's categorical simulation (§5.1, App. J): group sampling forgets unsampled correct actions.

Setup [PAPER: F-GRPO App. J, which adopts Hu et al. (BroRL) §4.1 with one change, the learning
rate]: a softmax policy π = softmax(z) over |A| = 128,000 actions, 10,000 of them correct
(R = +1), the rest wrong (R = −1). Initial logits: one *anchor* correct action 5.0, the other
correct 3.0, wrong 0.0 (Q_pos ≈ 0.63, entropy 10.78 nats). Each step samples a group of N
actions a_1..a_N ~ π, centres the rewards by the group mean (r̃_j = R_j − mean_k R_k, no std)
and ascends the surrogate

    L(z) = (1/N) Σ_j r̃_j · π(a_j)                      (``surrogate="prob"``, default)

— the probability of the sampled action, not its log. With ∂π(a)/∂z_i = π(a)(1[a = i] − π_i),

    ∂L/∂z_i = (π_i/N) · (C_i − S),   C_i = Σ_{j: a_j = i} r̃_j,   S = Σ_j r̃_j π(a_j) = Σ_i π_i C_i,

so *every* logit moves: a sampled action by its summed centred reward C_i against S, an
unsampled one (C_i = 0) by −π_i·S/N — down whenever the sampled correct actions are more
probable than the sampled wrong ones (S > 0), which is how unsampled correct mass shrinks. The
focal weight g = (1 − μ̂)^γ (μ̂ = the group's share of correct actions) multiplies the objective
[PAPER: App. J "objective is scaled by g"], so the gradient fed to the optimiser is g·∂L/∂z.
:func:`surrogate` is the objective itself (for autograd), :func:`surrogate_grad` its closed
form, which the simulation uses (tests check they agree).

Optimiser (``optimizer``):

- ``"adamw"`` (default) [PAPER: Hu et al. §4.1 "update z with AdamW (learning rate η = 1e-3)";
  F-GRPO App. J keeps that set-up and changes only η to 1e-2]: :func:`adamw_step`, batched over
  rows, the update of ``torch.optim.AdamW`` on −g·L. Neither paper gives β₁, β₂, ε or the
  weight decay: [OURS] PyTorch's defaults (0.9, 0.999), 1e-8, 0.01 (``betas``, ``adam_eps``,
  ``weight_decay``). Adam divides each logit's step by its own gradient scale, so the
  6e-5-probability actions move by ~η per step like the anchor: η = 1e-2 over 1000 steps
  concentrates the policy (F-GRPO App. J: at η = 1e-3 the entropy stays above 4 even at
  N = 65,536, which motivated 1e-2).
- ``"plain"`` [OURS, labelled: not the papers' optimiser]: plain gradient ascent
  z ← z + η·g·∂L/∂z. The per-logit step is ~η·π_i/N, so
  η = 1e-2 moves nothing visible (Q_pos gain ~3e-9 in 1000 steps) and the effects need
  η ≈ 1e3–2e3 (reproductions/categorical keeps a labelled row of it).

``surrogate="logprob"`` is the labelled alternative L = (1/N) Σ_j r̃_j · log π(a_j), gradient
(1/N)·(C_i − π_i Σ_j r̃_j) = C_i/N (Σ_j r̃_j = 0): only sampled logits move, so only the
softmax normalisation couples the rest [OURS, not the paper's].

γ is compared both at equal N (the paper's Fig. 2, dashed vs solid) and at **matched gain** in
Q_pos: the focal weight changes the step, so each γ > 0 row also reports M_ret of the γ = 0
runs at the step where their Q_pos gain equalled this row's final gain
(:func:`matched_reference`: each γ = 0 seed's own curve, linearly interpolated; NaN for a seed
that never got there), with its SE and the row's excess over it. γ defaults to {0, 0.5, 1};
every N runs ``seeds`` seeds (4, the paper's) unless ``one_seed_from`` is set.

Metrics: Q_pos(t) = Σ_{a∈A+} π_t(a), retained positive mass M_ret(t) = 1 − Σ_{a∈A+}
max(0, π_0(a) − π_t(a)) / Σ_{a∈A+} π_0(a) (F-GRPO eq. 26), entropy H(t), π_t(anchor). Sampling
is exact (inverse CDF on sorted uniforms); all seeds and γ values of one (η, N) run batched as
rows.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
from rich.progress import Progress

from grouprl.report.html import figure
from grouprl.simulate._common import Claim, SimResult

__all__ = [
    "OPTIMIZERS",
    "SURROGATES",
    "CategoricalConfig",
    "adamw_step",
    "simulate",
    "surrogate",
    "surrogate_grad",
]

SURROGATES = ("prob", "logprob")
"""``prob``: F-GRPO's (1/N) Σ r̃_j π(a_j) (default); ``logprob``: (1/N) Σ r̃_j log π(a_j)."""

OPTIMIZERS = ("adamw", "plain")
"""``adamw``: Hu et al. §4.1 / F-GRPO App. J (default); ``plain``: gradient ascent [OURS]."""


@dataclass(frozen=True)
class CategoricalConfig:
    """Parameters of the categorical simulation; defaults are the paper's (F-GRPO §5.1)."""

    n_actions: int = 128_000
    n_correct: int = 10_000
    anchor_logit: float = 5.0
    correct_logit: float = 3.0
    wrong_logit: float = 0.0
    surrogate: str = "prob"
    optimizer: str = "adamw"
    """``adamw`` (Hu et al. §4.1, F-GRPO App. J) or ``plain`` gradient ascent [OURS, labelled]."""
    lr: float = 1e-2
    """η: 1e-2, F-GRPO App. J (Hu et al. §4.1 used 1e-3)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (β₁, β₂): [OURS] torch.optim.AdamW's defaults (neither paper states them)."""
    adam_eps: float = 1e-8
    """AdamW ε: [OURS] torch.optim.AdamW's default."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay on the logits: [OURS] torch.optim.AdamW's default."""
    lr_sweep: tuple[float, ...] = ()
    """More step sizes, each run on the whole (N, γ, seed) grid after ``lr``."""
    group_sizes: tuple[int, ...] = tuple(2**k for k in range(1, 18))  # 2 .. 131072
    gammas: tuple[float, ...] = (0.0, 0.5, 1.0)
    """Focal exponents γ: 0 = GRPO; the paper's simulation uses 1, its maze and LLM runs 0.5
    (both are reported)."""
    steps: int = 1000
    """T = 1,000 (F-GRPO App. J, Hu et al. §4.1)."""
    seeds: int = 4
    """4 seeds at every N (F-GRPO App. J)."""
    one_seed_from: int | None = None
    """Group sizes N >= this run one seed (None: every N runs ``seeds``, as the paper does)."""
    log_every: int = 25
    seed: int = 0


QUICK = CategoricalConfig(
    n_actions=12_800,
    n_correct=1_000,
    group_sizes=(2, 8, 64, 1024, 16384),
    steps=300,
    seeds=2,
    log_every=25,
)
"""``--quick``: a tenth of the actions (same correct share and Q_pos(0)), 300 steps, 2 seeds,
AdamW at the paper's η = 1e-2."""


def _check_surrogate(kind: str) -> None:
    if kind not in SURROGATES:
        raise ValueError(f"unknown surrogate {kind!r}; valid surrogates: {', '.join(SURROGATES)}")


def _check_optimizer(kind: str) -> None:
    if kind not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {kind!r}; valid optimizers: {', '.join(OPTIMIZERS)}")


def adamw_step(
    z: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    t: int,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AdamW step (Loshchilov & Hutter 2019, as ``torch.optim.AdamW`` takes it), **in place**.

    ``z, grad, m, v [B, A]`` (``grad`` the gradient of the loss to *minimise*), ``t`` ≥ 1 the
    step count after this step; ``z``, ``m``, ``v`` are updated in place (three distinct
    tensors) and returned. Element-wise, so every row and every logit has its own moments:

        z ← z·(1 − η·λ);  m ← β₁m + (1 − β₁)·grad;  v ← β₂v + (1 − β₂)·grad²;
        z ← z − η·(m / (1 − β₁ᵗ)) / (√(v / (1 − β₂ᵗ)) + ε).

    In place because it is the simulation's inner loop: one temporary instead of eight (the
    step costs ~5× less CPU at |A| = 128,000).
    """
    b1, b2 = betas
    m.mul_(b1).add_(grad, alpha=1.0 - b1)  # [B, A]
    v.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)  # [B, A]
    denom = (v / (1.0 - b2**t)).sqrt_().add_(eps)  # [B, A] the one temporary
    z.mul_(1.0 - lr * weight_decay).addcdiv_(m, denom, value=-lr / (1.0 - b1**t))
    return z, m, v


def initial_logits(cfg: CategoricalConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``[A]`` initial logits and ``[A]`` rewards (+1 for the first n_correct actions, else −1)."""
    z = torch.full((cfg.n_actions,), cfg.wrong_logit, dtype=torch.float64)
    z[: cfg.n_correct] = cfg.correct_logit
    z[0] = cfg.anchor_logit
    reward = -torch.ones(cfg.n_actions, dtype=torch.float64)
    reward[: cfg.n_correct] = 1.0
    return z, reward


def sample_actions(pi: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """``[B, n]`` actions drawn i.i.d. from each row of ``pi [B, A]`` (unnormalised is fine).

    Exact inverse-CDF sampling with replacement. The n uniforms are generated already sorted
    (normalised cumulative sums of n + 1 Exp(1) variables are the order statistics of n
    uniforms), which makes the lookup into the cumulative probabilities cache-friendly (~3×
    faster at n = 131,072). The actions come back in sorted order: a group is a multiset.
    """
    cdf = pi.cumsum(dim=1)  # [B, A]
    e = torch.empty(pi.shape[0], n + 1, dtype=pi.dtype).exponential_(generator=generator)
    s = e.cumsum(dim=1)  # [B, n + 1]
    u = s[:, :n] / s[:, n:] * cdf[:, -1:]  # [B, n] sorted uniforms on [0, total)
    return torch.searchsorted(cdf, u).clamp_max(pi.shape[1] - 1)


def centred(reward: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` r̃_j = R(a_j) − mean_k R(a_k): group-centred rewards, no std [PAPER]."""
    r = reward[actions]  # [B, N]
    return r - r.mean(dim=1, keepdim=True)


def surrogate(
    z: torch.Tensor, actions: torch.Tensor, r_tilde: torch.Tensor, kind: str = "prob"
) -> torch.Tensor:
    """``[B]`` the surrogate L of each row: (1/N) Σ_j r̃_j π(a_j) (``prob``) or log π (``logprob``).

    ``z [B, A]`` logits (differentiable), ``actions [B, N]``, ``r_tilde [B, N]``. The
    objective F-GRPO differentiates (§3); :func:`surrogate_grad` is its gradient in closed form.
    """
    _check_surrogate(kind)
    logp = torch.log_softmax(z, dim=1).gather(1, actions)  # [B, N]
    term = logp.exp() if kind == "prob" else logp
    return (r_tilde * term).mean(dim=1)


def surrogate_grad(
    pi: torch.Tensor, actions: torch.Tensor, r_tilde: torch.Tensor, kind: str = "prob"
) -> torch.Tensor:
    """``[B, A]`` ∂L/∂z of :func:`surrogate` at π = softmax(z), in closed form.

    ``prob``: (π_i/N)·(C_i − S); ``logprob``: (C_i − π_i Σ_j r̃_j)/N, with C_i = Σ_{j: a_j = i}
    r̃_j and S = Σ_j r̃_j π(a_j) (module docstring for the derivation).
    """
    _check_surrogate(kind)
    n = actions.shape[1]
    c = torch.zeros_like(pi).scatter_add_(1, actions, r_tilde)  # [B, A] C_i
    if kind == "prob":
        s = (r_tilde * pi.gather(1, actions)).sum(dim=1, keepdim=True)  # [B, 1] S
        return pi * (c - s) / n
    return (c - pi * r_tilde.sum(dim=1, keepdim=True)) / n


def focal(reward: torch.Tensor, actions: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """``[B]`` g = (1 − μ̂)^γ, μ̂ the group's success rate (R ∈ {−1, +1}); 0**0 = 1."""
    mu_hat = (reward[actions].mean(dim=1) + 1.0) / 2.0  # [B]
    return (1.0 - mu_hat).clamp_min(0) ** gamma


METRICS = ("q_pos", "m_ret", "entropy", "anchor")
"""Logged per row: Q_pos, M_ret, entropy H (nats) and the anchor's probability π(a_0)."""


def _metrics(z: torch.Tensor, pi0: torch.Tensor, c: int) -> tuple[torch.Tensor, ...]:
    """``[B]`` each of :data:`METRICS` for logits ``z [B, A]`` (the anchor is action 0)."""
    pi = torch.softmax(z, dim=1)  # [B, A]
    q_pos = pi[:, :c].sum(dim=1)  # [B]
    lost = (pi0[:, :c] - pi[:, :c]).clamp_min(0).sum(dim=1)  # [B]
    entropy = torch.logsumexp(z, dim=1) - (pi * z).sum(dim=1)  # [B] nats
    return q_pos, 1.0 - lost / pi0[:, :c].sum(dim=1), entropy, pi[:, 0]


def seeds_at(cfg: CategoricalConfig, n: int) -> int:
    """Seeds run at group size ``n``: ``seeds``, or one from ``one_seed_from`` on (when set)."""
    return 1 if cfg.one_seed_from is not None and n >= cfg.one_seed_from else cfg.seeds


def run_group_size(
    cfg: CategoricalConfig, n: int, generator: torch.Generator, lr: float | None = None
) -> dict[str, torch.Tensor]:
    """Train ``len(gammas) × seeds`` policies at group size ``n`` and step size ``lr``.

    ``lr`` None = ``cfg.lr``. Rows are gamma-major: row ``k * S + s`` has γ = gammas[k], seed
    s (S = :func:`seeds_at`). Returns each of :data:`METRICS` of shape ``[R, T']``
    (T' = logged points, step 0 included) and ``steps``.
    """
    _check_surrogate(cfg.surrogate)
    _check_optimizer(cfg.optimizer)
    lr = cfg.lr if lr is None else lr
    z0, reward = initial_logits(cfg)
    gam = torch.tensor(cfg.gammas, dtype=torch.float64).repeat_interleave(seeds_at(cfg, n))  # [B]
    z = z0.expand(gam.numel(), -1).clone()  # [B, A]
    m, v = torch.zeros_like(z), torch.zeros_like(z)  # AdamW moments [B, A]
    pi0 = torch.softmax(z, dim=1)
    curves: dict[str, list] = {k: [] for k in (*METRICS, "steps")}
    for t in range(cfg.steps + 1):
        if t % cfg.log_every == 0 or t == cfg.steps:
            for key, value in zip(METRICS, _metrics(z, pi0, cfg.n_correct)):
                curves[key].append(value)
            curves["steps"].append(t)
        if t == cfg.steps:
            break
        pi = torch.softmax(z, dim=1)  # [B, A]
        a = sample_actions(pi, n, generator)  # [B, N]
        grad = surrogate_grad(pi, a, centred(reward, a), cfg.surrogate)  # [B, A] ∂L/∂z
        grad = grad * focal(reward, a, gam)[:, None]  # [B, A] ∂(g·L)/∂z
        if cfg.optimizer == "plain":
            z = z + lr * grad
        else:  # minimise −g·L
            z, m, v = adamw_step(
                z, -grad, m, v, t + 1, lr=lr, betas=cfg.betas, eps=cfg.adam_eps,
                weight_decay=cfg.weight_decay,
            )  # fmt: skip
    out = {k: torch.stack(v, 1) for k, v in curves.items() if k != "steps"}
    return {**out, "steps": torch.tensor(curves["steps"])}


def _se(x: torch.Tensor) -> float:
    """Standard error of the mean over seeds (0 with one seed)."""
    return float(x.std(correction=1) / x.numel() ** 0.5) if x.numel() > 1 else 0.0


def at_gain(gain: torch.Tensor, values: torch.Tensor, target: float) -> float:
    """``values`` where the curve ``gain [T']`` first reaches ``target`` (linear interpolation).

    NaN when the curve never gets there. Used to compare γ at matched Q_pos gain.
    """
    above = (gain >= target).nonzero()
    if above.numel() == 0:
        return math.nan
    i = int(above[0])
    if i == 0:
        return float(values[0])
    g0, g1, v0, v1 = float(gain[i - 1]), float(gain[i]), float(values[i - 1]), float(values[i])
    w = (target - g0) / (g1 - g0) if g1 > g0 else 1.0
    return v0 + w * (v1 - v0)


def matched_reference(q_pos: torch.Tensor, m_ret: torch.Tensor, target: float) -> torch.Tensor:
    """``[S]`` M_ret of each reference (γ = 0) seed where its own Q_pos gain first reached
    ``target``; ``q_pos``, ``m_ret`` ``[S, T']``. NaN for a seed that never got there.

    Per seed, not on the seed-mean curve, so the reference has a standard error of its own
    [OURS: γ compared at matched gain in Q_pos].
    """
    gain = q_pos - q_pos[:, :1]  # [S, T']
    vals = [at_gain(gain[s], m_ret[s], target) for s in range(q_pos.shape[0])]
    return torch.tensor(vals, dtype=torch.float64)


def _matched(ref_q, ref_m, q, m) -> dict[str, float]:
    """M_ret of the reference runs at this row's mean final gain, and the row's excess over it.

    The excess's SE is unpaired, sqrt(se_row² + se_ref²): the γ rows draw their own groups.
    NaN when a reference seed never reached the gain (the mean is then over the others).
    """
    target = float(q[:, -1].mean() - q[:, 0].mean())
    ref = matched_reference(ref_q, ref_m, target)  # [S]
    ok = ref[~ref.isnan()]
    if ok.numel() == 0:
        return dict.fromkeys(("ref", "ref_se", "diff", "diff_se", "ref_n"), math.nan)
    mean, se_ref = float(ok.mean()), _se(ok)
    diff = float(m[:, -1].mean()) - mean
    return {
        "ref": mean,
        "ref_se": se_ref,
        "diff": diff,
        "diff_se": math.hypot(_se(m[:, -1]), se_ref),
        "ref_n": ok.numel(),
    }


def _summary(cfg: CategoricalConfig, lr: float, curves: dict) -> list[dict]:
    rows = []
    g0 = cfg.gammas[0]
    for n, cur in curves.items():
        s = seeds_at(cfg, n)
        base = slice(0, s)  # γ = gammas[0] rows: the reference at matched gain
        for k, gamma in enumerate(cfg.gammas):
            sl = slice(k * s, (k + 1) * s)
            q, m, h, anc = (cur[key][sl] for key in METRICS)
            nan = dict.fromkeys(("ref", "ref_se", "diff", "diff_se"), math.nan)
            mt = nan if k == 0 else _matched(cur["q_pos"][base], cur["m_ret"][base], q, m)
            rows.append(
                {
                    "optimizer": cfg.optimizer,
                    "lr": lr,
                    "N": n,
                    "gamma": gamma,
                    "seeds": s,
                    "Q_pos(0)": float(q[:, 0].mean()),
                    "Q_pos(T)": float(q[:, -1].mean()),
                    "Q_pos gain": float(q[:, -1].mean() - q[:, 0].mean()),
                    "Q_pos se": _se(q[:, -1]),
                    "M_ret(T)": float(m[:, -1].mean()),
                    "M_ret se": _se(m[:, -1]),
                    "M_ret min over t": float(m.mean(0).min()),
                    f"M_ret γ={g0:g} at this gain": mt["ref"],
                    "matched se": mt["ref_se"],
                    "M_ret − matched": mt["diff"],
                    "M_ret − matched se": mt["diff_se"],
                    "H(0)": float(h[:, 0].mean()),
                    "H(T)": float(h[:, -1].mean()),
                    "π_anchor(T)": float(anc[:, -1].mean()),
                }
            )
    return rows


def _unpaired(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """mean(x) − mean(y) and its unpaired SE √(se_x² + se_y²) (the rows draw their own groups)."""
    return float(x.mean() - y.mean()), math.hypot(_se(x), _se(y))


def _above(d: float, se: float) -> bool:
    """A difference counts when it exceeds 2 SE and 1e-6 (float noise at a tiny step) [OURS]."""
    return math.isfinite(d) and d > max(2 * se, 1e-6)


def fig2_claims(cfg: CategoricalConfig, lr: float, curves: dict[int, dict]) -> list[Claim]:
    """F-GRPO §5.1 / Fig. 2 at step size ``lr``, each with its statistics (γ = gammas[0] = GRPO).

    ``curves`` maps N to :func:`run_group_size`'s output. The parts of Fig. 2:

    - (a) ``q_pos_rises_at_every_n``: Q_pos(T) − Q_pos(0) > 2 SE at every N;
    - (b) ``m_ret_lowest_at_intermediate_n``: M_ret(T) is lowest at an interior N, below both
      the smallest and the largest N by > 2 SE (unpaired);
    - (c) regime I ``small_n_slow_gain_and_retains``: at the smallest N, Q_pos grows less and
      M_ret is higher than at the N of lowest M_ret (both > 2 SE);
    - (c) regime III ``largest_n_keeps_m_ret_throughout``: at the largest N, min over t of the
      seed-mean M_ret ≥ 0.99 (the paper: "N = 131k maintains M_ret ≈ 1 throughout");
    - dashed lines ``focal_retains_more_in_zone``: γ = gammas[-1] ends with more M_ret than
      γ = 0 at the same N (> 2 SE) at every N of the concentration zone, the N whose γ = 0
      M_ret(T) is below the midpoint of the smallest-N and the lowest M_ret [OURS: the paper
      shades the zone by eye];
    - ``focal_retains_more_at_matched_gain``: the same at equal Q_pos gain (the focal weight also
      changes the step), over the zone's N.
    """
    ns = sorted(curves)
    g0, g1 = cfg.gammas[0], cfg.gammas[-1]

    def rows(n: int, k: int, key: str) -> torch.Tensor:
        s = seeds_at(cfg, n)
        return curves[n][key][k * s : (k + 1) * s]  # [S, T']

    gain = {n: rows(n, 0, "q_pos")[:, -1] - rows(n, 0, "q_pos")[:, 0] for n in ns}  # [S]
    m_end = {n: rows(n, 0, "m_ret")[:, -1] for n in ns}  # [S]
    at = f" @{cfg.optimizer} lr={lr:g}"
    low_q = [n for n in ns if not _above(float(gain[n].mean()), _se(gain[n]))]
    n_min = min(ns, key=lambda n: float(m_end[n].mean()))
    lo, hi = _unpaired(m_end[ns[0]], m_end[n_min]), _unpaired(m_end[ns[-1]], m_end[n_min])
    interior = ns[0] < n_min < ns[-1]
    dq = _unpaired(gain[n_min], gain[ns[0]])
    big = rows(ns[-1], 0, "m_ret").mean(0)  # [T'] seed mean
    mid = (float(m_end[ns[0]].mean()) + float(m_end[n_min].mean())) / 2
    zone = [n for n in ns if float(m_end[n].mean()) < mid] or [n_min]
    k1 = len(cfg.gammas) - 1
    at_n, at_gain_ = [], []
    for n in zone:
        d, se = _unpaired(rows(n, k1, "m_ret")[:, -1], m_end[n])
        at_n.append((n, d, se))
        q1 = rows(n, k1, "q_pos")
        mt = _matched(rows(n, 0, "q_pos"), rows(n, 0, "m_ret"), q1, rows(n, k1, "m_ret"))
        at_gain_.append((n, mt["diff"], mt["diff_se"]))
    fmt = lambda xs: ", ".join(f"N={n}: {d:+.3g} ± {se:.2g}" for n, d, se in xs)  # noqa: E731
    return [
        Claim(
            "q_pos_rises_at_every_n" + at,
            not low_q,
            f"γ={g0:g}: Q_pos gain > 2 SE at {len(ns) - len(low_q)}/{len(ns)} N; gain "
            f"{float(gain[ns[0]].mean()):+.4f} (N={ns[0]}) … {float(gain[ns[-1]].mean()):+.4f} "
            f"(N={ns[-1]})" + (f"; not at N = {low_q}" if low_q else ""),
        ),
        Claim(
            "m_ret_lowest_at_intermediate_n" + at,
            interior and _above(*lo) and _above(*hi),
            f"γ={g0:g}: lowest M_ret(T) {float(m_end[n_min].mean()):.4f} at N={n_min}; N={ns[0]} "
            f"keeps {lo[0]:+.4f} ± {lo[1]:.2g} more, N={ns[-1]} {hi[0]:+.4f} ± {hi[1]:.2g} more",
        ),
        Claim(
            "small_n_slow_gain_and_retains" + at,
            n_min != ns[0] and _above(*dq) and _above(*lo),
            f"N={ns[0]} vs N={n_min}: Q_pos gain lower by {dq[0]:.4f} ± {dq[1]:.2g}, M_ret higher "
            f"by {lo[0]:+.4f} ± {lo[1]:.2g}"
            if n_min != ns[0]
            else f"the lowest M_ret(T) is at the smallest N={ns[0]} itself: no regime I below it",
        ),
        Claim(
            "largest_n_keeps_m_ret_throughout" + at,
            float(big.min()) >= 0.99,
            f"N={ns[-1]}, γ={g0:g}: min over t of M_ret = {float(big.min()):.4f} (needs ≥ 0.99), "
            f"M_ret(T) {float(big[-1]):.4f}, H(T) {float(rows(ns[-1], 0, 'entropy')[:, -1].mean()):.3f}",
        ),
        Claim(
            "focal_retains_more_in_zone" + at,
            all(_above(d, se) for _, d, se in at_n),
            f"γ={g1:g} − γ={g0:g}, M_ret(T) at equal N over the zone (γ=0 M_ret < {mid:.3f}): "
            + fmt(at_n),
        ),
        Claim(
            "focal_retains_more_at_matched_gain" + at,
            all(_above(d, se) for _, d, se in at_gain_),
            f"γ={g1:g} − γ={g0:g} at equal Q_pos gain over the zone: " + fmt(at_gain_),
        ),
    ]


def _figures(cfg: CategoricalConfig, curves: dict, rows: list[dict]):
    fig, ax = figure(4, 1, width=4.2)
    lrs = sorted({r["lr"] for r in rows})
    for lr in lrs:
        for gamma in cfg.gammas:
            sel = [r for r in rows if r["gamma"] == gamma and r["lr"] == lr]
            lab = f"η={lr:g}, γ={gamma:g}"
            ns = [r["N"] for r in sel]
            ax[0, 0].plot(ns, [r["Q_pos gain"] for r in sel], "o-", ms=3, label=lab)
            ax[0, 1].plot(ns, [r["M_ret(T)"] for r in sel], "o-", ms=3, label=lab)
            if gamma != cfg.gammas[0]:
                ax[0, 2].plot(ns, [r["M_ret − matched"] for r in sel], "o-", ms=3, label=lab)
    ax[0, 2].axhline(0.0, color="grey", lw=0.8)
    for a, lab in (
        (ax[0, 0], "Q_pos(T) − Q_pos(0)"),
        (ax[0, 1], "M_ret(T)"),
        (ax[0, 2], f"M_ret − M_ret(γ={cfg.gammas[0]:g}) at equal gain"),
    ):
        a.set_xscale("log", base=2), a.set_xlabel("group size N"), a.set_title(lab, fontsize=9)
    ax[0, 0].legend(fontsize=6)
    cur = curves[cfg.lr]
    ns = sorted(cur)
    for n in dict.fromkeys([ns[0], ns[len(ns) // 2], ns[-1]]):
        s = seeds_at(cfg, n)
        for k, gamma in enumerate(cfg.gammas):
            m = cur[n]["m_ret"][k * s : (k + 1) * s].mean(0)
            ax[0, 3].plot(
                cur[n]["steps"], m, ls=("-", "--", ":")[k % 3], label=f"N={n}, γ={gamma:g}"
            )
    ax[0, 3].set_xlabel("step"), ax[0, 3].set_title(f"M_ret(t), η={cfg.lr:g}", fontsize=9)
    ax[0, 3].legend(fontsize=6)
    return {"main": fig}


def _data(cfg: CategoricalConfig, curves: dict) -> dict:
    """Curves by str(N) for ``cfg.lr`` (the layout reproductions read), the sweep under
    ``lr_sweep`` -> str(η) -> str(N)."""
    pack = lambda c: {k: c[k] for k in ("steps", *METRICS)}  # noqa: E731
    data = {str(n): pack(c) for n, c in curves[cfg.lr].items()}
    data["lr_sweep"] = {
        f"{lr:g}": {str(n): pack(c) for n, c in cur.items()}
        for lr, cur in curves.items()
        if lr != cfg.lr
    }
    return data


def _check(cfg: CategoricalConfig) -> None:
    if not 0 < cfg.n_correct < cfg.n_actions:
        raise ValueError("need 0 < n_correct < n_actions")
    _check_surrogate(cfg.surrogate)
    _check_optimizer(cfg.optimizer)
    if any(not (lr >= 0 and math.isfinite(lr)) for lr in (cfg.lr, *cfg.lr_sweep)):
        raise ValueError(f"step sizes must be finite and >= 0, got {(cfg.lr, *cfg.lr_sweep)}")
    b1, b2 = cfg.betas
    if not (0 <= b1 < 1 and 0 <= b2 < 1 and cfg.adam_eps > 0 and cfg.weight_decay >= 0):
        raise ValueError(
            f"AdamW needs 0 <= betas < 1, adam_eps > 0 and weight_decay >= 0; got betas "
            f"{cfg.betas}, adam_eps {cfg.adam_eps}, weight_decay {cfg.weight_decay}"
        )
    if not cfg.gammas or any(not (g >= 0 and math.isfinite(g)) for g in cfg.gammas):
        raise ValueError(
            f"gammas must be finite focal exponents >= 0 (the first, usually 0, is the "
            f"reference at matched gain), got {cfg.gammas}"
        )
    if any(int(n) < 1 for n in cfg.group_sizes) or cfg.steps < 1 or cfg.seeds < 1:
        raise ValueError("group sizes, steps and seeds must be positive")


def simulate(quick: bool = False, seed: int = 0, **overrides) -> SimResult:
    """F-GRPO §5.1 categorical simulation: Q_pos, M_ret and entropy vs group size and step size."""
    base = QUICK if quick else CategoricalConfig()
    cfg = CategoricalConfig(**{**asdict(base), "seed": seed, **overrides})
    _check(cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    t0 = time.perf_counter()
    lrs = list(dict.fromkeys([cfg.lr, *cfg.lr_sweep]))
    curves: dict[float, dict[int, dict]] = {lr: {} for lr in lrs}
    with Progress(transient=True) as bar:
        task = bar.add_task("categorical", total=len(lrs) * len(cfg.group_sizes))
        for lr in lrs:
            for n in cfg.group_sizes:
                curves[lr][int(n)] = run_group_size(cfg, int(n), gen, lr)
                bar.advance(task)
    rows = [row for lr in lrs for row in _summary(cfg, lr, curves[lr])]
    result = SimResult(
        name="categorical",
        title="F-GRPO categorical simulation: group size vs retained positive mass",
        config=asdict(cfg),
        rows=rows,
        claims=[c for lr in lrs for c in fig2_claims(cfg, lr, curves[lr])],
        figures=_figures(cfg, curves, rows),
        data=_data(cfg, curves),
        notes=[
            f"surrogate {cfg.surrogate!r}: "
            + (
                "the paper's (1/N) Σ r̃_j π(a_j)"
                if cfg.surrogate == "prob"
                else "the labelled log-prob variant (1/N) Σ r̃_j log π(a_j), not the paper's"
            )
            + f"; optimizer {cfg.optimizer!r}: "
            + (
                f"AdamW as Hu et al. §4.1 / F-GRPO App. J (betas {cfg.betas}, eps "
                f"{cfg.adam_eps:g}, weight decay {cfg.weight_decay:g}: torch defaults [OURS])."
                if cfg.optimizer == "adamw"
                else "plain gradient ascent [OURS], not the papers' optimiser: η = 1e-2 moves "
                "nothing visible in 1000 steps (the per-logit step is ~η·π_i/N)."
            ),
            "Matched gain: each γ > 0 row also gives M_ret of the γ = 0 run at the step where "
            "its Q_pos gain equalled this row's final gain (NaN: never reached).",
        ],
    )
    result.seconds = time.perf_counter() - t0
    return result
