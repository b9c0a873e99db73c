"""The decode loop's internals: the inverse-CDF draw, the legacy multinomial draw,
and the KV cache written in place."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl import models
from grouprl.rollout import hf
from grouprl.rollout.hf import Sampling, generate, sample_tokens

PROMPTS = ["Calculate 1 + 2.", "2+2=", "What is 10 - 3 ? Be quick."]


@pytest.fixture(scope="module")
def char_model():
    model, tok = models.load("tiny:d=32,layers=2,heads=2", seed=0)
    return model, tok


def old_sample_tokens(logits, sampling, generator, temperature=None):
    """rollout.hf.sample_tokens's multinomial form (torch.multinomial), the reference."""
    logits = logits.float()
    lp_t = sampling.logprob_temperature
    if temperature is None and sampling.temperature == 0.0:
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits / (lp_t or 1.0), dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    t = sampling.temperature if temperature is None else temperature.float()[:, None]
    logp = torch.log_softmax(logits / t, dim=-1)
    probs = logp.exp()
    if sampling.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p
        sorted_p = sorted_p.masked_fill(before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    tokens = torch.multinomial(probs, 1, generator=generator)
    if lp_t is not None and (temperature is not None or lp_t != sampling.temperature):
        logp = torch.log_softmax(logits / lp_t, dim=-1)
    return tokens.squeeze(-1), logp.gather(-1, tokens).squeeze(-1)


# ---- the draw ------------------------------------------------------------------------------


def test_inverse_cdf_known_answer():
    # p = (0.5, 0.3, 0.2): the CDF crosses u at 0.5 and 0.8, so u < 0.5 -> token 0,
    # 0.5 <= u < 0.8 -> token 1, u >= 0.8 -> token 2; u is the row's uniform from the stream
    logits = torch.tensor([0.5, 0.3, 0.2]).log().expand(200, 3)
    tok, logp = sample_tokens(logits, Sampling(), torch.Generator().manual_seed(11))
    u = torch.rand(200, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(11))[:, 0]
    expected = (u >= 0.5).long() + (u >= 0.8).long()
    near = ((u - 0.5).abs() < 1e-6) | ((u - 0.8).abs() < 1e-6)  # float rounding of the CDF
    assert torch.equal(tok[~near], expected[~near]) and len(set(tok.tolist())) == 3
    torch.testing.assert_close(logp, torch.tensor([0.5, 0.3, 0.2]).log()[tok], atol=1e-6, rtol=0)


@pytest.mark.parametrize("draw", hf.DRAWS)
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.5, 1.0), (1.0, 0.75)])
def test_draw_frequencies(draw, temperature, top_p):
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    n = 40_000
    logits = probs.log().expand(n, 5)
    tok, _ = sample_tokens(logits, Sampling(temperature, top_p, 1, draw=draw),
                           torch.Generator().manual_seed(1))  # fmt: skip
    target = probs ** (1 / temperature)
    if top_p < 1.0:  # mass above: 0, .4, .65, .85 -> the first three are kept at 0.75
        target[3:] = 0.0
    target = target / target.sum()
    freq = torch.bincount(tok, minlength=5).double() / n
    se = (target * (1 - target) / n).sqrt().double()
    assert ((freq - target.double()).abs() <= 4 * se + 1e-12).all()


def test_zero_probability_tokens_are_never_drawn():
    logits = torch.full((5000, 7), -math.inf)
    logits[:, [0, 3, 5]] = torch.tensor([0.0, 1.0, 2.0])  # the last position has p = 0
    for top_p in (1.0, 0.9):
        tok, logp = sample_tokens(logits, Sampling(top_p=top_p), torch.Generator().manual_seed(2))
        assert set(tok.tolist()) <= {0, 3, 5} and torch.isfinite(logp).all()
    # u · total rounding up to the total: the last position of positive weight, not a p = 0 one
    w = torch.tensor([[1.0, 0.0, 2.0, 0.0, 0.0]])
    cdf = w.cumsum(-1, dtype=torch.float64)
    idx = hf._inverse_cdf(w, cdf, torch.tensor([[5]]), torch.tensor([[1.0]], dtype=torch.float64))
    assert idx.tolist() == [2]


