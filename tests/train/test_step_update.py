"""Known answers of whole training steps, part 1: what the update does with the batch.

Each test trains the hand policy of ``hand_policy.py`` (three parameters, logits at every
position ``(θ_eos, θ_a, θ_b)``) for one step through ``train()`` and compares θ with the
update derived by hand in that module (its docstring: (1) the log-prob gradient, (2) the
clip surrogate's, (3) AdamW with eps = 1), computed from the completions the verifier saw.
Each test also checks that the update without the behaviour under test is a different
number, so that ignoring the setting fails it.
"""

from __future__ import annotations

import math

import pytest
import torch
from hand_policy import (
    AdamW,
    HandTask,
    Row,
    completion_tokens,
    expected_update,
    first_is,
    group_std,
    groups,
    grpo_advantages,
    step_round,
    theta_of,
    train_hand,
)

from grouprl.train.loop import TrainingError
from grouprl.train.sinks import read_jsonl

G = 4
TOL = 1e-6


def _rows(calls, theta0, *, max_new=1, adv=None, drop=lambda c: False, **kw):
    """The update's rows: every scored completion (prompt-major), GRPO advantages unless
    ``adv`` gives them, leaving out the rows ``drop`` says."""
    out = []
    for grp in groups(calls, G):
        a = adv(grp) if adv else grpo_advantages([c.reward for c in grp])
        out += [
            Row(completion_tokens(c.text, max_new), x, theta0, **kw)
            for c, x in zip(grp, a)
            if not drop(c)
        ]
    return out


def _mixed(calls) -> bool:
    """A group whose rewards differ: the step has a non-zero policy gradient."""
    return any(
        len({c.reward for c in grp if not math.isnan(c.reward)}) > 1 for grp in groups(calls, G)
    )


def _far(a, b, margin=1e-3) -> bool:
    return max(abs(x - y) for x, y in zip(a, b)) > margin


# ---- gradient clip ---------------------------------------------------------------------------


def test_gradient_clip_rescales_the_gradient_to_the_bound_before_adamw(tmp_path):
    task = HandTask({"ab": first_is("a", empty=0.5)})
    result, policy, theta0 = train_hand(tmp_path, task, "optim.grad_clip=0.1")
    assert _mixed(task.calls)
    rows = _rows(task.calls, theta0)
    # GRPO's aggregation (seq_mean_token_mean); g = −(1/S) Σ_i A_i (e_y − π), ‖g‖ ≈ 0.6 here,
    # so the clip multiplies g by 0.1/(‖g‖ + 1e-6) before AdamW's −lr·g/(|g| + 1)
    want, (norm,) = expected_update(
        theta0, [rows], aggregation="seq_mean_token_mean", opt=AdamW(lr=0.1), grad_clip=0.1
    )
    unclipped, _ = expected_update(
        theta0, [rows], aggregation="seq_mean_token_mean", opt=AdamW(lr=0.1)
    )
    assert norm > 0.2 and _far(want, unclipped, 5e-3)
    assert theta_of(policy) == pytest.approx(want, abs=TOL)
    assert result.metrics["optim/grad_norm"] == pytest.approx(norm, rel=1e-5)  # before the clip


# ---- the per-group KL weight ------------------------------------------------------------------


@pytest.mark.parametrize("seed", [5, 21])  # a collapsed and a live group; two live σ
def test_grpo_beta_comp_weighs_each_groups_kl_gradient_by_one_over_its_sigma(tmp_path, seed):
    # group 0: a -> 1, else 0; group 1: a -> 1, b -> 0.25, <eos> -> 0
    tables = {"ab": first_is("a"), "quarter": first_is("a", other=0.25)}
    task = HandTask(tables, plan=lambda split, s, i: ("q", ["ab", "quarter"][i]))
    _, policy, theta0 = train_hand(
        tmp_path, task, "algorithm.preset=grpo_beta_comp", "algorithm.beta=0.5",
        "algorithm.kl=k1", f"run.seed={seed}",
    )  # fmt: skip
    calls = groups(task.calls, G)
    sigma = [group_std([c.reward for c in grp]) for grp in calls]
    if seed == 5:
        assert sorted(sigma)[0] == 0.0 and sorted(sigma)[1] > 0.1, sigma
    else:
        assert min(sigma) > 0.1 and abs(sigma[0] - sigma[1]) > 0.1, sigma
    # kl_weight_q = 1/(σ_q + 1e-6), 1 for a collapsed group (σ < 1e-6); with k1 = log π −
    # log π_ref the KL term's gradient is β·w_q·(e_y − π) per token even at π = π_ref
    # (step 1), token_mean over all 8 tokens (a collapsed group has A = 0 but a KL term)
    weight = {p: 1 / (s + 1e-6) if s >= 1e-6 else 1.0 for p, s in enumerate(sigma)}
    rows = [r for p, grp in enumerate(calls) for r in _rows(grp, theta0, kl_weight=weight[p])]
    loss = {"aggregation": "token_mean", "beta": 0.5, "kl": "k1", "ref_theta": theta0}
    want, _ = expected_update(theta0, [rows], opt=AdamW(lr=0.1), **loss)
    unweighted = [Row(r.tokens, r.adv, theta0) for r in rows]
    ignored, _ = expected_update(theta0, [unweighted], opt=AdamW(lr=0.1), **loss)
    assert _far(want, ignored, 1e-3)
    assert theta_of(policy) == pytest.approx(want, abs=TOL)


