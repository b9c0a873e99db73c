"""Vectorised estimators and transforms == a plain per-group loop (tests/advantages/reference.py)
on random ragged batches with NaN entries, collapsed groups and singletons, in float64."""

import math

import inputs
import numpy as np
import pytest
import reference as ref
import torch

from grouprl import advantages

ESTIMATORS = advantages.names()


def ragged_batch(seed: int, p: int = 40, g: int = 8) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    kind = rng.integers(0, 4, size=p)
    r = np.where(
        kind[:, None] == 0,
        rng.integers(0, 2, (p, g)),  # binary
        np.where(
            kind[:, None] == 1,
            rng.integers(0, 5, (p, g)) / 4,  # 5-level partial credit
            np.where(
                kind[:, None] == 2,
                rng.random((p, g)),  # continuous
                1e-3 * rng.random((p, g)) + 0.5,
            ),
        ),  # sub-resolution jitter
    ).astype(np.float64)
    r[rng.random((p, g)) < 0.2] = np.nan  # ragged / unscorable
    r[0] = 1.0  # all correct
    r[1] = 0.0  # all wrong
    r[2, 1:] = np.nan  # singleton
    r[3] = np.nan  # empty group
    r[4, :3] = 0.25  # constant with NaN
    r[4, 3:] = np.nan
    return torch.tensor(r)


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_estimator_equals_loop(name, seed):
    rewards = ragged_batch(seed)
    out = inputs.compute(name, rewards)
    want, want_scale = ref.per_group(
        name, rewards.numpy(), **inputs.reference_inputs(name, rewards)
    )
    np.testing.assert_allclose(out.values.numpy(), want, atol=1e-9, rtol=1e-9)
    assert (out.values[torch.isnan(rewards)] == 0).all()
    # the scale of every group that is updated (collapsed groups' scale is informational)
    upd = out.updated.numpy()
    np.testing.assert_allclose(out.scale.numpy()[upd], want_scale[upd], rtol=1e-9)
    assert out.values.dtype == torch.float64


@pytest.mark.parametrize("name", ["grpo", "rloo", "maxnorm_rloo", "batch_std", "gopo"])
def test_float32_matches_float64(name):
    # rewards on a grid of quarters (exact in float32): float32 math must then agree with
    # float64 to float32 precision. (Sub-resolution jitter groups are left out on purpose:
    # GRPO amplifies the float32 rounding of such rewards by 1/σ_q, which is the point of
    # the MaxNorm paper, not an error of the code.)
    rng = np.random.default_rng(5)
    r = rng.integers(0, 5, (64, 8)) / 4
    r[rng.random((64, 8)) < 0.2] = np.nan
    rewards = torch.tensor(r)
    a64 = advantages.compute(name, rewards).values
    a32 = advantages.compute(name, rewards.float()).values
    np.testing.assert_allclose(a32.numpy(), a64.numpy(), atol=1e-6)


def test_beta_comp_kl_weight_equals_loop():
    rewards = ragged_batch(3)
    out = advantages.compute("grpo_beta_comp", rewards)
    _, scale = ref.per_group("grpo", rewards.numpy())
    for p in range(rewards.shape[0]):
        xs = [x for x in rewards[p].tolist() if not math.isnan(x)]
        collapsed = ref._collapsed(xs, 1, ref.TAU)
        want = 1.0 if collapsed else 1.0 / scale[p]
        assert out.kl_weight[p].item() == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("delta", [1e-2, 0.2])
def test_resolution_equals_loop(seed, delta):
    rewards = ragged_batch(seed)
    binned, keep = advantages.resolution(rewards, ~torch.isnan(rewards), delta)
    want, want_keep = ref.resolution(rewards.numpy(), delta)
    np.testing.assert_allclose(binned.numpy(), want, atol=1e-12, equal_nan=True)
    np.testing.assert_array_equal(keep.numpy(), want_keep)


@pytest.mark.parametrize("name", ["maxnorm_rloo", "grpo", "rloo"])
def test_resolution_then_estimator_equals_loop(name):
    rewards = ragged_batch(7)
    out = advantages.compute(name, rewards, delta_res=1e-2)
    binned, keep = ref.resolution(rewards.numpy(), 1e-2)
    want, _ = ref.per_group(name, binned, tau_res=1e-2)
    want[~keep] = 0.0
    np.testing.assert_allclose(out.values.numpy(), want, atol=1e-9)
    np.testing.assert_array_equal(out.keep.numpy(), keep)


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("gamma", [0.5, 1.0])
def test_focal_equals_loop(name, gamma):
    rewards = ragged_batch(11)
    out = inputs.compute(name, rewards, focal_gamma=gamma)
    base, _ = ref.per_group(name, rewards.numpy(), **inputs.reference_inputs(name, rewards))
    want = base * ref.focal(rewards.numpy(), gamma)[:, None]
    np.testing.assert_allclose(out.values.numpy(), want, atol=1e-9)


@pytest.mark.parametrize("name", ["grpo", "rloo", "dr_grpo", "maxnorm_rloo", "gopo"])
def test_symmetric_virtual_equals_loop(name):
    # a batch with many collapsed groups so that ACR > τ_adapt and virtual samples fire
    rewards = ragged_batch(13, p=12, g=6)
    rewards[5:10] = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])[:, None]
    extras, k, acr = ref.symmetric_virtual(rewards.numpy(), tau_adapt=0.3)
    assert acr > 0.3 and any(extras)
    out = advantages.compute(
        name, rewards, virtual="symmetric", trigger=advantages.VirtualTrigger(tau=0.3)
    )
    for p in range(rewards.shape[0]):
        row = rewards[p].tolist()
        aug = np.array([row + extras[p] + [math.nan] * (k - len(extras[p]))])
        want, _ = ref.per_group(name, aug)
        np.testing.assert_allclose(out.values[p].numpy(), want[0, : rewards.shape[1]], atol=1e-9)
