"""Every estimator and transform makes its tensors on the rewards' device and in their dtype,
never on torch's default device or in its default dtype: float32 CPU rewards under a
default device of "meta" and a default dtype of float64 give float32 CPU results (a tensor
made without an explicit device would land on meta and fail; one without a dtype would
widen the result). On a GPU the same mistake puts a tensor on the CPU."""

from __future__ import annotations

import math

import inputs
import pytest
import torch

from grouprl import advantages

R = torch.tensor(
    [[1.0, 0.0, 0.5, 0.0], [0.2, 0.9, 0.9, 0.4], [1.0, 1.0, 1.0, 1.0], [0.0, math.nan, 0.0, 0.0]]
)
TRANSFORMS = [{}, {"focal_gamma": 0.5}, {"delta_res": 1e-2}, {"virtual": "symmetric"}]
TRANSFORMS += [{"virtual": "code", "virtual_batch_groups": 2}]


def _check(out: advantages.Advantages) -> None:
    for field in ("values", "kl_weight", "scale", "token_values"):
        t = getattr(out, field)
        if t is not None:
            assert (t.device.type, t.dtype) == ("cpu", torch.float32), (field, t.device, t.dtype)
    for field in ("keep", "updated"):
        t = getattr(out, field)
        assert (t.device.type, t.dtype) == ("cpu", torch.bool), (field, t.device, t.dtype)


@pytest.mark.parametrize("kw", TRANSFORMS, ids=lambda kw: ",".join(kw) or "plain")
@pytest.mark.parametrize("name", advantages.names())
def test_every_estimator_and_transform(name, kw, under_wide_meta_defaults):
    inp = inputs.inputs_for(name, R, **kw)
    reads_more = advantages.needs(name) or name == "gdpo"
    if ("virtual" in kw and reads_more) or ("delta_res" in kw and name == "gdpo"):
        # refused by design (docs/ALGORITHMS.md §2): virtual samples have no tokens or greedy
        # completion for an estimator that reads them; GDPO's normalised rewards take neither
        # resolution nor virtual samples
        with pytest.raises(ValueError, match=r"virtual samples|normalised rewards"):
            under_wide_meta_defaults(advantages.compute, name, R, **inp, **kw)
        return
    _check(under_wide_meta_defaults(advantages.compute, name, R, **inp, **kw))


@pytest.mark.parametrize("name", list(advantages.TOKEN_ESTIMATORS))
def test_every_token_estimator(name, under_wide_meta_defaults):
    mask = torch.ones(4, 4, 3, dtype=torch.bool)
    mask[0, 1, 2] = False
    kw = {"token_rewards": torch.full((4, 4, 3), 0.1)}
    if "optimal" in name:
        kw = {"old_logp": torch.full((4, 4, 3), -1.0), "sum_pi_squared": torch.full((4, 4, 3), 0.5)}
    _check(under_wide_meta_defaults(advantages.compute_tokens, name, R, mask, **kw))


def test_resolution_of_groups_beyond_the_sorting_network(under_wide_meta_defaults):
    # G = 33 takes the torch.sort branch of resolution (beyond SORT_NETWORK_MAX)
    r = torch.linspace(0, 1, 66).reshape(2, 33)
    r[0, 3] = math.nan
    binned, keep = under_wide_meta_defaults(
        advantages.transforms.resolution, r, ~torch.isnan(r), 0.01
    )
    assert (binned.device.type, binned.dtype) == ("cpu", torch.float32)
    assert keep.device.type == "cpu"
