"""The parts of ``losses.objective``'s result a caller reads besides the loss: the zero result
of a fully dropped micro-batch, every statistic by hand, the unweighted KL branch under the
step's totals, the entropy bonus, the per-sequence input checks, and tensors that follow the
inputs' device and dtype rather than torch's defaults. Written against the survivors of the
mutation run (docs/mutation.md)."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl import losses

N, T = 4, 3


def _inputs(dtype=torch.float64):
    """Rows of 3, 2, 3, 1 tokens; on-policy (ratio 1) so the surrogate is −A per token."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=dtype)
    logp = torch.tensor(
        [[-0.5, -1.0, -0.2], [-0.3, -0.7, 0.0], [-1.2, -0.4, -0.9], [-0.6, 0.0, 0.0]],
        dtype=dtype,
        requires_grad=True,
    )
    ref = logp.detach() - torch.tensor(
        [[0.1, -0.2, 0.3], [0.0, 0.2, 0.0], [-0.1, 0.1, 0.2], [0.3, 0.0, 0.0]], dtype=dtype
    )
    adv = torch.tensor([1.0, -0.5, 0.25, 2.0], dtype=dtype)
    ent = torch.tensor(
        [[0.9, 0.8, 0.7], [0.6, 0.5, 9.0], [0.4, 0.3, 0.2], [0.1, 9.0, 9.0]], dtype=dtype
    )  # 9.0 at padding: must never count
    return logp, ref, adv, mask, ent


def test_a_fully_dropped_micro_batch_returns_exact_zeros_and_every_statistic():
    logp, ref, adv, mask, ent = _inputs()
    out = losses.objective(
        logp, logp.detach(), adv, mask, keep=torch.zeros(N, dtype=torch.bool), ref_logp=ref,
        beta=0.1, entropy=ent, entropy_coeff=0.01,
    )  # fmt: skip
    for part in (out.loss, out.pg_loss, out.kl_loss, out.entropy_bonus, out.kl_unweighted):
        assert isinstance(part, torch.Tensor) and part.shape == () and part.item() == 0.0
    assert out.per_token.shape == (N, T) and (out.per_token == 0).all()
    assert {"pg_loss", "kl_loss", "kl_mean", "entropy_mean", "kept_frac", "ratio_mean"} <= set(
        out.stats
    )
    assert all(value == 0.0 for value in out.stats.values()), out.stats
    out.loss.backward()  # connected to logp, adds nothing
    assert (logp.grad == 0).all()


def test_statistics_are_the_losses_and_token_means_of_the_kept_tokens():
    logp, ref, adv, mask, ent = _inputs()
    keep = torch.tensor([True, True, False, True])
    out = losses.objective(
        logp, logp.detach(), adv, mask, keep=keep, ref_logp=ref, kl="k1", beta=0.5,
        entropy=ent,
    )  # fmt: skip
    # kept rows 0, 1, 3: 3 + 2 + 1 = 6 tokens; on-policy ppo_clip per token = −A
    tokens = {0: 3, 1: 2, 3: 1}
    pg = sum(-adv[i].item() * k for i, k in tokens.items()) / 6
    d = logp.detach() - ref  # k1 per token
    kl_sum = sum(d[i, :k].sum().item() for i, k in tokens.items())
    ent_sum = sum(ent[i, :k].sum().item() for i, k in tokens.items())
    s = out.stats
    assert s["pg_loss"] == pytest.approx(pg, abs=1e-12)
    assert s["kl_loss"] == pytest.approx(0.5 * kl_sum / 6, abs=1e-12)
    assert s["kl_mean"] == pytest.approx(kl_sum / 6, abs=1e-12)
    assert s["entropy_mean"] == pytest.approx(ent_sum / 6, abs=1e-12)
    assert s["kept_frac"] == pytest.approx(3 / 4)
    assert out.loss.item() == pytest.approx(pg + 0.5 * kl_sum / 6, abs=1e-12)
    # entropy_coeff defaults to 0: logged, not trained
    assert float(out.entropy_bonus.detach()) == 0.0
    plain = losses.objective(logp, logp.detach(), adv, mask, keep=keep)
    assert plain.stats["kl_mean"] == 0.0 and plain.stats["entropy_mean"] == 0.0  # β = 0


def test_the_entropy_bonus_is_subtracted_with_its_coefficient():
    logp, _, adv, mask, ent = _inputs()
    out = losses.objective(logp, logp.detach(), adv, mask, entropy=ent, entropy_coeff=0.1)
    ent_mean = sum(ent[i, : int(mask[i].sum())].sum().item() for i in range(N)) / 9
    pg = sum(-adv[i].item() * int(mask[i].sum()) for i in range(N)) / 9
    assert float(out.entropy_bonus.detach()) == pytest.approx(0.1 * ent_mean, abs=1e-12)
    assert out.loss.item() == pytest.approx(pg - 0.1 * ent_mean, abs=1e-12)


