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


# --------------------------------------------------------------------------- the peers' methods
R2 = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
MASK = torch.ones(2, 2, 3, dtype=torch.bool)


@pytest.mark.parametrize(
    "name, kwargs, match",
    [
        ("opo", {}, r"reads lengths: pass lengths=\[P, G\]"),
        ("remax", {}, r"reads baseline: pass baseline=\[P\]"),
        ("grpo", {"baseline": torch.zeros(2)}, "does not read a baseline; baseline= is for remax"),
        ("remax", {"baseline": torch.zeros(3)}, r"baseline must be a tensor \[P\] = \[2\]"),
        ("remax", {"baseline": torch.tensor([1.0, math.inf])}, "±inf"),
        ("opo", {"lengths": torch.ones(2, 3)}, r"lengths must be a tensor \[P, G\] = \[2, 2\]"),
        ("opo", {"lengths": -torch.ones(2, 2)}, "token counts >= 0"),
        ("reinforce_pp_global", {"weighting": "tokens"}, "valid: sample, token"),
        ("reinforce_pp_global", {"weighting": "token"}, r"reads lengths: pass lengths"),
        ("gdpo", {"eps_mode": "both"}, "valid: std, var, var_clamp"),
        ("gpg", {"alpha": "book"}, "alpha must be one of paper, verl or a positive number"),
        ("gpg", {"alpha": -1.0}, "alpha must be a finite number > 0"),
        ("gpg", {"f_norm": "mad"}, "f_norm must be a positive number or 'std'"),
        ("opo", {"lengths": torch.ones(2, 2), "virtual": "symmetric"}, "do not combine"),
        ("grpo", {"reward_weights": [1.0]}, r"pass rewards as \[P, G, K\]"),
        ("grpo", {"combine": "max"}, "valid: sum, normalize_then_sum"),
        ("optimal_token_baseline", {}, "token-level estimator: call advantages.compute_tokens"),
    ],
)
def test_issue22_estimator_errors(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        advantages.compute(name, R2, **kwargs)


def test_per_function_rewards_errors():
    r3 = torch.zeros(2, 2, 3)
    with pytest.raises(ValueError, match=r"3 reward function\(s\).*one weight per function"):
        advantages.compute("gdpo", r3, reward_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="reward weights must be finite"):
        advantages.compute("gdpo", r3, reward_weights=[1.0, math.nan, 1.0])
    with pytest.raises(ValueError, match="±inf"):
        advantages.compute("gdpo", torch.full((2, 2, 3), math.inf))
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['tau_res'\]"):
        advantages.compute("gdpo", r3, combine_params={"tau_res": 0.1})
    with pytest.raises(ValueError, match="delta_res and virtual work on combine='sum' only"):
        advantages.compute("gdpo", r3, delta_res=1e-2)
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'gdpo2'.*token-level: "):
        advantages.compute("gdpo2", r3)


@pytest.mark.parametrize(
    "name, kwargs, match",
    [
        ("grpo", {"mask": torch.ones(4, 3)}, r"completion-token mask \[P, G, T\]"),
        ("optimal_token_baseline", {}, "needs old_logp .* and sum_pi_squared"),
        (
            "optimal_token_baseline",
            {"old_logp": torch.zeros(2, 2, 2), "sum_pi_squared": torch.zeros(2, 2, 3)},
            r"old_logp must have the mask's shape \(2, 2, 3\)",
        ),
        (
            "optimal_token_baseline",
            {"old_logp": torch.full((2, 2, 3), math.nan), "sum_pi_squared": torch.zeros(2, 2, 3)},
            "old_logp is not finite at a valid",
        ),
        ("grpo", {"old_logp": torch.zeros(2, 2, 3)}, "read by the optimal token baseline only"),
        (
            "grpo",
            {"token_rewards": torch.zeros(2, 2, 3), "token_rewards_as": "sum"},
            "valid: score, return",
        ),
        ("reinforce_pp_global", {"token_rewards_as": "score"}, "one reading of token rewards"),
        ("reinforce_pp_global", {"gamma": 1.5}, r"gamma must be in \[0, 1\]"),
        ("reinforce_pp_global", {"focal_gamma": 0.5}, r"unknown parameter\(s\) \['focal_gamma'\]"),
        ("optimal_token_baseline", {"baseline": torch.zeros(2)}, "does not read a baseline"),
        ("nope", {}, "unknown advantage estimator 'nope'"),
    ],
)
def test_compute_tokens_errors(name, kwargs, match):
    kwargs = dict(kwargs)  # the parameters are shared by every run of the test: no pop on them
    mask = kwargs.pop("mask", MASK)
    with pytest.raises(ValueError, match=match):
        advantages.compute_tokens(name, R2, mask, **kwargs)


def test_kl_controller_errors():
    from grouprl.control import AdaptiveKLController, make_kl_controller

    with pytest.raises(ValueError, match="unknown KL controller 'pid'; valid: fixed, adaptive"):
        make_kl_controller("pid")
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['target'\]"):
        make_kl_controller("fixed", target=0.1)
    with pytest.raises(ValueError, match="horizon must be an integer > 0"):
        AdaptiveKLController(horizon=0)
    with pytest.raises(ValueError, match="target must be a finite number > 0"):
        AdaptiveKLController(target=0.0)
    with pytest.raises(ValueError, match="current_kl must be finite"):
        AdaptiveKLController().update(math.nan, 4)
    with pytest.raises(ValueError, match="unknown KL estimator 'k9'"):
        advantages.kl_reward(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), 0.1, "k9")
