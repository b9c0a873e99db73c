"""Transforms that compose with any estimator (ALGORITHMS.md §2).

Applied in this order by :func:`grouprl.advantages.compute`:
resolution → virtual samples → estimator → focal weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from grouprl.advantages._groups import (
    DEFAULT_TAU,
    SORT_NETWORK_MAX,
    dense_valid,
    group_mean,
    group_moments,
    select,
    sort_columns,
    transposed,
    zero_where,
)

DEFAULT_DELTA_RES = 1e-2
"""Resolution of a reward in [0, 1] (MaxNorm paper's Reward-Resolution Protocol)."""

VIRTUAL_MODES = ("symmetric", "paper", "code")


# --------------------------------------------------------------------------- resolution
def resolution(
    rewards: torch.Tensor, valid: torch.Tensor | None, delta_res: float = DEFAULT_DELTA_RES
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward-Resolution Protocol: merge sub-resolution gaps, skip one-bin groups.

    MaxNorm paper (seed text) + [OURS] binning rule: sort each group's valid rewards; a new
    bin starts where the gap to the previous reward is ``>= delta_res`` (single linkage, so
    a chain of small gaps stays one bin); every reward becomes its bin's mean (the group mean
    is unchanged). A group whose valid rewards fall in one bin (or that has none) gets
    ``keep = False``: it is skipped for both the reward and the KL update.

    ``valid``: ``[P, G]`` mask of the non-NaN rewards, or None when every reward is valid.
    Returns ``(binned_rewards [P, G], keep [P])``; NaN entries stay NaN. A bin's mean is its
    members' sum, in ascending order from 0, over their count (the same floats for every
    group size). Groups of up to ``SORT_NETWORK_MAX`` samples: :func:`_resolution_columns`.
    """
    if rewards.shape[1] <= SORT_NETWORK_MAX:
        return _resolution_columns(rewards, valid, delta_res)
    valid = dense_valid(rewards, valid)
    p, g = rewards.shape
    sorted_r, order = torch.sort(rewards, dim=1)  # NaN sort last  # [P, G]
    sorted_valid = torch.gather(valid, 1, order)  # [P, G]
    gaps = sorted_r[:, 1:] - sorted_r[:, :-1]  # [P, G-1]
    new_bin = (gaps >= delta_res) & sorted_valid[:, 1:]  # [P, G-1]
    bin_id = torch.cat([torch.zeros_like(new_bin[:, :1]), new_bin], 1).long().cumsum(1)  # [P, G]
    flat = bin_id + torch.arange(p, device=rewards.device)[:, None] * g  # [P, G] global bin
    w = sorted_valid.to(rewards.dtype)
    filled = torch.where(sorted_valid, sorted_r, torch.zeros_like(sorted_r))
    sums = torch.zeros(p * g, dtype=rewards.dtype, device=rewards.device)
    counts = torch.zeros(p * g, dtype=rewards.dtype, device=rewards.device)
    sums.scatter_add_(0, flat.reshape(-1), filled.reshape(-1))
    counts.scatter_add_(0, flat.reshape(-1), w.reshape(-1))
    means = (sums / counts.clamp_min(1)).reshape(p * g)[flat]  # [P, G] sorted order
    binned_sorted = torch.where(sorted_valid, means, sorted_r)
    binned = torch.empty_like(rewards).scatter_(1, order, binned_sorted)  # [P, G]
    n_bins = (bin_id * sorted_valid).amax(dim=1) + 1  # [P]
    keep = (n_bins > 1) & (valid.sum(dim=1) > 1)
    return binned, keep


def _resolution_columns(
    rewards: torch.Tensor, valid: torch.Tensor | None, delta_res: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`resolution` on the G columns ``[P]``: a sorting network that carries each
    reward's position, bins by one scan over the sorted columns, and puts the means back.

    [OURS] the same numbers as sorting each row (``torch.sort``, the branch above): a bin's
    running sum restarts at each bin's first member, ``0 + s_a + s_{a+1} + ...``, in
    ascending order, and its count is exact.
    """
    g = rewards.shape[1]
    cols = transposed(rewards)  # [G, P]
    if valid is not None:
        cols = cols.nan_to_num_(nan=math.inf)  # NaN (the invalid entries) sort last
    index = torch.arange(g, dtype=torch.uint8, device=rewards.device)[:, None]
    s, order = sort_columns(list(cols.unbind(0)), list(index.expand_as(cols).unbind(0)))
    ok = None if valid is None else [x != math.inf for x in s]  # G x [P] valid, sorted
    acc, cnt = [s[0] + 0.0], [torch.ones_like(s[0])]  # running sum and count of each bin
    starts = []  # G-1 x [P]: position k starts a new bin
    for k in range(1, g):
        start = (s[k] - s[k - 1]) >= delta_res  # [P]
        if ok is not None:
            start &= ok[k]
        starts.append(start)
        acc.append(select(start, s[k] + 0.0, acc[k - 1] + s[k]))
        cnt.append(zero_where(cnt[k - 1].clone(), start).add_(1.0))
    mean = [a / c for a, c in zip(acc, cnt)]  # the bin mean at each bin's last position
    for k in range(g - 2, -1, -1):  # carry it back to the bin's other members
        last = starts[k] if ok is None else starts[k] | ~ok[k + 1]
        mean[k] = select(last, mean[k], mean[k + 1])
    if ok is not None:
        mean = [select(v, m, math.nan) for v, m in zip(ok, mean)]
    binned = torch.empty_like(cols).scatter_(0, torch.stack(order).long(), torch.stack(mean))
    keep = torch.zeros_like(s[0], dtype=torch.bool)  # [P] two bins or more
    for start in starts:
        keep |= start
    return transposed(binned), keep


