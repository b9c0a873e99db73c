"""Binary-KL (and TV) rejection as a rollout-correction mode: hand answers, OpenRLHF parity.

The peer run here is OpenRLHF 0.11.2's ``PolicyLoss`` (``models/loss.py``,
``is_correction_gating="binary_kl"`` / ``"tv"``), executed from the installed source by
``tests/advantages/openrlhf_ref.py`` (its modules import DeepSpeed at module level). verl
pull request 6800's head was not available to read; its ``rollout_rs`` reading is
``drop="reject"`` (the default), checked here by its own hand answer.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from grouprl import losses
from grouprl.losses.divergence_rs import token_divergence

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "advantages"))
import openrlhf_ref as ref

F64 = torch.float64


def test_hand_binary_kl_of_one_token():
    # p = μ = 0.5, q = π = 0.25: 0.5·ln 2 + 0.5·ln(0.5/0.75)
    kl = token_divergence(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]))
    assert kl.item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75), rel=1e-6)
    tv = token_divergence(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]), "tv")
    assert tv.item() == pytest.approx(0.25, rel=1e-6)


def test_hand_token_and_sequence_levels_and_the_two_drops():
    # row 0: tokens (μ, π) = (0.5, 0.25) [KL 0.1438] and (0.5, 0.5) [0]; row 1: (0.9, 0.9) only
    roll = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]], dtype=F64))
    train = torch.log(torch.tensor([[0.25, 0.5], [0.9, 0.1]], dtype=F64))
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    kl0 = 0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75)  # 0.1438
    tok = losses.correction.compute(
        ("binary_kl", {"threshold": 0.1, "level": "token"}), train, roll, mask
    )
    assert tok.keep.tolist() == [[False, True], [True, False]]
    assert tok.stats["corr/binary_kl/rejected_frac"] == pytest.approx(1 / 3)
    assert tok.stats["corr/binary_kl/divergence_mean"] == pytest.approx(kl0 / 3, rel=1e-6)
    seq = losses.correction.compute("binary_kl:threshold=0.1", train, roll, mask)  # mean 0.0719
    assert seq.keep.tolist() == [[True, True], [True, False]]
    seq = losses.correction.compute("binary_kl:threshold=0.05", train, roll, mask)
    assert seq.keep.tolist() == [[False, False], [True, False]]
    assert seq.stats["corr/binary_kl/rejected_seq_frac"] == pytest.approx(0.5)
    # drop=zero keeps the tokens in the normaliser with weight 0; is_weight multiplies ρ_t
    z = losses.correction.compute(
        ("binary_kl", {"threshold": 0.05, "drop": "zero", "is_weight": True}), train, roll, mask
    )
    assert z.keep.tolist() == mask.tolist()
    torch.testing.assert_close(z.weight, torch.tensor([[0.0, 0.0], [1.0, 0.0]], dtype=F64))


def test_nan_neutral_rollout_tokens_have_zero_divergence():
    train = torch.log(torch.tensor([[0.3, 0.6]]))
    roll = torch.tensor([[float("nan"), math.log(0.6)]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    c = losses.correction.compute("binary_kl:threshold=0", train, roll, mask, nan_rollout="neutral")
    assert c.keep.all()


def test_bad_parameters_are_named():
    t = torch.zeros(1, 2) - 1.0
    m = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="needs threshold"):
        losses.correction.compute("binary_kl", t, t, m)
    with pytest.raises(ValueError, match="level"):
        losses.correction.compute("binary_kl:threshold=1,level=seq_sum", t, t, m)
    with pytest.raises(ValueError, match="no parameter train_logp"):
        losses.correction.compute(("binary_kl", {"threshold": 1, "train_logp": t}), t, t, m)


@pytest.mark.skipif(not ref.available(), reason="openrlhf is not installed")
@pytest.mark.parametrize("level", ["token", "seq"])
@pytest.mark.parametrize("gating", ["binary_kl", "tv"])
def test_equal_to_openrlhfs_gated_policy_loss(level, gating):
    agg = ref.load("models/loss.py", {"aggregate_loss"}, masked_mean=_masked_mean)
    policy_loss = ref.load(
        "models/loss.py",
        {"PolicyLoss"},
        nn=torch.nn,
        masked_mean=_masked_mean,
        aggregate_loss=agg["aggregate_loss"],
    )["PolicyLoss"]
    g = torch.Generator().manual_seed(3)
    n, t = 10, 7
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(F64)
    roll = torch.log(torch.rand(n, t, generator=g, dtype=F64) * 0.9 + 0.05)
    old = roll + 0.3 * torch.randn(n, t, generator=g, dtype=F64)  # trainer at behaviour params
    old = old.clamp(max=-1e-3)
    logp = (old + 0.1 * torch.randn(n, t, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(n, generator=g, dtype=F64)
    delta = 0.02 if gating == "binary_kl" else 0.1
    theirs_fn = policy_loss(
        clip_eps_low=0.2,
        clip_eps_high=0.2,
        is_correction_level=level,
        is_correction_mode="mask",
        is_correction_gating=gating,
        is_correction_threshold=[0.0, delta],
    )
    theirs = theirs_fn(logp, old, adv[:, None].expand(n, t), mask, rollout_log_probs=roll)[0]
    (g_theirs,) = torch.autograd.grad(theirs, logp)
    corr = losses.correction.compute(
        (
            "binary_kl",
            {
                "threshold": delta,
                "level": "token" if level == "token" else "seq_mean",
                "divergence": gating,
                "drop": "zero",
                "is_weight": True,
            },
        ),
        old,
        roll,
        mask,
    )
    assert 0 < corr.stats["corr/binary_kl/rejected_frac"] < 1  # the gate acts on this batch
    per_token, _ = losses.surrogate("ppo_clip", logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    ours = losses.aggregate("token_mean", per_token * corr.weight, corr.loss_mask(mask))
    (g_ours,) = torch.autograd.grad(ours, logp)
    torch.testing.assert_close(ours, theirs, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(g_ours, g_theirs, atol=1e-10, rtol=1e-10)


def _masked_mean(tensor, mask, dim=None):
    """OpenRLHF ``models/utils.py:masked_mean`` (that module imports DeepSpeed)."""
    return ref.load("models/utils.py", {"masked_mean"})["masked_mean"](tensor, mask, dim)
