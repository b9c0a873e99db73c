"""Stage 5, the update: epochs × minibatches of whole groups, one AdamW step each.

The objective's settings are one frozen :class:`LossSpec`, built once per run from the preset
and the config (:meth:`LossSpec.of`); :meth:`LossSpec.objective` is the one call of
``losses.objective`` in the trainer. The functions take the policy, the optimizer, the batch,
the step's targets and the spec, and return what they changed in an :class:`UpdateLog`
(statistics, the optimizer steps taken and skipped, the run of non-finite steps): the run's
counters are ``train()``'s, which reads them from the log.

Inputs the surrogate or the rollout correction declare (``grouprl.registry.INPUTS``) are
provided here by name: ``entropy`` (the forward computes the token entropies),
``step_selection`` (the surrogate's ``select`` over the whole minibatch before its first
backward, :func:`step_selection`) and ``current_logp`` (a correction recomputed from each
micro-batch's log-probs).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from grouprl import diagnostics, losses
from grouprl.losses import correction
from grouprl.train.batch import Batch, group_rows
from grouprl.train.targets import Targets

__all__ = [
    "BalanceProbe",
    "LossSpec",
    "StepStats",
    "UpdateLog",
    "gradient_rows",
    "guarded_step",
    "micro_batch_loss",
    "micro_batches",
    "optimizer_step",
    "step_selection",
    "update_policy",
]


@dataclass(frozen=True)
class LossSpec:
    """The settings of the objective for a whole run (the preset's and the config's).

    ``select``: the surrogate's step-level token selection (its declaration's ``select``, when
    it reads ``step_selection``); ``every_row``: a row with A = 0 still has a gradient (the
    surrogate's ``zero_at_zero_advantage`` is False); ``per_micro_batch``: the rollout
    corrections that read ``current_logp``, computed in the loss (:func:`split_correction`;
    the others run once on the batch, in the loop's stage 2b).
    """

    surrogate: str
    aggregation: str
    kl: str
    beta: float
    kl_correction: str | None = None
    top_entropy_quantile: float = 1.0
    selection: str = "step"
    entropy: bool = True
    select: Callable[..., Any] | None = None
    every_row: bool = False
    per_micro_batch: tuple = ()
    max_new_tokens: int = 0
    micro_batch_size: int = 0
    grad_clip: float = 1.0
    max_nonfinite_steps: int = 3

    @classmethod
    def of(cls, preset: Any, cfg: Any) -> LossSpec:
        """The spec of ``preset`` (resolved) under config ``cfg``."""
        algo, optim = cfg.algorithm, cfg.optim
        decl = losses.surrogate_axis.get(preset.surrogate)
        _, per_micro = split_correction(preset.rollout_correction)
        return cls(
            surrogate=preset.surrogate,
            aggregation=preset.aggregation,
            kl=preset.kl,
            beta=preset.beta,
            kl_correction=algo.kl_correction,
            top_entropy_quantile=algo.top_entropy_quantile,
            selection=algo.selection,
            entropy=optim.entropy or algo.top_entropy_quantile < 1.0 or "entropy" in decl.reads,
            select=decl.extra.get("select") if "step_selection" in decl.reads else None,
            every_row=not decl.extra.get("zero_at_zero_advantage", True),
            per_micro_batch=per_micro,
            max_new_tokens=cfg.sampling.max_new_tokens,
            micro_batch_size=optim.micro_batch_size,
            grad_clip=optim.grad_clip,
            max_nonfinite_steps=optim.max_nonfinite_steps,
        )

    def objective(
        self,
        lp: Any,
        batch: Batch,
        t: Targets,
        m: torch.Tensor,
        totals: losses.StepTotals,
        *,
        weight: torch.Tensor | None = None,
        keep: torch.Tensor | None = None,
        selected: torch.Tensor | None = None,
        stats: bool = True,
    ) -> losses.Objective:
        """``losses.objective`` of rows ``m`` (log-probs ``lp``, targets ``t = targets.rows(m)``)
        under ``totals``: the trainer's one call of it."""
        params = dict(t.clip) if selected is None else {**t.clip, "selected": selected}
        return losses.objective(
            lp.logp, batch.old_logp[m], t.adv, batch.mask[m], surrogate=self.surrogate,
            surrogate_params=params, aggregation=self.aggregation, totals=totals,
            keep=t.keep, ref_logp=t.ref_logp, kl=self.kl, beta=self.beta, kl_weight=t.kl_weight,
            entropy=lp.entropy, correction_weight=weight, correction_keep=keep,
            kl_correction=self.kl_correction, top_entropy_quantile=self.top_entropy_quantile,
            stats=stats,
        )  # fmt: skip


def split_correction(text: str) -> tuple[tuple, tuple]:
    """``(per batch, per micro-batch)`` parts of a rollout-correction spec: the methods that
    declare ``reads={"current_logp"}`` run in the loss, the others once on the whole batch."""
    spec = correction.parse_spec(text)
    now = {n for n, _ in spec if "current_logp" in losses.correction_axis.reads(n)}
    return (
        tuple((n, p) for n, p in spec if n not in now),
        tuple((n, p) for n, p in spec if n in now),
    )


# ---- what the update adds up to ----------------------------------------------------------------

_LOSS_STATS = {"pg_loss": "pg", "kl_loss": "kl"}
"""The objective's loss statistics (summed over micro-batches) -> their ``loss/`` name; every
other statistic of ``losses.objective`` is a mean (weighted by sequences)."""


@dataclass
class UpdateLog:
    """What the update's optimizer steps add up to; :meth:`metrics` turns it into means.

    ``losses`` and ``policy`` hold, per key, the sum over optimizer steps taken of each
    step's value (a step's loss is the sum of its micro-batch losses, exact under
    StepTotals; a step's policy statistic is the sequence-weighted mean over its
    micro-batches [OURS]). Skipped (non-finite) and empty steps are counted, not averaged in.
    ``streak``: non-finite optimizer steps in a row at the end (it starts at the run's);
    ``diverged``: the streak reached ``optim.max_nonfinite_steps`` and the update stopped.
    """

    taken: int = 0
    skipped: int = 0
    empty: int = 0
    grad_norm: float = 0.0
    losses: dict[str, float] = field(default_factory=dict)
    policy: dict[str, float] = field(default_factory=dict)
    balance: dict[str, float] = field(default_factory=dict)
    streak: int = 0
    diverged: bool = False

    def add(self, step: StepStats, grad_norm: float) -> None:
        """One optimizer step taken: its statistics and gradient norm."""
        self.taken += 1
        self.grad_norm += grad_norm
        for key, value in step.losses.items():
            self.losses[key] = self.losses.get(key, 0.0) + value
        for key, value in step.policy.items():
            value = value / (1.0 - step.missing) if step.missing else value
            self.policy[key] = self.policy.get(key, 0.0) + value

    def metrics(self) -> dict[str, float]:
        n = max(self.taken, 1)
        out = {f"loss/{k}": v / n for k, v in self.losses.items()}
        out.update({f"policy/{k}": v / n for k, v in self.policy.items()})
        out["kl/mean"] = out.pop("policy/kl_mean", 0.0)
        out["loss/total"] = out.get("loss/pg", 0.0) + out.get("loss/kl", 0.0)
        if self.taken:
            out["optim/grad_norm"] = self.grad_norm / n
        out["optim/steps"] = float(self.taken)  # optimizer steps taken on this batch
        out["optim/skipped_steps"] = float(self.skipped)
        out["optim/empty_steps"] = float(self.empty)
        out.update(self.balance)  # measured once per step, not averaged
        return out


@dataclass
class StepStats:
    """One optimizer step's statistics, summed over its micro-batches: the losses as sums
    (exact under StepTotals), every other statistic of ``losses.objective`` weighted by the
    micro-batch's share of the step's sequences [OURS]."""

    losses: dict[str, float] = field(default_factory=dict)
    policy: dict[str, float] = field(default_factory=dict)
    missing: float = 0.0
    """The share of the step's sequences in micro-batches without a loss token (skipped):
    the weighted statistics are then over the rest."""

    def add(self, stats: dict[str, float], weight: float) -> None:
        for key, value in stats.items():
            if key in _LOSS_STATS:
                name = _LOSS_STATS[key]
                self.losses[name] = self.losses.get(name, 0.0) + value
            else:
                self.policy[key] = self.policy.get(key, 0.0) + weight * value


# ---- the update ------------------------------------------------------------------------------


def update_policy(
    policy: Any,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    targets: Targets,
    spec: LossSpec,
    *,
    schedule: Any,
    shuffle: torch.Generator,
    timer: Any,
    balance_rows: torch.Tensor | bool | None = None,
    streak: int = 0,
) -> UpdateLog:
    """``schedule.ppo_epochs`` × ``schedule.minibatches`` AdamW steps over whole groups.

    Groups are shuffled each epoch with ``shuffle``. ``balance_rows``: measure the R/KL
    balance at the first optimizer step (:class:`BalanceProbe`): the ``[N]`` low-σ row
    mask of MaxNorm Table 3's subset, or True (no subset); None: not this step. ``streak``:
    the run's non-finite steps in a row so far. Stops when the streak reaches
    ``spec.max_nonfinite_steps`` (``UpdateLog.diverged``).
    """
    g = batch.group_size
    log = UpdateLog(streak=streak)
    balance = balance_rows
    for _ in range(schedule.ppo_epochs):
        order = torch.randperm(batch.num_prompts, generator=shuffle, device="cpu")  # [P]
        for groups in order.chunk(schedule.minibatches):
            rows = group_rows(groups.sort().values.to(batch.mask.device), g)  # [n] sorted
            optimizer_step(
                policy, optimizer, batch, targets, spec, rows, timer=timer, log=log,
                balance=balance,
            )  # fmt: skip
            balance = None
            if log.diverged:
                return log
    return log


def _trainable(policy: Any) -> list[torch.Tensor]:
    return [q for q in policy.model.parameters() if q.requires_grad]


def optimizer_step(
    policy: Any,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    targets: Targets,
    spec: LossSpec,
    rows: torch.Tensor,
    *,
    timer: Any,
    log: UpdateLog,
    balance: torch.Tensor | bool | None = None,
) -> None:
    """One AdamW step over sequences ``rows`` ``[n]``, added to ``log``: micro-batches share
    one StepTotals, so their losses sum to the minibatch loss whatever the split. A
    non-finite loss or gradient skips the step (``log.skipped``, ``log.streak``)."""
    loss_mask = targets.loss_mask(batch.mask)  # [N, T] without rollout-rejected tokens
    totals = losses.step_totals(  # counts over the whole minibatch, whatever the split
        loss_mask[rows], keep=targets.keep[rows],
        max_len=max(spec.max_new_tokens, batch.mask.shape[1]),
    )  # fmt: skip
    if totals.is_empty:  # no kept token: nothing to learn from
        log.empty += 1
        return
    micro = micro_batches(
        rows, targets, beta=spec.beta, g=batch.group_size, size=spec.micro_batch_size,
        every_row=spec.every_row,
    )  # fmt: skip
    totals, selected = step_selection(
        policy, batch, targets, spec, loss_mask, micro, totals, timer=timer
    )
    probe = None
    if balance is not None and balance is not False:
        low = balance if isinstance(balance, torch.Tensor) else None
        probe = BalanceProbe(_trainable(policy), spec.beta, micro, loss_mask, targets, totals, low)
    stats, finite, backward = StepStats(), True, False
    for (m, grad), chosen in zip(micro, selected):
        if not loss_mask[m].any():  # no loss token (every completion masked): adds exactly 0
            stats.missing += len(m) / len(rows)
            continue
        with torch.set_grad_enabled(grad):
            obj = micro_batch_loss(
                policy, batch, targets, spec, m, totals, timer=timer, selected=chosen
            )
            if obj is None:  # a non-finite log-prob or loss: the step is skipped
                finite = False
                break
            if grad:
                with timer("backward"):
                    if probe is not None:  # before the backward frees the graph
                        probe.add(obj, m)
                    obj.loss.backward()  # micro-batch losses sum to the minibatch loss
                backward = True
        stats.add(obj.stats, len(m) / len(rows))
    params = _trainable(policy)
    if not backward:  # the gradient is exactly 0; AdamW still takes its step
        for q in params:
            q.grad = torch.zeros_like(q)
    grad_norm = guarded_step(params, optimizer, spec, finite=finite, timer=timer)
    if probe is not None and grad_norm is not None:  # [OURS] a skipped step logs none
        log.balance = probe.metrics()
    if grad_norm is None:
        log.skipped += 1
        log.streak += 1
        log.diverged = log.streak >= spec.max_nonfinite_steps
        return
    log.streak = 0
    log.add(stats, grad_norm)


def guarded_step(
    params: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    spec: LossSpec,
    *,
    finite: bool,
    timer: Any,
) -> float | None:
    """Clip the gradient and take the AdamW step: the gradient norm, or None when the step
    is skipped (a non-finite loss or gradient; the gradient is dropped either way)."""
    with timer("optimizer"):
        max_norm = spec.grad_clip if spec.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        ok = finite and math.isfinite(grad_norm)
        if ok:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return grad_norm if ok else None


def micro_batches(
    rows: torch.Tensor,
    targets: Targets,
    *,
    beta: float,
    g: int,
    size: int,
    every_row: bool = False,
) -> list[tuple[torch.Tensor, bool]]:
    """The micro-batch plan of one optimizer step: ``(rows [m], with gradient)`` pairs.

    ``size`` sequences each (0: all of ``rows`` at once), the groups with a gradient first
    (:func:`gradient_rows`), then the rest: [OURS] groups whose every loss term is 0
    (dropped, or zero advantage without a KL term) run their forward without gradient, for
    the logged statistics only. ``every_row``: the surrogate has a term that does not vanish
    at A = 0 (its declaration's ``zero_at_zero_advantage`` is False): every kept row carries
    a gradient.
    """
    active = gradient_rows(
        rows,
        adv=targets.adv,
        keep=targets.keep,
        kl_weight=targets.kl_weight,
        beta=beta,
        g=g,
        every_row=every_row,
    )  # [n] fmt: skip
    return [
        (m, grad) for grad in (True, False) for m in rows[active == grad].split(size or len(rows))
        if len(m)
    ]  # fmt: skip


def gradient_rows(
    rows: torch.Tensor,
    *,
    adv: torch.Tensor,
    keep: torch.Tensor,
    kl_weight: torch.Tensor,
    beta: float,
    g: int,
    every_row: bool = False,
) -> torch.Tensor:
    """``[n]`` bool: the rows of groups where some row's loss has a gradient.

    A row's loss terms are the surrogate, ∝ its advantage for every surrogate declared
    ``zero_at_zero_advantage`` (``-A·f(ratio)`` or ``-A·w·logp``; for the others, whose
    penalty acts at A = 0 too, ``every_row`` makes every kept row live), and
    β·kl_weight·KL; a dropped row (``keep`` False) has none. Rows with ``keep`` False, or
    with A = 0 and no KL weight, add exactly 0 to the loss and its gradient (GRPO's
    collapsed groups: all rewards equal). Decided per group, since a group's rows share one
    prompt forward. ``rows`` holds whole groups (``group_rows``). The trainer passes no
    entropy bonus to ``losses.objective``; one would make every row live.
    """
    adv_r, keep_r, kl_r = adv[rows], keep[rows], kl_weight[rows]  # [n] ([n, T] per token)
    nonzero = adv_r != 0
    if nonzero.dim() > 1:  # per-token advantages: a row lives when any token's does
        nonzero = nonzero.any(-1)
    live = keep_r & (nonzero | ((beta > 0) & (kl_r != 0)) | every_row)  # [n]
    return live.view(-1, g).any(-1).repeat_interleave(g)  # [n]


def step_selection(
    policy: Any,
    batch: Batch,
    targets: Targets,
    spec: LossSpec,
    loss_mask: torch.Tensor,
    micro: list[tuple[torch.Tensor, bool]],
    totals: losses.StepTotals,
    *,
    timer: Any,
) -> tuple[losses.StepTotals, list[torch.Tensor | None]]:
    """The step's token selections, one per micro-batch, and ``totals`` with the step's
    top-entropy threshold (``algorithm.selection="step"``).

    The surrogate's ``select`` (its declaration, for one that reads ``step_selection``:
    Clip-Cov's and KL-Cov's covariance selection over the lists of micro-batches) and the
    top-entropy threshold (``losses.entropy_threshold``) of the whole minibatch, from one
    no-grad forward of each micro-batch before the first backward: the update is the
    one-batch update whatever ``optim.micro_batch_size`` is. Nothing to do (None per
    micro-batch, ``totals`` as given) for one micro-batch, where the loss call's own selection
    is the step's, for ``selection="micro_batch"`` and when no selection applies.
    ``loss_mask`` ``[N, T]``: the step's mask without rollout-rejected tokens.
    """
    top = spec.top_entropy_quantile < 1.0
    none: list[torch.Tensor | None] = [None] * len(micro)
    if spec.selection != "step" or len(micro) < 2 or not (spec.select is not None or top):
        return totals, none
    rows = [m for m, _ in micro]
    with timer("logprobs"), torch.no_grad():
        parts = [policy.logprobs(batch, m, entropy=top) for m in rows]
    kept = [loss_mask[m] * targets.keep[m][:, None].to(loss_mask.dtype) for m in rows]
    if top:
        threshold = losses.entropy_threshold(
            [p.entropy for p in parts], kept, spec.top_entropy_quantile
        )
        totals = replace(totals, entropy_threshold=threshold)
    if spec.select is None:
        return totals, none
    clip = {k: v for k, v in targets.clip.items() if not isinstance(v, torch.Tensor)}
    selected = spec.select(
        [p.logp for p in parts],
        [batch.old_logp[m] for m in rows],
        [targets.adv[m] for m in rows],
        kept,
        **clip,
    )
    return totals, list(selected)


def micro_batch_loss(
    policy: Any,
    batch: Batch,
    targets: Targets,
    spec: LossSpec,
    m: torch.Tensor,
    totals: losses.StepTotals,
    *,
    timer: Any,
    selected: torch.Tensor | None = None,
) -> losses.Objective | None:
    """The objective of micro-batch ``m`` (``[m]`` rows) under the minibatch's ``totals``, or
    None when its log-probs or loss are not finite. Gradient as the caller's grad mode.
    ``selected``: the step's selection of these rows (:func:`step_selection`; None: the
    loss call selects within the micro-batch)."""
    with timer("logprobs"):
        lp = policy.logprobs(batch, m, entropy=spec.entropy)
    if not torch.isfinite(lp.logp.detach()).all():  # the surrogate refuses such input
        return None
    t = targets.rows(m)  # per-sequence bounds [N] (AGPO's per-prompt ε) follow the rows
    weight, keep = _correction(batch, t, spec, lp, m)
    with timer("backward"):
        obj = spec.objective(lp, batch, t, m, totals, weight=weight, keep=keep, selected=selected)
    return obj if torch.isfinite(obj.loss) else None


def _correction(
    batch: Batch, t: Targets, spec: LossSpec, lp: Any, m: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(weight, keep)`` of the rollout correction on rows ``m``: the batch's (stage 2b)
    times the methods that read ``current_logp``, from these log-probs ``lp``."""
    weight = keep = None
    if t.correction is not None:
        weight, keep = t.correction.weight, t.correction.keep
    if spec.per_micro_batch and batch.rollout_logp is not None:
        now = correction.compute(
            spec.per_micro_batch, lp.logp.detach(), batch.rollout_logp[m], batch.mask[m],
            adv=t.adv,
        ).weight  # fmt: skip
        weight = now if weight is None else weight * now
    return weight, keep


class BalanceProbe:
    """R/KL = ‖g_R‖/(β‖g_KL‖) and the reward/KL gradient cosine of one optimizer step,
    measured from the update's own objectives (ALGORITHMS.md §5).

    As the MaxNorm paper's Table 3 caption defines it (``diagnostics.reward_kl_balance``): the
    base β and the gradient of the *unweighted* KL branch (no β, no per-group ``kl_weight``,
    so ``grpo_beta_comp``'s 1/σ weights are not folded in). A diagnostic: MaxNorm's schedule
    does not read it (its scale s_q and the resolution protocol set the step), the health
    rule does. Nothing is recomputed: each gradient micro-batch's :class:`losses.Objective`
    (the forward, the selection, the correction and the entropy mask that are trained) is
    split into its two branches, each differentiated by ``torch.autograd.grad`` with the
    graph kept for the update's own backward, so the ``.grad`` buffers and the step are those
    of an unmeasured step.

    ``balance/batch/*``: both branches of the first gradient micro-batch as the update
    aggregated them (the step's StepTotals), every kept row [OURS]. ``balance/low_sigma/*``:
    Table 3's subset, the rows of updated groups with σ_q < 1e-2 (``low_sigma`` ``[N]``,
    ``diagnostics.low_sigma_groups``) among the step's gradient micro-batches, both branches
    aggregated over those rows alone (:meth:`losses.Objective.branches` under the subset's own
    StepTotals, the step's entropy threshold), their gradients summed over the micro-batches
    that hold them, with ``balance/low_sigma/rows`` their count (no ratio when they have no
    loss token): the number to hold against Table 3 and the one the health rule reads. A
    subset row in a micro-batch without gradient is not measured [OURS]: with β > 0 only a
    group with ``keep`` False or ``kl_weight`` 0 everywhere is there, and neither is updated.

    Against a separate forward of the subset's rows alone (a second objective call on them),
    the subset's log-probs and both branch values are the same bits; its gradients are not
    always: the backward runs through the whole micro-batch's graph, whose float32 sums over
    rows (the other rows adding exact zeros) take another order, a few ulp in some entries,
    so the logged norms can move in their ninth digit. A surrogate with a step selection
    (Clip-Cov, KL-Cov) is measured with the selection it trained with, where a separate call
    on the subset would select within the subset.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        beta: float,
        micro: list[tuple[torch.Tensor, bool]],
        loss_mask: torch.Tensor,
        targets: Targets,
        totals: losses.StepTotals,
        low_sigma: torch.Tensor | None,
    ) -> None:
        self.params, self.beta = params, beta
        self.batch: dict[str, float] = {}
        self.g_r: torch.Tensor | None = None  # [D] the subset's reward gradient, summed
        self.g_k: torch.Tensor | None = None  # [D] its unweighted KL gradient, summed
        self.low = low_sigma
        sub = [m[low_sigma[m]] for m, grad in micro if grad] if low_sigma is not None else []
        self.rows = sum(len(r) for r in sub)
        self.sub_totals = None
        if any(len(r) for r in sub):
            counts = losses.step_totals(
                [loss_mask[r] for r in sub if len(r)],
                keep=[targets.keep[r] for r in sub if len(r)], max_len=int(totals.max_len),
            )  # fmt: skip
            # the subset's loss as trained: the step's top-entropy threshold
            self.sub_totals = replace(counts, entropy_threshold=totals.entropy_threshold)
        if self.sub_totals is not None and self.sub_totals.is_empty:
            self.sub_totals = None

    def add(self, obj: losses.Objective, m: torch.Tensor) -> None:
        """Measure the gradient micro-batch ``m`` (``[m]`` rows) whose objective is ``obj``,
        before its backward."""
        if not self.batch:
            self.batch = diagnostics.subset_keys(
                diagnostics.reward_kl_balance(
                    obj.pg_loss, obj.kl_unweighted, self.params, beta=self.beta
                ),
                "batch",
            )
        if self.sub_totals is None or self.low is None:
            return
        local = self.low[m].nonzero().squeeze(-1)  # [k] this micro-batch's subset rows
        if not len(local):
            return
        pg, kl = obj.branches(local, self.sub_totals)
        g_r = diagnostics.flat_gradient(pg, self.params)
        g_k = diagnostics.flat_gradient(kl, self.params)
        self.g_r = g_r if self.g_r is None else self.g_r + g_r
        self.g_k = g_k if self.g_k is None else self.g_k + g_k

    def metrics(self) -> dict[str, float]:
        out = {**self.batch, "balance/low_sigma/rows": float(self.rows)}
        if self.g_r is not None and self.g_k is not None:
            out.update(
                diagnostics.subset_keys(
                    diagnostics.gradient_balance(self.g_r, self.g_k, beta=self.beta), "low_sigma"
                )
            )
        return out
