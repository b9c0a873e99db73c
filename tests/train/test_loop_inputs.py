"""What the step hands its parts, pinned by known answers (the mutation triage of
``train/loop.py``, docs/mutation.md): each test kills surviving mutants of the loop.

- ``step_selection``: the step-level top-entropy threshold and KL-Cov's selection count the
  step's loss mask, the rollout correction's rejected tokens out, and only kept rows.
- ``step_advantages``: OPO's lengths, IS-GRPO-exact's draw weights (ignored by GRPO), AVSPO's
  run trigger and the task's reward range, each against advantages derived by hand.
- ``_balance``: R/KL on the low-σ rows with the loss as trained (CISPO off-policy with its
  clip, the rollout correction's weights and rejection, the ratio KL correction, L_max),
  gradients by hand on the three-parameter policy of ``hand_policy.py``.
- the update's bookkeeping: the seeded shuffle, ``UpdateLog`` / ``StepStats`` means, a
  micro-batch without loss tokens, an empty step, skipped steps, OPSM's weight times the
  per-batch correction's, ``balance=True``.
- the batch: draw importance weights, GDPO's float32 parts on the run's device, the
  unscorable share over dynamic sampling's rounds.
- the run: printed notes, the final save, the sinks' settings, the resume note, stage times
  (and the GPU synchronisation), the collapse split's reward range, a KL in the reward.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
import torch
from hand_policy import (
    BASE,
    HandPolicy,
    HandTask,
    HandTokenizer,
    first_is,
    grpo_advantages,
    log_prob,
    softmax,
    step_round,
    train_hand,
)
from train_toy import WORDS, ToyTask, make

from grouprl import losses
from grouprl.losses import correction
from grouprl.tasks.base import Example
from grouprl.tasks.verify import BatchScores
from grouprl.train import config as config_module
from grouprl.train import filters, inputs, loop, update
from grouprl.train.config import load_config
from grouprl.train.loop import Timer, collect_batch, step_advantages
from grouprl.train.state import setup
from grouprl.train.targets import Targets
from grouprl.train.update import LossSpec


def _spec(run) -> LossSpec:
    return LossSpec.of(run.preset, run.cfg)


def _parts(run):
    return run.policy, run.optimizer


def _update(run, batch, targets):
    seed = run.cfg.run.seed * 1_000_003 + run.step
    return update.update_policy(
        *_parts(run), batch, targets, _spec(run), schedule=run.cfg.schedule(run.preset),
        shuffle=torch.Generator().manual_seed(seed), timer=Timer(run.device),
    )  # fmt: skip


class _VariedTask(ToyTask):
    """The toy task with a different prompt per group: token entropies differ between
    groups (one prompt would tie them at each position)."""

    def examples(self, split, n, seed):
        return [
            Example(f"varied/{split}/{seed}/{i}", " ".join(WORDS[: 1 + (i + seed) % 4]), "a")
            for i in range(n)
        ]


# ---- step_selection: the loss mask, not the sampled mask ------------------------------------


def _selection_inputs(tmp_path, *extra):
    """The toy run at micro-batches of one group, its first batch, the rows' entropies and
    log-probs from one forward, and Targets whose rollout correction rejects the valid tokens
    of highest entropy (a third of them) and whose ``keep`` drops the last group."""
    cfg, inj = make(tmp_path, "optim.micro_batch_size=4", *extra, task=_VariedTask())
    run = setup(cfg, **inj)
    batch, _ = collect_batch(run, Timer(run.device))
    _, adv_n, _ = step_advantages(run, batch, None)
    n = batch.mask.shape[0]
    with torch.no_grad():
        lp = run.policy.logprobs(batch, torch.arange(n), entropy=True)
    valid = batch.mask > 0
    ent = lp.entropy.float().masked_fill(~valid, -1.0)
    top = ent.reshape(-1).topk(int(valid.sum()) // 3).indices
    rejected = torch.zeros(valid.numel(), dtype=torch.bool)
    rejected[top] = True
    rejected = rejected.view_as(valid)
    corr = correction.Correction(weight=batch.mask.float(), keep=~rejected)
    keep = torch.ones(n, dtype=torch.bool)
    keep[-batch.group_size :] = False
    clip, _ = run.controller.clip_params(run.policy, batch, dict(run.preset.surrogate_params))
    targets = Targets(adv_n, keep, torch.ones(n), None, clip, correction=corr)
    return run, batch, targets, lp, rejected


def _select(run, batch, targets, loss_mask):
    rows = torch.arange(batch.mask.shape[0])
    micro = update.micro_batches(
        rows, targets, beta=0.0, g=batch.group_size, size=4,
        every_row=run.preset.surrogate not in losses.ZERO_AT_ZERO_ADVANTAGE,
    )  # fmt: skip
    assert len(micro) > 1  # the step-level path, not the loss call's own
    totals = losses.step_totals(loss_mask, keep=targets.keep, max_len=batch.mask.shape[1])
    out, selected = update.step_selection(
        run.policy, batch, targets, _spec(run), loss_mask, micro, totals, timer=Timer(run.device)
    )
    return micro, out, selected


def test_no_selection_takes_no_extra_forward(tmp_path, monkeypatch):
    # ρ = 1 and a surrogate without a step selection: nothing to select before the backward,
    # so no no-grad forward of the micro-batches (the totals come back as given)
    run, batch, targets, _, _ = _selection_inputs(tmp_path)
    assert _spec(run).top_entropy_quantile == 1.0 and _spec(run).select is None
    calls = []
    real = run.policy.logprobs
    monkeypatch.setattr(run.policy, "logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    loss_mask = targets.loss_mask(batch.mask)
    micro, out, selected = _select(run, batch, targets, loss_mask)
    assert calls == [] and selected == [None] * len(micro)
    assert out.entropy_threshold is None


def test_the_steps_top_entropy_threshold_counts_the_loss_mask_not_the_rejected_tokens(tmp_path):
    run, batch, targets, lp, rejected = _selection_inputs(
        tmp_path, "algorithm.top_entropy_quantile=0.5"
    )
    loss_mask = targets.loss_mask(batch.mask)
    assert rejected.any() and bool((batch.mask.bool() & rejected).any())
    _, totals, selected = _select(run, batch, targets, loss_mask)
    assert selected == [None] * len(selected)  # no covariance selection for this surrogate
    # by hand: the median (ρ = 0.5) of the entropies of the valid, unrejected tokens of kept
    # rows; torch.quantile's linear interpolation is the definition
    counted = loss_mask.bool() & targets.keep[:, None]
    want = float(torch.quantile(lp.entropy.float()[counted], 0.5))
    assert totals.entropy_threshold == pytest.approx(want, rel=1e-6)
    # counting the rejected tokens (the highest entropies) would move the median up, and
    # counting the dropped group would move it too: both are other thresholds
    with_rejected = batch.mask.bool() & targets.keep[:, None]
    wrong = float(torch.quantile(lp.entropy.float()[with_rejected], 0.5))
    with_dropped = float(torch.quantile(lp.entropy.float()[loss_mask.bool()], 0.5))
    assert wrong - want > 1e-3 and abs(with_dropped - want) > 1e-4  # ≫ the 1e-6 tolerance


def test_the_steps_kl_cov_selection_counts_the_loss_mask_not_the_rejected_tokens(tmp_path):
    run, batch, targets, lp, _ = _selection_inputs(
        tmp_path, "algorithm.surrogate=kl_cov",
        "algorithm.surrogate_params={kl_cov_ratio: 0.1, ppo_kl_coef: 1.0}",
    )  # fmt: skip
    loss_mask = targets.loss_mask(batch.mask)
    micro, _, selected = _select(run, batch, targets, loss_mask)
    rows = torch.cat([m for m, _ in micro])
    got = torch.zeros_like(batch.mask, dtype=torch.bool)
    for (m, _), s in zip(micro, selected):
        got[m] = s[:, : got.shape[1]]
    # by hand: over the counted tokens (valid, unrejected, kept rows) the covariance term
    # (A − mean A)(log π − mean log π), both means over those tokens; the top ⌊0.1·count⌋
    counted = loss_mask.bool() & targets.keep[:, None]
    a = targets.adv[:, None].expand_as(lp.logp)
    mean_a, mean_lp = a[counted].mean(), lp.logp[counted].mean()
    cov = ((a - mean_a) * (lp.logp - mean_lp)).masked_fill(~counted, -float("inf"))
    k = int(0.1 * int(counted.sum()))
    want = torch.zeros(cov.numel(), dtype=torch.bool)
    want[cov.reshape(-1).topk(k).indices] = True
    assert k >= 2 and int(got.sum()) == k
    assert torch.equal(got, want.view_as(got))
    assert len(rows) == batch.mask.shape[0]
    # counting the rejected tokens is another count (⌊0.1·valid⌋ of every kept row)
    assert int(0.1 * int((batch.mask.bool() & targets.keep[:, None]).sum())) != k


# ---- step_advantages: what the estimator reads, by hand --------------------------------------
# The hand policy's run (hand_policy.py), its first batch, then the batch's rewards (and the
# inputs under test) set by the test: step_advantages reads nothing else of the batch.


def _hand_batch(tmp_path, *overrides, reward_range=(0.0, 1.0)):
    task = HandTask({"ab": first_is("a")}, reward_range=reward_range)
    cfg = load_config(None, [*BASE, f"run.out={tmp_path}", *overrides], validate=False)
    run = setup(cfg, model=HandPolicy(), tokenizer=HandTokenizer(), task=task)
    run.step = 1
    batch, _ = collect_batch(run, Timer(run.device))
    return run, batch


def _adv(run, batch, **fields):
    adv, adv_n, metrics = step_advantages(run, dataclasses.replace(batch, **fields), None)
    return adv, [float(x) for x in adv_n], metrics


MIXED = [0.0, 1.0, 1.0, 0.0]


def test_opo_reads_each_completions_length_from_the_mask(tmp_path):
    run, batch = _hand_batch(tmp_path, "algorithm.preset=opo")
    rewards = torch.tensor([MIXED, [1.0, 1.0, 1.0, 1.0]])
    lengths = [1, 3, 2, 2, 1, 1, 1, 1]
    mask = torch.tensor([[1.0] * n + [0.0] * (3 - n) for n in lengths])
    _, got, _ = _adv(run, batch, rewards=rewards, mask=mask)
    # OPO: b = Σ L·r / Σ L = (3 + 2)/8 in the first group; the second is collapsed (0)
    b = 5 / 8
    assert got == pytest.approx([r - b for r in MIXED] + [0.0] * 4, abs=1e-6)
    # the plain mean 1/2 would be another baseline
    assert abs(b - 0.5) > 0.1


def test_is_grpo_exact_weighs_each_group_by_its_draws_importance_weight(tmp_path):
    run, batch = _hand_batch(tmp_path, "algorithm.preset=is_grpo_exact", "sampling.pool_size=4")
    rewards = torch.tensor([MIXED, [1.0, 0.0, 0.0, 0.0]])
    weights = torch.tensor([2.0, 0.5])
    _, got, _ = _adv(run, batch, rewards=rewards, draw_weights=weights)
    # Dr.GRPO r − mean, times the group's weight
    want = [2.0 * (r - 0.5) for r in MIXED] + [0.5 * (r - 0.25) for r in (1.0, 0.0, 0.0, 0.0)]
    assert got == pytest.approx(want, abs=1e-6)
    # a preset without the sampler's weight ignores the draw weights (GRPO by hand)
    run2, batch2 = _hand_batch(tmp_path / "grpo", "algorithm.preset=grpo")
    _, plain, _ = _adv(run2, batch2, rewards=rewards, draw_weights=weights)
    want2 = grpo_advantages(MIXED) + grpo_advantages([1.0, 0.0, 0.0, 0.0])
    assert plain == pytest.approx(want2, abs=1e-6)


def test_avspo_reads_the_runs_trigger_and_the_tasks_reward_range(tmp_path):
    # rewards on [0, 2]: an all-correct group (2s) and a mixed one, batch ACR 1/2; the run's
    # trigger at τ = 0.2 fires (1/2 > 0.2), its default τ = 0.5 would not
    run, batch = _hand_batch(tmp_path, "algorithm.preset=avspo", reward_range=(0.0, 2.0))
    run.trigger.tau = 0.2
    rewards = torch.tensor([[2.0, 2.0, 2.0, 2.0], [0.0, 2.0, 0.0, 2.0]])
    adv, got, _ = _adv(run, batch, rewards=rewards)
    # K = max(1, min(4, ⌈4·(1/2)^0.5⌉)) = 3 virtual rewards r_hi − (r_hi − r_lo)·k/K = 4/3, 2/3,
    # 0 (on [0, 1] they would be 2/3, 1/3, 0); GRPO over the 7, the 4 real ones kept
    virtual = [4 / 3, 2 / 3, 0.0]
    want = grpo_advantages([2.0] * 4 + virtual)[:4] + grpo_advantages([0.0, 2.0, 0.0, 2.0])
    assert got == pytest.approx(want, abs=1e-6)
    assert want[0] > 0.1  # the collapsed group learns only through the virtual samples
    # the run's trigger advanced once: its EMA starts at the batch's mean reward 12/8
    assert run.trigger.steps == 1 and run.trigger.reward_ema == pytest.approx(1.5)
    assert adv.stats["virtual/tau_adapt"] == pytest.approx(0.2)


# ---- BalanceProbe: R/KL on the low-σ rows, from the step's own loss ------------------------


def test_the_low_sigma_balance_is_the_trained_loss_of_those_rows_by_hand(tmp_path):
    # One token per completion (max_new_tokens=1). The batch's behaviour log-probs are those
    # of θ_old ≠ θ (ratios ≠ 1, some outside CISPO's bounds [1 − 0.3, 1 + 0.1]), the
    # reference is θ_ref ≠ θ (KL ≠ 0, so the ratio KL correction changes the KL gradient),
    # the rollout correction weighs rows 4 and 5 (0.5, 2) and rejects row 6, and the step's
    # L_max is 4 while the completions are 1 token wide. Rows 4-7 are the low-σ subset.
    run, batch = _hand_batch(
        tmp_path, "algorithm.preset=grpo", "algorithm.surrogate=cispo", "algorithm.beta=0.5",
        "algorithm.kl=k1", "algorithm.kl_correction=ratio",
        "algorithm.aggregation=seq_mean_token_sum_norm",
    )  # fmt: skip
    theta, old, ref = [-0.5, 0.3, 0.0], [0.2, -0.4, 0.1], [0.0, 0.5, -0.3]
    ys = [int(y) for y in batch.completion_ids[:, 0]]
    assert batch.mask.shape == (8, 1) and bool((batch.mask == 1).all())
    col = lambda th: torch.tensor([[log_prob(th, y)] for y in ys])  # noqa: E731
    batch = dataclasses.replace(batch, old_logp=col(old))
    adv = [0.5, -1.0, 1.5, -0.5, 1.0, -2.0, 0.7, -0.3]
    weight = [1.0, 1.0, 1.0, 1.0, 0.5, 2.0, 1.0, 1.0]
    kept = [True] * 6 + [False, True]
    corr = correction.Correction(
        weight=torch.tensor(weight)[:, None], keep=torch.tensor(kept)[:, None]
    )
    targets = Targets(
        torch.tensor(adv), torch.ones(8, dtype=torch.bool), torch.tensor([1.0] * 4 + [3.0] * 4),
        col(ref), {"eps_low": 0.3, "eps_high": 0.1}, correction=corr,
    )  # fmt: skip
    rows = torch.arange(8)
    totals = losses.step_totals(targets.loss_mask(batch.mask), keep=targets.keep, max_len=4)
    obj = update.micro_batch_loss(
        run.policy, batch, targets, _spec(run), rows, totals, timer=Timer(run.device)
    )
    low = torch.tensor([False] * 4 + [True] * 4)
    probe = update.BalanceProbe(
        list(run.policy.model.parameters()), _spec(run).beta, [(rows, True)],
        targets.loss_mask(batch.mask), targets, totals, low,
    )  # fmt: skip
    probe.add(obj, rows)  # the update's own objective: no second forward, no second loss
    out = probe.metrics()

    pi = softmax(theta)

    def branches(subset):
        """(g_R, g_KL) by hand: CISPO's −w·clip(ρ)·A and the unweighted k1 branch under the
        ratio correction, ρ·(log π − log π_ref + 1), each times (e_y − π)/(S·L_max)."""
        counted = [i for i in subset if kept[i]]
        scale = 1 / (len(counted) * 4)
        g_r, g_kl = [0.0] * 3, [0.0] * 3
        for i in counted:
            y = ys[i]
            rho = math.exp(log_prob(theta, y) - log_prob(old, y))
            c_r = -weight[i] * min(max(rho, 0.7), 1.1) * adv[i]
            c_kl = rho * (log_prob(theta, y) - log_prob(ref, y) + 1)
            for k in range(3):
                g_r[k] += scale * c_r * ((k == y) - pi[k])
                g_kl[k] += scale * c_kl * ((k == y) - pi[k])
        return g_r, g_kl

    for name, subset in (("batch", range(8)), ("low_sigma", range(4, 8))):
        g_r, g_kl = branches(subset)
        n_r, n_kl = math.hypot(*g_r), math.hypot(*g_kl)
        assert out[f"balance/{name}/reward_grad_norm"] == pytest.approx(n_r, rel=1e-5)
        assert out[f"balance/{name}/kl_grad_norm"] == pytest.approx(n_kl, rel=1e-5)
        assert out[f"balance/{name}/r_over_kl"] == pytest.approx(n_r / (0.5 * n_kl), rel=1e-5)
        cos = sum(a * b for a, b in zip(g_r, g_kl)) / (n_r * n_kl)
        assert out[f"balance/{name}/cosine"] == pytest.approx(cos, abs=1e-5)
    assert out["balance/low_sigma/rows"] == 4.0
    # the inputs act: some ratio is clipped, the rows' tokens differ
    rhos = [math.exp(log_prob(theta, y) - log_prob(old, y)) for y in ys[4:]]
    assert any(r > 1.1 or r < 0.7 for r in rhos) and len(set(ys[4:])) > 1, ys

    # both groups in the subset, one micro-batch each: the subset's gradients are the sums of
    # its two micro-batches' (each aggregated under the subset's totals), the by-hand numbers
    # of all eight rows; balance/batch/* is the first micro-batch's group alone
    halves = [rows[:4], rows[4:]]
    probe = update.BalanceProbe(
        list(run.policy.model.parameters()), _spec(run).beta, [(h, True) for h in halves],
        targets.loss_mask(batch.mask), targets, totals, torch.ones(8, dtype=torch.bool),
    )  # fmt: skip
    for h in halves:
        probe.add(update.micro_batch_loss(run.policy, batch, targets, _spec(run), h, totals,
                                          timer=Timer(run.device)), h)  # fmt: skip
    out = probe.metrics()
    for name, subset in (("batch", range(4)), ("low_sigma", range(8))):
        g_r, g_kl = branches(subset)
        if name == "batch":  # the first micro-batch under the step's totals: 7 kept rows
            g_r, g_kl = ([x * 4 / 7 for x in g] for g in (g_r, g_kl))
        assert out[f"balance/{name}/reward_grad_norm"] == pytest.approx(math.hypot(*g_r), rel=1e-5)
        assert out[f"balance/{name}/kl_grad_norm"] == pytest.approx(math.hypot(*g_kl), rel=1e-5)
    assert out["balance/low_sigma/rows"] == 8.0


# ---- update_policy: the seeded shuffle ------------------------------------------------------


def test_the_groups_are_shuffled_by_the_seed_and_step_stream(tmp_path, monkeypatch):
    # the documented stream: epoch orders from torch.randperm(P) with a generator seeded
    # seed·1000003 + step (resume replays it); step 5 of seed 3, 4 groups in 4 minibatches
    run, batch = _hand_batch(
        tmp_path, "sampling.prompts_per_step=4", "optim.minibatches=4", "optim.ppo_epochs=2",
        "run.seed=3",
    )  # fmt: skip
    run.step = 5
    seen: list[list[int]] = []
    monkeypatch.setattr(update, "optimizer_step", lambda *a, **k: seen.append(a[5]))
    n = batch.mask.shape[0]
    targets = Targets(torch.ones(n), torch.ones(n, dtype=torch.bool), torch.ones(n), None, {})
    _update(run, batch, targets)

    def orders(seed):
        gen = torch.Generator().manual_seed(seed)
        return [torch.randperm(4, generator=gen).tolist() for _ in range(2)]

    want = orders(3 * 1_000_003 + 5)
    assert [[int(r[0]) // 4 for r in seen[e * 4 : e * 4 + 4]] for e in range(2)] == want
    assert all(r.tolist() == list(range(r[0], r[0] + 4)) for r in seen)  # whole groups
    assert want != orders(3 * 1_000_003 - 5) and want[0] != want[1]


# ---- UpdateLog / StepStats: the update's metrics as means over the steps taken ---------------


def test_the_update_log_averages_over_the_steps_taken_by_hand():
    # step 1: two micro-batches of 1/4 and 3/4 of the sequences; step 2: half of its
    # sequences in a micro-batch without a loss token (missing 1/2), the other half's
    # statistics rescaled to the whole step
    one = update.StepStats()
    one.add({"pg_loss": 0.5, "kl_loss": 0.25, "ratio_mean": 1.0, "kl_mean": 0.1}, 0.25)
    one.add({"pg_loss": -0.125, "kl_loss": 0.125, "ratio_mean": 2.0, "kl_mean": 0.3}, 0.75)
    assert one.losses == {"pg": 0.375, "kl": 0.375}
    assert one.policy == pytest.approx({"ratio_mean": 1.75, "kl_mean": 0.25})
    two = update.StepStats(missing=0.5)
    two.add({"pg_loss": 1.0, "ratio_mean": 3.0}, 0.5)
    log = update.UpdateLog(skipped=2, empty=1, balance={"balance/batch/cosine": 0.5})
    log.add(one, 4.0)
    log.add(two, 2.0)
    m = log.metrics()
    assert m == pytest.approx(
        {
            "loss/pg": (0.375 + 1.0) / 2,
            "loss/kl": 0.375 / 2,
            "loss/total": (0.375 + 1.0) / 2 + 0.375 / 2,
            "policy/ratio_mean": (1.75 + 3.0) / 2,  # 1.5 of half the step, over 1 − 1/2
            "kl/mean": 0.25 / 2,
            "optim/grad_norm": 3.0,
            "optim/steps": 2.0,
            "optim/skipped_steps": 2.0,
            "optim/empty_steps": 1.0,
            "balance/batch/cosine": 0.5,
        }
    )
    # no step taken: no gradient norm, zero losses, the counts
    empty = update.UpdateLog(empty=1).metrics()
    assert empty == {
        "kl/mean": 0.0, "loss/total": 0.0, "optim/steps": 0.0, "optim/skipped_steps": 0.0,
        "optim/empty_steps": 1.0,
    }  # fmt: skip


# ---- the run: its notes, final save, sinks, result and stage times ---------------------------


def test_a_runs_notes_final_save_sinks_and_result(tmp_path, capsys):
    # two steps of GRPO at its own one-step schedule, a rollout correction set although the
    # rollouts are sampled at the training precision, save_final on a policy that cannot
    # save_pretrained, tensorboard off
    task = HandTask({"ab": first_is("a", empty=0.5)})
    result, _, _ = train_hand(
        tmp_path, task, "optim.steps=2", "algorithm.rollout_correction=icepop",
        "run.save_final=true",
    )  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert (result.run_dir, result.step, result.stopped_by) == (tmp_path, 2, None)
    notes = [line for line in out if line.startswith(("note:", "schedule:", "warning:"))]
    assert notes == [
        "note: grpo takes one optimizer step per generation batch, as its sources do: every "
        "step is on-policy (ratio 1), so the ppo_clip clip does not act",
        "note: algorithm.rollout_correction='icepop' has nothing to correct: the rollouts are "
        "sampled at the training precision (model.rollout_precision=same), so their log-probs "
        "are the trainer's and every correction weight is 1",
    ]
    assert out.count("final policy not written: HandPolicy has no save_pretrained") == 1
    assert not (tmp_path / "tb").exists()  # run.tensorboard=false, though tensorboard is here
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert "resume/changed" not in rows[0]
    assert [k for k in rows[0] if k.startswith("eval/")] == []  # eval.every=0
    # without save_final and without the correction: neither line
    again, _, _ = train_hand(tmp_path / "b", HandTask({"ab": first_is("a")}), "optim.steps=1")
    out = capsys.readouterr().out
    assert "final policy" not in out and "has nothing to correct" not in out
    assert again.run_dir == tmp_path / "b"


def test_a_steps_stage_times_are_its_own(tmp_path, monkeypatch):
    # every stage of a step is timed under its own name, and the step's time spans them
    run, _ = _hand_batch(tmp_path, "algorithm.beta=0.1")
    clock = itertools.count(1000.0)  # each perf_counter call one second later
    monkeypatch.setattr(loop.time, "perf_counter", lambda: next(clock))
    m = loop.train_step(run)
    times = {k: v for k, v in m.items() if k.startswith("time/")}
    assert set(times) == {f"time/{s}" for s in loop.Timer.STAGES} | {"time/step"}
    assert all(v >= 1.0 for v in times.values())  # every stage ran (whole seconds)
    calls = next(clock) - 1000.0  # the clock's reads so far
    assert sum(v for k, v in times.items() if k != "time/step") <= times["time/step"] < calls


def test_a_micro_batch_without_loss_tokens_is_left_out_of_the_steps_means(tmp_path):
    # two micro-batches of one group; the second group's completions are all masked, so its
    # micro-batch is skipped (exactly 0 of the loss) and the step's statistics are those of
    # the first alone: the ratio 1 on-policy, the entropy H(π) of the hand policy's θ
    run, batch = _hand_batch(tmp_path, "optim.micro_batch_size=4")
    mask = batch.mask.clone()
    mask[4:] = 0.0
    batch = dataclasses.replace(batch, mask=mask)
    n = mask.shape[0]
    adv = torch.tensor([1.0, -1.0] * 4)
    targets = Targets(adv, torch.ones(n, dtype=torch.bool), torch.ones(n), None, {})
    log = update.UpdateLog()
    rows = torch.arange(n)
    update.optimizer_step(
        *_parts(run), batch, targets, _spec(run), rows, timer=Timer(run.device), log=log
    )
    entropy = -sum(p * math.log(p) for p in softmax([-0.5, 0.3, 0.0]))
    assert log.taken == 1 and log.skipped == 0
    assert log.policy["entropy_mean"] == pytest.approx(entropy, rel=1e-5)
    assert log.policy["ratio_mean"] == pytest.approx(1.0, rel=1e-6)
    assert log.policy["kept_frac"] == pytest.approx(1.0)
    # optim.entropy=false (and no top-entropy selection): the entropy is not computed
    run.cfg = dataclasses.replace(run.cfg, optim=dataclasses.replace(run.cfg.optim, entropy=False))
    log = update.UpdateLog()
    update.optimizer_step(
        *_parts(run), batch, targets, _spec(run), rows, timer=Timer(run.device), log=log
    )
    assert log.taken == 1 and log.policy["entropy_mean"] == 0.0  # 0: not computed
    # every completion masked: an empty step, counted once, no AdamW step
    batch = dataclasses.replace(batch, mask=torch.zeros_like(mask))
    before = [float(x) for x in run.model.theta.detach()]
    log = update.UpdateLog()
    update.optimizer_step(
        *_parts(run), batch, targets, _spec(run), rows, timer=Timer(run.device), log=log
    )
    assert (log.empty, log.taken, log.skipped) == (1, 0, 0)
    assert [float(x) for x in run.model.theta.detach()] == before
    update.optimizer_step(  # a second empty step in the same update adds one
        *_parts(run), batch, targets, _spec(run), rows, timer=Timer(run.device), log=log
    )
    assert (log.empty, log.taken, log.skipped) == (2, 0, 0)


def test_the_current_policy_correction_multiplies_the_batchs_correction_weight(
    tmp_path, monkeypatch
):
    # a chain of a per-batch method (its weights given: 0.5 / 2 per row) and OPSM, which runs
    # in the loss on the current policy: OPSM drops (weight 0) the sequences with A < 0 whose
    # mean log(π_rollout/π_θ) exceeds δ = 0; the loss's weight is the product of the two
    run, batch = _hand_batch(
        tmp_path, "algorithm.rollout_correction=token_tis:cap=2+opsm:threshold=0"
    )
    ys = [int(y) for y in batch.completion_ids[:, 0]]
    lp = torch.tensor([[log_prob([-0.5, 0.3, 0.0], y)] for y in ys])
    drift = [0.1, 0.1, -0.1, -0.1] * 2  # log π_rollout − log π_θ per row
    batch = dataclasses.replace(batch, old_logp=lp, rollout_logp=lp + torch.tensor(drift)[:, None])
    adv = [1.0, -1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 1.0]
    given = [0.5, 2.0] * 4
    corr = correction.Correction(weight=torch.tensor(given)[:, None], keep=batch.mask > 0)
    n = len(adv)
    targets = Targets(torch.tensor(adv), torch.ones(n, dtype=torch.bool), torch.ones(n), None,
                      {}, correction=corr)  # fmt: skip
    seen = []
    real = losses.objective
    monkeypatch.setattr(
        loop.losses, "objective",
        lambda *a, **k: seen.append(k["correction_weight"]) or real(*a, **k),
    )  # fmt: skip
    rows = torch.arange(n)
    totals = losses.step_totals(batch.mask, keep=targets.keep, max_len=1)
    update.micro_batch_loss(
        run.policy, batch, targets, _spec(run), rows, totals, timer=Timer(run.device)
    )
    dropped = [a < 0 and d > 0 for a, d in zip(adv, drift)]
    want = [0.0 if drop else w for w, drop in zip(given, dropped)]
    assert [float(x) for x in seen[0][:, 0]] == pytest.approx(want)
    assert 0 < sum(dropped) < n


def test_every_sampling_of_a_step_is_timed_by_the_steps_timer(tmp_path, monkeypatch):
    # AGPO probes each prompt before the training groups are sampled (collect_batch's probe),
    # ReMax samples a greedy completion per prompt (reward_side): every generation (and the
    # scoring inside it) counts in the step's stage times
    timers = []

    def recording(real):
        def sample(*a, timer=None, **k):
            timers.append(timer)
            return real(*a, timer=timer, **k)

        return sample

    monkeypatch.setattr(loop, "sample_groups", recording(loop.sample_groups))
    monkeypatch.setattr(inputs, "greedy_rewards", recording(inputs.greedy_rewards))
    for preset in ("agpo", "remax"):
        run, _ = _hand_batch(tmp_path / preset, f"algorithm.preset={preset}")
        timers.clear()
        timer = Timer(run.device)
        loop.collect_batch(run, timer)
        # AGPO: the probe, the groups; ReMax: the groups, the greedy completions
        assert len(timers) == 2 and all(t is timer for t in timers), preset


def test_a_steps_collapse_split_reads_the_tasks_reward_range(tmp_path):
    # every reward 1 on a task whose range is [0, 2]: both groups collapsed, neither all
    # correct (2) nor all wrong (0) but "other" (on [0, 1] they would be all correct)
    task = HandTask({"one": lambda words: 1.0}, reward_range=(0.0, 2.0))
    result, _, _ = train_hand(tmp_path, task)
    m = result.metrics
    split = [m[f"acr/{k}"] for k in ("rate", "all_correct", "all_wrong", "other")]
    assert split == [1.0, 0.0, 0.0, 1.0]


def test_the_batch_carries_each_draws_importance_weight(tmp_path):
    # IS-GRPO-exact over a pool of 4: after the sampler saw σ̂ = std(0, 1, 0, 1) for prompt 0
    # and std(0, 0, 0, 1) = 1/2 for prompt 1, p ∝ max(σ̂, 0.05) with the unvisited prompts at
    # the mean σ̂; each drawn group's weight is 1/(|pool|·p) of its prompt, as drawn
    run, _ = _hand_batch(tmp_path, "algorithm.preset=is_grpo_exact", "sampling.pool_size=4")
    run.step = 2
    run.prompts.observe(torch.tensor([0, 1]), torch.tensor([MIXED[:2] * 2, [0.0, 0.0, 0.0, 1.0]]))
    sigma = [math.sqrt(1 / 3), 0.5]
    sigma += [sum(sigma) / 2] * 2
    p = [s / sum(sigma) for s in sigma]
    batch, _ = collect_batch(run, Timer(run.device))
    drawn = [int(e.rsplit("/", 1)[1]) for e in batch.example_ids]
    assert batch.draw_weights is not None
    assert [float(w) for w in batch.draw_weights] == pytest.approx([1 / (4 * p[i]) for i in drawn])
    assert len({round(1 / (4 * x), 6) for x in p}) > 1  # the weights differ from 1


def test_gdpo_reads_each_functions_rewards_as_float32_parts(tmp_path):
    # two reward functions (weights 1 and 2) on 2 prompts × 4 completions: the estimator gets
    # [P, G, K] float32 parts, also under a float64 default dtype, and the weights
    run, _ = _hand_batch(tmp_path, "algorithm.preset=gdpo")
    flat = [[float(i % 2), float(i // 2 % 2)] for i in range(8)]  # [P·G, K]
    scores = BatchScores([0.0] * 8, 0, per_function=flat, function_weights=(1.0, 2.0))
    overlong = filters.Overlong.of(None, max_new_tokens=1, cache=0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.set_default_device("meta")  # the parts go to the run's device, not the default one
    try:
        out = inputs.round_inputs(run.preset.reads, _view(run, scores, overlong))
    finally:
        torch.set_default_dtype(default)
        torch.set_default_device(None)
    assert out["reward_parts"].dtype == torch.float32
    assert out["reward_parts"].device == run.device
    assert out["reward_parts"].tolist() == [flat[:4], flat[4:]]
    assert out["reward_weights"] == (1.0, 2.0) and "baseline" not in out
    # GRPO sums the functions (the scorer's reward): no parts are collected for it
    assert run.preset.combination == "normalize_then_sum"
    grpo, _ = _hand_batch(tmp_path / "grpo")
    assert grpo.preset.combination == "sum" and "reward_parts" not in grpo.preset.reads
    assert inputs.round_inputs(grpo.preset.reads, _view(grpo, scores, overlong)) == {}


def _view(run, scores, overlong) -> inputs.RoundView:
    """A round of 2 prompts as the round-level providers see it."""
    return inputs.RoundView(
        run.policy, run.scorer, [None, None], scores, None, overlong, run.gen, Timer(run.device),
        run.device,
    )  # fmt: skip


def test_on_a_gpu_each_timed_stage_ends_with_a_synchronisation(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(a))
    gpu, cpu = Timer(torch.device("cuda")), Timer(torch.device("cpu"))
    for timer in (gpu, cpu):
        with timer("logprobs"):
            pass
        with timer("correction"):  # a stage outside STAGES, logged once it ran
            pass
    assert len(calls) == 2  # the GPU timer's two stages, none of the CPU timer's
    assert set(cpu.metrics(step=1.0)) == {f"time/{s}" for s in (*Timer.STAGES, "correction")} | {
        "time/step"
    }


def test_a_resumed_runs_note_is_in_its_first_metrics_row(tmp_path, monkeypatch):
    # what --resume-anyway changed (Run.resume_note, train.resume.check) goes into the first
    # row the run writes, and only that one
    real = loop.setup

    def setup(cfg, **injected):
        run = real(cfg, **injected)
        run.resume_note = {"resume/changed": ["optim.lr"]}
        return run

    monkeypatch.setattr(loop, "setup", setup)
    train_hand(tmp_path, HandTask({"ab": first_is("a")}), "optim.steps=2")
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("resume/changed") for r in rows] == [["optim.lr"], None]


def test_the_runs_sinks_get_the_configs_settings(tmp_path, monkeypatch):
    seen = []

    class Recording(loop.Sinks):
        def __init__(self, *a, **k):
            seen.append((a, k))
            super().__init__(*a, **k)

    monkeypatch.setattr(loop, "Sinks", Recording)
    # wandb is not installed here: the config's check and the sink's opening are skipped
    monkeypatch.setattr(config_module, "_check_loggers", lambda run: None)
    monkeypatch.setattr(Recording, "_open_wandb", lambda self, config, step: None)
    train_hand(
        tmp_path, HandTask({"ab": first_is("a")}), "optim.steps=2", "run.progress=true",
        "run.tensorboard=true", "run.wandb=true",
    )  # fmt: skip
    ((args, kwargs),) = seen
    assert args[0] == tmp_path and args[1]["optim"]["steps"] == 2
    assert kwargs == {
        "total_steps": 2, "resume_step": 0, "tensorboard": True, "wandb": True,
        "progress": True, "note": None,
    }  # fmt: skip


def test_a_kl_in_the_reward_without_a_loss_side_kl_logs_no_loss_kl(tmp_path):
    # REINFORCE++ (global) folds −β·KL into the reward and has β = 0 in the loss: the
    # reference's log-probs feed the reward, never the loss or its kl/* metrics
    task = HandTask({"ab": first_is("a", empty=0.5)})
    result, _, _ = train_hand(tmp_path, task, "algorithm.preset=reinforce_pp_global")
    m = result.metrics
    assert m["kl_reward/coef"] > 0 and "kl_reward/kl" in m
    assert "kl/p95" not in m and "kl/max" not in m and m["kl/mean"] == 0.0


def test_the_unscorable_share_is_the_mean_over_dynamic_samplings_rounds(tmp_path):
    # DAPO's dynamic sampling (the draws of test_step_sampling's refill test): round 0 draws
    # an unscorable group (every reward NaN: dropped) and an informative one, round 1 two
    # informative ones; the unscorable share is the rounds' mean, (4/8 + 0/8)/2
    tables = {"nan": lambda words: math.nan, "ab": first_is("a"), "ba": first_is("b", empty=0.5)}

    def plan(split, seed, i):
        return "q", (["nan", "ab"] if step_round(seed)[1] == 0 else ["ba", "ab"])[i]

    task = HandTask(tables, plan=plan)
    result, _, _ = train_hand(
        tmp_path, task, "algorithm.preset=dapo", "algorithm.overlong=null",
        "optim.minibatches=1", "run.seed=2", "sampling.max_unscorable_frac=1.0",
    )  # fmt: skip
    m = result.metrics
    assert m["dynamic/tries"] == 2 and len(task.calls) == 16
    assert m["reward/unscorable_frac"] == pytest.approx(0.25)


def test_an_optimizer_step_measures_the_balance_without_a_low_sigma_subset(tmp_path):
    # optimizer_step(balance=True): R/KL on the batch only, no low-σ rows
    run, batch = _hand_batch(tmp_path, "algorithm.beta=0.5", "algorithm.kl=k1")
    n = batch.mask.shape[0]
    ref = run.reference.logprobs(run.policy, batch)
    targets = Targets(torch.tensor([1.0, -1.0] * 4), torch.ones(n, dtype=torch.bool),
                      torch.ones(n), ref, {})  # fmt: skip
    log = update.UpdateLog()
    update.optimizer_step(
        *_parts(run), batch, targets, _spec(run), torch.arange(n), timer=Timer(run.device),
        log=log, balance=True,
    )  # fmt: skip
    assert log.balance["balance/low_sigma/rows"] == 0.0
    assert log.balance["balance/batch/reward_grad_norm"] > 0
    assert not any(k.startswith("balance/low_sigma/r") and "rows" not in k for k in log.balance)


def test_each_skipped_minibatch_of_a_step_is_counted(tmp_path):
    # a prompt "z" poisons the training forward (NaN logits, hand_policy.py): two skipped
    # optimizer steps in one update are two
    task = HandTask({"ab": first_is("a")}, plan=lambda split, seed, i: ("z", "ab"))
    cfg = load_config(None, [*BASE, f"run.out={tmp_path}", "optim.max_nonfinite_steps=5"],
                      validate=False)  # fmt: skip
    run = setup(cfg, model=HandPolicy(), tokenizer=HandTokenizer(), task=task)
    run.step = 1
    batch, _ = collect_batch(run, Timer(run.device))
    n = batch.mask.shape[0]
    targets = Targets(torch.tensor([1.0, -1.0] * 4), torch.ones(n, dtype=torch.bool),
                      torch.ones(n), None, {})  # fmt: skip
    log = update.UpdateLog()
    for rows in (torch.arange(4), torch.arange(4, 8)):
        update.optimizer_step(
            *_parts(run), batch, targets, _spec(run), rows, timer=Timer(run.device), log=log
        )
    assert (log.skipped, log.taken, log.streak, log.diverged) == (2, 0, 2, False)
    assert (run.nonfinite_total, run.nonfinite_run) == (0, 0)  # the run's: train_step's to set
