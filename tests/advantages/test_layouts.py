"""The advantages of a batch do not depend on how its tensors sit in memory: a transposed
view, a slice of a wider tensor or a broadcast row give the bits of the row-major copy
(``compute`` reads rewards, verifier rewards and lengths in row-major order)."""

from __future__ import annotations

import math

import inputs
import pytest
import torch

from grouprl import advantages

TRANSFORMS = [{}, {"delta_res": 1e-2}, {"focal_gamma": 0.5}, {"virtual": "symmetric"}]


def _refused(name: str, kw: dict) -> bool:
    reads_more = advantages.needs(name) or name == "gdpo"
    return ("virtual" in kw and reads_more) or ("delta_res" in kw and name == "gdpo")


CASES = [
    pytest.param(name, kw, id=f"{name}-{','.join(kw) or 'plain'}")
    for name in advantages.names()
    for kw in TRANSFORMS
    if not _refused(name, kw)
]


def _batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(13)
    binary = (torch.rand(200, 8, generator=gen) < 0.4).float()
    r = torch.where(torch.rand(200, 1, generator=gen) < 0.5, binary, torch.rand(200, 8))
    r[::9, 2] = math.nan
    return r


def _views(r: torch.Tensor) -> dict[str, torch.Tensor]:
    wide = torch.zeros(r.shape[0], 3 * r.shape[1], dtype=r.dtype)
    wide[:, 1::3] = r
    return {"transposed": r.t().contiguous().t(), "strided": wide[:, 1::3]}


@pytest.mark.parametrize(("name", "kw"), CASES)
def test_a_view_gives_the_bits_of_its_row_major_copy(name, kw):
    r = _batch()
    extra = inputs.inputs_for(name, r, **kw)
    want = advantages.compute(name, r, **extra, **kw)
    for layout, view in _views(r).items():
        assert not view.is_contiguous() and torch.equal(view.nan_to_num(9), r.nan_to_num(9))
        more = {k: (v.t().contiguous().t() if v.dim() == 2 else v) for k, v in extra.items()}
        got = advantages.compute(name, view, **more, **kw)
        bits = torch.int32
        assert torch.equal(got.values.view(bits), want.values.view(bits)), layout
        assert got.stats == want.stats, layout


def test_a_broadcast_row_is_read_not_written():
    # an expanded tensor shares one row's memory: nothing may write into it
    row = torch.tensor([[0.0, 1.0, 0.25, 1.0]])
    r = row.expand(6, 4)
    for name in ("grpo", "maxnorm_rloo", "gopo", "grpo_passk", "p90"):
        out = advantages.compute(name, r, delta_res=1e-2)
        want = advantages.compute(name, r.contiguous(), delta_res=1e-2)
        assert torch.equal(out.values, want.values)
    assert row.tolist() == [[0.0, 1.0, 0.25, 1.0]]


@pytest.mark.parametrize("name", list(advantages.TOKEN_ESTIMATORS))
def test_token_tensors_as_views_give_the_bits_of_their_copies(name):
    gen = torch.Generator().manual_seed(14)
    r = torch.rand(6, 4, generator=gen)
    mask = torch.rand(6, 4, 5, generator=gen) < 0.8
    mask[..., 0] = True
    kw = {"token_rewards": torch.rand(6, 4, 5, generator=gen) * 0.1}
    if "optimal" in name:
        kw = {
            "old_logp": -torch.rand(6, 4, 5, generator=gen),
            "sum_pi_squared": torch.rand(6, 4, 5),
        }

    def view(x):  # the same values in reversed-dimension memory
        dims = tuple(range(x.dim()))[::-1]
        return x.permute(dims).contiguous().permute(dims)

    want = advantages.compute_tokens(name, r, mask, **kw)
    got = advantages.compute_tokens(
        name, view(r), view(mask), **{k: view(v) for k, v in kw.items()}
    )
    assert torch.equal(got.token_values.view(torch.int32), want.token_values.view(torch.int32))
    assert torch.equal(got.values.view(torch.int32), want.values.view(torch.int32))