def test_the_unweighted_kl_branch_is_normalised_by_the_steps_totals():
    # a micro-batch of a 20-token step: every branch divides by the step's 20 tokens
    logp, ref, adv, mask, _ = _inputs()
    totals = losses.StepTotals(num_tokens=20.0, num_seqs=8.0, max_len=3.0)
    weight = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    out = losses.objective(
        logp, logp.detach(), adv, mask, totals=totals, ref_logp=ref, kl="k1", beta=0.5,
        kl_weight=weight,
    )  # fmt: skip
    d = (logp.detach() - ref) * mask
    assert float(out.kl_unweighted.detach()) == pytest.approx(float(d.sum()) / 20, abs=1e-12)
    assert float(out.kl_loss.detach()) == pytest.approx(0.5 * float((d.sum(1) * weight).sum()) / 20)


def test_per_sequence_inputs_are_checked_and_the_error_says_what_came():
    logp, ref, adv, mask, _ = _inputs()
    old = logp.detach()
    for name, kw in (
        ("keep", {}),
        ("kl_weight", {"beta": 0.1, "ref_logp": ref}),
    ):
        with pytest.raises(ValueError, match=rf"{name} must be \[N\]=4 .*, got \(3,\);"):
            losses.objective(logp, old, adv, mask, **{name: torch.ones(3)}, **kw)
        with pytest.raises(ValueError, match=rf"{name} must be \[N\]=4 .*, got list;"):
            losses.objective(logp, old, adv, mask, **{name: [1.0] * N}, **kw)
    with pytest.raises(ValueError, match=r"correction_weight must be .* got \(3,\)"):
        losses.objective(logp, old, adv, mask, correction_weight=torch.ones(3))
    with pytest.raises(ValueError, match=r"correction_weight must be .* got list"):
        losses.objective(logp, old, adv, mask, correction_weight=[1.0] * N)
    with pytest.raises(ValueError, match=r"logp must be a \[N, T\] tensor"):
        losses.objective(logp[0], old[0], adv[:1], mask[0])
    with pytest.raises(ValueError, match="mask must have the shape of logp"):
        losses.objective(logp, old, adv, mask[:, :2])
    with pytest.raises(ValueError, match=r"mask must have the shape of logp \(4, 3\)"):
        losses.objective(logp, old, adv, mask.tolist())  # not a tensor: no .shape to read


def test_a_per_sequence_correction_weight_scales_each_rows_surrogate():
    # [N] weights with N = 4 rows of T = 3 tokens: row i's per-token surrogate times w_i
    logp, _, adv, mask, _ = _inputs()
    w = torch.tensor([0.5, 2.0, 1.0, 0.0], dtype=torch.float64)
    out = losses.objective(logp, logp.detach(), adv, mask, correction_weight=w)
    expect = (-adv * w)[:, None] * mask
    torch.testing.assert_close(out.per_token, expect, rtol=0, atol=1e-12)


def test_tensors_follow_the_inputs_device_and_dtype_not_torchs_defaults():
    # float32 CPU inputs under a default device of "meta" and a default dtype of float64: a
    # tensor made without an explicit device or dtype would land on meta (and fail) or
    # turn the float32 results into float64
    logp, ref, adv, mask, ent = (t.detach().float() for t in _inputs())
    logp.requires_grad_()
    wide = torch.tensor([1.0, 2.0, 0.5, 1.0], dtype=torch.float64)
    none_kept = torch.zeros(N, dtype=torch.bool)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            out = losses.objective(
                logp, None, adv, mask, ref_logp=ref, beta=0.1, kl_weight=wide, entropy=ent,
                entropy_coeff=0.01, correction_weight=wide,
            )  # fmt: skip
            empty = losses.objective(logp, None, adv, mask, keep=none_kept)
    finally:
        torch.set_default_dtype(old_dtype)
    for t in (out.loss, out.per_token, out.kl_loss, out.entropy_bonus, out.kl_unweighted):
        assert t.device.type == "cpu" and t.dtype == torch.float32, (t.device, t.dtype)
    assert empty.loss.device.type == "cpu" and math.isfinite(float(out.loss.detach()))


def _one_token(old: float):
    """One token, logp = log 0.5, ref = logp − 0.5, A = 0 (no surrogate gradient)."""
    logp = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    ref = logp.detach() - 0.5
    return logp, torch.tensor([[old]], dtype=torch.float64), ref


