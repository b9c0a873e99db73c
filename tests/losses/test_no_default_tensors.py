"""Every surrogate, KL estimator and aggregation (and the objective that joins them) makes
its tensors on the inputs' device and in their dtype, never on torch's default device or in
its default dtype: float32 CPU inputs under a default device of "meta" and a default dtype
of float64 give float32 CPU results (a tensor made without an explicit device would land on
meta and fail; one without a dtype would widen the result)."""

from __future__ import annotations

import pytest
import torch

from grouprl import losses

N, T = 4, 3
LOGP = -torch.rand(N, T, generator=torch.Generator().manual_seed(0)) - 0.1
OLD = LOGP + 0.05 * torch.randn(N, T, generator=torch.Generator().manual_seed(1))
REF = LOGP + 0.2 * torch.randn(N, T, generator=torch.Generator().manual_seed(2))
ADV = torch.tensor([1.0, -0.5, 0.25, -2.0])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.float32)
ENTROPY = torch.rand(N, T, generator=torch.Generator().manual_seed(3))


def _cpu32(t: torch.Tensor, what: str) -> None:
    assert (t.device.type, t.dtype) == ("cpu", torch.float32), (what, t.device, t.dtype)


PARAMS = {"dro": {"beta": 0.1}}
"""Surrogates without a default for a parameter."""


@pytest.mark.parametrize("name", list(losses.SURROGATES))
def test_every_surrogate(name, under_wide_meta_defaults):
    logp = LOGP.clone().requires_grad_()
    per_token, _ = under_wide_meta_defaults(
        losses.surrogate, name, logp, OLD, ADV, MASK, **PARAMS.get(name, {})
    )
    _cpu32(per_token, name)
    per_token.sum().backward()
    _cpu32(logp.grad, f"{name} gradient")


@pytest.mark.parametrize("name", list(losses.KL_ESTIMATORS))
def test_every_kl_estimator(name, under_wide_meta_defaults):
    _cpu32(under_wide_meta_defaults(losses.kl, name, LOGP, REF), name)


@pytest.mark.parametrize("name", list(losses.AGGREGATIONS))
def test_every_aggregation_and_the_objective(name, under_wide_meta_defaults):
    per_token = LOGP * MASK
    _cpu32(under_wide_meta_defaults(losses.aggregate, name, per_token, MASK), name)
    totals = losses.step_totals(MASK)
    out = under_wide_meta_defaults(
        losses.objective, LOGP.clone().requires_grad_(), OLD, ADV, MASK, aggregation=name,
        totals=totals, ref_logp=REF, beta=0.1, entropy=ENTROPY, entropy_coeff=0.01,
    )  # fmt: skip
    for field in ("loss", "pg_loss", "kl_loss", "entropy_bonus", "per_token", "kl_unweighted"):
        _cpu32(getattr(out, field), f"{name} objective.{field}")
