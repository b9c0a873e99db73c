"""F-GRPO's categorical simulation (§5.1): group sampling forgets unsampled correct actions.

Setup [PAPER: F-GRPO §5.1, ALGORITHMS.md §6]: a softmax policy over |A| = 128,000 actions,
10,000 of them correct (R = +1), the rest wrong (R = −1). Initial logits: one *anchor* correct
action 5.0, the other correct 3.0, wrong 0.0 (Q_pos ≈ 0.63). Each step samples a group of N
actions, centres the rewards within the group (r̃_j = R_j − mean_k R_k, no std), and ascends
the one-step surrogate (1/N) Σ_j r̃_j ρ_j, ρ_j = π(a_j)/π_old(a_j), whose gradient at ρ = 1 is
(1/N) Σ_j r̃_j ∇ log π(a_j). In logit space this is, for every action i,

    Δz_i = (η/N) · g · Σ_j r̃_j (1[a_j = i] − π_i) = (η/N) · g · c_i · r̃(i)   (Σ_j r̃_j = 0),

with c_i the count of i in the group and g = (1 − μ̂)^γ the focal weight (μ̂ = the group's
success rate). Unsampled actions keep their logit but lose probability when the sampled
correct ones gain it. Metrics: Q_pos(t) = Σ_{a∈A+} π_t(a) and the retained positive mass
M_ret(t) = 1 − Σ_{a∈A+} max(0, π_0(a) − π_t(a)) / Σ_{a∈A+} π_0(a).

[OURS] Learning rate. The paper states η = 1e-2. Read literally (either as the per-logit step
(η/N) p_i (R_i − S_R) of a linear probability surrogate, or as the step above) a 1000-step run
moves Q_pos by < 1e-3 here: every logit step is ~η/N. We default to ``lr = 1.0`` in the units
above, where the paper's qualitative picture appears clearly within 1000 steps; ``--lr 1e-2``
reproduces the literal setting (the same orderings, ~100× smaller effects). The sampling is
exact: inverse CDF on the cumulative probabilities, all seeds and γ values batched as rows.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from rich.progress import Progress

from grouprl.report.html import figure
from grouprl.simulate._common import Claim, SimResult

__all__ = ["CategoricalConfig", "simulate"]


@dataclass(frozen=True)
class CategoricalConfig:
    """Parameters of the categorical simulation; defaults are the paper's (lr: see module)."""

    n_actions: int = 128_000
    n_correct: int = 10_000
    anchor_logit: float = 5.0
    correct_logit: float = 3.0
    wrong_logit: float = 0.0
    lr: float = 1.0
    group_sizes: tuple[int, ...] = tuple(2**k for k in range(1, 18))  # 2 .. 131072
    gammas: tuple[float, ...] = (0.0, 1.0)
    steps: int = 1000
    seeds: int = 4
    log_every: int = 25
    seed: int = 0


QUICK = CategoricalConfig(
    n_actions=12_800,
    n_correct=1_000,
    group_sizes=(8, 64, 1024, 16384),
    steps=300,
    seeds=2,
    log_every=25,
)
"""``--quick``: a tenth of the actions (same correct share and Q_pos(0)), 300 steps, 2 seeds."""


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


