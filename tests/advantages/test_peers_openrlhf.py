"""Parity with OpenRLHF 0.11's own advantage code (``compute_advantages_and_returns``,
``compute_reward``, ``compute_approx_kl``, the KL controllers), run from the installed
package by ``openrlhf_ref`` (OpenRLHF's modules import DeepSpeed and Ray, so the functions
are executed from its source). OpenRLHF reshapes rewards to ``[-1, n_samples_per_prompt]``
and has no rule for a missing reward: its batches are full (no NaN case).
"""

from __future__ import annotations

import numpy as np
import openrlhf_ref as ref
import pytest
import torch

from grouprl import advantages
from grouprl.control import AdaptiveKLController, FixedKLController

pytestmark = [
    pytest.mark.peer,
    pytest.mark.skipif(not ref.available(), reason="openrlhf is not installed"),
]

T = 6
CASES = ["random", "g2", "equal"]


def batch(case: str, seed: int):
    rng = np.random.default_rng(seed)
    p, g = 5, (2 if case == "g2" else 4)
    r = np.where(rng.random((p, g)) < 0.5, rng.integers(0, 2, (p, g)), rng.random((p, g)))
    if case == "equal":
        r[0], r[1] = 1.0, 0.0
    lengths = rng.integers(1, T + 1, (p, g))
    mask = torch.arange(T)[None, None, :] < torch.tensor(lengths)[..., None]
    kl = 0.3 * torch.randn(
        p, g, T, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    )
    return torch.tensor(r, dtype=torch.float64), mask, kl * mask


def theirs(est, rewards, mask, kl, coef, gamma=1.0):
    n = rewards.numel()
    return ref.advantages(est, rewards, mask.reshape(n, -1), kl.reshape(n, -1), coef, gamma)


def close(ours, want, mask):
    m = mask.reshape(want.shape)
    torch.testing.assert_close((ours * m).double(), (want * m).double(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce(case, gamma):
    rewards, mask, kl = batch(case, 1)
    want = theirs("reinforce", rewards, mask, kl, 0.05, gamma)
    out = advantages.compute_tokens(
        "reinforce_pp_global",
        rewards,
        mask,
        token_rewards=-0.05 * kl,
        gamma=gamma,
        eps_mode="var_clamp",
        ddof=0,
        eps=1e-8,
    )
    close(out.per_token, want, mask)


@pytest.mark.parametrize("case", CASES)
def test_reinforce_baseline(case):
    rewards, mask, kl = batch(case, 2)
    want = theirs("reinforce_baseline", rewards, mask, kl, 0.05)
    out = advantages.compute_tokens(
        "reinforce_pp_baseline",
        rewards,
        mask,
        token_rewards=-0.05 * kl,
        token_rewards_as="return",
        eps_mode="var_clamp",
        ddof=0,
        eps=1e-8,
        zero_collapsed=False,
    )
    close(out.per_token, want, mask)
    # outcome only: the sample-level estimator, token-weighted
    want = theirs("reinforce_baseline", rewards, mask, kl, 0.0)
    seq = advantages.compute(
        "reinforce_pp_baseline",
        rewards,
        lengths=mask.sum(-1),
        weighting="token",
        eps_mode="var_clamp",
        ddof=0,
        eps=1e-8,
        zero_collapsed=False,
    )
    close((seq.values[..., None] * mask).reshape(want.shape), want, mask)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    ("est", "ours", "kw"),
    [
        ("group_norm", "grpo", {"eps": 1e-9}),
        ("dr_grpo", "dr_grpo", {}),
        ("rloo", "rloo", {}),
        ("flash_reinforce", "flash_reinforce", {}),
    ],
)
def test_group_estimators_with_kl_in_the_reward(case, est, ours, kw):
    # OpenRLHF: the estimator on the outcome reward, then the KL's reward-to-go per token
    rewards, mask, kl = batch(case, 3)
    want = theirs(est, rewards, mask, kl, 0.05)
    out = advantages.compute_tokens(
        ours, rewards, mask, token_rewards=-0.05 * kl, token_rewards_as="return", **kw
    )
    close(out.per_token, want, mask)


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_kl_reward_equals_compute_approx_kl_and_compute_reward(name):
    rewards, mask, _ = batch("random", 4)
    n = rewards.numel()
    g = torch.Generator().manual_seed(4)
    logp = -3 * torch.rand(n, T, generator=g, dtype=torch.float64)
    base = logp + 0.5 * torch.randn(n, T, generator=g, dtype=torch.float64)
    kl = ref.compute_approx_kl()(logp, base, kl_estimator=name)
    utils = ref.load("models/utils.py", {"compute_reward"})
    m = mask.reshape(n, T)
    want = utils["compute_reward"](rewards.reshape(-1), 0.07, kl, action_mask=m)
    dense, _ = advantages.kl_reward(logp, base, m, 0.07, name)
    ours = advantages.tokens.outcome_to_tokens(rewards, mask).reshape(n, T) + dense
    close(ours, want, mask)


def test_kl_controllers_equal_openrlhfs():
    adaptive, fixed = ref.kl_controllers()
    theirs_a, ours_a = adaptive(0.01, 0.2, 1000), AdaptiveKLController(0.01, 0.2, 1000)
    for kl, n in [(0.5, 256), (0.0, 256), (0.19, 64), (1.0, 512)]:
        theirs_a.update(kl, n)
        ours_a.update(kl, n)
        assert ours_a.value == pytest.approx(theirs_a.value, rel=1e-12)
    theirs_f, ours_f = fixed(0.03), FixedKLController(0.03)
    theirs_f.update(1.0, 10)
    ours_f.update(1.0, 10)
    assert ours_f.value == theirs_f.value
