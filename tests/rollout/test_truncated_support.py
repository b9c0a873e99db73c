"""Truncated sampling read on its own support: top-k, kept sets, renormalised log-probs.

Known answers by hand on a 4-token vocabulary p = [0.4, 0.3, 0.2, 0.1]:

- top_k=2 keeps {0, 1}, M = 0.7: tokens drawn at 0.4/0.7 and 0.3/0.7, renormalised log-probs
  log(p/0.7);
- top_k=3 then top_p=0.75 (HF's and vLLM's order): the top-3 distribution is [4, 3, 2]/9, the
  mass above token 2 is 7/9 ≥ 0.75, so {0, 1} (M = 0.7); top-p on the full softmax would have
  kept token 2 too (mass above it 0.7 < 0.75).
"""

from __future__ import annotations

import math

import pytest
import torch

from grouprl import models
from grouprl.rollout.hf import (
    Sampling,
    draw_tokens,
    generate,
    kept_mask,
    sample_tokens,
    truncated_log_softmax,
)
from grouprl.train.logprobs import completion_logprobs

PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1])
PROMPTS = ["Calculate 1 + 2.", "2+2=", "What is 10 - 3 ? Be quick."]


@pytest.fixture(scope="module")
def char_model():
    model, tok = models.load("tiny:d=32,layers=2,heads=2", seed=0)
    stops = [tok.eos_token_id, *tok.convert_tokens_to_ids(list("aeiou 0123"))[:8]]
    model.generation_config.eos_token_id = stops  # [test-only] stops early and late
    return model, tok


@pytest.mark.parametrize("draw", ["inverse_cdf", "multinomial"])
@pytest.mark.parametrize(
    ("top_p", "top_k", "kept"), [(1.0, 2, {0, 1}), (0.75, 3, {0, 1}), (0.75, 0, {0, 1, 2})]
)
def test_kept_sets_frequencies_and_renormalised_logp_by_hand(draw, top_p, top_k, kept):
    logits = PROBS.log().expand(20_000, 4)
    mass = float(PROBS[sorted(kept)].sum())
    s = Sampling(1.0, top_p, 1, draw=draw, top_k=top_k, logprob_support="truncated")
    d = draw_tokens(logits, s, torch.Generator().manual_seed(0))
    assert set(d.tokens.tolist()) == kept
    freq = torch.bincount(d.tokens, minlength=4).float() / len(d.tokens)
    assert torch.allclose(freq[sorted(kept)], PROBS[sorted(kept)] / mass, atol=0.015)
    torch.testing.assert_close(d.logp, (PROBS[d.tokens] / mass).log(), atol=1e-6, rtol=0)
    torch.testing.assert_close(d.log_kept_mass, torch.full((20_000,), math.log(mass)))
    assert d.kept.dtype == torch.int32 and d.kept.shape == (20_000, len(kept))
    assert {frozenset(r) for r in d.kept.tolist()} == {frozenset(kept)}
    # the full reading: the same draws, log-probs of the full softmax, no kept sets
    full = draw_tokens(logits, Sampling(1.0, top_p, 1, draw=draw, top_k=top_k),
                       torch.Generator().manual_seed(0))  # fmt: skip
    assert torch.equal(full.tokens, d.tokens) and full.kept is None
    torch.testing.assert_close(full.logp, PROBS[d.tokens].log(), atol=1e-6, rtol=0)