def _metrics(pi: torch.Tensor, pi0: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    q_pos = pi[:, :c].sum(dim=1)  # [B]
    lost = (pi0[:, :c] - pi[:, :c]).clamp_min(0).sum(dim=1)  # [B]
    return q_pos, 1.0 - lost / pi0[:, :c].sum(dim=1)


def run_group_size(
    cfg: CategoricalConfig, n: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Train ``len(gammas) × seeds`` policies at group size ``n``; return their metric curves.

    Rows are gamma-major: row ``k * seeds + s`` has γ = gammas[k], seed s. Returns ``q_pos`` and
    ``m_ret`` of shape ``[R, T']`` (T' = logged points, step 0 included) and ``steps``.

    Sparse exact update: since Σ_j r̃_j = 0, Δz_i = (η/N)·g·c_i·r̃(i) touches only the sampled
    actions, so each step costs O(N log |A|) plus one cumulative sum for the inverse CDF; the
    unnormalised weights w = exp(z) are refreshed only where z moved.
    """
    z0, reward = initial_logits(cfg)
    gam = torch.tensor(cfg.gammas, dtype=torch.float64).repeat_interleave(cfg.seeds)  # [B]
    b = gam.numel()
    z = z0.expand(b, -1).clone()  # [B, A]
    w = torch.exp(z)  # [B, A] unnormalised probabilities
    pi0 = w / w.sum(dim=1, keepdim=True)
    qs, ms, steps = [], [], []
    for t in range(cfg.steps + 1):
        if t % cfg.log_every == 0 or t == cfg.steps:
            q, m = _metrics(w / w.sum(dim=1, keepdim=True), pi0, cfg.n_correct)
            qs.append(q), ms.append(m), steps.append(t)
        if t == cfg.steps:
            break
        a = sample_actions(w, n, generator)  # [B, N]
        r = reward[a]  # [B, N]
        r_bar = r.mean(dim=1, keepdim=True)  # [B, 1]
        mu_hat = (r_bar.squeeze(1) + 1.0) / 2.0  # [B] success rate (R in {-1, +1})
        g = (1.0 - mu_hat).clamp_min(0) ** gam  # [B] focal weight; 0**0 = 1
        z.scatter_add_(1, a, (cfg.lr / n) * g[:, None] * (r - r_bar))  # Σ_j over repeats
        w.scatter_(1, a, z.gather(1, a).exp())
    return {"q_pos": torch.stack(qs, 1), "m_ret": torch.stack(ms, 1), "steps": torch.tensor(steps)}


def _se(x: torch.Tensor) -> float:
    """Standard error of the mean over seeds (0 with one seed)."""
    return float(x.std(correction=1) / x.numel() ** 0.5) if x.numel() > 1 else 0.0


def _summary(cfg, curves):
    rows = []
    for n, cur in curves.items():
        for k, gamma in enumerate(cfg.gammas):
            sl = slice(k * cfg.seeds, (k + 1) * cfg.seeds)
            q, m = cur["q_pos"][sl, -1], cur["m_ret"][sl, -1]
            rows.append(
                {
                    "N": n,
                    "gamma": gamma,
                    "Q_pos(0)": float(cur["q_pos"][sl, 0].mean()),
                    "Q_pos(T)": float(q.mean()),
                    "Q_pos se": _se(q),
                    "M_ret(T)": float(m.mean()),
                    "M_ret se": _se(m),
                    "M_ret min over t": float(cur["m_ret"][sl].mean(0).min()),
                }
            )
    return rows


def _claims(cfg, rows) -> list[Claim]:
    by = {(r["N"], r["gamma"]): r for r in rows}
    ns = sorted({r["N"] for r in rows})
    g0, g1 = cfg.gammas[0], cfg.gammas[-1]
    # "Moderate N": the N (among the smaller half) where GRPO (γ = 0) loses the most M_ret.
    small = ns[: max(1, len(ns) // 2)]
    n_mod = min(small, key=lambda n: by[(n, g0)]["M_ret(T)"])
    r0, r1 = by[(n_mod, g0)], by[(n_mod, g1)]
    rise = r0["Q_pos(T)"] > r0["Q_pos(0)"] and r0["M_ret(T)"] < 1.0 - 1e-3
    keep = sum(by[(n, g1)]["M_ret(T)"] > by[(n, g0)]["M_ret(T)"] for n in small)
    big = by[(ns[-1], g0)]
    return [
        Claim(
            "grpo_raises_q_pos_while_forgetting",
            rise,
            f"N={n_mod}, γ={g0:g}: Q_pos {r0['Q_pos(0)']:.4f} -> {r0['Q_pos(T)']:.4f}, "
            f"M_ret {r0['M_ret(T)']:.4f}",
        ),
        Claim(
            "focal_keeps_more_m_ret",
            keep == len(small),
            f"γ={g1:g} keeps more M_ret than γ={g0:g} at {keep}/{len(small)} of N in {small}; "
            f"at N={n_mod}: {r1['M_ret(T)']:.4f} vs {r0['M_ret(T)']:.4f}",
        ),
        Claim(
            "largest_n_keeps_m_ret",
            big["M_ret(T)"] >= 0.999,
            f"N={ns[-1]}, γ={g0:g}: M_ret = {big['M_ret(T)']:.5f} (>= 0.999)",
        ),
    ]


def _figures(cfg, curves, rows):
    fig, ax = figure(3, 1, width=4.6)
    ns = sorted(curves)
    for gamma in cfg.gammas:
        sel = [r for r in rows if r["gamma"] == gamma]
        ax[0, 0].plot(
            [r["N"] for r in sel], [r["Q_pos(T)"] for r in sel], "o-", label=f"γ={gamma:g}"
        )
        ax[0, 1].plot(
            [r["N"] for r in sel], [r["M_ret(T)"] for r in sel], "o-", label=f"γ={gamma:g}"
        )
    q0 = rows[0]["Q_pos(0)"]
    ax[0, 0].axhline(q0, color="grey", ls=":", label="Q_pos(0)")
    for a, lab in ((ax[0, 0], "Q_pos after T steps"), (ax[0, 1], "M_ret after T steps")):
        a.set_xscale("log", base=2), a.set_xlabel("group size N"), a.set_title(lab), a.legend()
    n_show = [ns[0], ns[len(ns) // 2], ns[-1]] if len(ns) > 2 else ns
    for n in dict.fromkeys(n_show):
        cur = curves[n]
        for k, gamma in enumerate(cfg.gammas):
            sl = slice(k * cfg.seeds, (k + 1) * cfg.seeds)
            ax[0, 2].plot(
                cur["steps"],
                cur["m_ret"][sl].mean(0),
                ls="-" if k == 0 else "--",
                label=f"N={n}, γ={gamma:g}",
            )
    ax[0, 2].set_xlabel("step"), ax[0, 2].set_title("M_ret(t)"), ax[0, 2].legend(fontsize=7)
    return {"main": fig}


def simulate(quick: bool = False, seed: int = 0, **overrides) -> SimResult:
    """F-GRPO §5.1 categorical simulation: Q_pos and retained positive mass M_ret vs group size."""
    base = QUICK if quick else CategoricalConfig()
    cfg = CategoricalConfig(**{**asdict(base), "seed": seed, **overrides})
    if not 0 < cfg.n_correct < cfg.n_actions:
        raise ValueError("need 0 < n_correct < n_actions")
    gen = torch.Generator().manual_seed(cfg.seed)
    t0 = time.perf_counter()
    curves = {}
    with Progress(transient=True) as bar:
        task = bar.add_task("categorical", total=len(cfg.group_sizes))
        for n in cfg.group_sizes:
            curves[n] = run_group_size(cfg, int(n), gen)
            bar.advance(task)
    rows = _summary(cfg, curves)
    result = SimResult(
        name="categorical",
        title="F-GRPO categorical simulation: group size vs retained positive mass",
        config=asdict(cfg),
        rows=rows,
        claims=_claims(cfg, rows),
        figures=_figures(cfg, curves, rows),
        data={
            str(n): {"steps": c["steps"], "q_pos": c["q_pos"], "m_ret": c["m_ret"]}
            for n, c in curves.items()
        },
        notes=[
            "lr is [OURS]: the paper's eta = 1e-2 moves Q_pos by < 1e-3 in 1000 steps under "
            "this update; run with --lr 0.01 for the literal setting.",
        ],
    )
    result.seconds = time.perf_counter() - t0
    return result