# --------------------------------------------------------------------------- virtual samples
@dataclass
class VirtualTrigger:
    """AVSPO's adaptive trigger threshold τ_adapt, carried across steps (ALGORITHMS.md §2).

    Update (ACR paper Eq. 12): τ ← clip(τ + η·sign(ΔJ)·(ACR_t − τ), lo, hi), where ΔJ is the
    change of an EMA of the batch mean reward ([OURS]: the EMA, decay ``ema_decay``, keeps
    one noisy batch from flipping the sign). The first update only initialises the EMA.
    Save it with ``state_dict()`` in checkpoints.

    Defaults: the paper's τ(0) = 0.5 ("initialized conservatively", §4.3), η = 0.01 and
    bounds [0.1, 0.9] (App. A.2, fixed across its experiments; the authors' README example,
    github.com/hexixiang/ACR, sets ``acr_threshold_init=0.5``). The paper's GRPO runs have
    ACR 0.28-0.45 (its Table of main results), below τ(0): the trigger fires only once τ
    has come down or on a batch above it.
    """

    tau: float = 0.5
    eta: float = 0.01
    lo: float = 0.1
    hi: float = 0.9
    ema_decay: float = 0.9
    reward_ema: float | None = None
    steps: int = 0
    last_delta: float = field(default=0.0)

    def update(self, acr: float, mean_reward: float) -> float:
        """Advance one step with the batch's ACR and mean reward; returns the new τ."""
        if self.reward_ema is None:
            self.reward_ema, delta = float(mean_reward), 0.0
        else:
            new = self.ema_decay * self.reward_ema + (1 - self.ema_decay) * float(mean_reward)
            delta, self.reward_ema = new - self.reward_ema, new
        sign = (delta > 0) - (delta < 0)
        self.tau = min(self.hi, max(self.lo, self.tau + self.eta * sign * (acr - self.tau)))
        self.last_delta = delta
        self.steps += 1
        return self.tau

    def state_dict(self) -> dict[str, float | int | None]:
        return {
            "tau": self.tau,
            "reward_ema": self.reward_ema,
            "steps": self.steps,
            "last_delta": self.last_delta,
        }

    def load_state_dict(self, state: dict) -> None:
        self.tau = float(state["tau"])
        self.reward_ema = None if state["reward_ema"] is None else float(state["reward_ema"])
        self.steps = int(state["steps"])
        self.last_delta = float(state.get("last_delta", 0.0))


def virtual_count(g: int, acr: float, alpha: float = 0.5) -> int:
    """K = max(1, min(G, ⌈G·ACR^α⌉)) virtual samples per triggered group (ACR paper, α = 0.5)."""
    return max(1, min(g, math.ceil(g * acr**alpha - 1e-9)))


