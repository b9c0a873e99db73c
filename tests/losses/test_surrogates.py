"""Surrogates: hand-derived per-token values, gradients, stats and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl import losses

LN = math.log


def _one_token_rows(ratios: list[float], old: float = -1.0):
    """logp, old_logp as [N, 1] with the given ratios exp(logp - old)."""
    old_logp = torch.full((len(ratios), 1), old, dtype=torch.float64)
    logp = (
        old_logp + torch.tensor([[LN(r)] for r in ratios], dtype=torch.float64)
    ).requires_grad_()
    return logp, old_logp, torch.ones_like(old_logp)


# ----------------------------------------------------------------------------- ppo_clip


def test_ppo_clip_hand_values_both_signs_inside_and_outside():
    # eps_low 0.2, eps_high 0.28 -> clip range [0.8, 1.28]; loss = -min(ρA, clip(ρ)A)
    # row  ρ    A   ρA    clip(ρ)A   loss    d loss / d logp (= -Aρ when ρA is the min, else 0)
    # 0   1.5  +1   1.5   1.28      -1.28    0      (clipped high)
    # 1   1.5  -1  -1.5  -1.28       1.5     1.5    (A<0, ρ>1: no clip; the pessimistic bound)
    # 2   0.5  +1   0.5   0.8       -0.5    -0.5    (A>0, ρ<1: no clip)
    # 3   0.5  -1  -0.5  -0.8        0.8     0      (clipped low)
    # 4   1.1  +2   2.2   2.2       -2.2    -2.2    (inside)
    # 5   0.9  -3  -2.7  -2.7        2.7     2.7    (inside)
    logp, old, mask = _one_token_rows([1.5, 1.5, 0.5, 0.5, 1.1, 0.9])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0, -3.0], dtype=torch.float64)
    per_token, stats = losses.surrogate(
        "ppo_clip", logp, old, adv, mask, eps_low=0.2, eps_high=0.28
    )
    expect = torch.tensor([[-1.28], [1.5], [-0.5], [0.8], [-2.2], [2.7]], dtype=torch.float64)
    torch.testing.assert_close(per_token, expect, atol=1e-12, rtol=0)
    per_token.sum().backward()
    grad = torch.tensor([[0.0], [1.5], [-0.5], [0.0], [-2.2], [2.7]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, grad, atol=1e-12, rtol=0)
    # clip fractions (TRL's definitions): low = row 3, high = row 0, region = both, of 6 tokens
    assert stats["clip_frac_low"] == pytest.approx(1 / 6)
    assert stats["clip_frac_high"] == pytest.approx(1 / 6)
    assert stats["clip_frac_region"] == pytest.approx(2 / 6)
    assert stats["ratio_min"] == pytest.approx(0.5)
    assert stats["ratio_max"] == pytest.approx(1.5)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 1.5 + 0.5 + 0.5 + 1.1 + 0.9) / 6)


def test_ppo_clip_dual_clip_caps_negative_advantage_loss():
    # c = 3: for A < 0 the loss is min(ppo loss, -cA).
    # row  ρ   A    ppo loss = -min(ρA, clip(ρ,0.8,1.2)A)   -cA   final
    # 0    5  -1    -min(-5, -1.2) = 5                       3     3   (dual clip active, grad 0)
    # 1    2  -1    2                                        3     2   (grad = -Aρ = 2)
    # 2    5  +1    -min(5, 1.2) = -1.2                      -     -1.2 (A>0: dual clip not used)
    logp, old, mask = _one_token_rows([5.0, 2.0, 5.0])
    adv = torch.tensor([-1.0, -1.0, 1.0], dtype=torch.float64)
    per_token, stats = losses.ppo_clip(logp, old, adv, mask, clip_ratio_c=3.0)
    torch.testing.assert_close(
        per_token, torch.tensor([[3.0], [2.0], [-1.2]], dtype=torch.float64), atol=1e-12, rtol=0
    )
    per_token.sum().backward()
    torch.testing.assert_close(
        logp.grad, torch.tensor([[0.0], [2.0], [0.0]], dtype=torch.float64), atol=1e-12, rtol=0
    )
    assert stats["clip_frac_dual"] == pytest.approx(1 / 3)
    # without dual clip row 0 is 5
    per_token, _ = losses.ppo_clip(logp, old, adv, mask)
    assert float(per_token[0, 0].detach()) == pytest.approx(5.0)


def test_ppo_clip_on_policy_equals_minus_advantage():
    # ρ = 1 everywhere: loss = -A on every valid token, 0 on padding.
    logp = torch.randn(3, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    adv = torch.tensor([0.5, -2.0, 1.0])
    per_token, stats = losses.ppo_clip(logp, None, adv, mask)
    torch.testing.assert_close(per_token, -adv[:, None] * mask, atol=0, rtol=0)
    assert stats["ratio_mean"] == 1.0 and stats["clip_frac_region"] == 0.0


# ----------------------------------------------------------------------------- cispo


def test_cispo_hand_values_and_gradient_is_sg_weight_times_advantage():
    # eps 0.2 / 0.28: w = clip(ρ, 0.8, 1.28); loss = -w·A·logp; d/dlogp = -w·A (every token).
    # old = -1, so logp = -1 + ln ρ.
    # row ρ    A   w     logp            loss = -w A logp
    # 0  1.5  +1  1.28  -1+ln1.5=-0.5945  1.28*0.5945 = 0.76101
    # 1  0.5  -1  0.8   -1+ln0.5=-1.6931  -0.8*1.6931 = -1.35452
    # 2  1.0  +2  1.0   -1                 2.0
    logp, old, mask = _one_token_rows([1.5, 0.5, 1.0])
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    per_token, stats = losses.cispo(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    lp = logp.detach()[:, 0]
    w = torch.tensor([1.28, 0.8, 1.0], dtype=torch.float64)
    torch.testing.assert_close(per_token[:, 0], -w * adv * lp, atol=1e-12, rtol=0)
    assert float(per_token[0, 0].detach()) == pytest.approx(1.28 * (1 - LN(1.5)), abs=1e-12)
    per_token.sum().backward()
    # CISPO's gradient: sg(w)·A·∇logp (with the minus sign of a loss); clipped tokens keep it
    torch.testing.assert_close(logp.grad[:, 0], -w * adv, atol=1e-12, rtol=0)
    assert stats["clip_frac_high"] == pytest.approx(1 / 3)
    assert stats["clip_frac_low"] == pytest.approx(1 / 3)


def test_cispo_default_bounds_weight_in_0_6():
    # defaults eps_low 1.0, eps_high 5.0: ρ = 9 -> w = 6; ρ = 0.01 -> w = 0.01 (lower bound 0)
    logp, old, mask = _one_token_rows([9.0, 0.01])
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    per_token, _ = losses.cispo(logp, old, adv, mask)
    per_token.sum().backward()
    torch.testing.assert_close(
        logp.grad[:, 0], torch.tensor([-6.0, -0.01], dtype=torch.float64), atol=1e-12, rtol=0
    )


# ----------------------------------------------------------------------------- gspo


def test_gspo_sequence_ratio_hand_values():
    # one sequence, 2 tokens, log ratios 0.1 and 0.3 -> s = exp(0.2) = 1.221403; eps 0.2/0.2
    # A=+1: -min(1.2214, 1.2) = -1.2 on both tokens (clipped -> grad 0)
    # A=-1: -min(-1.2214, -1.2) = 1.221403 on both tokens
    old = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]], dtype=torch.float64)
    logp = (old + torch.tensor([[0.1, 0.3], [0.1, 0.3]], dtype=torch.float64)).requires_grad_()
    mask = torch.ones_like(old)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    per_token, stats = losses.gspo(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    s = math.exp(0.2)
    expect = torch.tensor([[-1.2, -1.2], [s, s]], dtype=torch.float64)
    torch.testing.assert_close(per_token, expect, atol=1e-12, rtol=0)
    assert stats["clip_frac_high"] == pytest.approx(0.5)


def test_gspo_gradient_equals_sequence_level_objective():
    # With seq_mean_token_mean, the GSPO-token gradient equals that of the sequence-level
    # loss -min(s_i A_i, clip(s_i) A_i) averaged over sequences (GSPO paper, eq. for s_i).
    torch.manual_seed(0)
    old = -torch.rand(3, 5, dtype=torch.float64) - 0.5
    delta = 0.05 * torch.randn(3, 5, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    logp = (old + delta).requires_grad_()
    per_token, _ = losses.gspo(logp, old, adv, mask, eps_low=0.03, eps_high=0.04)
    losses.aggregate("seq_mean_token_mean", per_token, mask).backward()
    logp2 = (old + delta).requires_grad_()
    s = torch.exp(((logp2 - old) * mask).sum(-1) / mask.sum(-1))
    seq_loss = -torch.minimum(s * adv, s.clamp(0.97, 1.04) * adv)
    seq_loss.mean().backward()
    torch.testing.assert_close(logp.grad, logp2.grad * mask, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------- reinforce


def test_reinforce_is_minus_advantage_times_logp():
    logp = torch.tensor([[-0.5, -1.5], [-2.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([2.0, -1.0])
    per_token, _ = losses.reinforce(logp, None, adv, mask)
    # row 0: -2·(-0.5), -2·(-1.5) = 1, 3; row 1: -(-1)(-2) = -2, padding 0
    torch.testing.assert_close(per_token, torch.tensor([[1.0, 3.0], [-2.0, 0.0]]), atol=0, rtol=0)
    per_token.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, -2.0], [1.0, 0.0]]), atol=0, rtol=0)


# ----------------------------------------------------------------------------- common

REQUIRED = {"dro": {"beta": 0.1}}
"""Parameters a surrogate has no default for (verl's dro_beta has none)."""


@pytest.mark.parametrize("name", list(losses.SURROGATES))
def test_padding_with_inf_never_leaks_nan(name):
    logp = torch.tensor([[-0.5, -float("inf")], [-1.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[-0.4, 0.0], [-1.1, -float("inf")]])
    mask = torch.tensor([[1, 0], [1, 0]])
    adv = torch.tensor([1.0, -1.0])
    per_token, stats = losses.surrogate(name, logp, old, adv, mask, **REQUIRED.get(name, {}))
    loss = losses.aggregate("token_mean", per_token, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 1] == 0 and logp.grad[1, 1] == 0
    assert all(math.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("name", list(losses.SURROGATES))
def test_per_sample_and_per_token_advantages_agree(name):
    torch.manual_seed(1)
    logp = -torch.rand(4, 6)
    old = logp + 0.1 * torch.randn(4, 6)
    mask = torch.ones(4, 6)
    adv = torch.randn(4)
    params = REQUIRED.get(name, {})
    a, _ = losses.surrogate(name, logp, old, adv, mask, **params)
    b, _ = losses.surrogate(name, logp, old, adv[:, None].expand(4, 6), mask, **params)
    # gmpo averages a per-token advantage over the sequence (verl's reading): float rounding
    tol = 1e-6 if name == "gmpo" else 0.0
    torch.testing.assert_close(a, b, atol=tol, rtol=0)


def _good():
    return torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda lp, old, a, m: (lp[0], old, a, m), r"logp must be \[N sequences"),
        (lambda lp, old, a, m: (lp, old[:, :2], a, m), "old_logp must have the shape"),
        (lambda lp, old, a, m: (lp, old, a, m[:, :2]), "mask must have the shape"),
        (lambda lp, old, a, m: (lp, old, torch.zeros(3), m), r"adv must be \[N\]"),
        (lambda lp, old, a, m: (lp, old, a, torch.zeros(2, 3)), "no valid token"),
        (
            lambda lp, old, a, m: (torch.full((2, 3), float("nan")), old, a, m),
            "logp has 6 non-finite",
        ),
        (
            lambda lp, old, a, m: (lp, old.index_fill(1, torch.tensor([0]), -float("inf")), a, m),
            "old_logp has 2 non-finite",
        ),
        (lambda lp, old, a, m: (lp, old, torch.tensor([0.0, float("nan")]), m), "adv has non-fin"),
    ],
)
@pytest.mark.parametrize("name", list(losses.SURROGATES))
def test_bad_input_raises_clear_value_error(name, change, message):
    args = change(*_good())
    with pytest.raises(ValueError, match=message):
        losses.surrogate(name, *args, **REQUIRED.get(name, {}))