def test_the_straight_through_kl_correction_by_hand():
    # ρ = π/π_old = 0.5/0.25 = 2; value: k3 of ref − logp = −0.5, e^(−0.5) + 0.5 − 1; gradient
    # (OpenRLHF unbiased_gradient): min(ρ, clip)·(logp − ref) = 2·0.5 = 1 under the default
    # cap (10), or 0.5·0.5 = 0.25 with the weight capped at 0.5 (any cap > 0)
    k3 = math.exp(-0.5) - 0.5
    for clip, grad in (({}, 1.0), ({"kl_weight_clip": 0.5}, 0.25)):
        logp, old, ref = _one_token(math.log(0.25))
        out = losses.objective(
            logp, old, torch.zeros(1, dtype=torch.float64), torch.ones(1, 1), ref_logp=ref,
            beta=1.0, kl_correction="straight_through", **clip,
        )  # fmt: skip
        assert float(out.kl_loss.detach()) == pytest.approx(k3, rel=1e-12)
        out.loss.backward()
        assert float(logp.grad) == pytest.approx(grad, rel=1e-12)
    # the cap must be positive for the straight-through weight, and is not read by the others
    logp, old, ref = _one_token(math.log(0.25))
    kw = dict(ref_logp=ref, beta=1.0, kl_weight_clip=0.0)
    adv, mask = torch.zeros(1, dtype=torch.float64), torch.ones(1, 1)
    with pytest.raises(ValueError, match=r"kl_weight_clip must be > 0, got 0\.0"):
        losses.objective(logp, old, adv, mask, kl_correction="straight_through", **kw)
    ratio = losses.objective(logp, old, adv, mask, kl_correction="ratio", **kw)
    assert float(ratio.kl_loss.detach()) == pytest.approx(2 * k3, rel=1e-12)  # ρ·k3


@pytest.mark.parametrize("correction", [None, "ratio", "sequence_ratio", "straight_through"])
def test_wider_reference_and_entropy_tensors_do_not_widen_a_float32_loss(correction):
    # float64 ref_logp / old_logp / entropy beside a float32 logp: every branch is computed in
    # the loss's dtype (float32), so the loss stays float32
    logp, ref, adv, mask, ent = _inputs()
    logp32 = logp.detach().float().requires_grad_()
    out = losses.objective(
        logp32, logp.detach() - 0.1, adv.float(), mask.float(), ref_logp=ref, beta=0.1,
        kl_correction=correction, entropy=ent, entropy_coeff=0.01,
    )  # fmt: skip
    for part in ("loss", "kl_loss", "kl_unweighted", "entropy_bonus", "per_token"):
        assert getattr(out, part).dtype == torch.float32, (part, getattr(out, part).dtype)


def test_a_reference_of_the_wrong_shape_or_type_is_refused_and_named():
    logp, ref, adv, mask, _ = _inputs()
    with pytest.raises(ValueError, match=r"shape of logp \(4, 3\), got \(4, 2\)"):
        losses.objective(logp, None, adv, mask, ref_logp=ref[:, :2], beta=0.1)
    with pytest.raises(ValueError, match=r"ref_logp must have the shape .* got <class 'list'>"):
        losses.objective(logp, None, adv, mask, ref_logp=ref.tolist(), beta=0.1)


@pytest.mark.parametrize("correction", ["ratio", "sequence_ratio", "straight_through"])
def test_a_kl_correction_without_old_logp_is_on_policy(correction):
    # old_logp=None means π_old = π: ρ = 1 (its value), so every correction's value is k3's,
    # e^(−0.5) + 0.5 − 1 for the one token
    logp, _, ref = _one_token(0.0)
    out = losses.objective(
        logp, None, torch.zeros(1, dtype=torch.float64), torch.ones(1, 1), ref_logp=ref,
        beta=1.0, kl_correction=correction,
    )  # fmt: skip
    assert float(out.kl_loss.detach()) == pytest.approx(math.exp(-0.5) - 0.5, rel=1e-12)


