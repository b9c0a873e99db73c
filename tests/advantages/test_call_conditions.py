"""The advantages of a batch do not depend on how it is handed over: under
``torch.inference_mode`` (how a rollout worker or an evaluation loop may call the layer;
inference tensors keep no version counter, which the shared moments and the resolution's
column hand-over key by), or as a transposed, sliced or broadcast view (``compute`` and
``compute_tokens`` read their tensors in row-major memory), every estimator and transform
gives the bits of the plain call on a row-major copy."""

from __future__ import annotations

import math
from collections.abc import Callable

import inputs
import pytest
import torch

from grouprl import advantages

TRANSFORMS = [{}, {"delta_res": 1e-2}, {"focal_gamma": 0.5}, {"virtual": "symmetric"}]


def _refused(name: str, kw: dict) -> bool:
    """Pairs refused by design (test_no_default_tensors checks their errors)."""
    reads_more = advantages.needs(name) or name == "gdpo"
    return ("virtual" in kw and reads_more) or ("delta_res" in kw and name == "gdpo")


CASES = [
    pytest.param(name, kw, id=f"{name}-{','.join(kw) or 'plain'}")
    for name in advantages.names()
    for kw in TRANSFORMS
    if not _refused(name, kw)
]


def _batch(nan: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    binary = (torch.rand(300, 8, generator=gen) < 0.4).float()
    r = torch.where(torch.rand(300, 1, generator=gen) < 0.6, binary, torch.rand(300, 8))
    r[5] = 1.0  # a constant group
    if nan:
        r[::7, 3] = math.nan
    return r


def _token_case(name: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(rewards [6, 4], mask [6, 4, 5], the token tensors name reads)``."""
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
    return r, mask, kw


def _reversed_memory(x: torch.Tensor) -> torch.Tensor:
    """The same values with the dimensions' order in memory reversed (not contiguous)."""
    dims = tuple(range(x.dim()))[::-1]
    return x.permute(dims).contiguous().permute(dims)


def _strided(x: torch.Tensor) -> torch.Tensor:
    """The same values as every third column of a wider tensor."""
    wide = torch.zeros(x.shape[0], 3 * x.shape[1], dtype=x.dtype)
    wide[:, 1::3] = x
    return wide[:, 1::3]


def _same_bits(got: advantages.Advantages, want: advantages.Advantages) -> None:
    assert torch.equal(got.values.view(torch.int32), want.values.view(torch.int32))
    assert torch.equal(got.keep, want.keep) and got.stats == want.stats
    if want.token_values is not None:
        tv = torch.int32
        assert torch.equal(got.token_values.view(tv), want.token_values.view(tv))


@pytest.mark.parametrize("nan", [False, True], ids=["dense", "nan"])
@pytest.mark.parametrize(("name", "kw"), CASES)
def test_inference_mode_gives_the_same_bits(name, kw, nan):
    r = _batch(nan)
    want = inputs.compute(name, r, **kw)
    with torch.inference_mode():
        got = inputs.compute(name, r.clone(), **kw)
    _same_bits(got, want)


@pytest.mark.parametrize("view", [_reversed_memory, _strided])
@pytest.mark.parametrize(("name", "kw"), CASES)
def test_a_view_gives_the_bits_of_its_row_major_copy(name, kw, view: Callable):
    r = _batch(nan=True)
    extra = inputs.inputs_for(name, r, **kw)
    want = advantages.compute(name, r, **extra, **kw)
    v = view(r)
    assert not v.is_contiguous() and torch.equal(v.nan_to_num(9), r.nan_to_num(9))
    more = {k: (_reversed_memory(x) if x.dim() == 2 else x) for k, x in extra.items()}
    _same_bits(advantages.compute(name, v, **more, **kw), want)


@pytest.mark.parametrize("name", list(advantages.TOKEN_ESTIMATORS))
def test_token_estimators_under_inference_mode_and_as_views(name):
    r, mask, kw = _token_case(name)
    want = advantages.compute_tokens(name, r, mask, **kw)
    with torch.inference_mode():
        copies = {k: v.clone() for k, v in kw.items()}
        _same_bits(advantages.compute_tokens(name, r.clone(), mask.clone(), **copies), want)
    views = {k: _reversed_memory(v) for k, v in kw.items()}
    got = advantages.compute_tokens(name, _reversed_memory(r), _reversed_memory(mask), **views)
    _same_bits(got, want)


def test_a_broadcast_row_is_read_not_written():
    # an expanded tensor shares one row's memory: nothing may write into it
    row = torch.tensor([[0.0, 1.0, 0.25, 1.0]])
    r = row.expand(6, 4)
    for name in ("grpo", "maxnorm_rloo", "gopo", "grpo_passk", "p90"):
        out = advantages.compute(name, r, delta_res=1e-2)
        assert torch.equal(
            out.values, advantages.compute(name, r.contiguous(), delta_res=1e-2).values
        )
    assert row.tolist() == [[0.0, 1.0, 0.25, 1.0]]
