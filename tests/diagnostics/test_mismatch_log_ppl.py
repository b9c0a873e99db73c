"""The log-perplexity metrics verl logs under ``rollout_corr/``: hand values and verl parity."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from grouprl.diagnostics import mismatch

LOG_PPL = (
    "log_ppl_train",
    "log_ppl_rollout",
    "log_ppl_diff",
    "log_ppl_diff_max",
    "log_ppl_diff_min",
)


def test_hand_values_two_sequences():
    # sequence 0: train [-1, -2], rollout [-1.5, -1.5]: mean train −1.5, rollout −1.5, diff 0
    # sequence 1: train [-0.5], rollout [-1.0]: diff = −1.0 − (−0.5) = −0.5
    train = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    roll = torch.tensor([[-1.5, -1.5], [-1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    got = mismatch.mismatch_metrics(train, roll, mask)
    want = {
        "log_ppl_train": (1.5 + 0.5) / 2,
        "log_ppl_rollout": (1.5 + 1.0) / 2,
        "log_ppl_diff": (0.0 - 0.5) / 2,
        "log_ppl_diff_max": 0.0,
        "log_ppl_diff_min": -0.5,
    }
    for key, value in want.items():
        assert got[f"mismatch/{key}"] == pytest.approx(value, abs=1e-7), key
    # log_ppl_diff is the log of each sequence's perplexity ratio
    assert got["mismatch/ppl_ratio"] == pytest.approx((1.0 + math.exp(-0.5)) / 2, abs=1e-7)
    assert all(f"mismatch/{k}" in mismatch.MISMATCH_KEYS for k in LOG_PPL)


def test_equal_to_verls_offpolicy_metrics():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    g = torch.Generator().manual_seed(0)
    n, t = 16, 9
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.float64)
    train = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    roll = train + 0.2 * torch.randn(n, t, generator=g, dtype=torch.float64)
    theirs = helper.compute_offpolicy_metrics(train, roll, mask)
    ours = mismatch.mismatch_metrics(train, roll, mask)
    names = {
        "training_log_ppl": "log_ppl_train",
        "rollout_log_ppl": "log_ppl_rollout",
        "log_ppl_diff": "log_ppl_diff",
        "log_ppl_diff_max": "log_ppl_diff_max",
        "log_ppl_diff_min": "log_ppl_diff_min",
        "log_ppl_abs_diff": "log_ppl_abs_diff",
    }
    for verl_key, key in names.items():
        # verl's masked_mean divides by count + 1e-8: ≤ 1e-8 relative
        assert ours[f"mismatch/{key}"] == pytest.approx(theirs[verl_key], rel=1e-7, abs=1e-9)
    logged = {f"rollout_corr/{k}": v for k, v in theirs.items()}
    mapped = mismatch.from_peer_log("verl", logged)
    for verl_key, key in names.items():
        assert mapped[f"mismatch/{key}"] == theirs[verl_key]
