"""Edges of the surrogates and KL estimators: the clamps that keep values and gradients
finite far off-policy, the default bounds, per-sequence clip bounds, exact ties at the dual
clip, statistics of every surrogate, input errors that name what came, and results that keep
the inputs' device and dtype. Written against the survivors of the mutation run
(docs/mutation.md)."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl import losses
from grouprl.losses import surrogates


def test_k3_is_finite_in_value_and_gradient_far_from_the_reference():
    # ref − logp = +100: exp(100) overflows float32; ref − logp is clamped at 20 first, then
    # the value at 10, so the value is 10 and its gradient 0 (not 0·∞ = NaN)
    logp = torch.zeros(1, 2, requires_grad=True)
    ref = torch.tensor([[100.0, -100.0]])
    k = losses.kl("k3", logp, ref)
    assert k.tolist() == [[10.0, 10.0]]
    k.sum().backward()
    assert (logp.grad == 0).all()


def test_kl_and_token_entropy_inputs():
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"shape of logp \(2, 3\), got \(3,\)"):
        losses.kl("k1", logp, torch.zeros(3))
    with pytest.raises(ValueError, match=r"shape of logp \(2, 3\), got <class 'list'>"):
        losses.kl("k1", logp, [0.0, 0.0])
    # [N, T, V] logits: the entropy is over the last axis (V = 4 here, T = 2)
    logits = torch.log(torch.tensor([[[0.25] * 4, [1.0, 0.0, 0.0, 0.0]]]) + 1e-30)
    h = losses.token_entropy(logits.expand(3, 2, 4))
    torch.testing.assert_close(h, torch.tensor([[math.log(4), 0.0]] * 3), atol=1e-6, rtol=0)


def test_surrogate_inputs_are_named_in_their_errors():
    logp, mask, adv = torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2)
    for name, args in (
        ("logp", ([[0.0]], None, adv, mask)),
        ("adv", (logp, None, [0.0, 0.0], mask)),
        ("mask", (logp, None, adv, [[1.0]])),
    ):
        with pytest.raises(ValueError, match=rf"^{name} must be a torch.Tensor, got list"):
            losses.surrogate("ppo_clip", *args)
    with pytest.raises(ValueError, match=r"old_logp must have the shape of logp \(2, 3\), got"):
        losses.surrogate("ppo_clip", logp, torch.zeros(2, 2), adv, mask)
    with pytest.raises(ValueError, match=r"old_logp must .*, got list;"):
        losses.surrogate("ppo_clip", logp, [[0.0]], adv, mask)


def test_far_off_policy_ratios_are_clamped_at_exp_20_in_value_and_gradient():
    # log ρ = ±100: ρ is exp(±20), never 0 or ∞; the gradient stays finite
    for name in ("ppo_clip", "cispo"):
        logp = torch.tensor([[100.0, -100.0]], dtype=torch.float64, requires_grad=True)
        old = torch.zeros(1, 2, dtype=torch.float64)
        adv = torch.tensor([1.0], dtype=torch.float64)
        per_token, stats = losses.surrogate(name, logp, old, adv, torch.ones(1, 2))
        assert stats["ratio_max"] == pytest.approx(math.exp(20), rel=1e-12)
        assert stats["ratio_min"] == pytest.approx(math.exp(-20), rel=1e-12)
        per_token.sum().backward()
        assert torch.isfinite(logp.grad).all()
    # ppo_clip, A > 0 at ρ = exp(−20) < 1 − ε: the unclipped term −A·ρ, not 0
    logp = torch.tensor([[-100.0]], dtype=torch.float64)
    per_token, _ = losses.surrogate(
        "ppo_clip", logp, torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1)
    )
    assert float(per_token) == pytest.approx(-math.exp(-20), rel=1e-12)


def test_default_bounds_of_ppo_clip_gspo_and_the_dual_clip():
    one = torch.ones(1, 1, dtype=torch.float64)
    # ppo_clip defaults 0.2 / 0.2: A < 0 at ρ = 0.5 is cut at 0.8 -> loss −A·0.8, no gradient
    logp = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    per_token, stats = losses.surrogate("ppo_clip", logp, one * 0, -one[0], one)
    assert per_token.item() == pytest.approx(0.8) and stats["clip_frac_low"] == 1.0
    # GSPO defaults 3e-4 / 4e-4 on the sequence ratio: s = 1.001 with A > 0 is cut, s =
    # 0.999 with A < 0 is cut, and log s is capped at 10
    for s, a, key in ((1.001, 1.0, "clip_frac_high"), (0.999, -1.0, "clip_frac_low")):
        lp = torch.full((1, 2), math.log(s), dtype=torch.float64, requires_grad=True)
        pt, st = losses.surrogate(
            "gspo", lp, torch.zeros(1, 2), torch.tensor([a]), torch.ones(1, 2)
        )
        bound = 1 + 4e-4 if a > 0 else 1 - 3e-4
        assert pt[0].tolist() == pytest.approx([-a * bound] * 2) and st[key] == 1.0
        pt.sum().backward()
        assert (lp.grad == 0).all()
    lp = torch.full((1, 2), 10.5, dtype=torch.float64)
    pt, st = losses.surrogate("gspo", lp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2))
    assert pt[0].tolist() == pytest.approx([math.exp(10.0)] * 2)
    assert st["approx_kl"] == pytest.approx(-10.5)
    # the dual clip: c must be > 1 (1.5 is valid, 1.0 is not)
    losses.surrogate("ppo_clip", logp.detach(), one * 0, -one[0], one, clip_ratio_c=1.5)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        losses.surrogate("ppo_clip", logp.detach(), one * 0, -one[0], one, clip_ratio_c=1.0)


def test_the_dual_clip_counts_only_tokens_strictly_above_its_cap():
    # A = −1 at ρ = 2 exactly with c = 2: the loss equals the cap (not above it), and a token
    # with A = 0 is never dual-clipped
    logp = torch.tensor([[math.log(2.0)], [math.log(2.0)]], dtype=torch.float64)
    adv = torch.tensor([-1.0, 0.0], dtype=torch.float64)
    pt, stats = losses.surrogate(
        "ppo_clip", logp, torch.zeros(2, 1), adv, torch.ones(2, 1), clip_ratio_c=2.0
    )
    assert pt.tolist() == [[2.0], [0.0]] and stats["clip_frac_dual"] == 0.0


def test_per_sequence_clip_bounds():
    # [N] bounds (AGPO's per-prompt ε) with N = 2 rows of T = 3 tokens; ρ = 1.3, A > 0:
    # row 0 (ε = 0.5) keeps −A·ρ, row 1 (ε = 0.1) is cut at 1.1; a bound of 0 is valid
    logp = torch.full((2, 3), math.log(1.3), dtype=torch.float64, requires_grad=True)
    adv = torch.ones(2, dtype=torch.float64)
    eps = torch.tensor([0.5, 0.1], dtype=torch.float64)
    pt, stats = losses.surrogate(
        "ppo_clip", logp, torch.zeros(2, 3), adv, torch.ones(2, 3), eps_low=eps, eps_high=eps
    )
    torch.testing.assert_close(pt, torch.tensor([[-1.3] * 3, [-1.1] * 3], dtype=torch.float64))
    assert stats["clip_frac_high"] == pytest.approx(0.5)
    zero = torch.zeros(2, dtype=torch.float64)
    losses.surrogate("ppo_clip", logp, None, adv, torch.ones(2, 3), eps_low=zero, eps_high=eps)
    for bad in (torch.tensor([0.2, -0.1]), torch.tensor([0.2, math.inf])):
        with pytest.raises(ValueError, match="clip bounds must be >= 0"):
            losses.surrogate("ppo_clip", logp, None, adv, torch.ones(2, 3), eps_low=bad)
    with pytest.raises(ValueError, match=r"a tensor clip bound must be \[N\]=2"):
        losses.surrogate("ppo_clip", logp, None, adv, torch.ones(2, 3), eps_high=torch.ones(3))


def test_cispo_counts_ratios_strictly_outside_its_bounds():
    # ρ = 0.5 and 2.0 exactly with bounds [0.5, 2.0]: on the bounds, not outside
    logp = torch.tensor([[math.log(0.5), math.log(2.0)]], dtype=torch.float64)
    _, stats = losses.surrogate(
        "cispo", logp, torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), eps_low=0.5,
        eps_high=1.0,
    )  # fmt: skip
    assert stats["clip_frac_low"] == 0.0 and stats["clip_frac_high"] == 0.0


def test_reinforce_reports_the_ratio_to_the_behaviour_policy():
    logp = torch.tensor([[-0.5, -1.0]], dtype=torch.float64)
    old = torch.tensor([[-0.7, -1.0]], dtype=torch.float64)
    _, stats = losses.surrogate("reinforce", logp, old, torch.ones(1), torch.ones(1, 2))
    assert stats["ratio_max"] == pytest.approx(math.exp(0.2))
    assert stats["ratio_mean"] == pytest.approx((math.exp(0.2) + 1) / 2)
    assert stats["approx_kl"] == pytest.approx(-0.1)


def test_results_keep_the_inputs_dtype_and_device_whatever_the_defaults():
    # float32 CPU log-probs with float64 advantages and bounds, under a default dtype of
    # float64 and a default device of "meta": every result stays float32 on the CPU
    logp = torch.tensor([[-0.5, -1.0], [-0.2, -0.3]], requires_grad=True)
    old = logp.detach() - 0.1
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    eps = torch.tensor([0.2, 0.3], dtype=torch.float64)
    mask = torch.ones(2, 2)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            out = [
                losses.surrogate("ppo_clip", logp, old, adv, mask, eps_low=eps, eps_high=eps)[0],
                losses.surrogate("ppo_clip", logp, old, adv, mask, clip_ratio_c=3.0)[0],
                losses.surrogate("cispo", logp, old, adv, mask)[0],
                losses.surrogate("reinforce", logp, old, adv, mask)[0],
            ]
    finally:
        torch.set_default_dtype(old_dtype)
    for t in out:
        assert t.device.type == "cpu" and t.dtype == torch.float32, (t.device, t.dtype)


def test_the_on_policy_warning_says_why_and_what_to_set():
    note = surrogates.on_policy_warning("ppo_clip", 1, 1)
    assert "never acts and the update is REINFORCE with these advantages. Set " in note
    assert "optim.ppo_epochs above 1 for the clip to act (DAPO and CISPO take 16 " in note
    assert note.endswith("GSPO 4, AGPO 4 epochs).")
    assert surrogates.on_policy_warning("ppo_clip", 2, 1) is None
    assert surrogates.on_policy_warning("reinforce", 1, 1) is None