def test_kept_sets_of_different_sizes_are_padded_and_the_mask_replays_them():
    logits = torch.tensor([[3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # peaked, flat
    s = Sampling(1.0, 0.5, 1, logprob_support="truncated")
    d = draw_tokens(logits, s, torch.Generator().manual_seed(0))
    assert d.kept[0].tolist() == [0, -1] and sorted(d.kept[1].tolist()) == sorted(set(d.kept[1].tolist()))  # fmt: skip
    mask = kept_mask(d.kept, 4)
    assert mask[0].tolist() == [True, False, False, False] and int(mask[1].sum()) == 2
    # padding (-1) never clears a kept token 0
    assert kept_mask(torch.tensor([[0, -1, -1]]), 3).tolist() == [[True, False, False]]


def test_no_truncation_records_nothing_and_equals_full_bit_for_bit(char_model):
    model, tok = char_model
    full = generate(
        model, tok, PROMPTS, 3, Sampling(1.0, 1.0, 10), torch.Generator().manual_seed(3)
    )
    trunc = generate(model, tok, PROMPTS, 3, Sampling(1.0, 1.0, 10, logprob_support="truncated"),
                     torch.Generator().manual_seed(3))  # fmt: skip
    assert torch.equal(full.completion_ids, trunc.completion_ids)
    assert torch.equal(full.old_logp, trunc.old_logp)
    assert trunc.kept_ids is None and trunc.log_kept_mass is None and full.log_kept_mass is None


@pytest.mark.parametrize("draw", ["inverse_cdf", "multinomial"])
def test_generate_records_the_sets_and_the_kernel_replays_them(char_model, draw):
    """The sampler's renormalised old_logp equal the trainer's kernel on the recorded sets
    (HF forward, no shared cache), and every sampled token is in its position's set."""
    model, tok = char_model
    s = Sampling(1.0, 0.9, 10, draw=draw, top_k=5, logprob_support="truncated")
    out = generate(model, tok, PROMPTS, 4, s, torch.Generator().manual_seed(5))
    n, t, k = out.kept_ids.shape
    assert (n, t) == out.completion_ids.shape and 1 <= k <= 5
    valid = out.completion_mask.bool()
    assert bool((out.kept_ids[~valid] == -1).all())
    hit = (out.kept_ids.long() == out.completion_ids[..., None]).any(-1)  # [N, T]
    assert bool(hit[valid].all())
    with torch.no_grad():
        lp = completion_logprobs(model, out.prompt_ids, out.prompt_mask, out.completion_ids,
                                 out.completion_mask, kept_ids=out.kept_ids).logp  # fmt: skip
        full = completion_logprobs(model, out.prompt_ids, out.prompt_mask, out.completion_ids,
                                   out.completion_mask).logp  # fmt: skip
    torch.testing.assert_close(lp, out.old_logp, atol=1e-5, rtol=0)
    # the log of the kept mass is what separates the two readings, token by token
    torch.testing.assert_close(full - lp, out.log_kept_mass, atol=1e-5, rtol=0)
    assert float(out.log_kept_mass[valid].min()) < -0.05  # the truncation bites here


class _Fixed(torch.nn.Module):
    """A "model" whose logits at every position are one learnable vector ``[V]``."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.z = torch.nn.Parameter(logits.clone())

    def forward(self, input_ids, attention_mask=None, **_):
        return self.z.expand(*input_ids.shape, -1)


def test_renormalised_logp_entropy_and_gradient_on_a_tiny_vocabulary_by_hand():
    """V = 4, logits log p, p = [0.4, 0.3, 0.2, 0.1]; kept {0, 2} (mass 0.6) at the first
    completion token, {1} at the second (probability 1); token 0, then token 1.

    By hand: log π̃(0) = log(0.4/0.6); log π̃(1) = 0; entropy of [2/3, 0, 1/3, 0]; the gradient
    of log π̃(y) w.r.t. the logits is onehot(y) − π̃ (0 at every dropped token): at the first
    token [1 − 2/3, 0, −1/3, 0], at the second onehot(1) − onehot(1) = 0.
    """
    model = _Fixed(PROBS.log())
    prompt = torch.tensor([[0]])
    ids, mask = torch.tensor([[0, 1]]), torch.ones(1, 2, dtype=torch.long)
    kept = torch.tensor([[[0, 2], [1, -1]]], dtype=torch.int32)  # [1, 2, 2]
    out = completion_logprobs(model, prompt, torch.ones_like(prompt), ids, mask, kept_ids=kept,
                              entropy=True)  # fmt: skip
    expect = torch.tensor([[math.log(0.4 / 0.6), 0.0]])
    torch.testing.assert_close(out.logp, expect, atol=1e-6, rtol=0)
    h = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    torch.testing.assert_close(out.entropy, torch.tensor([[h, 0.0]]), atol=1e-6, rtol=0)
    out.logp.sum().backward()
    torch.testing.assert_close(model.z.grad, torch.tensor([1 / 3, 0.0, -1 / 3, 0.0]),
                               atol=1e-6, rtol=0)  # fmt: skip
    # the full-softmax gradient of the same token differs: onehot(0) - p, on every token
    model.z.grad = None
    completion_logprobs(model, prompt, torch.ones_like(prompt), ids[:, :1], mask[:, :1]).logp.sum().backward()  # fmt: skip
    torch.testing.assert_close(model.z.grad, torch.tensor([0.6, -0.3, -0.2, -0.1]), atol=1e-6, rtol=0)  # fmt: skip


def test_truncated_log_softmax_gradient_matches_autograd_of_the_renormalised_probability():
    """gradcheck in float64: d/dz log(softmax(z)[y] / Σ_kept softmax(z)) = the function's."""
    z = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    keep = torch.tensor([[1, 1, 0, 1, 0, 0], [0, 1, 0, 0, 0, 1], [1, 1, 1, 1, 1, 1]]).bool()
    y = torch.tensor([3, 5, 2])

    def ours(z):
        return truncated_log_softmax(z, keep).gather(-1, y[:, None])

    def by_definition(z):
        p = torch.softmax(z, -1)
        return (p.gather(-1, y[:, None]) / (p * keep).sum(-1, keepdim=True)).log()

    torch.testing.assert_close(ours(z), by_definition(z))
    g1 = torch.autograd.grad(ours(z).sum(), z)[0]
    g2 = torch.autograd.grad(by_definition(z).sum(), z)[0]
    torch.testing.assert_close(g1, g2)
    assert torch.autograd.gradcheck(ours, (z,))


def test_a_token_outside_its_kept_set_and_bad_shapes_are_refused():
    model = _Fixed(PROBS.log())
    prompt, ids, mask = torch.tensor([[0]]), torch.tensor([[3]]), torch.ones(1, 1)
    with pytest.raises(ValueError, match="outside the kept set"):
        completion_logprobs(model, prompt, torch.ones_like(prompt), ids, mask,
                            kept_ids=torch.tensor([[[0, 1]]]))  # fmt: skip
    with pytest.raises(ValueError, match=r"kept_ids must be \[N, T, K\]"):
        completion_logprobs(model, prompt, torch.ones_like(prompt), ids, mask,
                            kept_ids=torch.tensor([[0, 1]]))  # fmt: skip


def test_sampling_settings_are_checked():
    with pytest.raises(ValueError, match="top_k must be an integer >= 0"):
        Sampling(top_k=-1)
    with pytest.raises(ValueError, match="top_k must be an integer >= 0"):
        Sampling(top_k=2.5)
    with pytest.raises(ValueError, match="logprob_support must be one of full, truncated"):
        Sampling(logprob_support="nucleus")
    assert not Sampling(top_p=1.0, logprob_support="truncated").records_support
    assert not Sampling(temperature=0.0, top_k=3, logprob_support="truncated").records_support
    assert Sampling(top_k=3, logprob_support="truncated").records_support
    # sample_tokens keeps its two-tuple
    tok, lp = sample_tokens(PROBS.log()[None], Sampling(top_k=1), torch.Generator().manual_seed(0))
    assert tok.tolist() == [0] and math.isclose(float(lp), math.log(0.4), abs_tol=1e-6)