def test_unknown_names_and_params():
    with pytest.raises(ValueError, match="valid surrogates: ppo_clip, cispo, gspo, reinforce"):
        losses.surrogate("ppo", *_good())
    with pytest.raises(ValueError, match="unexpected keyword"):
        losses.surrogate("reinforce", *_good(), eps_low=0.2)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        losses.surrogate("ppo_clip", *_good(), clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="clip bounds"):
        losses.surrogate("ppo_clip", *_good(), eps_low=-0.1)


# ----------------------------------------------------------------------------- loop parity


def _loop_reference(name, logp, old, adv, mask, eps_low, eps_high, c=None):
    """Plain Python per-token loops over lists of floats (no tensors)."""
    out = []
    for i, row in enumerate(logp):
        a = adv[i]
        valid = [t for t in range(len(row)) if mask[i][t]]
        seq_lr = sum(row[t] - old[i][t] for t in valid) / max(len(valid), 1)
        res = []
        for t in range(len(row)):
            if not mask[i][t]:
                res.append(0.0)
                continue
            lr = seq_lr if name == "gspo" else row[t] - old[i][t]
            r = math.exp(lr)
            clipped = min(max(r, 1 - eps_low), 1 + eps_high)
            if name == "cispo":
                res.append(-clipped * a * row[t])
                continue
            loss = -min(r * a, clipped * a)
            if c is not None and a < 0:
                loss = min(loss, -c * a)
            res.append(loss)
        out.append(res)
    return out


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 5),
    t=st.integers(1, 6),
    name=st.sampled_from(["ppo_clip", "cispo", "gspo"]),
    eps_low=st.floats(0.0, 0.9),
    eps_high=st.floats(0.0, 2.0),
    dual=st.booleans(),
)
def test_property_matches_plain_loop(data, n, t, name, eps_low, eps_high, dual):
    floats = st.floats(-3.0, 0.0, allow_nan=False)
    logp = data.draw(st.lists(st.lists(floats, min_size=t, max_size=t), min_size=n, max_size=n))
    old = data.draw(st.lists(st.lists(floats, min_size=t, max_size=t), min_size=n, max_size=n))
    adv = data.draw(st.lists(st.floats(-3.0, 3.0), min_size=n, max_size=n))
    mask = data.draw(
        st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=n, max_size=n)
    )
    mask[0][0] = True
    c = 3.0 if dual and name == "ppo_clip" else None
    params = {"eps_low": eps_low, "eps_high": eps_high}
    if c is not None:
        params["clip_ratio_c"] = c
    tensor = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    per_token, _ = losses.surrogate(
        name, tensor(logp), tensor(old), tensor(adv), tensor(mask), **params
    )
    expect = _loop_reference(name, logp, old, adv, mask, eps_low, eps_high, c)
    torch.testing.assert_close(per_token, tensor(expect), atol=1e-9, rtol=1e-9)