# ---- NaN rewards ------------------------------------------------------------------------------


def test_unscorable_samples_leave_the_loss_and_its_normaliser(tmp_path):
    task = HandTask({"nan_eos": first_is("a", empty=math.nan)})
    result, policy, theta0 = train_hand(
        tmp_path, task, "sampling.max_unscorable_frac=1.0", theta=(0.5, 0.3, 0.0)
    )
    nan = sum(math.isnan(c.reward) for c in task.calls)
    assert 0 < nan < 2 * G and _mixed(task.calls), [c.text for c in task.calls]
    # advantages over the valid rewards only (NaN gets 0), and the NaN rows count in no
    # normaliser: S = the scorable sequences of seq_mean_token_mean
    rows = _rows(task.calls, theta0, drop=lambda c: math.isnan(c.reward))
    want, _ = expected_update(theta0, [rows], aggregation="seq_mean_token_mean", opt=AdamW(lr=0.1))
    kept_in_loss = _rows(task.calls, theta0)  # the NaN rows with A = 0: a larger S
    bug, _ = expected_update(
        theta0, [kept_in_loss], aggregation="seq_mean_token_mean", opt=AdamW(lr=0.1)
    )
    assert _far(want, bug, 1e-3)
    assert theta_of(policy) == pytest.approx(want, abs=TOL)
    assert result.metrics["reward/unscorable_frac"] == pytest.approx(nan / (2 * G))


# ---- DAPO's overlong handling -----------------------------------------------------------------

DAPO_ONE_UPDATE = [
    "algorithm.preset=dapo",
    "algorithm.dynamic_sampling=false",
    "optim.minibatches=1",
]


def test_overlong_mask_drops_the_tokens_of_truncated_completions_but_not_their_rewards(tmp_path):
    task = HandTask({"ab": first_is("a", empty=0.5)})
    result, policy, theta0 = train_hand(
        tmp_path, task, *DAPO_ONE_UPDATE, "algorithm.overlong=mask",
        "sampling.max_new_tokens=2", theta=(0.3, 0.3, 0.0),
    )  # fmt: skip
    truncated = [len(c.text.split()) == 2 for c in task.calls]
    assert 0 < sum(truncated) < 2 * G and _mixed(task.calls), [c.text for c in task.calls]
    # the advantages come from every reward; a truncated row's tokens leave the token mean
    # (M counts the other rows' tokens only), DAPO §3.4 overlong filtering
    rows = _rows(task.calls, theta0, max_new=2, drop=lambda c: len(c.text.split()) == 2)
    want, _ = expected_update(theta0, [rows], aggregation="token_mean", opt=AdamW(lr=0.1))
    unmasked, _ = expected_update(
        theta0, [_rows(task.calls, theta0, max_new=2)], aggregation="token_mean", opt=AdamW(lr=0.1)
    )
    assert _far(want, unmasked, 1e-3)
    assert theta_of(policy) == pytest.approx(want, abs=TOL)
    assert result.metrics["length/truncated_frac"] == pytest.approx(sum(truncated) / (2 * G))


def test_soft_overlong_penalty_is_added_to_the_rewards_before_the_advantages(tmp_path):
    task = HandTask({"ab": first_is("a", empty=0.5)}, reward_range=(-1.0, 1.0))
    result, policy, theta0 = train_hand(
        tmp_path, task, *DAPO_ONE_UPDATE, "sampling.max_new_tokens=3",
        "sampling.overlong_cache=2", "run.seed=5", theta=(0.3, 0.3, 0.0),
    )  # fmt: skip
    # DAPO eq. 13 with L_max = 3, L_cache = 2: 0 for L <= 1, (1 − L)/2 above: L = 2 -> −0.5,
    # L = 3 -> −1 (L counts the completion's tokens, <eos> included)
    lengths = [len(completion_tokens(c.text, 3)) for c in task.calls]
    penalty = [0.0 if n <= 1 else (1 - n) / 2 for n in lengths]
    shaped = [c.reward + p for c, p in zip(task.calls, penalty)]
    assert set(lengths) == {1, 2, 3}, lengths  # every branch of the penalty
    adv = {}
    for p in range(2):
        adv.update(zip(range(p * G, p * G + G), grpo_advantages(shaped[p * G : p * G + G])))
    rows = [Row(completion_tokens(c.text, 3), adv[i], theta0) for i, c in enumerate(task.calls)]
    want, _ = expected_update(theta0, [rows], aggregation="token_mean", opt=AdamW(lr=0.1))
    unshaped = _rows(task.calls, theta0, max_new=3)
    ignored, _ = expected_update(theta0, [unshaped], aggregation="token_mean", opt=AdamW(lr=0.1))
    assert _far(want, ignored, 1e-3)
    assert theta_of(policy) == pytest.approx(want, abs=TOL)
    assert result.metrics["reward/mean"] == pytest.approx(sum(shaped) / len(shaped), abs=1e-6)


