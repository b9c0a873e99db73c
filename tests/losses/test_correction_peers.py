"""Rollout correction against the peers' own functions on the same tensors.

verl 0.9.1: ``rollout_corr_helper.compute_rollout_correction_weights`` (token / sequence TIS,
IcePop, batch normalisation), ``compute_rollout_rejection_mask`` (all eleven k1/k2/k3 ×
token / seq_sum / seq_mean / seq_max options), their combination, ``compute_offpolicy_metrics``
and ``compute_is_metrics``, and ``compute_policy_loss_vanilla`` fed the weights and the
rewritten mask. TRL 1.16: ``GRPOTrainer.get_off_policy_mask`` (DeepSeek-V3.2's mask) and
``GRPOTrainer._compute_loss`` run on a stand-in ``self`` with an ``importance_sampling_ratio``
input (how TRL applies the vLLM correction in its loss). TRL's computation of that ratio lives
in ``_generate_and_score_completions``: tests/integrations/test_trl_correction.py runs it.

Inputs: random ratios, extreme ones (|log ρ| up to ~40, past verl's ±20 safety bound), rows
without a valid token, and rows whose reward was NaN (advantage 0).
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from grouprl import diagnostics, losses
from grouprl.losses import correction as C

pytestmark = pytest.mark.peer

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    rch = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")


def batch(kind: str, seed: int = 0, n: int = 10, t: int = 7):
    """(train [N, T], rollout [N, T], mask [N, T] float, adv [N]) of one input kind."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    lengths[0] = t
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.float64)
    train = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3 - 0.01
    spread = {"random": 0.3, "extreme": 12.0, "empty_rows": 0.3, "nan_reward": 0.3}[kind]
    rollout = train + spread * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    if kind == "empty_rows":
        mask[[2, 5]] = 0.0  # e.g. groups dropped upstream
    if kind == "nan_reward":
        adv[[1, 4]] = 0.0  # unscorable rewards get advantage 0 (ALGORITHMS.md §0)
    train = torch.where(mask > 0, train, torch.full_like(train, -7.0))  # padding: anything
    return train, rollout, mask, adv


KINDS = ["random", "extreme", "empty_rows", "nan_reward"]


# --------------------------------------------------------------------------- verl: weights
IS_CASES = [
    # verl (rollout_is, threshold) -> our spec
    (("token", 2.0), ("token_tis", {"cap": 2.0})),
    (("sequence", 2.0), ("seq_tis", {"cap": 2.0})),
    (("token", 5.0), ("token_tis", {"cap": 5.0})),
    (("token", "0.5_5.0"), ("icepop", {})),  # verl's decoupled_token_icepop
    (("token", "0.8_1.25"), ("icepop", {"low": 0.8, "high": 1.25})),
    (("sequence", "0.5_3.0"), ("seq_mis", {"cap": 3.0, "cap_low": 0.5})),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("verl_args", "ours"), IS_CASES)
@pytest.mark.parametrize("normalize", [False, True])
def test_is_weights_equal_verls(kind, verl_args, ours, normalize):
    train, rollout, mask, _ = batch(kind)
    level, threshold = verl_args
    name, params = ours
    got = C.compute((name, {**params, "batch_normalize": normalize}), train, rollout, mask)
    args = dict(rollout_is=level, rollout_is_threshold=threshold)
    if not bool((got.weight > 0).any()):
        # every weight masked (extreme ratios, tight IcePop band): verl 0.9.1's ESS metric
        # divides by zero; ours reports an ESS of 0
        with pytest.raises(ZeroDivisionError):
            rch.compute_rollout_correction_weights(train - rollout, mask, **args)
        assert float(diagnostics.effective_sample_size(got.weight, mask.bool())) == 0.0
        return
    want, metrics = rch.compute_rollout_correction_weights(
        train - rollout, mask, **args, rollout_is_batch_normalize=normalize
    )
    torch.testing.assert_close(got.weight * mask, want * mask, atol=1e-6, rtol=1e-6)
    if normalize:
        factor = got.stats[f"corr/{name}/batch_norm_factor"]
        assert factor == pytest.approx(metrics["rollout_is_batch_norm_factor"], rel=1e-6)
    # verl's ESS of the applied (clamped) weights is our effective_sample_size of them
    if not normalize:
        ess = diagnostics.effective_sample_size(
            got.weight.clamp(0, float(str(threshold).split("_")[-1])), mask.bool()
        )
        assert float(ess) == pytest.approx(metrics["rollout_is_eff_sample_size"], rel=1e-5)


