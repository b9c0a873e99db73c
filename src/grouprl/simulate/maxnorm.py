"""MaxNorm-AC where it applies: learnable partial credit beside sub-resolution jitter.

MaxNorm paper [PAPER seed: "Advantage Scale Calibration Imbalance in Group-Relative Optimization
under Low-Variance Rewards", abstract, Tables 1–3]: low-variance groups hold two kinds of gaps —
*sub-resolution jitter* that should never become a preference, and *credible small cardinal
gaps* that should be learned. GRPO's 1/σ_q lifts both to unit scale (the jitter without bound);
RLOO / Dr.GRPO keep the small gaps small, so a fixed β·KL outweighs them; MaxNorm-AC divides
the trusted numerator by s_q = max(τ_res, max_j |u_j|) and, with the Reward-Resolution Protocol
(δ_res = 1e-2), drops the jitter and recovers the credible gaps at a bounded scale. Table 2
(accuracy / KL P95, G = 16, 5 shared seeds): GRPO 70.6 / 0.086, GRPO + Protocol 71.3 / 0.091,
RLOO + Protocol 71.4 / 0.032, p90 + Protocol 73.5 / 0.080, MaxNorm-RLOO 78.3 / 0.055
(:data:`PAPER_TABLE2`).

**World** [OURS, stated so it can be argued with]. An answer is ``slots`` tokens, each one of
``options`` choices, plus one *surface-form* token (``forms`` choices) that the reward ignores —
two answers with equal reward need not be the same sequence, as in an LLM. Each prompt q has a
right choice per slot, right_{q,l} = argmax_c of a hidden linear score of its features x_q (plus
noise), so what is learned on one prompt transfers to the others. The verifier pays

    r = (1 − κ)·[all slots right] + κ·k/L + s_q·ξ,    k = number of right slots, L = ``slots``

- *accuracy* is the task's correctness, [all slots right] — the quantity the paper's accuracy
  measures — read **exactly** on ``test_prompts`` held-out prompts: E_π[correct] = Π_l π_l(right).
- *partial credit* κ·k/L (κ = ``credit``): one more right slot is worth κ/L = 0.025 ≥ 2.5·δ_res,
  a credible small gap (like one more unit test passed), and learning it *is* learning
  accuracy: the same slot choices make the full answer right.
- *jitter* s_q·ξ, ξ ~ N(0, 1) per sample, on a share ``jitter_share`` of prompts, s_q
  log-uniform in [``jitter_lo``, ``jitter_spread``·``jitter_lo``] = [3e-4, 3e-3]: below δ_res/3,
  in the decade where Table 3's GRPO 1/scale P95/P99 (980/3100) puts the smallest σ_q.

**Policy**: a two-layer network shared by every prompt and token position, so that a push on any
token moves the others (as in an LLM; [OURS]): h_q = tanh(x_q A), logits = prior_q + h_q B per
token (B starts at 0, so the initial policy is the prior; A random). The prior gives the right
choice of slot l a logit bonus e_{q,l} ~ N(``ease_mean``, ``ease_std``) over noise of scale
``prior_scale``: some slots are nearly solved at the start, others nearly never right, so many
groups are all wrong and differ only in partial credit. The reference is the initial policy.

**Training**: each step draws ``batch`` prompts, G = 16 answers each, computes the method's
advantages (:func:`grouprl.advantages.compute`), and takes one Adam step on
:func:`grouprl.losses.objective` (REINFORCE surrogate, token mean over the L + 1 tokens, k3 KL
to the reference with β and the method's ``kl_weight``; groups with ``keep = False`` out of both
branches). Every method of a seed sees the same world and the same prompt stream (common random
numbers), so differences between methods are paired by seed.

**Measured**: the held-out accuracy (and the expected partial credit) at the end; and over the
second half of training, on updated groups with σ_q < 1e-2 (Table 3's subset,
:func:`grouprl.diagnostics.low_sigma_groups`): 1/scale P95/P99, mean and P95 of the token k3 at
the sampled tokens, and — at every step that has such a group, the subset being rare after
the Protocol — R/KL = ‖g_R‖/(β‖g_KL‖) and the two readings of "Dir." (reward/KL cosine; cosine
with the cardinal r − r̄ gradient) of :func:`grouprl.simulate.low_variance.subset_gradients`.
For context, over *all* updated groups: the KL at the sampled tokens (mean, P95) and, every
``measure_every`` steps, R/KL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grouprl.diagnostics.balance import low_sigma_groups
from grouprl.diagnostics.inverse_scale import updated_groups
from grouprl.losses.kl import k3
from grouprl.losses.objective import objective
from grouprl.simulate.low_variance import PAPER_TABLE3, bisect_log, subset_gradients

__all__ = [
    "METHODS",
    "PAPER_TABLE2",
    "PAPER_TABLE3",
    "MaxNormConfig",
    "World",
    "accuracy",
    "calibrate_beta",
    "make_world",
    "rewards_of",
    "train",
]

METHODS: dict[str, tuple[str, dict]] = {
    "grpo": ("grpo", {}),
    "grpo+protocol": ("grpo", {"delta_res": 1e-2}),
    "grpo_beta_comp": ("grpo_beta_comp", {}),
    "rloo+protocol": ("rloo", {"delta_res": 1e-2}),
    "dr_grpo": ("dr_grpo", {}),
    "p90+protocol": ("p90", {"delta_res": 1e-2}),
    "gopo+protocol": ("gopo", {"delta_res": 1e-2}),
    "maxnorm_rloo": ("maxnorm_rloo", {"delta_res": 1e-2}),
    "maxnorm_dr_grpo": ("maxnorm_dr_grpo", {"delta_res": 1e-2}),
}
"""Row label -> (estimator, ``advantages.compute`` keywords). "+protocol" and the MaxNorm rows
run the Reward-Resolution Protocol (δ_res = 1e-2), as the paper's rows of those names. GOPO runs
with the Protocol [OURS]: a pure ranking without it ranks the jitter itself."""

PAPER_TABLE2: dict[str, dict[str, float]] = {
    "grpo": {"accuracy": 70.6, "KL P95": 0.086},
    "grpo+protocol": {"accuracy": 71.3, "KL P95": 0.091},
    "rloo+protocol": {"accuracy": 71.4, "KL P95": 0.032},
    "p90+protocol": {"accuracy": 73.5, "KL P95": 0.080},
    "maxnorm_rloo": {"accuracy": 78.3, "KL P95": 0.055},
}
"""MaxNorm paper, Table 2 (accuracy in points / KL P95): rows "GRPO", "GRPO + Protocol",
"RLOO + Protocol", "p90 ref. + Protocol", "MaxNorm-RLOO, no δ_res-binning"."""


@dataclass(frozen=True)
class MaxNormConfig:
    """Parameters of the partial-credit world and its training (module docstring)."""

    prompts: int = 4096
    test_prompts: int = 1024
    features: int = 8
    hidden: int = 32
    slots: int = 4
    options: int = 8
    forms: int = 8
    credit: float = 0.1
    prior_scale: float = 1.0
    ease_mean: float = 4.5
    ease_std: float = 1.5
    label_noise: float = 0.5
    jitter_share: float = 0.5
    jitter_lo: float = 3e-4
    jitter_spread: float = 10.0
    group_size: int = 16
    batch: int = 32
    steps: int = 400
    lr: float = 0.01
    beta: float = 0.35
    measure_every: int = 10
    low_sigma: float = 1e-2
    target_kl: float = 0.017
    beta_bracket: tuple[float, float] = (0.05, 5.0)
    calib_iters: int = 6
    seed: int = 0


QUICK = MaxNormConfig(
    prompts=128, test_prompts=64, batch=8, steps=12, measure_every=3, calib_iters=2
)
"""``--quick``: 128 prompts, 8 per step, 12 steps (a schema check, not a result)."""


@dataclass(frozen=True)
class World:
    """Prompts (train rows first, then held-out rows), right choices, prior and jitter."""

    x: torch.Tensor  # [Q, d] features, x[:, 0] = 1
    right: torch.Tensor  # [Q, L] long: the right choice of each slot
    prior: torch.Tensor  # [Q, L + 1, K] fixed logits (slots, then the form; K = max(C, F))
    mask: torch.Tensor  # [L + 1, K] bool: the real choices of each token position
    jitter: torch.Tensor  # [Q] s_q (0 where the verifier is exact)
    train: int  # the first ``train`` rows are the training prompts


def make_world(cfg: MaxNormConfig, gen: torch.Generator) -> World:
    """Draw the world of the module docstring (float64)."""
    q, d, ll, c, f = cfg.prompts + cfg.test_prompts, cfg.features, cfg.slots, cfg.options, cfg.forms
    if ll < 1 or c < 2 or f < 1 or d < 1 or cfg.prompts < 1 or cfg.test_prompts < 1:
        raise ValueError(
            f"need slots >= 1, options >= 2, forms >= 1, features >= 1 and prompts, test_prompts "
            f">= 1; got slots={ll}, options={c}, forms={f}, features={d}"
        )
    if not 0.0 <= cfg.credit < 1.0:
        raise ValueError(f"credit must be in [0, 1) (rewards stay in [0, 1]), got {cfg.credit}")
    kw = {"generator": gen, "dtype": torch.float64}
    x = torch.randn(q, d, **kw) / math.sqrt(d)
    x[:, 0] = 1.0
    score = torch.einsum("qd,dlc->qlc", x, torch.randn(d, ll, c, **kw))  # [Q, L, C]
    right = (score + cfg.label_noise * torch.randn(q, ll, c, **kw)).argmax(-1)  # [Q, L]
    k = max(c, f)
    ease = cfg.ease_mean + cfg.ease_std * torch.randn(q, ll, **kw)  # [Q, L]
    slot_prior = cfg.prior_scale * torch.randn(q, ll, c, **kw)  # [Q, L, C]
    slot_prior.scatter_add_(2, right[..., None], ease[..., None])
    prior = torch.zeros(q, ll + 1, k, dtype=torch.float64)
    prior[:, :ll, :c] = slot_prior
    prior[:, ll, :f] = cfg.prior_scale * torch.randn(q, f, **kw)
    mask = torch.zeros(ll + 1, k, dtype=torch.bool)
    mask[:ll, :c] = True
    mask[ll, :f] = True
    u, v = torch.rand(q, **kw), torch.rand(q, **kw)
    s = cfg.jitter_lo * cfg.jitter_spread**u
    jitter = torch.where(v < cfg.jitter_share, s, torch.zeros_like(s))  # [Q]
    return World(x, right, prior, mask, jitter, cfg.prompts)


def rewards_of(
    actions: torch.Tensor, right: torch.Tensor, credit: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(value [P, G], correct [P, G])``: (1 − κ)·[all right] + κ·k/L, before jitter.

    ``actions``: ``[P, G, L + 1]`` sampled tokens (the last is the surface form, ignored);
    ``right``: ``[P, L]`` the right choices; ``credit``: κ.
    """
    ll = right.shape[1]
    hits = (actions[..., :ll] == right[:, None, :]).sum(-1)  # [P, G]
    correct = (hits == ll).double()
    return (1.0 - credit) * correct + credit * hits.double() / ll, correct


