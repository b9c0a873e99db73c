"""Aggregations: hand values, and micro-batch accumulation equal to one big batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl import losses
from grouprl.losses import StepTotals, step_totals
from grouprl.losses.aggregation import linear_quantile

AGGS = [a for a in losses.AGGREGATIONS if a in losses.EXACT_UNDER_ACCUMULATION]


def test_hand_values():
    # per_token [[1,2,3],[4,x,x]] with x padding (set to 100: must be ignored)
    # token_mean = (1+2+3+4)/4 = 2.5
    # seq_mean_token_mean = ((1+2+3)/3 + 4/1)/2 = (2 + 4)/2 = 3
    # seq_mean_token_sum_norm = 10 / (2 sequences · L_max 3) = 1.666...
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(losses.aggregate("token_mean", per_token, mask)) == pytest.approx(2.5)
    assert float(losses.aggregate("seq_mean_token_mean", per_token, mask)) == pytest.approx(3.0)
    assert float(losses.aggregate("seq_mean_token_sum_norm", per_token, mask)) == pytest.approx(
        10 / 6
    )
    # Dr.GRPO with the generation limit L_max = 5 instead of the padded width 3: 10 / (2·5) = 1
    totals = step_totals(mask, max_len=5)
    assert float(losses.aggregate("seq_mean_token_sum_norm", per_token, mask, totals)) == 1.0
    # token_sum = 1+2+3+4 = 10; seq_mean_token_sum = (6 + 4)/2 = 5 (verl, TRL luspo)
    assert float(losses.aggregate("token_sum", per_token, mask)) == 10.0
    assert float(losses.aggregate("seq_mean_token_sum", per_token, mask)) == 5.0
    # micro_token_mean (TRL bnpo): one batch = token mean 2.5; as two micro-batches of one row:
    # (6/3)/2 + (4/1)/2 = 1 + 2 = 3, not the step's token mean 2.5
    assert float(losses.aggregate("micro_token_mean", per_token, mask)) == 2.5
    two = step_totals([mask[:1], mask[1:]])
    parts = [
        losses.aggregate("micro_token_mean", per_token[i : i + 1], mask[i : i + 1], two)
        for i in (0, 1)
    ]
    assert [float(p) for p in parts] == [1.0, 2.0]


def test_fully_masked_rows_count_in_no_normaliser():
    # a row with no valid token (keep=False group) must not dilute seq means (verl agg_loss)
    per_token = torch.tensor([[1.0, 3.0], [7.0, 7.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    assert float(losses.aggregate("seq_mean_token_mean", per_token, mask)) == 2.0
    assert float(losses.aggregate("seq_mean_token_sum_norm", per_token, mask)) == 2.0  # 4/(1·2)
    t = step_totals(mask)
    assert (t.num_tokens, t.num_seqs, t.max_len) == (2.0, 1.0, 2.0)


def _batch(seed: int, n: int = 8, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    lengths[0] = t  # at least one full-width row
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()  # [N, T]
    logp = (-torch.rand(n, t, generator=g, dtype=torch.float64)).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return logp, old, adv, mask


def _split(n: int, parts: int) -> list[slice]:
    size = n // parts
    return [slice(i * size, (i + 1) * size) for i in range(parts)]


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_micro_batches_sum_to_one_batch_loss_and_gradient(agg, parts):
    logp, old, adv, mask = _batch(0)
    per_token, _ = losses.surrogate("ppo_clip", logp, old, adv, mask, eps_high=0.28)
    full = losses.aggregate(agg, per_token, mask)
    (full_grad,) = torch.autograd.grad(full, logp)

    # micro-batches, each trimmed to its own padded width as a trainer would
    slices = _split(logp.shape[0], parts)
    widths = [int(mask[s].sum(-1).max()) for s in slices]
    mb_masks = [mask[s, :w] for s, w in zip(slices, widths)]
    totals = step_totals(mb_masks, max_len=mask.shape[1])
    acc = torch.zeros((), dtype=torch.float64)
    grad = torch.zeros_like(logp)
    for s, w, m in zip(slices, widths, mb_masks):
        lp = logp.detach()[s, :w].clone().requires_grad_()
        pt, _ = losses.surrogate("ppo_clip", lp, old[s, :w], adv[s], m, eps_high=0.28)
        loss = losses.aggregate(agg, pt, m, totals)
        loss.backward()
        acc = acc + loss.detach()
        grad[s, :w] += lp.grad
    torch.testing.assert_close(acc, full.detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, full_grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("agg", AGGS)
def test_float32_micro_batches_within_1e6(agg):
    logp, _old, adv, mask = _batch(3, n=16, t=33)
    per_token = (logp.detach().float() * adv.float()[:, None]) * mask
    full = losses.aggregate(agg, per_token, mask)
    totals = step_totals([mask[:4], mask[4:8], mask[8:12], mask[12:]])
    parts = sum(losses.aggregate(agg, per_token[s], mask[s], totals) for s in _split(16, 4))
    assert abs(float(parts) - float(full)) <= 1e-6 * max(1.0, abs(float(full)))  # token_sum: ~1e2


def test_naive_per_micro_batch_normalisation_is_wrong():
    # the bug this API prevents: averaging micro-batch token means != token mean of the step
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    full = float(losses.aggregate("token_mean", per_token, mask))  # (4 + 5)/5 = 1.8
    naive = (
        sum(
            float(losses.aggregate("token_mean", per_token[i : i + 1], mask[i : i + 1]))
            for i in range(2)
        )
        / 2
    )  # (1 + 5)/2 = 3
    totals = step_totals(mask)
    exact = sum(
        float(losses.aggregate("token_mean", per_token[i : i + 1], mask[i : i + 1], totals))
        for i in range(2)
    )
    assert full == pytest.approx(1.8) and naive == pytest.approx(3.0)
    assert exact == pytest.approx(full)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 6), min_size=2, max_size=10),
    cut=st.integers(1, 9),
    agg=st.sampled_from(AGGS),
)
def test_property_any_split_matches_one_batch(lengths, cut, agg):
    lengths[0] = max(lengths[0], 1)
    n, t = len(lengths), 6
    cut = min(cut, n - 1)
    mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).double()
    per_token = torch.arange(n * t, dtype=torch.float64).reshape(n, t).sin()
    full = losses.aggregate(agg, per_token, mask)
    totals = step_totals([mask[:cut], mask[cut:]])
    parts = [(per_token[:cut], mask[:cut]), (per_token[cut:], mask[cut:])]
    acc = sum(losses.aggregate(agg, p, m, totals) for p, m in parts)
    torch.testing.assert_close(acc, full, atol=1e-12, rtol=0)


def test_step_totals_with_keep_and_empty_step():
    mask = torch.ones(4, 3)
    keep = torch.tensor([True, False, True, False])
    t = step_totals(mask, keep=keep)
    assert (t.num_tokens, t.num_seqs, t.max_len) == (6.0, 2.0, 3.0)
    empty = step_totals(mask, keep=torch.zeros(4, dtype=torch.bool))
    assert empty.is_empty
    with pytest.raises(ValueError, match="skip the step"):
        losses.aggregate("token_mean", torch.ones(4, 3), mask, empty)
    # an all-masked micro-batch inside a non-empty step is fine: it adds 0
    ok = StepTotals(num_tokens=6.0, num_seqs=2.0, max_len=3.0)
    assert float(losses.aggregate("token_mean", torch.ones(4, 3), torch.zeros(4, 3), ok)) == 0.0


def test_bad_input():
    with pytest.raises(ValueError, match="valid aggregations: token_mean"):
        losses.aggregate("mean", torch.ones(1, 1), torch.ones(1, 1))
    with pytest.raises(ValueError, match="same shape"):
        losses.aggregate("token_mean", torch.ones(2, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="skip the step"):
        losses.aggregate("seq_mean_token_mean", torch.ones(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="shorter than a mask"):
        step_totals(torch.ones(2, 5), max_len=3)
    with pytest.raises(ValueError, match="keep tensors"):
        step_totals([torch.ones(2, 5)], keep=[torch.ones(2), torch.ones(2)])


@pytest.mark.parametrize(
    "agg, what",
    [
        ("token_mean", "valid tokens"),
        ("seq_mean_token_mean", "sequences with a valid token"),
        ("seq_mean_token_sum_norm", "sequences with a valid token"),
        ("seq_mean_token_sum", "sequences with a valid token"),
        ("micro_token_mean", "valid tokens"),
    ],
)
def test_a_zero_normaliser_names_what_was_counted(agg, what):
    with pytest.raises(ValueError, match=rf"the normaliser \({what}\) is 0"):
        losses.aggregate(agg, torch.ones(2, 3), torch.zeros(2, 3))


def test_step_totals_of_zero_width_masks_and_errors_that_name_the_shapes():
    empty = step_totals([torch.zeros(2, 0), torch.zeros(3, 0)])
    assert (empty.num_tokens, empty.num_seqs, empty.max_len, empty.is_empty) == (0, 0, 0, True)
    with pytest.raises(ValueError, match="needs at least one mask"):
        step_totals([])
    with pytest.raises(ValueError, match=r"each mask must be \[N, T\], got shape \(4,\)"):
        step_totals(torch.ones(4))
    with pytest.raises(ValueError, match=r"keep must be \[N\]=\(2,\) for its mask, got \(3,\)"):
        step_totals(torch.ones(2, 5), keep=torch.ones(3))
    with pytest.raises(ValueError, match="it must be the generation limit, at least the padded"):
        step_totals(torch.ones(2, 5), max_len=3)


def test_the_per_sequence_mean_keeps_the_losses_dtype_whatever_the_masks():
    # a float64 (or bool) mask must not widen a float32 loss
    per_token = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    for mask in (
        torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float64),
        torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool),
    ):
        for agg in AGGS:
            out = losses.aggregate(agg, per_token, mask)
            assert out.dtype == torch.float32, (agg, mask.dtype, out.dtype)
        assert float(losses.aggregate("seq_mean_token_mean", per_token, mask)) == 2.25


def test_the_entropy_threshold_of_hand_picked_entropies():
    # valid entropies {0.25, 0.5} (0.75 is padding): ρ = 1 keeps every token, the threshold is
    # the smallest valid entropy (the 0-quantile); ρ = 0.5: the median of two, (0.25 + 0.5)/2
    ent = torch.tensor([[0.5, 0.25, 0.75]])
    mask = torch.tensor([[1, 1, 0]])
    assert losses.entropy_threshold(ent, mask, 1.0) == 0.25
    assert losses.entropy_threshold(ent, mask, 0.5) == 0.375
    # one valid token: it is its own threshold, whatever ρ; no valid token: None
    one = torch.tensor([[0, 1, 0]])
    assert losses.entropy_threshold(ent, one, 0.2) == 0.25
    assert losses.entropy_threshold(ent, torch.zeros(1, 3), 0.2) is None
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
            losses.entropy_threshold(ent, mask, bad)


def test_linear_quantile_between_the_last_two_values_and_on_its_inputs_device(
    under_wide_meta_defaults,
):
    # torch's rank q·(n − 1) = 0.5 between the only two values: 1 + 0.5·(3 − 1) = 2
    assert float(linear_quantile(torch.tensor([3.0, 1.0]), 0.5)) == 2.0
    # rank 0.9·3 = 2.7 between the two largest of four: 3 + 0.7·(7 − 3) = 5.8
    values = torch.tensor([7.0, 0.0, 3.0, 1.0], dtype=torch.float64)
    assert float(linear_quantile(values, 0.9)) == pytest.approx(5.8, abs=1e-12)
    # its rank tensor is made on the values' device (a default device of "meta" must not leak)
    got = under_wide_meta_defaults(linear_quantile, values.float(), 0.9)
    assert (got.device.type, got.dtype, float(got)) == ("cpu", torch.float32, pytest.approx(5.8))


@pytest.mark.parametrize("agg", list(losses.AGGREGATIONS))
def test_nan_and_inf_in_the_padding_never_reach_the_loss_or_its_gradient(
    agg, under_wide_meta_defaults
):
    # the hand values of test_hand_values with NaN / -inf padding instead of 100: a product with
    # the mask would give NaN (NaN · 0); the padded positions must get an exact 0 gradient
    want = {"token_mean": 2.5, "seq_mean_token_mean": 3.0, "seq_mean_token_sum_norm": 10 / 6}
    want.update(token_sum=10.0, seq_mean_token_sum=5.0, micro_token_mean=2.5)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), -float("inf")]])
    per_token.requires_grad_()
    out = under_wide_meta_defaults(losses.aggregate, agg, per_token, mask)
    assert (out.device.type, out.dtype) == ("cpu", torch.float32)
    assert float(out.detach()) == pytest.approx(want[agg], rel=1e-6)
    out.backward()
    assert per_token.grad[1, 1:].tolist() == [0.0, 0.0]
    assert bool(torch.isfinite(per_token.grad).all())
    # the same through the step's totals (a step of 8 tokens in 4 sequences, L_max 5, two
    # micro-batches): 10/8, (2 + 4)/4, 10/(4·5), 10, 10/4, 2.5/2
    totals = StepTotals(num_tokens=8.0, num_seqs=4.0, max_len=5.0, num_micro=2)
    want = {"token_mean": 1.25, "seq_mean_token_mean": 1.5, "seq_mean_token_sum_norm": 0.5}
    want.update(token_sum=10.0, seq_mean_token_sum=2.5, micro_token_mean=1.25)
    out = losses.aggregate(agg, per_token.detach(), mask, totals)
    assert float(out) == pytest.approx(want[agg], rel=1e-6)


def test_the_steps_entropy_threshold_counts_only_kept_valid_tokens():
    # kept valid tokens: row 0 {0.5, 0.25}, row 2 {1.0} (row 1 dropped, 4.0 and 2.0 padding):
    # the median (ρ = 0.5) of {0.25, 0.5, 1.0} is 0.5; with row 1's 8s or the padding it moves
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    keep = torch.tensor([True, False, True])
    ent = torch.tensor([[0.5, 0.25, 4.0], [8.0, 8.0, 8.0], [1.0, 2.0, 2.0]])
    one = step_totals(mask, keep=keep, entropies=ent, top_entropy_quantile=0.5)
    assert one.entropy_threshold == 0.5
    split = step_totals(
        [mask[:2], mask[2:]], keep=[keep[:2], keep[2:]], entropies=[ent[:2], ent[2:]],
        top_entropy_quantile=0.5,
    )  # fmt: skip
    assert split.entropy_threshold == 0.5
    # ρ = 1 (every token kept, the default) or no entropies: no threshold
    assert step_totals(mask, keep=keep, entropies=ent).entropy_threshold is None
    assert step_totals(mask, entropies=ent, top_entropy_quantile=1.0).entropy_threshold is None
    assert step_totals(mask, top_entropy_quantile=0.5).entropy_threshold is None
