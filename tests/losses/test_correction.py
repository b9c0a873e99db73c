"""Rollout correction: hand-derived weights and masks, composition with the objective,
exactness under gradient accumulation, on-policy identity, and clear errors.

Every hand case writes its log-ratios as logs of round numbers, so the expected weights are
read off directly (log ρ = ln 3 -> ρ = 3, ...).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl import losses
from grouprl.losses import correction as C

LN = math.log


def _one(spec, log_ratio, mask=None, adv=None, **kw):
    """compute() with train = log_ratio + a fixed offset and rollout = that offset."""
    lr = torch.tensor(log_ratio, dtype=torch.float64)
    base = torch.full_like(lr, -1.3)
    m = torch.ones_like(lr) if mask is None else torch.tensor(mask, dtype=torch.float64)
    a = None if adv is None else torch.tensor(adv, dtype=torch.float64)
    return C.compute(spec, base + lr, base, m, adv=a, **kw)


def _close(got, want, atol=1e-9):
    torch.testing.assert_close(
        got.double(), torch.tensor(want, dtype=torch.float64), atol=atol, rtol=0
    )


# --------------------------------------------------------------------------- hand cases
TOKEN_ROW = [[LN(3), LN(0.5), 0.0, LN(0.4)]]  # ratios 3, 0.5, 1, 0.4


def test_token_tis_hand_values():
    c = _one(("token_tis", {"cap": 2.0}), TOKEN_ROW)
    _close(c.weight, [[2.0, 0.5, 1.0, 0.4]])  # min(rho, 2)
    assert c.stats["corr/token_tis/truncated_frac"] == pytest.approx(0.25)
    c = _one(("token_tis", {"cap": 2.0, "cap_low": 0.5}), TOKEN_ROW)
    _close(c.weight, [[2.0, 0.5, 1.0, 0.5]])  # TRL token_truncate clips both ends
    assert c.stats["corr/token_tis/truncated_frac"] == pytest.approx(0.5)  # 3 and 0.4
    assert c.keep.all()


def test_token_mis_and_icepop_hand_values():
    c = _one(("token_mis", {"cap": 2.5, "cap_low": 0.45}), TOKEN_ROW)
    _close(c.weight, [[0.0, 0.5, 1.0, 0.0]])  # outside [0.45, 2.5] -> 0, inside keeps rho
    assert c.stats["corr/token_mis/zeroed_frac"] == pytest.approx(0.5)
    c = _one("icepop", TOKEN_ROW)  # [0.5, 5]
    _close(c.weight, [[3.0, 0.5, 1.0, 0.0]])
    assert c.stats["corr/zeroed_frac"] == pytest.approx(0.25)
    assert c.keep.all()  # zero weight, the token stays in the normaliser


SEQ_ROWS = [[LN(2), LN(2), 0.0], [LN(0.5), 7.0, -7.0]]  # row 1 has one valid token
SEQ_MASK = [[1, 1, 1], [1, 0, 0]]


def test_sequence_weights_hand_values():
    c = _one(("seq_tis", {"cap": 2.0}), SEQ_ROWS, SEQ_MASK)  # products 4 and 0.5
    _close(c.weight, [[2.0, 2.0, 2.0], [0.5, 0.0, 0.0]])  # padding gets 0, not its 7.0
    assert c.stats["corr/seq_tis/truncated_frac"] == pytest.approx(0.5)  # per sequence
    assert c.stats["corr/seq_tis/weight_mean"] == pytest.approx(1.25)  # (2 + 0.5) / 2 seqs
    c = _one("seq_mis", SEQ_ROWS, SEQ_MASK)  # cap 3: the product 4 is masked
    _close(c.weight, [[0.0, 0.0, 0.0], [0.5, 0.0, 0.0]])
    assert c.stats["corr/seq_mis/zeroed_frac"] == pytest.approx(0.5)


def test_batch_normalisation_hand_values():
    # sequence level: weights 2 and 0.5, mean over sequences 1.25
    c = _one(("seq_tis", {"cap": 2.0, "batch_normalize": True}), SEQ_ROWS, SEQ_MASK)
    _close(c.weight, [[1.6, 1.6, 1.6], [0.4, 0.0, 0.0]])
    assert c.stats["corr/seq_tis/batch_norm_factor"] == pytest.approx(1.25)
    # token level: weights 2, 0.5, 1, 0.4, mean 0.975 over tokens
    c = _one(("token_tis", {"cap": 2.0, "batch_normalize": True}), TOKEN_ROW)
    _close(c.weight, [[2 / 0.975, 0.5 / 0.975, 1 / 0.975, 0.4 / 0.975]])


REJ_ROWS = [[0.1, -0.1, 0.3], [0.5, 0.0, 0.0]]


@pytest.mark.parametrize(
    ("params", "keep"),
    [
        # k2 = lr^2 / 2: 0.005 0.005 0.045 | 0.125 0 0; reject above 0.02
        ({"stat": "k2", "level": "token", "threshold": 0.02}, [[1, 1, 0], [0, 1, 1]]),
        # k1 sum 0.3 | 0.5 against [ln(1/1.5), ln 1.5] = [-0.405, 0.405]
        ({"stat": "k1", "level": "seq_sum", "threshold": 1.5}, [[1, 1, 1], [0, 0, 0]]),
        # k1 mean 0.1 | 0.1667 against ln 1.15 = 0.1398
        ({"stat": "k1", "level": "seq_mean", "threshold": 1.15}, [[1, 1, 1], [0, 0, 0]]),
        # k3 = e^x - 1 - x; max 0.0499 (x = 0.3) | 0.1487 (x = 0.5); reject above 0.1
        ({"stat": "k3", "level": "seq_max", "threshold": 0.1}, [[1, 1, 1], [0, 0, 0]]),
        # k3 sum: 0.0052 + 0.0048 + 0.0499 = 0.0599 | 0.1487 -> both under 0.2
        ({"stat": "k3", "level": "seq_sum", "threshold": 0.2}, [[1, 1, 1], [1, 1, 1]]),
    ],
)
def test_rejection_hand_values(params, keep):
    c = _one(("rejection", params), REJ_ROWS)
    assert c.keep.tolist() == [[bool(x) for x in row] for row in keep]
    _close(c.weight, [[1.0] * 3] * 2)  # rejection never weights
    rejected = 6 - sum(map(sum, keep))
    assert c.stats["corr/rejection/rejected_frac"] == pytest.approx(rejected / 6)


def test_k1_bounds_two_readings_differ_only_for_asymmetric_bounds():
    # bounds [0.9, 2.0] on the ratio: log rho in [-0.105, 0.693] keeps every token;
    # on 1/ratio (verl 0.9.1's code): log rho in [-0.693, 0.105] drops 0.3 and 0.5
    asym = {"stat": "k1", "level": "token", "threshold": 2.0, "low": 0.9}
    ratio = _one(("rejection", asym), REJ_ROWS)
    inverse = _one(("rejection", {**asym, "k1_bounds_on": "inverse_ratio"}), REJ_ROWS)
    assert ratio.keep.all()
    assert inverse.keep.tolist() == [[True, True, False], [False, True, True]]
    sym = {"stat": "k1", "level": "token", "threshold": 1.2}  # low = 1/1.2
    a = _one(("rejection", sym), REJ_ROWS)
    b = _one(("rejection", {**sym, "k1_bounds_on": "inverse_ratio"}), REJ_ROWS)
    assert torch.equal(a.keep, b.keep) and not a.keep.all()


def test_geo_rs_is_seq_mean_k1():
    rows = [[0.002, 0.0], [0.0005, -0.0005]]  # geometric means e^0.001 (> 1.001?) and 1
    c = _one("geo_rs", rows)
    # e^0.001 = 1.0010005 > 1.001: the first sequence is dropped
    assert c.keep.tolist() == [[False, False], [True, True]]


def test_opsm_hand_values():
    # drift = mean(log rollout - log current) = -mean(log rho): 1, 1, -0.2, 1
    rows = [[-1.0, -1.0], [-1.0, -1.0], [0.2, 0.2], [-1.0, -1.0]]
    adv = [-1.0, 1.0, -1.0, 0.0]  # the last: a NaN-reward row, advantage 0 -> kept (A >= 0)
    c = _one(("opsm", {"threshold": 0.5}), rows, adv=adv)
    _close(c.weight, [[0, 0], [1, 1], [1, 1], [1, 1]])
    assert c.keep.all()  # zero weight, kept in the normaliser as TRL does
    assert c.stats["corr/opsm/zeroed_frac"] == pytest.approx(0.25)


def test_chain_multiplies_weights_and_ands_keeps():
    spec = "seq_tis:cap=2+rejection:stat=k2,level=token,threshold=0.02"
    c = _one(spec, REJ_ROWS)
    a = _one(("seq_tis", {"cap": 2.0}), REJ_ROWS)
    b = _one(("rejection", {"stat": "k2", "level": "token", "threshold": 0.02}), REJ_ROWS)
    torch.testing.assert_close(c.weight, a.weight * b.weight)
    assert torch.equal(c.keep, a.keep & b.keep)
    assert "corr/seq_tis/truncated_frac" in c.stats and "corr/rejection/rejected_frac" in c.stats


def test_log_ratios_are_clamped_at_the_safety_bound():
    # uncapped masked IS is the plain ratio: exp(25) becomes exp(20) (verl's SAFETY_BOUND)
    c = _one(("token_mis", {"cap": None}), [[25.0, -25.0, 1.0]])
    _close(c.weight, [[math.exp(20.0), math.exp(-20.0), math.e]], atol=1e-3)
    c = _one(("seq_mis", {"cap": None}), [[15.0, 15.0]])  # the sum 30 is clamped too
    _close(c.weight, [[math.exp(20.0)] * 2], atol=1e-3)


def test_nan_rollout_readings():
    train = torch.tensor([[-1.0, -2.0, -0.5]])
    roll = torch.tensor([[-1.5, float("nan"), -0.5]])
    mask = torch.ones(1, 3)
    with pytest.raises(ValueError, match="nan_rollout='neutral'"):
        C.compute("token_tis", train, roll, mask)
    c = C.compute(("token_tis", {"cap": 5.0}), train, roll, mask, nan_rollout="neutral")
    _close(c.weight, [[math.exp(0.5), 1.0, 1.0]], atol=1e-6)  # TRL: an unscored token has rho 1
    c = C.compute("seq_tis:cap=5", train, roll, mask, nan_rollout="neutral")
    _close(c.weight, [[math.exp(0.5)] * 3], atol=1e-6)


# --------------------------------------------------------------------------- properties
def _batch(seed, n=8, t=6, spread=0.3, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(dtype)
    old = -torch.rand(n, t, generator=g, dtype=dtype) * 2 - 0.05
    rollout = old + spread * torch.randn(n, t, generator=g, dtype=dtype)
    logp = old + 0.2 * torch.randn(n, t, generator=g, dtype=dtype)
    adv = torch.randn(n, generator=g, dtype=dtype)
    return logp, old, rollout, adv, mask


DEFAULT_SPECS = [
    "token_tis",
    "seq_tis",
    "token_mis",
    "seq_mis",
    "icepop",
    "geo_rs",
    "rejection:stat=k3,level=seq_max,threshold=1e-4",
    "rejection:stat=k1,level=token,threshold=1.001",
    "opsm:threshold=0",
    "token_tis:batch_normalize=true+seq_mis:batch_normalize=true",
]


@pytest.mark.parametrize("spec", DEFAULT_SPECS)
def test_on_policy_every_correction_is_the_identity(spec):
    _, old, _, adv, mask = _batch(3)
    c = C.compute(spec, old, old.clone(), mask, adv=adv)
    torch.testing.assert_close(c.weight, mask.to(c.weight.dtype), atol=0, rtol=0)
    assert torch.equal(c.keep, mask.bool())


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    spread=st.sampled_from([0.01, 0.3, 3.0, 40.0]),
    spec=st.sampled_from(DEFAULT_SPECS),
)
def test_weights_are_finite_nonnegative_and_zero_on_padding(seed, spread, spec):
    _, old, rollout, adv, mask = _batch(seed, spread=spread)
    c = C.compute(spec, old, rollout, mask, adv=adv)
    assert torch.isfinite(c.weight).all() and (c.weight >= 0).all()
    assert (c.weight[mask == 0] == 0).all() and not c.keep[mask == 0].any()
    assert 0.0 <= c.stats["corr/rejected_frac"] <= 1.0


# --------------------------------------------------------------------------- the objective
SURROGATE_PARAMS = {
    "ppo_clip": {"eps_low": 0.2, "eps_high": 0.28, "clip_ratio_c": 3.0},
    "cispo": {},
    "gspo": {},
    "reinforce": {},
    # the peers' surrogates (Clip-Cov's random draw kept empty so both calls agree)
    "sapo": {},
    "gmpo": {},
    "vespo": {},
    "clip_cov": {"clip_cov_lb": 50.0, "clip_cov_ub": 60.0},
    "kl_cov": {"kl_cov_ratio": 0.1},
    "dppo_tv": {},
    "dppo_kl": {},
    "dro": {"beta": 0.1},
    "topr": {},
}


@pytest.mark.parametrize("surrogate", list(losses.SURROGATES))
@pytest.mark.parametrize("aggregation", list(losses.AGGREGATIONS))
def test_correction_weights_only_the_surrogate_and_keep_masks_every_branch(surrogate, aggregation):
    logp, old, rollout, adv, mask = _batch(5)
    ref = old - 0.1
    corr = C.compute(
        "token_tis:cap=1.2+rejection:stat=k2,level=token,threshold=0.03", old, rollout, mask
    )
    assert (
        0 < corr.stats["corr/rejected_frac"] < 1 and corr.stats["corr/token_tis/truncated_frac"] > 0
    )
    ent = torch.rand_like(logp)
    common = dict(
        surrogate=surrogate,
        surrogate_params=SURROGATE_PARAMS[surrogate],
        aggregation=aggregation,
        ref_logp=ref,
        beta=0.04,
        entropy=ent,
        entropy_coeff=0.01,
    )
    lp = logp.clone().requires_grad_()
    out = losses.objective(
        lp, old, adv, mask, correction_weight=corr.weight, correction_keep=corr.keep, **common
    )
    kept = corr.loss_mask(mask)
    base = losses.objective(logp.clone().requires_grad_(), old, adv, kept, **common)
    # the KL and entropy branches are those of the rejected-token mask, unweighted
    torch.testing.assert_close(out.kl_loss, base.kl_loss)
    torch.testing.assert_close(out.entropy_bonus, base.entropy_bonus)
    # the reward branch is the surrogate's per-token loss times the weight
    per_token, _ = losses.surrogate(surrogate, logp, old, adv, kept, **SURROGATE_PARAMS[surrogate])
    want = losses.aggregate(aggregation, per_token * corr.weight, kept)
    torch.testing.assert_close(out.pg_loss, want)
    assert not torch.allclose(out.pg_loss, base.pg_loss)  # the weight did something
    out.loss.backward()
    assert (lp.grad[~corr.keep] == 0).all()  # rejected tokens carry no gradient


def test_reinforce_with_weight_hand_gradient():
    # -A * w * logp per token, token mean over 3 valid tokens: d/dlogp = -A * w / 3
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    w = torch.tensor([[2.0, 0.5, 0.0]])
    out = losses.objective(
        logp,
        None,
        torch.tensor([1.5]),
        torch.ones(1, 3),
        surrogate="reinforce",
        correction_weight=w,
    )
    out.loss.backward()
    torch.testing.assert_close(logp.grad, -1.5 * w / 3)
    torch.testing.assert_close(out.loss, -(1.5 * (2 * -1.0 + 0.5 * -2.0)) / 3 * torch.ones(()))


@pytest.mark.parametrize("aggregation", sorted(losses.EXACT_UNDER_ACCUMULATION))
@pytest.mark.parametrize(
    "spec",
    [
        "token_tis:cap=1.3,batch_normalize=true",
        "seq_mis:cap=1.5,batch_normalize=true+rejection:stat=k3,level=token,threshold=0.04",
        "icepop:low=0.8,high=1.25+geo_rs:low=0.9,high=1.1",
    ],
)
def test_micro_batches_sum_to_the_one_batch_loss(aggregation, spec):
    logp, old, rollout, adv, mask = _batch(7, n=10, spread=0.4)
    corr = C.compute(spec, old, rollout, mask)  # once, on the whole step
    totals = losses.step_totals(corr.loss_mask(mask), max_len=8)
    kw = dict(surrogate="ppo_clip", aggregation=aggregation, totals=totals)
    lp = logp.clone().requires_grad_()
    whole = losses.objective(
        lp, old, adv, mask, correction_weight=corr.weight, correction_keep=corr.keep, **kw
    )
    (g_whole,) = torch.autograd.grad(whole.loss, lp)
    lp2 = logp.clone().requires_grad_()
    parts = []
    for rows in (slice(0, 3), slice(3, 4), slice(4, 10)):
        mb = corr.rows(rows)
        parts.append(
            losses.objective(
                lp2[rows],
                old[rows],
                adv[rows],
                mask[rows],
                correction_weight=mb.weight,
                correction_keep=mb.keep,
                **kw,
            ).loss
        )
    total = torch.stack(parts).sum()
    (g_parts,) = torch.autograd.grad(total, lp2)
    torch.testing.assert_close(total, whole.loss, atol=1e-12, rtol=0)
    torch.testing.assert_close(g_parts, g_whole, atol=1e-12, rtol=0)


def test_per_micro_batch_normalisation_would_not_add_up():
    # the same split with the batch-normalised weight computed per micro-batch: not the step's
    logp, old, rollout, adv, mask = _batch(7, n=10, spread=0.4)
    spec = "seq_tis:cap=1.5,batch_normalize=true"
    corr = C.compute(spec, old, rollout, mask)
    totals = losses.step_totals(mask)
    whole = losses.objective(logp, old, adv, mask, totals=totals, correction_weight=corr.weight)
    parts = 0.0
    for rows in (slice(0, 3), slice(3, 10)):
        local = C.compute(spec, old[rows], rollout[rows], mask[rows])
        parts = (
            parts
            + losses.objective(
                logp[rows],
                old[rows],
                adv[rows],
                mask[rows],
                totals=totals,
                correction_weight=local.weight,
            ).loss
        )
    assert abs(float(parts - whole.loss)) > 1e-4


def test_everything_rejected_gives_a_connected_zero():
    logp, old, _, adv, mask = _batch(2)
    lp = logp.clone().requires_grad_()
    out = losses.objective(
        lp, old, adv, mask, correction_keep=torch.zeros_like(mask, dtype=torch.bool)
    )
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and (lp.grad == 0).all()


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("toke_tis", "unknown rollout correction 'toke_tis'; valid corrections: token_tis"),
        ("token_tis:cap=0.5", "cap must be a finite number >= 1"),
        ("icepop:low=1.5", "lower bound must be in \\[0, 1\\]"),
        ("token_tis:cap=None", "give cap, cap_low or both"),
        ("seq_tis:threshold=2", "has no parameter threshold; its parameters: cap, cap_low"),
        ("rejection:stat=k4,threshold=1", "unknown stat 'k4'; valid: k1, k2, k3"),
        ("rejection:level=seq_median,threshold=1", "unknown level 'seq_median'"),
        ("rejection:stat=k1,level=seq_max,threshold=2", "seq_max takes k2 or k3"),
        ("rejection:stat=k3", "needs threshold > 0"),
        ("rejection:stat=k1,threshold=0.5", "k1 needs threshold >= 1"),
        ("rejection:stat=k1,threshold=2,k1_bounds_on=log", "k1_bounds_on must be one of"),
        ("opsm", "opsm: needs threshold >= 0"),
        ("token_tis:cap", "parameters are key=value"),
    ],
)
def test_bad_specs_name_the_option_and_the_choices(spec, message):
    _, old, rollout, adv, mask = _batch(1)
    with pytest.raises(ValueError, match=message):
        C.compute(spec, old, rollout, mask, adv=adv)


def test_bad_tensors_are_clear_errors():
    _, old, rollout, adv, mask = _batch(1)
    with pytest.raises(ValueError, match="rollout_logp must have the shape of train_logp"):
        C.compute("icepop", old, rollout[:, :-1], mask)
    with pytest.raises(ValueError, match="mask must have the shape"):
        C.compute("icepop", old, rollout, mask[:-1])
    bad = rollout.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="rollout_logp has 1 non-finite"):
        C.compute("icepop", old, bad, mask)
    bad = old.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="train_logp has 1 non-finite"):
        C.compute("icepop", bad, rollout, mask)
    with pytest.raises(ValueError, match="opsm: needs the advantages"):
        C.compute("opsm:threshold=0.5", old, rollout, mask)
    with pytest.raises(ValueError, match="adv must be"):
        C.compute("opsm:threshold=0.5", old, rollout, mask, adv=adv[:-1])
    with pytest.raises(ValueError, match="nan_rollout must be one of error, neutral"):
        C.compute("icepop", old, rollout, mask, nan_rollout="zero")
    # padding may hold anything
    pad = rollout.clone()
    pad[mask == 0] = float("nan")
    C.compute("icepop", old, pad, mask)


def test_objective_rejects_bad_correction_tensors():
    logp, old, _, adv, mask = _batch(1)
    with pytest.raises(ValueError, match="correction_weight must be"):
        losses.objective(logp, old, adv, mask, correction_weight=torch.ones(3))
    with pytest.raises(ValueError, match="finite and >= 0"):
        losses.objective(logp, old, adv, mask, correction_weight=-torch.ones_like(mask))
    with pytest.raises(ValueError, match="correction_keep must be"):
        losses.objective(logp, old, adv, mask, correction_keep=torch.ones(3, dtype=torch.bool))


def test_trl_mode_names_and_errors():
    assert C.trl_mode() == ("seq_mis", {"cap": 3.0, "cap_low": None})
    assert C.trl_mode("token_truncate", 0.5, 2.0) == ("token_tis", {"cap": 2.0, "cap_low": 0.5})
    with pytest.raises(ValueError, match="valid: token_truncate, token_mask, sequence_truncate"):
        C.trl_mode("sequence_clip")


def test_parse_and_format_round_trip():
    text = "seq_tis:cap=2.0,batch_normalize=True+rejection:stat=k1,level=seq_sum,threshold=2.0"
    spec = C.parse_spec(text)
    assert spec == [
        ("seq_tis", {"cap": 2.0, "batch_normalize": True}),
        ("rejection", {"stat": "k1", "level": "seq_sum", "threshold": 2.0}),
    ]
    assert C.parse_spec(C.format_spec(spec)) == spec
    assert C.parse_spec("none") == [] and C.format_spec([]) == "none"


def test_check_spec_dry_runs_the_values():
    assert C.check_spec("icepop") == [("icepop", {})]
    with pytest.raises(ValueError, match="cap must be a finite number >= 1"):
        C.check_spec("seq_tis:cap=0.5")
    with pytest.raises(ValueError, match="needs threshold > 0"):
        C.check_spec("rejection")