RS_OPTIONS = sorted(rch.SUPPORTED_ROLLOUT_RS_OPTIONS)
THRESHOLDS = {
    "k1": ["2.0", "0.5_2.0", "0.8_1.5", "0.999_1.001"],
    "k2": ["0.02"],
    "k3": ["0.01", "0.3"],
}


def _ours_rs(option: str, threshold: str, reading: str):
    level, stat = option.rsplit("_", 1)
    if stat == "k1":
        lo, _, hi = threshold.rpartition("_")
        params = {"threshold": float(hi), "low": float(lo) if lo else None}
        params["k1_bounds_on"] = reading
    else:
        params = {"threshold": float(threshold)}
    return ("rejection", {"stat": stat, "level": level, **params})


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("option", RS_OPTIONS)
def test_rejection_masks_equal_verls(kind, option):
    train, rollout, mask, _ = batch(kind, seed=3)
    for threshold in THRESHOLDS[option.rsplit("_", 1)[1]]:
        want, _ = rch.compute_rollout_rejection_mask(train - rollout, mask, option, threshold)
        got = C.compute(_ours_rs(option, threshold, "inverse_ratio"), train, rollout, mask)
        assert torch.equal(got.keep, want.bool()), (option, threshold)
        torch.testing.assert_close(got.loss_mask(mask), want)


def test_k1_readings_against_verls_code():
    # symmetric bounds: both readings are verl's; asymmetric: only inverse_ratio is verl's code
    train, rollout, mask, _ = batch("random", seed=5)
    for threshold, same in (("0.5_2.0", True), ("0.8_1.5", False)):
        want, _ = rch.compute_rollout_rejection_mask(train - rollout, mask, "token_k1", threshold)
        got = C.compute(_ours_rs("token_k1", threshold, "ratio"), train, rollout, mask)
        assert torch.equal(got.keep, want.bool()) == same


@pytest.mark.parametrize("kind", KINDS)
def test_is_plus_rejection_equals_verls_pipeline(kind):
    # verl's decoupled_seq_is_rs ("Seq-MIS" in verl): sequence TIS + seq_sum_k1 rejection
    train, rollout, mask, _ = batch(kind, seed=8)
    proto, new_mask, metrics = rch.compute_rollout_correction_and_rejection_mask(
        train,
        rollout,
        mask,
        rollout_is="sequence",
        rollout_is_threshold=2.0,
        rollout_rs="seq_sum_k1",
        rollout_rs_threshold="0.5_2.0",
    )
    spec = "seq_tis:cap=2+rejection:stat=k1,level=seq_sum,threshold=2,k1_bounds_on=inverse_ratio"
    got = C.compute(spec, train, rollout, mask)
    torch.testing.assert_close(got.loss_mask(mask), new_mask)
    torch.testing.assert_close(
        got.weight * new_mask, proto.batch["rollout_is_weights"] * new_mask, atol=1e-6, rtol=1e-6
    )
    assert got.stats["corr/rejected_frac"] == pytest.approx(
        metrics["rollout_corr/rollout_rs_masked_fraction"], abs=1e-6
    )


