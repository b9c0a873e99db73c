"""Parity with the formulas TRL and verl use for GRPO and RLOO, and with their own code.

Our rule for singleton groups (advantage 0) differs from verl's (raw score): the batches here
have no singleton groups, except the test that reproduces verl's rule explicitly.
"""

import numpy as np
import pytest
import torch

from grouprl import advantages


def batch(seed, p=64, g=8, nan=False):
    rng = np.random.default_rng(seed)
    r = np.where(rng.random((p, g)) < 0.5, rng.integers(0, 2, (p, g)), rng.random((p, g)))
    if nan:
        r[rng.random((p, g)) < 0.15] = np.nan
        r[:, :2] = np.where(np.isnan(r[:, :2]), 0.5, r[:, :2])  # >= 2 valid per group
    return torch.tensor(r, dtype=torch.float32)


def test_trl_formula_grpo_and_batch():
    # TRL GRPOTrainer: (r - nanmean_group) / (nanstd_group + 1e-4), Bessel std; batch mode uses
    # the std of the whole batch
    trl_utils = pytest.importorskip("trl.trainer.utils")
    r = batch(0, nan=True)
    mean = torch.nanmean(r, dim=1, keepdim=True)
    std = trl_utils.nanstd(r, dim=1, keepdim=True)
    want = torch.nan_to_num((r - mean) / (std + 1e-4))
    got = advantages.compute("grpo", r, eps=1e-4).values
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    want_b = torch.nan_to_num((r - mean) / (trl_utils.nanstd(r) + 1e-4))
    torch.testing.assert_close(
        advantages.compute("batch_std", r, eps=1e-4).values, want_b, atol=1e-6, rtol=1e-6
    )


def _verl():
    return pytest.importorskip("verl.trainer.ppo.core_algos")


def _flat(r):
    p, g = r.shape
    index = np.repeat(np.array([f"uid-{i}" for i in range(p)], dtype=object), g)
    tokens = torch.zeros(p * g, 5)
    tokens[:, -1] = r.reshape(-1)  # outcome reward on the last token
    return tokens, torch.ones(p * g, 5), index


@pytest.mark.parametrize(
    "fn", ["compute_grpo_outcome_advantage", "compute_grpo_vectorized_outcome_advantage"]
)
def test_verl_grpo(fn):
    core = _verl()
    r = batch(1)
    tokens, mask, index = _flat(r)
    want, _ = getattr(core, fn)(tokens, mask, index, epsilon=1e-6)
    got = advantages.compute("grpo", r).values.reshape(-1)
    torch.testing.assert_close(got, want[:, 0], atol=1e-6, rtol=1e-6)
    # norm_adv_by_std_in_grpo=False is Dr.GRPO
    want_dr, _ = getattr(core, fn)(tokens, mask, index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(
        advantages.compute("dr_grpo", r).values.reshape(-1), want_dr[:, 0], atol=1e-6, rtol=0
    )


def test_verl_rloo():
    core = _verl()
    r = batch(2)
    tokens, mask, index = _flat(r)
    want, _ = core.compute_rloo_outcome_advantage(tokens, mask, index)
    torch.testing.assert_close(
        advantages.compute("rloo", r).values.reshape(-1), want[:, 0], atol=1e-6, rtol=1e-6
    )


def test_verl_singleton_rule_differs_only_where_documented():
    # verl gives a singleton group its raw score (mean 0, std 1): ours gives 0 (ALGORITHMS.md §0)
    core = _verl()
    tokens = torch.zeros(3, 2)
    tokens[:, -1] = torch.tensor([0.7, 1.0, 0.0])
    index = np.array(["a", "b", "b"], dtype=object)
    want, _ = core.compute_grpo_outcome_advantage(tokens, torch.ones(3, 2), index)
    assert want[0, 0].item() == pytest.approx(0.7 / (1 + 1e-6))
    ours = advantages.compute("grpo", torch.tensor([[0.7, float("nan")], [1.0, 0.0]]))
    assert ours.values[0, 0] == 0
    assert ours.values[1].tolist() == pytest.approx(want[1:, 0].tolist(), abs=1e-6)