def _logits(world: World, idx: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[P, L + 1, K]`` log-softmax of prior + tanh(x A) B, impossible choices at −inf."""
    h = torch.tanh(world.x[idx] @ a)  # [P, H]
    z = world.prior[idx] + (h @ b).view(len(idx), *world.prior.shape[1:])  # [P, L + 1, K]
    return torch.log_softmax(z.masked_fill(~world.mask, -math.inf), -1)


def accuracy(world: World, rows: torch.Tensor, a, b) -> tuple[float, float]:
    """``(E_π[correct], E_π[k/L])`` averaged over prompts ``rows``, exactly (no sampling).

    The slots are independent given the prompt, so E_π[correct] = Π_l π_l(right_l) and
    E_π[k/L] = mean_l π_l(right_l).
    """
    with torch.no_grad():
        ll = world.right.shape[1]
        lsm = _logits(world, rows, a, b)[:, :ll]  # [R, L, K]
        p = lsm.gather(2, world.right[rows][..., None]).squeeze(2).exp()  # [R, L]
        return float(p.prod(1).mean()), float(p.mean())


def _params(world: World, cfg: MaxNormConfig, gen: torch.Generator):
    """One flat trainable vector θ (so that the gradient diagnostics see every parameter) and
    the views A ``[d, H]`` (random, N(0, 1)) and B ``[H, (L + 1)·K]`` (0: the initial policy is the
    prior) into it."""
    d, hdim = cfg.features, cfg.hidden
    out = world.prior.shape[1] * world.prior.shape[2]
    theta = torch.zeros(d * hdim + hdim * out, dtype=torch.float64)
    theta[: d * hdim] = torch.randn(d * hdim, generator=gen, dtype=torch.float64)
    theta.requires_grad_(True)
    return theta, (d * hdim, hdim, out)


def _views(theta: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor]:
    n_a, hdim, out = shape
    return theta[:n_a].view(-1, hdim), theta[n_a:].view(hdim, out)


def train(
    method: str,
    world: World,
    cfg: MaxNormConfig,
    *,
    seed: int,
    lr: float | None = None,
    beta: float | None = None,
) -> dict[str, float]:
    """One run of ``method`` (a :data:`METHODS` label) at ``lr`` and ``beta`` (default: the
    config's).

    Four generators seeded from ``seed`` (initial A, prompt stream, answers, jitter): every
    method of a seed starts from the same network and sees the same prompts. Returns the
    held-out accuracy and credit at the start and the end, and Table 3's columns.
    """
    from grouprl import advantages

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")
    name, kw = METHODS[method]
    lr = cfg.lr if lr is None else lr
    beta = cfg.beta if beta is None else beta
    gens = [torch.Generator().manual_seed(seed * 7919 + k) for k in (1, 2, 3, 4)]
    theta, shape = _params(world, cfg, gens[0])
    opt = torch.optim.Adam([theta], lr=lr)
    g, p, ll = cfg.group_size, cfg.batch, world.right.shape[1]
    test = torch.arange(world.train, world.x.shape[0])
    acc0 = accuracy(world, test, *_views(theta, shape))
    ref_all = _logits(world, torch.arange(world.x.shape[0]), *_views(theta.detach(), shape))
    mask = torch.ones(p * g, ll + 1, dtype=torch.float64)
    inv, kls, kl_all, rkl, cos_kl, cos_c, rkl_all = [], [], [], [], [], [], []
    n_low = n_groups = n_skip = 0
    start = cfg.steps // 2
    for t in range(cfg.steps):
        idx = torch.randint(world.train, (p,), generator=gens[1])  # [P]
        lsm = _logits(world, idx, *_views(theta, shape))  # [P, L + 1, K]
        probs = lsm.detach().exp().reshape(p * (ll + 1), -1)
        act = torch.multinomial(probs, g, replacement=True, generator=gens[2])  # [P(L+1), G]
        act = act.view(p, ll + 1, g).transpose(1, 2)  # [P, G, L + 1]
        value, _ = rewards_of(act, world.right[idx], cfg.credit)  # [P, G]
        xi = torch.randn(p, g, generator=gens[3], dtype=torch.float64)
        rewards = value + world.jitter[idx, None] * xi  # [P, G]
        adv = advantages.compute(name, rewards, **kw)
        gather = act.transpose(1, 2)[..., None]  # [P, L + 1, G, 1]
        lp = lsm[:, :, None, :].expand(-1, -1, g, -1).gather(3, gather)[..., 0]  # [P, L+1, G]
        lp = lp.transpose(1, 2)  # [P, G, L + 1]
        ref = ref_all[idx][:, :, None, :].expand(-1, -1, g, -1).gather(3, gather)[..., 0]
        ref = ref.transpose(1, 2)  # [P, G, L + 1]
        obj = objective(
            lp.reshape(p * g, ll + 1),
            None,
            adv.per_sample,
            mask,
            surrogate="reinforce",
            aggregation="token_mean",
            keep=adv.keep.repeat_interleave(g),
            ref_logp=ref.reshape(p * g, ll + 1),
            kl="k3",
            beta=beta,
            kl_weight=adv.kl_weight.repeat_interleave(g),
        )
        if t >= start:
            sel = low_sigma_groups(rewards, adv, cfg.low_sigma)  # [P] Table 3's subset
            every = updated_groups(adv)  # [P]
            n_groups += p
            n_low += int(sel.sum())
            n_skip += int((~adv.keep.to(torch.bool)).sum())
            kl_all.append(k3(lp[every], ref[every]).detach().reshape(-1))
            card = rewards - rewards.mean(1, keepdim=True)  # [P, G] cardinal r − r̄
            if bool(sel.any()):  # the subset is rare: measured at every step that has it
                inv.append(1.0 / adv.scale[sel].double())
                kls.append(k3(lp[sel], ref[sel]).detach().reshape(-1))
                m = subset_gradients(theta, lp[sel], ref[sel], adv.values[sel], card[sel], beta)
                rkl.append(m["r_over_kl"])
                cos_kl.append(m["cos_kl"])
                cos_c.append(m["cos_cardinal"])
            if (t - start) % cfg.measure_every == 0 and bool(every.any()):
                m = subset_gradients(
                    theta, lp[every], ref[every], adv.values[every], card[every], beta
                )
                rkl_all.append(m["r_over_kl"])
        opt.zero_grad(set_to_none=True)
        obj.loss.backward()
        opt.step()
    acc1 = accuracy(world, test, *_views(theta, shape))
    train_rows = torch.arange(world.train)
    acc_train = accuracy(world, train_rows, *_views(theta, shape))[0]
    return {
        "accuracy": acc1[0],
        "accuracy at start": acc0[0],
        "accuracy gain": acc1[0] - acc0[0],
        "credit": acc1[1],
        "credit gain": acc1[1] - acc0[1],
        "train accuracy": acc_train,
        **_table3(inv, kls, (rkl, cos_kl, cos_c)),
        "mean KL, all updated": float(torch.cat(kl_all).mean()) if kl_all else float("nan"),
        "KL P95, all updated": _p95(kl_all),
        "R/KL, all updated": _finite_mean(rkl_all),
        "low-σ updated share": n_low / max(n_groups, 1),
        "skipped share": n_skip / max(n_groups, 1),
    }


def calibrate_beta(cfg: MaxNormConfig, seed: int) -> tuple[float, float]:
    """``(β, RLOO + Protocol's mean KL at β)``: β such that RLOO + Protocol's mean KL on the
    low-σ updated groups is ``target_kl`` (Table 3: 0.017), on the world and streams of
    ``seed`` at ``cfg.lr``; ``calib_iters`` bisections of log β in ``beta_bracket`` [OURS:
    the one number of Table 3 that sets the KL's level, as in ``simulate.low_variance``]."""
    world = make_world(cfg, torch.Generator().manual_seed(seed))

    def kl_at(b: float) -> float:
        out = train("rloo+protocol", world, cfg, seed=seed, beta=b)["mean KL"]
        return out if math.isfinite(out) else 0.0

    beta = bisect_log(kl_at, cfg.target_kl, *cfg.beta_bracket, cfg.calib_iters)
    return beta, kl_at(beta)


def _finite_mean(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def _p95(chunks: list[torch.Tensor]) -> float:
    if not chunks or not sum(c.numel() for c in chunks):
        return float("nan")
    return float(torch.quantile(torch.cat(chunks), 0.95))


def _table3(inv, kls, grads) -> dict[str, float]:
    nan = float("nan")
    if inv:
        qs = torch.tensor([0.95, 0.99], dtype=torch.float64)
        p95, p99 = torch.quantile(torch.cat(inv), qs).tolist()
        kl_t = torch.cat(kls)
        kl_mean, kl_p95 = float(kl_t.mean()), float(torch.quantile(kl_t, 0.95))
    else:
        p95 = p99 = kl_mean = kl_p95 = nan
    rkl, cos_kl, cos_c = grads
    return {
        "mean KL": kl_mean,
        "KL P95": kl_p95,
        "inv P95": p95,
        "inv P99": p99,
        "R/KL": _finite_mean(rkl),
        "Dir: cos(g_R, g_KL)": _finite_mean(cos_kl),
        "Dir: cos(g_R, g_cardinal)": _finite_mean(cos_c),
    }