# --------------------------------------------------------------------------- verl: the loss
VERL_MODES = {
    "token-mean": "token_mean",
    "seq-mean-token-mean": "seq_mean_token_mean",
    "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("mode", "aggregation"), list(VERL_MODES.items()))
def test_objective_with_correction_equals_verls_corrected_vanilla_loss(kind, mode, aggregation):
    from verl.workers.config import ActorConfig

    train, rollout, mask, adv = batch(kind, seed=11)
    old = train  # decoupled mode: the trainer's log-probs at the behaviour parameters
    g = torch.Generator().manual_seed(2)
    logp = old + 0.2 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    proto, new_mask, _ = rch.compute_rollout_correction_and_rejection_mask(
        old,
        rollout,
        mask,
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="token_k3",
        rollout_rs_threshold=0.5,
    )
    cfg = ActorConfig(strategy="fsdp", rollout_n=2, ppo_micro_batch_size_per_gpu=2)
    lp_v = logp.clone().requires_grad_()
    want, _ = core_algos.compute_policy_loss_vanilla(
        old,
        lp_v,
        adv[:, None] * mask,
        new_mask,
        mode,
        cfg,
        rollout_is_weights=proto.batch["rollout_is_weights"],
    )
    corr = C.compute(
        "token_tis:cap=2+rejection:stat=k3,level=token,threshold=0.5", old, rollout, mask
    )
    lp = logp.clone().requires_grad_()
    got = losses.objective(
        lp,
        old,
        adv,
        mask,
        surrogate="ppo_clip",
        surrogate_params={"eps_low": 0.2, "eps_high": 0.2, "clip_ratio_c": 3.0},
        aggregation=aggregation,
        correction_weight=corr.weight,
        correction_keep=corr.keep,
    )
    # 1e-7: verl divides a sequence's token sum by (count + 1e-8)
    torch.testing.assert_close(got.loss, want, atol=1e-9, rtol=1e-7)
    (g_got,) = torch.autograd.grad(got.loss, lp)
    (g_want,) = torch.autograd.grad(want, lp_v)
    torch.testing.assert_close(g_got, g_want, atol=1e-9, rtol=1e-7)


def test_sequence_normaliser_readings_with_rejected_sequences():
    # verl's trainer divides seq-mean losses by the mini-batch size (global_batch_size, every
    # row, rejected ones too); our StepTotals count only rows that keep a token [OURS].
    from verl.workers.config import ActorConfig

    train, rollout, mask, adv = batch("random", seed=12)
    logp = train + 0.1
    corr = C.compute("rejection:stat=k1,level=seq_sum,threshold=1.5", train, rollout, mask)
    kept_rows = corr.loss_mask(mask).sum(-1) > 0
    assert 0 < int(kept_rows.sum()) < mask.shape[0]
    cfg = ActorConfig(strategy="fsdp", rollout_n=2, ppo_micro_batch_size_per_gpu=2)
    cfg.global_batch_info.update({"global_batch_size": mask.shape[0], "dp_size": 1})
    want, _ = core_algos.compute_policy_loss_vanilla(
        train, logp, adv[:, None] * mask, corr.loss_mask(mask), "seq-mean-token-mean", cfg
    )
    kw = dict(
        surrogate_params={"clip_ratio_c": 3.0},
        aggregation="seq_mean_token_mean",
        correction_keep=corr.keep,
    )
    ours = losses.objective(
        logp, train, adv, mask, totals=losses.step_totals(corr.loss_mask(mask)), **kw
    )
    verl_reading = losses.StepTotals(num_tokens=1.0, num_seqs=float(mask.shape[0]), max_len=7.0)
    as_verl = losses.objective(logp, train, adv, mask, totals=verl_reading, **kw)
    torch.testing.assert_close(as_verl.loss, want, atol=1e-9, rtol=1e-7)
    torch.testing.assert_close(
        ours.loss * int(kept_rows.sum()) / mask.shape[0], want, rtol=1e-7, atol=1e-9
    )


# --------------------------------------------------------------------------- verl: metrics
@pytest.mark.parametrize("kind", ["random", "extreme", "nan_reward"])
def test_mismatch_metrics_equal_verls_offpolicy_metrics(kind):
    train, rollout, mask, _ = batch(kind, seed=21)
    if kind == "extreme":
        # chi2 past the +-20 safety bound: both clamp log rho (and its sequence sum) there
        theirs = rch.compute_offpolicy_metrics(train, rollout, mask)
        ours = diagnostics.mismatch_metrics(train, rollout, mask)
        assert (train - rollout)[mask.bool()].abs().max() > 20
        for key in ("chi2_token", "chi2_seq"):
            assert ours[f"mismatch/{key}"] == pytest.approx(theirs[key], rel=1e-6), key
        # verl's k3_kl is unclamped: keep |log rho| < 20 for the other comparisons
        rollout = train + (rollout - train).clamp(-15, 15)
    theirs = rch.compute_offpolicy_metrics(train, rollout, mask)
    ours = diagnostics.mismatch_metrics(train, rollout, mask)
    pairs = {
        "kl": "kl_k1",
        "k3_kl": "kl_k3",
        "chi2_token": "chi2_token",
        "chi2_seq": "chi2_seq",
        "training_ppl": "ppl_train",
        "rollout_ppl": "ppl_rollout",
        "ppl_ratio": "ppl_ratio",
        "log_ppl_abs_diff": "log_ppl_abs_diff",
    }
    for verl_key, key in pairs.items():
        assert ours[f"mismatch/{key}"] == pytest.approx(theirs[verl_key], rel=1e-5, abs=1e-7), key


def test_chi2_seq_readings_with_empty_rows():
    # verl averages (Π rho)^2 over every row, an empty row adding e^0 = 1; ours skips it [OURS]
    train, rollout, mask, _ = batch("empty_rows", seed=4)
    theirs = rch.compute_offpolicy_metrics(train, rollout, mask)["chi2_seq"]
    ours = diagnostics.mismatch_metrics(train, rollout, mask)["mismatch/chi2_seq"]
    n, empty = mask.shape[0], int((mask.sum(-1) == 0).sum())
    assert empty == 2
    assert theirs == pytest.approx(((ours + 1) * (n - empty) + empty) / n - 1, rel=1e-6)


# --------------------------------------------------------------------------- TRL
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("threshold", [0.0, 0.05, 0.5])
def test_opsm_equals_trls_get_off_policy_mask(kind, threshold):
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    current, rollout, mask, adv = batch(kind, seed=31)
    want = trl_grpo.GRPOTrainer.get_off_policy_mask(
        adv[:, None], current, rollout, mask, threshold
    )  # [N, 1]
    got = C.compute(("opsm", {"threshold": threshold}), current, rollout, mask, adv=adv)
    torch.testing.assert_close(got.weight, (want * mask).to(got.weight.dtype))
    assert got.keep.equal(mask.bool())


def _trl_stub(lp, *, loss_type, off_policy_mask_threshold, n_tokens):
    return SimpleNamespace(
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=off_policy_mask_threshold,
        importance_sampling_level="token",
        beta=0.0,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.28,
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=lp.shape[1],
        accelerator=SimpleNamespace(
            num_processes=1,
            gather=lambda x: x,
            gather_for_metrics=lambda x: x,
            reduce=lambda x, reduction="sum": x,
            sync_gradients=True,
        ),
        get_off_policy_mask=__import__("trl").GRPOTrainer.get_off_policy_mask,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None),
    )


