"""The loss-side methods (SAPO, GMPO, GPG, Clip-Cov, KL-Cov, DPPO-TV, ...) against the peers' own functions, on the same tensors.

verl 0.9.1: ``sapo``, ``geo_mean`` (GMPO), ``gpg``, ``clip_cov``, ``kl_cov``, ``dppo_tv``,
``dppo_kl``, ``dro`` policy losses, ``agg_loss`` ``token-sum`` / ``seq-mean-token-sum``, and
``kl_penalty`` (``abs``, aliases, ``+`` straight-through names). TRL 1.16: ``GRPOTrainer.
_compute_loss`` for ``sapo`` (token and sequence level), ``vespo``, ``luspo``, ``bnpo``, the
two-sided ``delta`` clip, ``top_entropy_quantile`` and ``use_bias_correction_kl``, and the
experimental ``GMPOTrainer._compute_loss``, each run on a stand-in ``self`` (the method is TRL's
own code). OpenRLHF 0.11.2: ``compute_approx_kl(..., unbiased_gradient=True)`` and
``PolicyLoss`` (dual clip, GSPO, both aggregations), executed from its installed source by
``tests/advantages/openrlhf_ref.py`` without its DeepSpeed/vLLM package imports
(``scripts/install-peers.sh`` installs it without dependencies). Each comparison runs over the cases of :func:`case`: random, G = 2, all-equal
groups (advantage 0), NaN-reward rows (advantage 0 from grouprl's estimator), extreme ratios
(|log ρ| up to 30, beyond every clamp) and ragged masks. Loss and gradient are compared.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import peer_calls
import pytest
import torch

from grouprl import advantages, losses

pytestmark = pytest.mark.peer

CASES = ("random", "g2", "equal", "nan_rows", "extreme", "ragged")


def case(kind: str, seed: int = 0, n: int = 8, t: int = 7):
    """``(logp, old, ref, adv [N], mask)`` in float64 for one named case (prompt-major, G = 4)."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.float64
    if kind == "g2":
        n = 6
    lengths = torch.full((n,), t)
    if kind in ("ragged", "random", "extreme"):
        lengths = torch.randint(1, t + 1, (n,), generator=g)
        lengths[0] = t
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(dt)
    old = -torch.rand(n, t, generator=g, dtype=dt) * 2 - 0.05
    logp = old + 0.3 * torch.randn(n, t, generator=g, dtype=dt)
    logp = logp.clamp(max=-1e-4)  # probabilities below 1 (DPPO's binary KL takes log(1 − p))
    ref = logp + 0.2 * torch.randn(n, t, generator=g, dtype=dt)
    group = 2 if kind == "g2" else 4
    rewards = torch.randint(0, 2, (n // group, group), generator=g).to(dt)
    if kind == "equal":
        rewards[:] = 1.0
    if kind == "nan_rows":
        rewards[0, 1] = rewards[1, 0] = float("nan")
    adv = advantages.compute("grpo", rewards).values.reshape(-1)
    if kind in ("random", "ragged", "extreme"):
        adv = torch.randn(n, generator=g, dtype=dt)
    if kind == "extreme":
        logp[1, 0] = old[1, 0] + 30.0
        logp[2, 1] = old[2, 1] - 25.0
        logp[3, 0] = old[3, 0] + 15.0
        logp[1:4] = logp[1:4].clamp(max=-1e-4)
        old[1, 0], old[3, 0] = logp[1, 0] - 30.0, logp[3, 0] - 15.0
        ref[1, 0] = logp[1, 0] - 22.0
    return logp, old, ref, adv, mask


def _grad(fn, logp):
    lp = logp.detach().clone().requires_grad_()
    loss = fn(lp)
    (g,) = torch.autograd.grad(loss, lp)
    return loss.detach(), g


def _close(ours, theirs, tol=1e-10):
    torch.testing.assert_close(ours[0], theirs[0], atol=tol, rtol=tol, equal_nan=False)
    torch.testing.assert_close(ours[1], theirs[1], atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- verl


@pytest.fixture(scope="module")
def verl():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        core = pytest.importorskip("verl.trainer.ppo.core_algos")
        config = pytest.importorskip("verl.workers.config")
    return core, config


def _cfg(config, **kw):
    return peer_calls.verl_config(**kw)


VERL_AGG = {
    "token_mean": "token-mean",
    "seq_mean_token_mean": "seq-mean-token-mean",
    "seq_mean_token_sum_norm": "seq-mean-token-sum-norm",
    "seq_mean_token_sum": "seq-mean-token-sum",
    "token_sum": "token-sum",
}

VERL_METHODS = [
    # verl loss name, our surrogate, our params, verl config kwargs
    ("sapo", "sapo", {"tau_pos": 1.0, "tau_neg": 1.05}, {"tau_pos": 1.0, "tau_neg": 1.05}),
    ("sapo", "sapo", {"tau_pos": 2.0, "tau_neg": 3.0}, {"tau_pos": 2.0, "tau_neg": 3.0}),
    ("gpg", "reinforce", {}, {}),
    ("dro", "dro", {"beta": 0.3}, {"dro_beta": 0.3}),
    (
        "kl_cov",
        "kl_cov",
        {"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.5},
        {"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.5},
    ),
    (
        "dppo_tv",
        "dppo_tv",
        {"delta_low": 0.05, "delta_high": 0.08, "clip_ratio_c": 3.0},
        {"clip": (0.05, 0.08)},
    ),
    (
        "dppo_kl",
        "dppo_kl",
        {"delta_low": 0.01, "delta_high": 0.02, "clip_ratio_c": 3.0},
        {"clip": (0.01, 0.02)},
    ),
]


def _verl_policy_loss(core, name, logp, old, adv, mask, cfg, agg):
    adv_tok = adv[:, None] * mask  # verl's advantages are per token, zero on padding
    return _grad(
        lambda lp: core.get_policy_loss_fn(name)(
            old, lp, adv_tok, mask, loss_agg_mode=VERL_AGG[agg], config=cfg
        )[0],
        logp,
    )


def _ours(name, logp, old, adv, mask, params, agg, **kw):
    return _grad(
        lambda lp: (
            losses.objective(
                lp, old, adv, mask, surrogate=name, surrogate_params=params, aggregation=agg, **kw
            ).loss
        ),
        logp,
    )


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize(("verl_name", "name", "params", "verl_kw"), VERL_METHODS)
def test_verl_policy_losses(verl, kind, verl_name, name, params, verl_kw):
    core, config = verl
    logp, old, _, adv, mask = case(kind, seed=1)
    verl_kw = dict(verl_kw)
    cfg = _cfg(config, clip=verl_kw.pop("clip", (0.2, 0.2)), **verl_kw)
    aggs = ["seq_mean_token_mean"] if verl_name == "sapo" else list(VERL_AGG)  # verl's SAPO
    for agg in aggs:  # forces seq-mean-token-mean whatever loss_agg_mode says
        theirs = _verl_policy_loss(core, verl_name, logp, old, adv, mask, cfg, agg)
        ours = _ours(name, logp, old, adv, mask, params, agg)
        _close(ours, theirs, tol=1e-8)  # verl's seq-mean-token-mean adds 1e-8 to |y|


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("eps", [(0.4, 0.4), (0.2, 0.3)])
def test_verl_geo_mean_is_gmpo(verl, kind, eps):
    core, config = verl
    logp, old, _, adv, mask = case(kind, seed=2)
    if kind == "extreme":  # exp of an unclamped log-ratio of 30/|y| overflows neither
        mask[:, 2:] = 0.0
    cfg = _cfg(config, clip=eps)
    # verl's geo_mean ignores loss_agg_mode: a plain mean over rows (all rows have a token here)
    theirs = _verl_policy_loss(core, "geo_mean", logp, old, adv, mask, cfg, "token_mean")
    params = {"eps_low": eps[0], "eps_high": eps[1]}
    ours = _ours("gmpo", logp, old, adv, mask, params, "seq_mean_token_mean")
    _close(ours, theirs, tol=1e-7)  # verl divides by |y| + 1e-8


@pytest.mark.parametrize("kind", CASES)
def test_verl_clip_cov_with_the_same_random_draw(verl, kind):
    core, config = verl
    logp, old, _, adv, mask = case(kind, seed=3)
    # a wide (lb, ub) and a large ratio so that several candidates exist and the draw matters
    kw = {"clip_cov_ratio": 0.2, "clip_cov_lb": -1.0, "clip_cov_ub": 5.0}
    cfg = _cfg(config, clip=(0.2, 0.28), **kw)
    for agg in VERL_AGG:
        torch.manual_seed(7)
        theirs = _verl_policy_loss(core, "clip_cov", logp, old, adv, mask, cfg, agg)
        torch.manual_seed(7)
        ours = _ours(
            "clip_cov", logp, old, adv, mask, {"eps_low": 0.2, "eps_high": 0.28, **kw}, agg
        )
        _close(ours, theirs, tol=1e-8)


def test_clip_cov_selection_is_a_random_draw_among_candidates(verl):
    # two seeds give two selections of the same size, both inside the candidate set
    logp, old, _, adv, mask = case("random", seed=3, n=16, t=9)
    kw = {"clip_cov_ratio": 0.1, "clip_cov_lb": -1.0, "clip_cov_ub": 5.0}
    a = losses.clip_cov_select(
        logp, old, adv, mask, generator=torch.Generator().manual_seed(0), **kw
    )
    b = losses.clip_cov_select(
        logp, old, adv, mask, generator=torch.Generator().manual_seed(1), **kw
    )
    count = max(int(0.1 * mask.sum()), 1)
    assert int(a.sum()) == int(b.sum()) == count and not torch.equal(a, b)


@pytest.mark.parametrize(
    "name", ["abs", "kl", "mse", "low_var_kl", "k1+", "k3+", "abs+", "mse+", "low_var_kl+"]
)
def test_verl_kl_penalty_names(verl, name):
    core, _ = verl
    logp, _, ref, _, _ = case("extreme", seed=4)
    theirs = _grad(lambda lp: (core.kl_penalty(lp, ref, name) * torch.arange(7.0)).sum(), logp)
    ours = _grad(lambda lp: (losses.kl(name, lp, ref) * torch.arange(7.0)).sum(), logp)
    _close(ours, theirs, tol=1e-12)


@pytest.mark.parametrize("agg", ["token_sum", "seq_mean_token_sum"])
def test_verl_new_aggregations_with_global_batch_info(verl, agg):
    core, _ = verl
    logp, _, _, adv, mask = case("ragged", seed=5)
    per_token = logp * adv[:, None]
    totals = losses.step_totals([mask[:3], mask[3:]])
    for s in (slice(0, 3), slice(3, 8)):
        theirs = core.agg_loss(
            per_token[s], mask[s], VERL_AGG[agg], global_batch_size=totals.num_seqs
        )
        ours = losses.aggregate(agg, per_token[s], mask[s], totals)
        torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- TRL


def _trl(logp, old, ref, adv, mask, **kw):
    pytest.importorskip("trl.trainer.grpo_trainer")
    return _grad(lambda lp: peer_calls.trl_loss(lp, old, ref, adv, mask, **kw), logp)


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_sapo(kind, level):
    logp, old, ref, adv, mask = case(kind, seed=6)
    if level == "sequence" and kind == "extreme":
        mask[:, 1:] = 1.0  # a 1-token row would put the raw 30 into exp; verl/we clamp at 20
    # TRL builds its temperatures with torch.where on two Python floats, i.e. in float32: values
    # exact in float32 keep the comparison exact (1.05 would differ by 5e-8 relative)
    tau = {"tau_pos": 1.25, "tau_neg": 1.5}
    theirs = _trl(
        logp, old, ref, adv, mask, loss_type="sapo", eps=(0.2, 0.2), beta=0.0, level=level, **tau
    )
    ours = _ours("sapo", logp, old, adv, mask, {**tau, "level": level}, "seq_mean_token_mean")
    _close(ours, theirs)


@pytest.mark.parametrize("kind", CASES)
def test_trl_vespo(kind):
    logp, old, ref, adv, mask = case(kind, seed=7)
    theirs = _trl(logp, old, ref, adv, mask, loss_type="vespo", eps=(0.2, 0.2), beta=0.0)
    ours = _ours("vespo", logp, old, adv, mask, {}, "token_mean")
    _close(ours, theirs)


@pytest.mark.parametrize("kind", CASES)
def test_trl_luspo_is_gspo_with_the_sequence_token_sum(kind):
    logp, old, ref, adv, mask = case(kind, seed=8)
    old = logp.detach() + 0.01 * (old - logp.detach())  # GSPO-sized ratios
    eps = (3e-3, 4e-3)
    theirs = _trl(logp, old, ref, adv, mask, loss_type="luspo", eps=eps, beta=0.0, level="sequence")
    params = {"eps_low": eps[0], "eps_high": eps[1]}
    ours = _ours("gspo", logp, old, adv, mask, params, "seq_mean_token_sum")
    _close(ours, theirs)


def test_trl_bnpo_is_the_micro_batch_token_mean():
    # two micro-batches of different token counts: TRL's bnpo = each micro-batch's token mean
    # divided by the accumulation steps; ours micro_token_mean with the step's totals
    logp, old, ref, adv, mask = case("ragged", seed=9)
    parts = (slice(0, 3), slice(3, 8))
    totals = losses.step_totals([mask[s] for s in parts])
    for s in parts:
        theirs = _trl(
            logp[s], old[s], ref[s], adv[s], mask[s], loss_type="bnpo", eps=(0.2, 0.28), beta=0.0,
            accum=2,
        )  # fmt: skip
        ours = _ours(
            "ppo_clip", logp[s], old[s], adv[s], mask[s], {"eps_low": 0.2, "eps_high": 0.28},
            "micro_token_mean", totals=totals,
        )  # fmt: skip
        _close(ours, theirs)


@pytest.mark.parametrize("kind", CASES)
def test_trl_two_sided_delta_is_the_dual_clip(kind):
    # TRL caps the unclipped ratio at delta (INTELLECT-2); with delta >= 1 + eps_high this is
    # the dual clip c = delta for A < 0 and changes nothing for A > 0
    logp, old, ref, adv, mask = case(kind, seed=10)
    theirs = _trl(logp, old, ref, adv, mask, loss_type="dapo", eps=(0.2, 0.28), beta=0.0, delta=2.0)
    params = {"eps_low": 0.2, "eps_high": 0.28, "clip_ratio_c": 2.0}
    ours = _ours("ppo_clip", logp, old, adv, mask, params, "token_mean")
    _close(ours, theirs)


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.6])
@pytest.mark.parametrize(("loss_type", "name", "agg"), [
    ("dapo", "ppo_clip", "token_mean"),
    ("grpo", "ppo_clip", "seq_mean_token_mean"),
    ("sapo", "sapo", "seq_mean_token_mean"),
    ("cispo", "cispo", "token_mean"),
])  # fmt: skip
def test_trl_top_entropy_quantile(kind, quantile, loss_type, name, agg):
    logp, old, ref, adv, mask = case(kind, seed=11)
    ref = logp.detach() + 0.2 * torch.randn(logp.shape, dtype=logp.dtype)  # TRL's k3: no clamp
    entropy = torch.rand(logp.shape, generator=torch.Generator().manual_seed(3), dtype=logp.dtype)
    eps = (0.2, 5.0) if name == "cispo" else (0.2, 0.28)
    params = {
        "cispo": {"eps_low": 1.0, "eps_high": 4.0},
        "ppo_clip": {"eps_low": 0.2, "eps_high": 0.28},
        "sapo": {"tau_pos": 1.0, "tau_neg": 1.5},  # exact in float32, as TRL builds them
    }[name]
    theirs = _trl(
        logp, old, ref, adv, mask, loss_type=loss_type, eps=eps, beta=0.04, quantile=quantile,
        entropy=entropy, tau_pos=1.0, tau_neg=1.5,
    )  # fmt: skip
    ours = _ours(
        name, logp, old, adv, mask, params, agg, entropy=entropy, top_entropy_quantile=quantile,
        ref_logp=ref, beta=0.04, kl="k3",
    )  # fmt: skip
    _close(ours, theirs)


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_trl_bias_corrected_kl(kind, level):
    logp, old, ref, adv, mask = case(kind, seed=12)
    if kind == "extreme":  # TRL's k3 has no clamp: keep it below verl's ±10 clamp here
        ref = logp.detach() + 0.2 * torch.randn(logp.shape, dtype=logp.dtype)
        mask[:, 1:] = 1.0
    surrogate = "gspo" if level == "sequence" else "ppo_clip"
    theirs = _trl(
        logp, old, ref, adv, mask, loss_type="grpo", eps=(0.2, 0.2), beta=0.04, level=level,
        bias_kl=True,
    )  # fmt: skip
    correction = "sequence_ratio" if level == "sequence" else "ratio"
    params = {"eps_low": 0.2, "eps_high": 0.2}
    ours = _ours(
        surrogate, logp, old, adv, mask, params, "seq_mean_token_mean", ref_logp=ref, beta=0.04,
        kl="k3", kl_correction=correction,
    )  # fmt: skip
    _close(ours, theirs)


@pytest.mark.parametrize("kind", CASES)
def test_trl_gmpo_trainer(kind):
    logp, old, ref, adv, mask = case(kind, seed=13)
    theirs = _trl(
        logp, old, ref, adv, mask, trainer="gmpo", loss_type="grpo", eps=(0.4, 0.3), beta=0.0
    )
    ours = _ours(
        "gmpo", logp, old, adv, mask, {"eps_low": 0.4, "eps_high": 0.3}, "seq_mean_token_mean"
    )
    _close(ours, theirs)


def test_trl_gmpo_trainer_counts_rows_without_tokens_where_we_do_not():
    # TRL's plain mean over rows gives an all-masked row the value -A (exp(0) = 1) and counts
    # it; our aggregations leave such a row out (verl's agg_loss rule). Gradients agree.
    logp, old, ref, adv, mask = case("random", seed=14)
    mask[5] = 0.0
    theirs = _trl(
        logp, old, ref, adv, mask, trainer="gmpo", loss_type="grpo", eps=(0.4, 0.4), beta=0.0
    )
    ours = _ours("gmpo", logp, old, adv, mask, {}, "seq_mean_token_mean")
    n = mask.shape[0]
    torch.testing.assert_close(theirs[0], (ours[0] * (n - 1) - adv[5]) / n, atol=1e-12, rtol=0)
    torch.testing.assert_close(theirs[1], ours[1] * (n - 1) / n, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- OpenRLHF


@pytest.fixture(scope="module")
def openrlhf():
    """OpenRLHF's ``compute_approx_kl`` and ``PolicyLoss`` (peer_calls.openrlhf_functions)."""
    fns = peer_calls.openrlhf_functions()
    if fns is None:
        pytest.skip("OpenRLHF is not installed (scripts/install-peers.sh installs it, no deps)")
    return SimpleNamespace(utils=fns, loss=fns)


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("off_policy", [True, False])
def test_openrlhf_unbiased_kl_gradient(openrlhf, kind, estimator, off_policy):
    # compute_approx_kl casts to float32 (log_probs.float()): compare in float32
    logp, old, ref, _, mask = (x.float() for x in case(kind, seed=15))
    weights = torch.rand(logp.shape, generator=torch.Generator().manual_seed(1))
    theirs = _grad(
        lambda lp: (
            openrlhf.utils.compute_approx_kl(
                lp, ref, old if off_policy else None, kl_estimator=estimator, unbiased_gradient=True
            )
            * weights
        ).sum(),
        logp,
    )
    ours = _grad(
        lambda lp: (
            losses.kl_corrected(
                estimator, lp, ref, old if off_policy else None, mask, correction="straight_through"
            )
            * weights
        ).sum(),
        logp,
    )
    # OpenRLHF clamps every estimator's value to ±10, verl (and we) only k3: the gradients
    # agree everywhere, the values wherever |k1|, k2 < 10
    torch.testing.assert_close(ours[1], theirs[1], atol=1e-6, rtol=1e-6)
    value_theirs = openrlhf.utils.compute_approx_kl(logp, ref, kl_estimator=estimator)
    ok = (losses.kl(estimator, logp, ref).abs() < 10).to(logp.dtype)
    torch.testing.assert_close(
        (losses.kl(estimator, logp, ref) * ok * weights).sum(), (value_theirs * ok * weights).sum()
    )


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize(("loss_type", "dual"), [("ppo", None), ("ppo", 3.0), ("gspo", None)])
def test_openrlhf_policy_loss(openrlhf, kind, token_level, loss_type, dual):
    logp, old, _, adv, mask = case(kind, seed=16)
    if loss_type == "gspo":
        old = logp.detach() + 0.01 * (old - logp.detach())
    eps = (3e-3, 4e-3) if loss_type == "gspo" else (0.2, 0.28)
    fn = openrlhf.loss.PolicyLoss(
        clip_eps_low=eps[0], clip_eps_high=eps[1], dual_clip=dual, token_level_loss=token_level,
        policy_loss_type=loss_type,
    )  # fmt: skip
    adv_tok = adv[:, None] * mask
    theirs = _grad(lambda lp: fn(lp, old, adv_tok, action_mask=mask)[0], logp)
    agg = "token_mean" if token_level and loss_type == "ppo" else "seq_mean_token_mean"
    name = "gspo" if loss_type == "gspo" else "ppo_clip"
    params = {"eps_low": eps[0], "eps_high": eps[1]}
    if dual is not None:
        params["clip_ratio_c"] = dual
    ours = _ours(name, logp, old, adv, mask, params, agg)
    _close(ours, theirs, tol=1e-8)  # OpenRLHF's sample mean adds 1e-8 to |y|
