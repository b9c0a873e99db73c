"""Every estimator and transform under ``torch.inference_mode`` (how a rollout worker or an
evaluation loop may call them) gives the bits it gives outside: inference tensors keep no
version counter, which the shared moments and the resolution's column hand-over key by."""

from __future__ import annotations

import math

import inputs
import pytest
import torch

from grouprl import advantages

TRANSFORMS = [{}, {"delta_res": 1e-2}, {"focal_gamma": 0.5}, {"virtual": "symmetric"}]


def _batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    binary = (torch.rand(300, 8, generator=gen) < 0.4).float()
    partial = torch.rand(300, 8, generator=gen)
    r = torch.where(torch.rand(300, 1, generator=gen) < 0.6, binary, partial)
    r[5] = 1.0  # a constant group
    return r


def _refused(name: str, kw: dict) -> bool:
    reads_more = advantages.needs(name) or name == "gdpo"
    return ("virtual" in kw and reads_more) or ("delta_res" in kw and name == "gdpo")


CASES = [  # the refused pairs (test_no_default_tensors checks their errors) left out
    pytest.param(name, kw, id=f"{name}-{','.join(kw) or 'plain'}")
    for name in advantages.names()
    for kw in TRANSFORMS
    if not _refused(name, kw)
]


@pytest.mark.parametrize("nan", [False, True], ids=["dense", "nan"])
@pytest.mark.parametrize(("name", "kw"), CASES)
def test_inference_mode_gives_the_same_bits(name, kw, nan):
    r = _batch()
    if nan:
        r[::7, 3] = math.nan
    want = inputs.compute(name, r, **kw)
    with torch.inference_mode():
        ri = r.clone()
        got = inputs.compute(name, ri, **kw)
    assert torch.equal(got.values.view(torch.int32), want.values.view(torch.int32))
    assert torch.equal(got.keep, want.keep) and got.stats == want.stats


@pytest.mark.parametrize("name", list(advantages.TOKEN_ESTIMATORS))
def test_token_estimators_under_inference_mode_give_the_same_bits(name):
    gen = torch.Generator().manual_seed(12)
    r = torch.rand(6, 4, generator=gen)
    mask = torch.rand(6, 4, 5, generator=gen) < 0.8
    mask[..., 0] = True
    kw = {"token_rewards": torch.rand(6, 4, 5, generator=gen) * 0.1}
    if "optimal" in name:
        kw = {
            "old_logp": -torch.rand(6, 4, 5, generator=gen),
            "sum_pi_squared": torch.rand(6, 4, 5),
        }
    want = advantages.compute_tokens(name, r, mask, **kw)
    with torch.inference_mode():
        copies = {k: v.clone() for k, v in kw.items()}
        got = advantages.compute_tokens(name, r.clone(), mask.clone(), **copies)
    assert torch.equal(got.token_values.view(torch.int32), want.token_values.view(torch.int32))
