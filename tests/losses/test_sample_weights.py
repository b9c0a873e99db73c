"""Per-sample loss weights: hand answers and the duplication property."""

from __future__ import annotations

import pytest
import torch

from grouprl import losses
from grouprl.losses.sample_weights import sample_weights

F64 = torch.float64


def test_hand_token_mean_with_weights():
    # two sequences, per-token REINFORCE loss −A·logp; token_mean over 3 valid tokens
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    w = sample_weights(torch.tensor([2.0, 0.0], dtype=F64), mask)
    assert w.tolist() == [[2.0, 2.0], [0.0, 0.0]]
    out = losses.objective(
        logp, None, adv, mask, surrogate="reinforce", aggregation="token_mean", correction_weight=w
    )
    # (2·(1 + 2) + 0·(−0.5)) / 3 tokens: the weight-0 token stays in the normaliser
    assert out.loss.item() == pytest.approx(2.0, abs=1e-12)
    (grad,) = torch.autograd.grad(out.loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[-2 / 3, -2 / 3], [0.0, 0.0]], dtype=F64))


def test_integer_weight_equals_duplicating_the_sample_under_token_sum():
    g = torch.Generator().manual_seed(0)
    n, t = 4, 5
    mask = (torch.rand(n, t, generator=g) > 0.3).to(F64)
    mask[:, 0] = 1.0
    old = -torch.rand(n, t, generator=g, dtype=F64) - 0.1
    logp = (old + 0.1 * torch.randn(n, t, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(n, generator=g, dtype=F64)
    w = sample_weights(torch.tensor([1.0, 3.0, 0.0, 2.0], dtype=F64), mask)
    got = losses.objective(
        logp, old, adv, mask, surrogate="ppo_clip", aggregation="token_sum", correction_weight=w
    ).loss
    idx = torch.tensor([0, 1, 1, 1, 3, 3])
    dup = losses.objective(
        logp[idx], old[idx], adv[idx], mask[idx], surrogate="ppo_clip", aggregation="token_sum"
    ).loss
    torch.testing.assert_close(got, dup)
    torch.testing.assert_close(*(torch.autograd.grad(x, logp)[0] for x in (got, dup)))


def test_mean_normalisation_and_bad_input():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    w = sample_weights(torch.tensor([1.0, 3.0, 100.0]), mask, normalize="mean")
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.5], [1.5, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="finite and >= 0"):
        sample_weights(torch.tensor([1.0, -1.0, 0.0]), mask)
    with pytest.raises(ValueError, match="one weight per sample"):
        sample_weights(torch.ones(3, 1), mask)
    with pytest.raises(ValueError, match="normalize"):
        sample_weights(torch.ones(3), mask, normalize="sum")