@pytest.mark.parametrize("correction", [None, "ratio", "sequence_ratio", "straight_through"])
def test_nan_and_inf_padding_change_nothing_in_any_branch(correction, under_wide_meta_defaults):
    # -inf log-probs, NaN reference / behaviour log-probs and NaN entropies at the padded
    # positions (a model's padding may hold them): every branch, the loss and the gradient are
    # those of the same batch with finite padding, and the padding's gradient is exactly 0
    def run(pad_logp, pad_other):
        logp, ref, adv, mask, ent = (t.detach().float() for t in _inputs())
        pad = mask == 0
        logp, ref = logp.masked_fill(pad, pad_logp), ref.masked_fill(pad, pad_other)
        old = (logp.detach() - 0.1).masked_fill(pad, pad_other)
        ent = ent.masked_fill(pad, pad_other)
        logp.requires_grad_()
        out = under_wide_meta_defaults(
            losses.objective, logp, old, adv, mask, ref_logp=ref, beta=0.1, entropy=ent,
            entropy_coeff=0.01, kl_correction=correction, top_entropy_quantile=0.5,
        )  # fmt: skip
        out.loss.backward()
        parts = ("loss", "pg_loss", "kl_loss", "kl_unweighted", "entropy_bonus")
        return [float(getattr(out, p).detach()) for p in parts], logp.grad, out.stats

    clean, clean_grad, clean_stats = run(0.0, 0.0)
    dirty, dirty_grad, dirty_stats = run(-math.inf, math.nan)
    assert dirty == clean and dirty_stats == clean_stats
    assert torch.equal(dirty_grad, clean_grad)
    assert dirty_grad.dtype == torch.float32 and (dirty_grad[_inputs()[3] == 0] == 0).all()


def test_the_top_entropy_mask_keeps_the_tokens_at_the_threshold():
    # entropies 0.25, 0.5, 1.0, ρ = 0.5: the threshold is the median 0.5 and a token whose
    # entropy equals it is kept ("at least the quantile"): tokens 2 and 3. On-policy with A = 1
    # each kept token's surrogate is −1; token_mean keeps all 3 tokens in the normaliser:
    # pg_loss = −2/3, entropy_mask_frac = 2/3; the bonus acts on the kept tokens only:
    # 0.1·(0.5 + 1.0)/3 = 0.05
    logp = torch.tensor([[-0.5, -1.0, -0.2]], dtype=torch.float64, requires_grad=True)
    ent = torch.tensor([[0.25, 0.5, 1.0]], dtype=torch.float64)
    out = losses.objective(
        logp, logp.detach(), torch.ones(1, dtype=torch.float64), torch.ones(1, 3),
        entropy=ent, top_entropy_quantile=0.5, entropy_coeff=0.1,
    )  # fmt: skip
    assert float(out.pg_loss.detach()) == pytest.approx(-2 / 3, rel=1e-12)
    assert float(out.entropy_bonus.detach()) == pytest.approx(0.05, rel=1e-12)
    assert out.stats["entropy_mask_frac"] == pytest.approx(2 / 3, rel=1e-12)
    assert out.per_token.detach()[0].tolist() == pytest.approx([0.0, -1.05, -1.1], rel=1e-12)


def test_large_finite_weights_whose_sum_overflows_are_accepted_and_zero_weights_too():
    # float32 weights 3e38 + 3e38 overflow the quick check's sum (inf): the element-wise check
    # then decides, and finite weights >= 0 (0 included) pass. Rows with A = 0 stay 0 whatever
    # their weight; row 3 (one token, A = 2, weight 1): −2
    logp, _, _, mask, _ = (t.detach().float() for t in _inputs())
    adv = torch.tensor([0.0, 0.0, 0.25, 2.0])
    w = torch.tensor([3e38, 3e38, 0.0, 1.0])
    out = losses.objective(logp, logp, adv, mask, correction_weight=w)
    assert out.per_token.tolist() == [[0.0] * 3, [0.0] * 3, [0.0] * 3, [-2.0, 0.0, 0.0]]
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="correction_weight must be finite and >= 0"):
            losses.objective(logp, logp, adv, mask, correction_weight=w.clone().fill_(bad))


@pytest.mark.parametrize("coeff", [0.01, 0.5])
def test_the_entropy_bonus_acts_without_statistics_too(coeff):
    # the trainer asks for no statistics (stats=False); the bonus must still act. The valid
    # entropies sum to 0.9+0.8+0.7 + 0.6+0.5 + 0.4+0.3+0.2 + 0.1 = 4.5 over 9 tokens: token mean
    # 0.5, bonus coeff·0.5, subtracted from the loss
    logp, _, adv, mask, ent = _inputs()
    out = losses.objective(
        logp, logp.detach(), adv, mask, entropy=ent, entropy_coeff=coeff, stats=False
    )
    assert out.stats == {}
    assert float(out.entropy_bonus.detach()) == pytest.approx(coeff * 0.5, rel=1e-12)
    assert float(out.loss.detach()) == pytest.approx(
        float(out.pg_loss.detach()) - coeff * 0.5, rel=1e-12
    )