def virtual_samples(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    *,
    mode: str = "symmetric",
    tau_adapt: float = 0.5,
    alpha: float = 0.5,
    reward_range: tuple[float, float] = (0.0, 1.0),
    tau: float = DEFAULT_TAU,
    ddof: int = 1,
    batch_groups: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """AVSPO virtual samples: extra columns of rewards that enter the statistics only.

    Returns ``(augmented [P, G+K], valid_aug [P, G+K], stats)``: the first G columns are the
    real samples; the K virtual columns are NaN for groups that are not triggered. When no
    group is triggered the input comes back unchanged (``[P, G]``, same ``valid``). The
    estimator runs on the augmented tensor and only the first G columns are kept, so virtual
    rewards have no tokens and no gradient.

    - ``"symmetric"`` ([OURS], default): triggered when the batch ACR_t > τ_adapt and
      σ_q < tau. All-correct group → v_k = r_hi − (r_hi − r_lo)·k/K, all-wrong group →
      v_k = r_lo + (r_hi − r_lo)·k/K, k = 1..K (for [0, 1] exactly ALGORITHMS.md's r_hi·(1 −
      k/K) and k/K). Other collapsed groups (a constant strictly inside the range) are left.
    - ``"paper"``: same trigger; v_1 = r_max, v_k = r_max·(1 − (k−1)/K), r_max the group's
      max reward (ACR paper Eq. 10, restated as Eq. 21 in App. B.3: "r_max = max r_i is the
      highest observed reward in the original group"). As written it gives an all-incorrect
      group no anchor: r_max = 0, every v_k = 0, and the group stays collapsed; with K = 1 the
      virtual sample equals the group's value. A summary of the paper that speaks of "small
      positive anchors" for all-incorrect groups describes no equation of the paper; the
      ``"symmetric"`` mode is that reading.
    - ``"code"`` (what the authors' repository runs): only when every valid reward of the
      whole generation batch is r_lo (or every one is r_hi), one virtual sample of the
      opposite value is added to every group of it; τ_adapt is not used. ``batch_groups``:
      the generation batch is each run of ``batch_groups`` consecutive groups (None = all P).
      The authors' script trains one group per generation batch [CODE: hexixiang/ACR
      train_grpo.sh, 4 processes × per-device batch 1 completion, num_generations 4;
      trl_scope/trainer/grpo_trainer.py:1515-1536], i.e. ``batch_groups=1``: the rule then
      fires on every all-wrong and every all-correct group. With 32 groups in one batch it
      essentially never fires.
    """
    if mode not in VIRTUAL_MODES:
        raise ValueError(f"unknown virtual mode {mode!r}; valid modes: {', '.join(VIRTUAL_MODES)}")
    r_lo, r_hi = reward_range
    p, g = rewards.shape
    m = group_moments(rewards, valid, ddof, tau)
    mean = m.mean  # [P]
    collapsed = m.collapsed & (m.count > 0)  # [P]
    acr = float(collapsed.float().mean())
    atol = 1e-6 * (r_hi - r_lo)
    all_hi = collapsed & (mean >= r_hi - atol)  # [P]
    all_lo = collapsed & (mean <= r_lo + atol)  # [P]
    stats = {"virtual/acr": acr, "virtual/tau_adapt": float(tau_adapt)}

    if batch_groups is not None and (mode != "code" or batch_groups < 1):
        raise ValueError(
            f"batch_groups={batch_groups!r} applies to virtual mode 'code' only and must be a "
            f"positive number of groups per generation batch (mode is {mode!r})"
        )
    if mode == "code":
        k = 1
        triggered, fill = _code_trigger(rewards, valid, r_lo, r_hi, atol, batch_groups or p)
        v = fill[:, None]  # [P, 1]
    else:
        k = virtual_count(g, acr, alpha)
        fire = acr > tau_adapt
        kk = torch.arange(1, k + 1, dtype=rewards.dtype, device=rewards.device)  # [K]
        if mode == "symmetric":
            triggered = (all_hi | all_lo) & fire
            down = r_hi - (r_hi - r_lo) * kk / k  # [K]
            up = r_lo + (r_hi - r_lo) * kk / k  # [K]
            v = torch.where(all_hi[:, None], down, up)  # [P, K]
        else:  # paper
            triggered = collapsed & fire
            r_max = rewards.nan_to_num(nan=-math.inf).amax(1)  # [P] over the valid rewards
            v = r_max[:, None] * (1 - (kk - 1) / k)  # [P, K]
    stats.update({"virtual/K": float(k), "virtual/triggered_frac": float(triggered.float().mean())})
    if not triggered.any():  # nothing fires: the batch goes on unchanged (and unmasked)
        return rewards, valid, stats
    v = torch.where(triggered[:, None], v, torch.full_like(v, float("nan")))
    augmented = torch.cat([rewards, v], dim=1)  # [P, G+K]
    return augmented, torch.cat([dense_valid(rewards, valid), ~torch.isnan(v)], dim=1), stats


def _code_trigger(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    r_lo: float,
    r_hi: float,
    atol: float,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The code mode's rule per generation batch of ``width`` consecutive groups.

    Returns ``(triggered [P] bool, fill [P])``: a batch whose valid rewards are all r_lo gets
    r_hi in each of its groups, all r_hi gets r_lo (a batch with no valid reward: all r_lo,
    as the authors' ``torch.all`` over an empty batch) [CODE grpo_trainer.py:1515-1536].
    """
    p, g = rewards.shape
    width = max(1, min(width, p))
    n_batches = -(-p // width)
    # each batch's extremes over its valid rewards (NaN left out; an empty batch: -inf / +inf),
    # one reduction per batch over its width·G rewards (one over the whole tensor by default)
    top = rewards if valid is None else rewards.nan_to_num(nan=-math.inf)  # [P, G]
    low = rewards if valid is None else rewards.nan_to_num(nan=math.inf)
    missing = n_batches * width - p  # rows that pad the last batch
    if missing:
        top = torch.cat([top, top.new_full((missing, g), -math.inf)])
        low = torch.cat([low, low.new_full((missing, g), math.inf)])
    top = top.reshape(n_batches, width * g).amax(1)  # [B]
    low = low.reshape(n_batches, width * g).amin(1)  # [B]
    batch_lo = top <= r_lo + atol  # [B] every valid reward is r_lo (true for an empty batch)
    batch_hi = (low >= r_hi - atol) & ~batch_lo  # [B] every valid reward is r_hi ...
    if valid is not None:  # ... and every group of the batch has one (an empty group is not hi)
        empty = ~valid.any(1)  # [P]
        if missing:
            empty = torch.cat([empty, empty.new_zeros(missing)])
        batch_hi &= ~empty.reshape(n_batches, width).any(1)
    triggered = (batch_lo | batch_hi).repeat_interleave(width)[:p]  # [P]
    # r_hi / r_lo in the rewards' dtype (a where over two Python floats would round them
    # through torch's default dtype: 0.1 -> 0.10000000149 beside float64 rewards)
    fill = torch.full_like(batch_lo, r_lo, dtype=rewards.dtype).masked_fill_(batch_lo, r_hi)
    fill = fill.repeat_interleave(width)[:p]  # [P]
    return triggered, fill


# --------------------------------------------------------------------------- focal weight
def focal_mean_weight(gamma: float) -> float:
    """m_γ = (4/√π)·Γ(γ + 3/2)/Γ(γ + 3): the focal weight's mean reduction (F-GRPO App. N).

    F-GRPO App. N averages the multiplicative reduction (1 − μ)^γ over the success rate μ
    uniform on [0, 1], weighted by the GRPO advantage's magnitude, and writes the ratio of
    Beta functions B(3/2, γ + 3/2)/B(3/2, 3/2) — the weight √(μ(1 − μ)), which is the total
    |A| of a std-normalised binary group (Σ_i |A_i| = N·2μ(1 − μ)/√(μ(1 − μ))). The text calls
    the magnitude "proportional to µ(1 − µ)"; that weight would give B(2, γ + 2)/B(2, 2)
    (0.686 at γ = 0.5), not the paper's numbers, which are the closed form here: m_0 = 1,
    m_0.5 = 0.679 (§5.6's low-LR control, 6.8e-7 = 0.679 × 1e-6), m_1 = 0.5.
    """
    if not (gamma >= 0 and math.isfinite(gamma)):
        raise ValueError(f"focal_gamma must be a finite number >= 0, got {gamma!r}")
    return 4.0 / math.sqrt(math.pi) * math.exp(math.lgamma(gamma + 1.5) - math.lgamma(gamma + 3.0))


def focal_weight(
    rewards: torch.Tensor,
    valid: torch.Tensor | None,
    gamma: float,
    reward_range: tuple[float, float] = (0.0, 1.0),
) -> torch.Tensor:
    """F-GRPO's per-group weight g_q = (1 − μ̂_q)^γ, μ̂_q = clip((r̄_q − r_lo)/(r_hi − r_lo), 0, 1).

    F-GRPO (focal weight on high-success groups); γ = 0 gives 1 everywhere. Returns ``[P]``.
    """
    r_lo, r_hi = reward_range
    mu = ((group_mean(rewards, valid) - r_lo) / (r_hi - r_lo)).clamp(0.0, 1.0)  # [P]
    if gamma == 0:
        return torch.ones_like(mu)
    return (1.0 - mu).pow(gamma)