@pytest.mark.parametrize("top_p", [1.0, 0.8])
@pytest.mark.parametrize("lp_t", [None, 1.0])
@pytest.mark.parametrize("per_row", [False, True])
def test_multinomial_draw_is_the_old_sampler_bit_for_bit(top_p, lp_t, per_row):
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(3)) * 3
    taus = torch.rand(16, generator=torch.Generator().manual_seed(4)) + 0.5 if per_row else None
    s = Sampling(0.7, top_p, 1, logprob_temperature=lp_t, draw="multinomial")
    got = sample_tokens(logits, s, torch.Generator().manual_seed(5), taus)
    want = old_sample_tokens(logits, s, torch.Generator().manual_seed(5), taus)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_draw_setting_is_checked_and_carried():
    with pytest.raises(ValueError, match="inverse_cdf, multinomial"):
        Sampling(draw="gumbel")
    assert Sampling.of({"draw": "multinomial"}).draw == "multinomial"

    class Cfg:  # a config object without the field: the default draw
        temperature, top_p, max_new_tokens = 1.0, 1.0, 8

    assert Sampling.of(Cfg()).draw == "inverse_cdf"


def test_generate_with_the_multinomial_draw_records_its_logp(char_model):
    model, tok = char_model
    s = Sampling(1.0, 1.0, 10, draw="multinomial")
    a = generate(model, tok, PROMPTS, 3, s, torch.Generator().manual_seed(4))
    b = generate(model, tok, PROMPTS, 3, Sampling(1.0, 1.0, 10), torch.Generator().manual_seed(4))
    assert not torch.equal(a.completion_ids, b.completion_ids)  # other draws, one seed
    a2 = generate(model, tok, PROMPTS, 3, s, torch.Generator().manual_seed(4))
    assert torch.equal(a.completion_ids, a2.completion_ids)


# ---- the in-place KV cache --------------------------------------------------------------------


def _dynamic(cache, group_size, capacity):
    """The cache as transformers grows it (torch.cat per step): the reference."""
    cache.batch_repeat_interleave(group_size)
    return cache


@pytest.mark.parametrize("compact_below", [0.0, 0.75, 1.0])
def test_in_place_cache_gives_the_same_rollouts(char_model, monkeypatch, compact_below):
    model, tok = char_model
    s = Sampling(1.0, 1.0, 12)
    fast = generate(model, tok, PROMPTS, 4, s, torch.Generator().manual_seed(6),
                    compact_below=compact_below)  # fmt: skip
    monkeypatch.setattr(hf, "_preallocate", _dynamic)
    ref = generate(model, tok, PROMPTS, 4, s, torch.Generator().manual_seed(6),
                   compact_below=compact_below)  # fmt: skip
    assert torch.equal(fast.completion_ids, ref.completion_ids)
    torch.testing.assert_close(fast.old_logp, ref.old_logp, atol=1e-6, rtol=0)


def test_in_place_layer_equals_concatenation():
    from transformers.cache_utils import DynamicLayer

    gen = torch.Generator().manual_seed(0)
    k0, v0 = torch.randn(2, 3, 5, 4, generator=gen), torch.randn(2, 3, 5, 4, generator=gen)
    layer = hf._InPlaceLayer(k0, v0, repeats=3, capacity=7)  # capacity 7: grows at step 3
    ref = DynamicLayer()
    ref.update(k0.repeat_interleave(3, 0), v0.repeat_interleave(3, 0))
    for step in range(4):
        k, v = torch.randn(6, 3, 1, 4, generator=gen), torch.randn(6, 3, 1, 4, generator=gen)
        got, want = layer.update(k, v), ref.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert layer.get_seq_length() == ref.get_seq_length() == 6 + step
    rows = torch.tensor([0, 4, 5])
    layer.batch_select_indices(rows)
    ref.batch_select_indices(rows)
    assert torch.equal(layer.keys, ref.keys) and torch.equal(layer.values, ref.values)
    k, v = torch.randn(3, 3, 2, 4, generator=gen), torch.randn(3, 3, 2, 4, generator=gen)
    assert torch.equal(layer.update(k, v)[0], ref.update(k, v)[0])  # two positions at once
    layer.crop(4)
    ref.crop(4)
    assert torch.equal(layer.values, ref.values) and layer.get_seq_length() == 4
