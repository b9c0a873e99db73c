"""Bad input gets a ValueError that names the problem and what to do."""

import math

import pytest
import torch

from grouprl import advantages

R = torch.tensor([[1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "rewards, match",
    [
        (torch.tensor([1.0, 0.0]), "2-D"),
        (torch.zeros(2, 2, 2, 2), "2-D"),
        (torch.tensor([[1, 0]]), "floating point"),
        (torch.zeros(0, 4), "empty"),
        (torch.tensor([[1.0, math.inf]]), "infinite"),
        (torch.tensor([[1.0, -math.inf]]), "infinite"),
        ([[1.0, 0.0]], "torch.Tensor"),
    ],
)
def test_bad_rewards(rewards, match):
    with pytest.raises(ValueError, match=match):
        advantages.compute("grpo", rewards)


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'gpro'.*grpo.*maxnorm_rloo"):
        advantages.compute("gpro", R)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"focal_gamma": -0.5}, "focal_gamma"),
        ({"focal_gamma": math.nan}, "focal_gamma"),
        ({"delta_res": 0.0}, "delta_res"),
        ({"delta_res": -1e-2}, "delta_res"),
        ({"virtual": "both"}, "symmetric, paper, code"),
        ({"reward_range": (1.0, 0.0)}, "r_lo < r_hi"),
        ({"reward_range": 1.0}, "pair"),
        ({"eps": -1.0}, "eps"),
        ({"tau": 0.0}, "tau"),
        ({"ddof": 2}, "ddof"),
        ({"temperature": 1.0}, "unknown parameter.*temperature.*accepts"),
    ],
)
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        advantages.compute("grpo", R, **kwargs)


def test_tau_res_only_where_it_exists():
    with pytest.raises(ValueError, match="tau_res"):
        advantages.compute("grpo", R, tau_res=1e-2)
    advantages.compute("maxnorm_rloo", R, tau_res=1e-3)  # accepted there
    with pytest.raises(ValueError, match="quantile"):
        advantages.compute("p90", R, quantile=1.5)


def test_nan_is_not_an_error_and_is_counted():
    r = torch.tensor([[1.0, math.nan, 0.0, 0.0]])
    out = advantages.compute("grpo", r)
    assert out.stats["nan_frac"] == 0.25
    assert out.values[0, 1] == 0
    # the NaN is out of the baseline: mean of [1, 0, 0] = 1/3, not 1/4
    assert out.values[0, 0].item() == pytest.approx((2 / 3) / math.sqrt(1 / 3), rel=1e-5)