# ---- non-finite steps -------------------------------------------------------------------------


@pytest.mark.parametrize("poisoned", [0, 1])
@pytest.mark.parametrize("poison", ["z", "n"])  # a NaN loss; a finite loss with a NaN gradient
def test_a_non_finite_minibatch_is_skipped_and_the_other_one_is_adamws_first_step(
    tmp_path, poison, poisoned
):
    # two minibatches of one group; group `poisoned` has a poisoned prompt, whose training
    # forward is NaN (z) or whose gradient is (n): its minibatch is skipped (no parameter, no
    # AdamW state, no gradient is left behind), so the clean minibatch takes AdamW's first
    # step (t = 1) whichever order they run in
    task = HandTask(
        {"ab": first_is("a", empty=0.5)},
        plan=lambda split, seed, i: (poison if i == poisoned else "q", "ab"),
    )
    result, policy, theta0 = train_hand(tmp_path, task, "optim.minibatches=2")
    assert all(_mixed(grp) for grp in groups(task.calls, G))  # both minibatches have a gradient
    clean = groups(task.calls, G)[1 - poisoned]
    want, (norm,) = expected_update(
        theta0, [_rows(clean, theta0)], aggregation="seq_mean_token_mean", opt=AdamW(lr=0.1)
    )
    assert theta_of(policy) == pytest.approx(want, abs=TOL)
    m = result.metrics
    assert (m["optim/steps"], m["optim/skipped_steps"], m["optim/skipped_total"]) == (1, 1, 1)
    assert m["optim/grad_norm"] == pytest.approx(norm, rel=1e-5)  # the step taken only


def test_k_non_finite_steps_in_a_row_stop_the_run_and_a_finite_step_resets_the_count(tmp_path):
    # steps 1, 3, 4 have only z prompts (every optimizer step non-finite), step 2 is clean:
    # with K = 2 the streak is 1, 0, 1, 2 -> the run stops at step 4, not at step 3
    bad = {1, 3, 4}
    task = HandTask(
        {"ab": first_is("a", empty=0.5)},
        plan=lambda split, seed, i: ("z" if step_round(seed)[0] in bad else "q", "ab"),
    )
    with pytest.raises(TrainingError, match=r"step 4: 2 optimizer steps in a row"):
        train_hand(tmp_path, task, "optim.steps=6", "optim.max_nonfinite_steps=2")
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["optim/skipped_steps"] for r in rows] == [1, 0, 1]
    assert [r["optim/skipped_total"] for r in rows] == [1, 1, 2]
    assert [r["optim/steps"] for r in rows] == [0, 1, 0]


# ---- the update schedule ----------------------------------------------------------------------


def _epoch_orders(seed: int, step: int, p: int, epochs: int) -> list[list[int]]:
    """The documented shuffle (``update_policy``): one generator seeded by (seed, step) per
    step, one permutation of the P groups per epoch, drawn in turn."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return [torch.randperm(p, generator=gen).tolist() for _ in range(epochs)]


def test_epochs_and_minibatches_step_adamw_once_per_minibatch_in_the_shuffled_order(tmp_path):
    # 2 epochs × 2 minibatches of one group: four AdamW steps; from the second on the ratio
    # moves away from 1, and with a clip of 0.05 some tokens' gradients are cut (2)
    seed = 3
    orders = _epoch_orders(seed, 1, 2, 2)
    assert orders == [[1, 0], [0, 1]]  # the seed is chosen so that each order matters
    task = HandTask({"ab": first_is("a", empty=0.5)})
    result, policy, theta0 = train_hand(
        tmp_path, task, f"run.seed={seed}", "optim.minibatches=2", "optim.ppo_epochs=2",
        "optim.lr=0.3", "algorithm.surrogate_params={eps_low: 0.05, eps_high: 0.05}",
    )  # fmt: skip
    per_group = [_rows(grp, theta0, eps_low=0.05, eps_high=0.05) for grp in groups(task.calls, G)]
    assert all(_mixed(grp) for grp in groups(task.calls, G))

    def run(order):  # each minibatch normalised over its own sequences (StepTotals)
        batches = [per_group[p] for epoch in order for p in epoch]
        return expected_update(
            theta0, batches, aggregation="seq_mean_token_mean", opt=AdamW(lr=0.3)
        )[0]

    want = run(orders)
    assert theta_of(policy) == pytest.approx(want, abs=TOL)
    assert result.metrics["optim/steps"] == 4
    for other in ([[0, 1], [0, 1]], [[1, 0], [1, 0]], [[0, 1], [1, 0]]):
        assert _far(want, run(other), 1e-4)  # unshuffled, one permutation reused, ...
    one_batch = expected_update(
        theta0, [per_group[0] + per_group[1]] * 2, aggregation="seq_mean_token_mean",
        opt=AdamW(lr=0.3),
    )[0]  # fmt: skip
    assert _far(want, one_batch, 1e-4)  # the minibatches are not one batch
