"""Parity with TRL's GRPOTrainer loss types and verl's policy losses on the same tensors.

TRL's loss lives inside ``GRPOTrainer._compute_loss``; we call that very method on a stand-in
``self`` that holds only the attributes it reads, with the model forward replaced by our
log-prob tensor, so the comparison runs TRL's own code, not a copy of it. verl's policy
losses are plain functions (``core_algos.compute_policy_loss_*``, ``agg_loss``,
``kl_penalty_forward``). Both are skipped when the packages are not installed
(``scripts/install-peers.sh`` installs the tested versions: TRL 1.16.0, verl 0.9.1).
"""

from __future__ import annotations

import warnings

import peer_calls
import pytest
import torch

from grouprl import losses

pytestmark = pytest.mark.peer


def _tensors(seed: int, n: int = 6, t: int = 9, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, t + 1, (n,), generator=g)
    lengths[0] = t
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.float64)
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 2 - 0.05
    # spread 0.3 puts many ratios outside 0.8..1.28, so the clips are exercised
    logp = old + spread * torch.randn(n, t, generator=g, dtype=torch.float64)
    ref = logp + 0.2 * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return logp, old, ref, adv, mask


# ----------------------------------------------------------------------------- TRL


def _trl_loss(
    loss_type, logp, old, ref, adv, mask, *, eps_low, eps_high, beta, max_len=None, level="token"
):
    """Run TRL's GRPOTrainer._compute_loss on our tensors; return (loss, d loss / d logp)."""
    pytest.importorskip("trl.trainer.grpo_trainer")
    lp = logp.detach().clone().requires_grad_()
    metrics: dict = {}
    loss = peer_calls.trl_loss(
        lp, old, ref, adv, mask, loss_type=loss_type, eps=(eps_low, eps_high), beta=beta,
        level=level, max_len=max_len, metrics=metrics,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def _ours(logp, old, ref, adv, mask, *, surrogate, params, aggregation, beta, totals=None):
    lp = logp.detach().clone().requires_grad_()
    out = losses.objective(
        lp,
        old,
        adv,
        mask,
        surrogate=surrogate,
        surrogate_params=params,
        aggregation=aggregation,
        totals=totals,
        ref_logp=ref,
        kl="k3",
        beta=beta,
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out.loss.detach(), grad, out.stats


TRL_CASES = [
    # TRL loss_type, TRL eps (low, high), our surrogate, our params, our aggregation
    ("grpo", (0.2, 0.2), "ppo_clip", {"eps_low": 0.2, "eps_high": 0.2}, "seq_mean_token_mean"),
    (
        "dr_grpo",
        (0.2, 0.2),
        "ppo_clip",
        {"eps_low": 0.2, "eps_high": 0.2},
        "seq_mean_token_sum_norm",
    ),
    ("dapo", (0.2, 0.28), "ppo_clip", {"eps_low": 0.2, "eps_high": 0.28}, "token_mean"),
    # TRL's cispo clamps rho from above at the absolute bound epsilon_high (here 5.0):
    # our lower bound 1 - 1.0 = 0 (inactive for rho > 0) and upper 1 + 4.0
    ("cispo", (0.2, 5.0), "cispo", {"eps_low": 1.0, "eps_high": 4.0}, "token_mean"),
]


@pytest.mark.parametrize(("loss_type", "eps", "surrogate", "params", "aggregation"), TRL_CASES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_trl_loss_types(loss_type, eps, surrogate, params, aggregation, beta):
    logp, old, ref, adv, mask = _tensors(11)
    max_len = 12  # Dr.GRPO's constant: TRL's max_completion_length, wider than the padding
    theirs, g_theirs, metrics = _trl_loss(
        loss_type,
        logp,
        old,
        ref,
        adv,
        mask,
        eps_low=eps[0],
        eps_high=eps[1],
        beta=beta,
        max_len=max_len,
    )
    totals = losses.step_totals(mask, max_len=max_len)
    ours, g_ours, stats = _ours(
        logp,
        old,
        ref,
        adv,
        mask,
        surrogate=surrogate,
        params=params,
        aggregation=aggregation,
        beta=beta,
        totals=totals,
    )
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)
    torch.testing.assert_close(g_ours, g_theirs, atol=1e-12, rtol=0)
    if loss_type != "cispo":
        for ours_key, trl_key in [
            ("clip_frac_low", "clip_ratio/low_mean"),
            ("clip_frac_high", "clip_ratio/high_mean"),
            ("clip_frac_region", "clip_ratio/region_mean"),
        ]:
            assert stats[ours_key] == pytest.approx(metrics[trl_key][0], abs=1e-12)
        assert stats["clip_frac_region"] > 0  # the case exercises the clip


def test_trl_sequence_level_importance_sampling_matches_gspo():
    # TRL's importance_sampling_level="sequence" with loss_type="grpo" is GSPO
    logp, old, ref, adv, mask = _tensors(12, spread=0.02)
    theirs, g_theirs, _ = _trl_loss(
        "grpo", logp, old, ref, adv, mask, eps_low=3e-3, eps_high=4e-3, beta=0.0, level="sequence"
    )
    ours, g_ours, stats = _ours(
        logp,
        old,
        ref,
        adv,
        mask,
        surrogate="gspo",
        params={"eps_low": 3e-3, "eps_high": 4e-3},
        aggregation="seq_mean_token_mean",
        beta=0.0,
    )
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)
    torch.testing.assert_close(g_ours, g_theirs, atol=1e-12, rtol=0)
    assert stats["clip_frac_region"] > 0


# ----------------------------------------------------------------------------- verl


@pytest.fixture(scope="module")
def verl():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        core = pytest.importorskip("verl.trainer.ppo.core_algos")
        config = pytest.importorskip("verl.workers.config")
    return core, config


def _verl_config(config_mod, eps_low, eps_high, clip_ratio_c=3.0):
    return peer_calls.verl_config(clip=(eps_low, eps_high), c=clip_ratio_c)


VERL_AGG = {
    "token_mean": "token-mean",
    "seq_mean_token_mean": "seq-mean-token-mean",
    "seq_mean_token_sum_norm": "seq-mean-token-sum-norm",
}

VERL_CASES = [
    # verl policy loss, our surrogate, eps, our extra params
    ("vanilla", "ppo_clip", (0.2, 0.28), {"clip_ratio_c": 3.0}),
    ("cispo", "cispo", (1.0, 5.0), {}),
    ("gspo", "gspo", (3e-3, 4e-3), {}),
]


@pytest.mark.parametrize(("verl_name", "surrogate", "eps", "extra"), VERL_CASES)
@pytest.mark.parametrize("aggregation", list(VERL_AGG))
def test_verl_policy_losses(verl, verl_name, surrogate, eps, extra, aggregation):
    core, config_mod = verl
    spread = 0.02 if surrogate == "gspo" else 1.0  # 1.0 reaches the dual clip (rho > 3)
    logp, old, _, adv, mask = _tensors(21, spread=spread)
    if surrogate != "gspo":
        adv[1] = -adv[1].abs() - 0.1
        logp[1, 0] = old[1, 0] + 2.0  # rho = e^2 > 3 with A < 0: the dual clip is active
    adv_tok = adv[:, None].expand_as(logp)  # verl takes per-token advantages
    cfg = _verl_config(config_mod, *eps)
    lp = logp.detach().clone().requires_grad_()
    theirs, metrics = core.get_policy_loss_fn(verl_name)(
        old, lp, adv_tok, mask, loss_agg_mode=VERL_AGG[aggregation], config=cfg
    )
    (g_theirs,) = torch.autograd.grad(theirs, lp)
    params = {"eps_low": eps[0], "eps_high": eps[1], **extra}
    lp2 = logp.detach().clone().requires_grad_()
    per_token, stats = losses.surrogate(surrogate, lp2, old, adv, mask, **params)
    ours = losses.aggregate(aggregation, per_token, mask)
    (g_ours,) = torch.autograd.grad(ours, lp2)
    # verl's seq-mean-token-mean divides each sequence by (its token count + 1e-8)
    tol = 1e-8 if aggregation == "seq_mean_token_mean" else 1e-12
    torch.testing.assert_close(ours.detach(), theirs.detach(), atol=tol, rtol=0)
    torch.testing.assert_close(g_ours, g_theirs, atol=tol, rtol=0)
    if verl_name == "vanilla":
        # verl's pg_clipfrac is our region fraction; pg_clipfrac_lower our dual-clip fraction
        # (abs 1e-9: verl's masked_mean adds 1e-8 to the token count)
        assert stats["clip_frac_region"] == pytest.approx(metrics["actor/pg_clipfrac"], abs=1e-9)
        assert stats["clip_frac_dual"] == pytest.approx(
            metrics["actor/pg_clipfrac_lower"], abs=1e-9
        )
        assert stats["clip_frac_dual"] > 0
    assert stats["approx_kl"] == pytest.approx(metrics["actor/ppo_kl"], abs=1e-9)


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_verl_kl_estimators(verl, name):
    core, _ = verl
    logp, _, ref, _, _ = _tensors(31)
    logp[0, :3] = torch.tensor([0.0, 30.0, -25.0], dtype=torch.float64)  # exercise the clamps
    torch.testing.assert_close(
        losses.kl(name, logp, ref), core.kl_penalty_forward(logp, ref, name), atol=1e-12, rtol=0
    )


@pytest.mark.parametrize("aggregation", list(VERL_AGG))
def test_verl_agg_loss_with_global_batch_info(verl, aggregation):
    # verl's global-batch normaliser (batch_num_tokens / global_batch_size) vs our StepTotals
    core, _ = verl
    logp, _, _, adv, mask = _tensors(41, n=8)
    per_token = logp * adv[:, None]
    totals = losses.step_totals([mask[:3], mask[3:]])
    for s in (slice(0, 3), slice(3, 8)):
        theirs = core.agg_loss(
            per_token[s],
            mask[s],
            VERL_AGG[aggregation],
            batch_num_tokens=totals.num_tokens,
            global_batch_size=totals.num_seqs,
            loss_scale_factor=mask.shape[1],
        )
        ours = losses.aggregate(aggregation, per_token[s], mask[s], totals)
        tol = 1e-8 if aggregation == "seq_mean_token_mean" else 1e-12  # verl's + 1e-8
        torch.testing.assert_close(ours, theirs, atol=tol, rtol=0)