def test_bfloat16_logp_is_computed_in_float32():
    # ρ = e^0.01 = 1.01005 is not representable in bf16 (spacing 2^-7 near 1): computing the
    # ratio in bf16 would give 1.0078; we upcast, so the loss is -A·1.01005 exactly (float32)
    logp = torch.tensor([[-1.0]], dtype=torch.bfloat16)
    old = logp.float() - 0.01
    per_token, _ = losses.ppo_clip(logp.requires_grad_(), old, torch.ones(1), torch.ones(1, 1))
    assert per_token.dtype == torch.float32
    assert float(per_token.detach()) == pytest.approx(-math.exp(0.01), abs=1e-6)


# ----------------------------------------------------------------------------- update schedule


def _policy_logp(w: torch.Tensor, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[N, 1] log-probs of ``tokens`` under a linear softmax policy ``x @ w`` (V = w.shape[1])."""
    return torch.log_softmax(x @ w, dim=-1).gather(-1, tokens[:, None])


@pytest.mark.parametrize("name", ["ppo_clip", "cispo", "gspo"])
def test_clip_acts_only_after_an_optimizer_step(name):
    # One generation batch of 8 sequences, split into 2 minibatches. The first minibatch is
    # taken at the behaviour policy: ρ = 1 exactly, no clip. After one SGD step the second
    # minibatch sees ρ != 1, and with a large step some ratios leave the clip range.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    w = torch.randn(4, 6, generator=gen, dtype=torch.float64).requires_grad_()
    tokens = torch.randint(0, 6, (8,), generator=gen)
    adv = torch.tensor([1.0, -1.0] * 4, dtype=torch.float64)
    mask = torch.ones(8, 1, dtype=torch.float64)
    old = _policy_logp(w, x, tokens).detach()  # behaviour log-probs at sampling time
    params = {"ppo_clip": {}, "cispo": {"eps_low": 0.2, "eps_high": 0.2}, "gspo": {}}[name]
    first, second = slice(0, 4), slice(4, 8)
    per_token, stats = losses.surrogate(
        name, _policy_logp(w, x[first], tokens[first]), old[first], adv[first], mask[first],
        **params,
    )  # fmt: skip
    assert stats["ratio_min"] == stats["ratio_max"] == 1.0
    assert stats["clip_frac_region"] == 0.0
    per_token.sum().backward()
    with torch.no_grad():
        w -= 5.0 * w.grad  # a large step, so that the ratios leave [1 - eps, 1 + eps]
    _, stats = losses.surrogate(
        name, _policy_logp(w, x[second], tokens[second]), old[second], adv[second],
        mask[second], **params,
    )  # fmt: skip
    assert stats["ratio_max"] > 1.0 or stats["ratio_min"] < 1.0
    assert stats["clip_frac_region"] > 0.0


def test_on_policy_warning_names_the_schedule():
    for name in ("ppo_clip", "cispo", "gspo"):
        text = losses.on_policy_warning(name, 1, 1)
        assert text is not None and repr(name) in text and "ratio 1" in text
        assert "optim.minibatches=1, optim.ppo_epochs=1" in text
        assert losses.on_policy_warning(name, 2, 1) is None
        assert losses.on_policy_warning(name, 1, 4) is None
    assert losses.on_policy_warning("reinforce", 1, 1) is None
    assert {"ppo_clip", "cispo", "gspo"} <= losses.CLIPPED
    assert "clip_cov" not in losses.CLIPPED and "reinforce" not in losses.CLIPPED


def test_on_policy_note_is_one_line_without_advice():
    # a preset run at its own one-step schedule: the same fact, said once, nothing to fix
    note = losses.on_policy_note("ppo_clip", "grpo", 1, 1)
    assert note == (
        "grpo takes one optimizer step per generation batch, as its sources do: every step is "
        "on-policy (ratio 1), so the ppo_clip clip does not act"
    )
    assert "\n" not in note and "Set optim" not in note
    assert losses.on_policy_note("ppo_clip", "dapo", 16, 1) is None
    assert losses.on_policy_note("reinforce", "grpo", 1, 1) is None