@pytest.mark.parametrize("kind", ["random", "extreme", "nan_reward"])  # TRL has no empty rows
@pytest.mark.parametrize(
    ("mode", "clip_min", "clip_max"),
    [
        ("sequence_mask", None, 3.0),
        ("token_truncate", 0.5, 2.0),
        ("token_mask", 0.5, 3.0),
        ("sequence_truncate", None, 2.0),
    ],
)
@pytest.mark.parametrize(
    ("loss_type", "aggregation"), [("dapo", "token_mean"), ("grpo", "seq_mean_token_mean")]
)
def test_trls_loss_with_its_is_ratio_and_opsm_equals_our_objective(
    kind, mode, clip_min, clip_max, loss_type, aggregation
):
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    old, rollout, mask, adv = batch(kind, seed=41)
    g = torch.Generator().manual_seed(5)
    logp = old + 0.2 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    name, params = C.trl_mode(mode, clip_min, clip_max)
    corr = C.compute((name, params), old, rollout, mask)
    # TRL keeps a sequence ratio [N, 1]; token modes give [N, T] (1 at padding)
    ratio = corr.weight if mode.startswith("token") else corr.weight.amax(-1, keepdim=True)
    lp = logp.clone().requires_grad_()
    stub = _trl_stub(lp, loss_type=loss_type, off_policy_mask_threshold=0.1, n_tokens=mask.sum())
    inputs = {
        "prompt_ids": torch.zeros(mask.shape[0], 1, dtype=torch.long),
        "prompt_mask": torch.ones(mask.shape[0], 1, dtype=torch.long),
        "completion_ids": torch.zeros(mask.shape, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "sampling_per_token_logps": rollout,
        "importance_sampling_ratio": ratio,
        "num_items_in_batch": mask.sum(),
    }
    want = trl_grpo.GRPOTrainer._compute_loss(stub, None, inputs)
    (g_want,) = torch.autograd.grad(want, lp)
    lp2 = logp.clone().requires_grad_()
    opsm = C.compute("opsm:threshold=0.1", logp.detach(), rollout, mask, adv=adv)
    got = losses.objective(
        lp2,
        old,
        adv,
        mask,
        surrogate="ppo_clip",
        surrogate_params={"eps_low": 0.2, "eps_high": 0.28},
        aggregation=aggregation,
        correction_weight=corr.weight * opsm.weight,
    )
    (g_got,) = torch.autograd.grad(got.loss, lp2)
    torch.testing.assert_close(got.loss, want, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(g_got, g_want, atol=1e-9, rtol=1e-9)
    assert math.isfinite(float(want.detach()))
