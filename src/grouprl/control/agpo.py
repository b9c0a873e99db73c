"""AGPO's controllers: probe statistics, adaptive temperature and adaptive clip (ALGORITHMS.md §4).

AGPO (Adaptive Group Policy Optimization; code: github.com/wandugu/paper_agpo, LlamaFactory
``train/agpo/trainer.py``) samples a *probe* group of G completions per prompt at the base
temperature τ_base; it is never used for gradients. From the probe it reads

- the reward dispersion σ̂ (:func:`dispersion`: ``std`` | ``mad`` | ``iqr``),
- the reward skewness κ (:func:`skewness`, adjusted Fisher–Pearson, clamped ±10),
- the vote entropy E of the extracted final answers (:func:`vote_entropy`,
  :func:`extract_answer_key`),

and drives two controllers that carry state across steps (EMAs) and checkpoint with
``state_dict()/load_state_dict()``:

- :class:`AdaptiveTemperature`: U = w_r σ̂ + w_e E + w_k|κ|, c = (U − EMA)/(EMA + 1e-8),
  τ_t = clip(τ_base(1 + λc), τ_min, τ_max); the training group is sampled at τ_t.
- :class:`AdaptiveClip`: ε = clip(ε_base·h·(1 + δ_E E)/(1 + α_var σ̂ + γ_KL D + ζ|κ|), ε_min,
  ε_max) with h = clip(H/H_ref, 0.5, 1.5) and D an EMA of the post-update drift
  (:func:`step_drift`).

A trainer step, per batch of P prompts (prompt-major, as everywhere; :class:`AGPO` wraps it)::

    stats = agpo.probe_stats(probe_rewards, probe_texts)          # [P] each
    taus = temp.update_batch(temp.uncertainty(stats))             # [P] per-prompt τ_t
    ... sample prompt p's training group at taus[p]; log-probs at T = 1 (the raw logits)
    H = agpo.group_token_mean(entropy, mask, G)                   # [P], before the update
    eps = clip.update_batch(stats, H)                             # [P] -> ppo_clip eps_low/high
    ... optimizer steps (the code: 4 epochs, one step each) ...
    clip.observe_drift(agpo.step_drift(old_logp, new_logp, mask, G))

The AGPO code walks the prompts one by one and updates the EMAs after each; ``update_batch``
keeps that order (the EMA is a recurrence over P scalars, not a hot path).

Conventions against the code (``src/llamafactory/train/agpo/trainer.py``): the functions
below default to the textbook statistics and take the code's as options; :class:`AGPO`
defaults to the code's (``median="lower"``: ``torch.median``, the lower middle value;
``skew_moment_ddof=1``: the cubed deviations over the Bessel std).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from grouprl.tasks.answers import last_boxed

__all__ = [
    "AGPO",
    "DISPERSIONS",
    "AdaptiveClip",
    "AdaptiveTemperature",
    "ProbeStats",
    "clip_epsilon",
    "dispersion",
    "extract_answer_key",
    "group_token_mean",
    "probe_stats",
    "skewness",
    "step_drift",
    "vote_entropy",
]

MAD_SCALE = 1.4826
"""MAD → σ for normal data (AGPO code ``_dispersion``)."""
IQR_SCALE = 1.349
"""IQR → σ for normal data (AGPO code ``_dispersion``)."""
FLOOR = 1e-8
"""AGPO code's ``uncertainty_floor`` / ``clip_entropy_floor``."""


# ============================================================================ probe statistics


def _valid(rewards: torch.Tensor) -> torch.Tensor:
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2:
        raise ValueError("probe rewards must be a [P, G] tensor (NaN = unscorable)")
    if not rewards.is_floating_point():
        raise ValueError(f"probe rewards must be floating point, got {rewards.dtype}")
    return ~torch.isnan(rewards)


def _std(rewards: torch.Tensor, valid: torch.Tensor, ddof: int) -> tuple[torch.Tensor, ...]:
    n = valid.sum(dim=1).to(rewards.dtype)  # [P]
    x = torch.where(valid, rewards, torch.zeros_like(rewards))
    mean = x.sum(dim=1) / n.clamp_min(1)  # [P]
    dev = torch.where(valid, rewards - mean[:, None], torch.zeros_like(rewards))  # [P, G]
    var = dev.square().sum(dim=1) / (n - ddof).clamp_min(1)
    std = torch.where(n > ddof, var.sqrt(), torch.zeros_like(var))  # [P]
    return std, dev, n


def _median(x: torch.Tensor, median: str) -> torch.Tensor:
    """``[P]`` NaN-ignoring median along dim 1 (an all-NaN row gives NaN). [OURS] The lower
    median reads a row-major copy: torch 2.13's CPU ``nanmedian`` of a broadcast (stride-0)
    batch returns values that are not in it."""
    if median == "lower":
        return torch.nanmedian(x.contiguous(), dim=1).values
    return torch.nanquantile(x, 0.5, dim=1)


def _std_dispersion(rewards: torch.Tensor, median: str = "mean_of_middle") -> torch.Tensor:
    """Sample std (ddof = 1, AGPO code ``_bessel_std``); fewer than 2 valid rewards -> 0."""
    return _std(rewards, _valid(rewards), ddof=1)[0]


def _mad_dispersion(rewards: torch.Tensor, median: str = "mean_of_middle") -> torch.Tensor:
    """1.4826 · median|r − median(r)| over the valid rewards (robust σ)."""
    _valid(rewards)
    med = _median(rewards, median)  # [P]
    return torch.nan_to_num(MAD_SCALE * _median((rewards - med[:, None]).abs(), median), nan=0.0)


def _iqr_dispersion(rewards: torch.Tensor, median: str = "mean_of_middle") -> torch.Tensor:
    """(Q75 − Q25)/1.349 over the valid rewards, linear interpolation (torch / numpy default)."""
    _valid(rewards)
    q = torch.nanquantile(rewards, torch.tensor([0.25, 0.75], dtype=rewards.dtype), dim=1)
    return torch.nan_to_num((q[1] - q[0]) / IQR_SCALE, nan=0.0)


DISPERSIONS: dict[str, Callable[..., torch.Tensor]] = {
    "std": _std_dispersion,
    "mad": _mad_dispersion,
    "iqr": _iqr_dispersion,
}
"""Dispersion name -> function ``(rewards [P, G], median=...) -> [P]`` (AGPO ``_dispersion``)."""


def dispersion(
    rewards: torch.Tensor, mode: str = "std", *, median: str = "mean_of_middle"
) -> torch.Tensor:
    """``[P]`` reward dispersion σ̂ of each probe group: ``std`` | ``mad`` | ``iqr``.

    ``std``: sample std, ddof = 1; ``mad``: 1.4826·median|r − median|; ``iqr``: IQR/1.349
    (AGPO code ``_dispersion``, default ``std``). NaN rewards are ignored; a group with no
    valid reward gets 0. ``median``: ``"mean_of_middle"`` (default [OURS], the statistical
    median: mean of the two middle values for even G) or ``"lower"`` (the AGPO code's
    ``torch.median``, the lower middle value). They differ for even G: binary rewards
    [0, 0, 1, 1] give MAD 0.7413 with the former and 0 with the latter.
    """
    try:
        fn = DISPERSIONS[mode]
    except KeyError:
        raise ValueError(
            f"unknown dispersion {mode!r}; valid dispersions: {', '.join(DISPERSIONS)}"
        ) from None
    if median not in ("mean_of_middle", "lower"):
        raise ValueError(f"median must be 'mean_of_middle' or 'lower', got {median!r}")
    return fn(rewards, median=median)


def skewness(
    rewards: torch.Tensor,
    *,
    sigma_min: float = 1e-6,
    clamp: float = 10.0,
    moment_ddof: int = 0,
) -> torch.Tensor:
    """``[P]`` adjusted Fisher–Pearson skewness G1 of each probe group, clamped to ±``clamp``.

    ``G1 = √(n(n−1))/(n−2) · m3/s³`` over the n valid rewards, with ``m3`` the mean cubed
    deviation and ``s`` the std with ``moment_ddof``: 0 (default) is the textbook G1
    (= ``scipy.stats.skew(bias=False)``); 1 reproduces the AGPO code, which divides by the
    Bessel std (its value is G1·((n−1)/n)^{3/2}). No adjustment for n ≤ 2 (the AGPO code's
    rule; g1 is 0 there anyway). 0 when the sample std (ddof = 1) is below ``sigma_min``
    (1e-6) or n < 2. ``clamp`` = 10 (AGPO ``skew_kappa_max``).
    """
    valid = _valid(rewards)
    bessel, dev, n = _std(rewards, valid, ddof=1)
    s = bessel if moment_ddof == 1 else _std(rewards, valid, ddof=0)[0]
    m3 = dev.pow(3).sum(dim=1) / n.clamp_min(1)  # [P]
    g1 = m3 / s.clamp_min(1e-30).pow(3)
    adj = torch.where(
        n > 2, (n * (n - 1)).clamp_min(0).sqrt() / (n - 2).clamp_min(1), torch.ones_like(n)
    )
    out = (adj * g1).clamp(-clamp, clamp)
    return torch.where(bessel < sigma_min, torch.zeros_like(out), out)


_NUMBER = re.compile(r"[-+]?\d*\.?\d+(?:/[1-9]\d*)?")


def _canonical_number(key: str) -> str:
    """``"4.0"``, ``"+4"``, ``"8/2"`` all become ``"4"``, ``"1,234"`` ``"1234"``; else as is."""
    try:
        value = Fraction(key.replace(" ", "").replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return key
    return (
        str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    )


def extract_answer_key(text: str) -> str:
    """The final-answer key of a completion, for vote counting (AGPO ``_extract_vote_key``).

    In order: the content of the last ``\\boxed{...}``; else the text after the last ``####``
    (GSM8K style); else the last number in the text (thousands commas removed; ``a/b``
    fractions kept); else the whole text with runs of whitespace collapsed. The key is stripped
    and lower-cased. [OURS] two refinements over the AGPO code: nested braces inside
    ``\\boxed{}`` are matched (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``, where the code's
    regex falls through to the number ``2``), and numeric keys are canonicalised so that
    ``4``, ``4.0``, ``8/2`` are one vote (and ``1,234`` after ``####`` is ``1234``).
    """
    stripped = text.strip()
    boxed = last_boxed(stripped)
    if boxed is not None:
        key = boxed.strip().lower()
    elif "####" in stripped:
        key = stripped.rsplit("####", 1)[-1].strip().lower()
    else:
        numbers = _NUMBER.findall(stripped.replace(",", ""))
        key = numbers[-1] if numbers else re.sub(r"\s+", " ", stripped).lower()
    return _canonical_number(key)


def vote_entropy(texts: Sequence[str], key: Callable[[str], str] = extract_answer_key) -> float:
    """Entropy in nats of the distribution of final answers among ``texts`` (one group).

    ``E = −Σ_a p_a ln p_a`` with p_a the share of completions whose :func:`extract_answer_key`
    is a (AGPO ``_vote_entropy``). 0 for an empty group or a unanimous one; ln G when all G
    answers differ.
    """
    if not texts:
        return 0.0
    counts = Counter(key(t) for t in texts)
    total = sum(counts.values())
    return float(-sum((c / total) * math.log(c / total) for c in counts.values()))


@dataclass(frozen=True)
class ProbeStats:
    """AGPO's probe statistics per prompt, each ``[P]``."""

    dispersion: torch.Tensor
    skewness: torch.Tensor
    vote_entropy: torch.Tensor

    def as_dict(self) -> dict[str, float]:
        """Batch means, for logging."""
        return {
            "probe_dispersion": float(self.dispersion.mean()),
            "probe_skewness": float(self.skewness.mean()),
            "probe_vote_entropy": float(self.vote_entropy.mean()),
        }


def probe_stats(
    rewards: torch.Tensor,
    texts: Sequence[str],
    *,
    dispersion_mode: str = "std",
    median: str = "mean_of_middle",
    key: Callable[[str], str] = extract_answer_key,
    skew_params: dict[str, Any] | None = None,
) -> ProbeStats:
    """Dispersion, skewness and vote entropy of P probe groups.

    ``rewards``: ``[P, G]`` (NaN = unscorable, ignored); ``texts``: the P·G probe completions,
    prompt-major (row p·G + g).
    """
    _valid(rewards)
    p, g = rewards.shape
    if len(texts) != p * g:
        raise ValueError(
            f"texts must hold P*G = {p * g} completions (prompt-major), got {len(texts)}"
        )
    entropies = [vote_entropy(texts[i * g : (i + 1) * g], key) for i in range(p)]
    return ProbeStats(
        dispersion=dispersion(rewards, dispersion_mode, median=median),
        skewness=skewness(rewards, **(skew_params or {})),
        vote_entropy=torch.tensor(entropies, dtype=rewards.dtype),
    )


def group_token_mean(values: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[P]`` token mean of ``values [N, T]`` over each group's valid tokens (N = P·G).

    Use it for H, the policy entropy of a training group before the update (AGPO code:
    token-mean entropy of the prompt's group).
    """
    if values.shape != mask.shape or values.dim() != 2 or values.shape[0] % group_size:
        raise ValueError(
            f"values and mask must be [P*G, T] with N divisible by group_size={group_size}, got "
            f"{tuple(values.shape)} and {tuple(mask.shape)}"
        )
    m = mask.to(values.dtype)
    p = values.shape[0] // group_size
    num = (values * m).reshape(p, -1).sum(dim=1)  # [P]
    return num / m.reshape(p, -1).sum(dim=1).clamp_min(1.0)


def step_drift(
    old_logp: torch.Tensor, new_logp: torch.Tensor, mask: torch.Tensor, group_size: int
) -> float:
    """Drift of one update: mean over groups of max(0, token-mean(old_logp − new_logp)).

    Measured after the optimizer step on the step's rollouts (AGPO code ``_estimate_step_kl``,
    which takes each prompt's group as one rollout); feeds :meth:`AdaptiveClip.observe_drift`.
    """
    d = group_token_mean((old_logp - new_logp).detach(), mask, group_size)  # [P]
    return float(d.clamp_min(0.0).mean())


# ============================================================================ controllers


def clip_epsilon(
    *,
    dispersion: float,
    vote_entropy: float,
    abs_skew: float,
    h: float,
    drift: float,
    eps_base: float = 0.2,
    eps_min: float = 0.05,
    eps_max: float = 0.4,
    delta_e: float = 0.1,
    alpha_var: float = 1.0,
    gamma_kl: float = 0.5,
    zeta: float = 0.0,
) -> float:
    """ε = clip(ε_base·h·(1 + δ_E E)/(1 + α_var σ̂ + γ_KL D + ζ|κ|), ε_min, ε_max).

    AGPO code ``compute_adaptive_clip``; defaults are its config's. Test vector
    (ALGORITHMS.md §4): ε_base 0.2, h 1.5, E 0.7, δ_E 0.1, σ̂ 0.4, D 0.2, γ_KL 0.5, |κ| 0.3,
    ζ 0.2 -> 0.2·1.5·1.07 / 1.56 = 0.2058.
    """
    num = eps_base * h * (1.0 + delta_e * vote_entropy)
    den = 1.0 + alpha_var * dispersion + gamma_kl * drift + zeta * abs_skew
    return float(min(max(num / den, eps_min), eps_max))


class AdaptiveTemperature:
    """AGPO's bidirectional adaptive sampling temperature, centred on a running baseline.

    ``U = w_r σ̂ + w_e E + w_k |κ|``; while the EMA is ≤ 1e-8 (first call) ``c = 0`` and
    ``EMA ← U``; afterwards ``c = (U − EMA)/(EMA + 1e-8)`` then ``EMA ← αU + (1 − α)EMA``;
    ``τ_t = clip(τ_base(1 + λc), τ_min, τ_max)`` (AGPO code ``compute_centered_uncertainty``,
    ``compute_adaptive_temperature``). Higher uncertainty than usual heats the sampler, lower
    cools it. Defaults: τ_base 1.0, [0.5, 1.5], λ 0.15, w = (1, 1, 0), α 0.1 (AGPO README and
    config).
    """

    def __init__(
        self,
        *,
        tau_base: float = 1.0,
        tau_min: float = 0.5,
        tau_max: float = 1.5,
        lam: float = 0.15,
        w_r: float = 1.0,
        w_e: float = 1.0,
        w_k: float = 0.0,
        ema_alpha: float = 0.1,
        floor: float = FLOOR,
    ) -> None:
        if not 0 < tau_min <= tau_base <= tau_max:
            raise ValueError(
                f"need 0 < tau_min <= tau_base <= tau_max, got {tau_min}, {tau_base}, {tau_max}"
            )
        if not 0 < ema_alpha <= 1:
            raise ValueError(f"ema_alpha must be in (0, 1], got {ema_alpha}")
        self.tau_base, self.tau_min, self.tau_max = tau_base, tau_min, tau_max
        self.lam, self.w_r, self.w_e, self.w_k = lam, w_r, w_e, w_k
        self.ema_alpha, self.floor = ema_alpha, floor
        self.ema = 0.0
        self.last_centered = 0.0

    def uncertainty(self, stats: ProbeStats) -> torch.Tensor:
        """``[P]`` U = w_r σ̂ + w_e E + w_k |κ|."""
        return (
            self.w_r * stats.dispersion
            + self.w_e * stats.vote_entropy
            + self.w_k * stats.skewness.abs()
        )

    def update(self, u: float) -> float:
        """Feed one uncertainty U (one prompt, or a batch mean); return τ_t and advance the EMA."""
        u = float(u)
        if not math.isfinite(u):
            raise ValueError(f"uncertainty must be finite, got {u}")
        if self.ema <= self.floor:
            c, self.ema = 0.0, u
        else:
            c = (u - self.ema) / (self.ema + self.floor)
            self.ema = self.ema_alpha * u + (1.0 - self.ema_alpha) * self.ema
        self.last_centered = c
        return float(min(max(self.tau_base * (1.0 + self.lam * c), self.tau_min), self.tau_max))

    def update_batch(self, u: torch.Tensor) -> torch.Tensor:
        """``[P]`` τ_t per prompt, updating the EMA after each prompt in order (AGPO code)."""
        return torch.tensor([self.update(x) for x in u.tolist()], dtype=torch.float32)

    def state_dict(self) -> dict[str, float]:
        return {"ema": self.ema, "last_centered": self.last_centered}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.ema = float(state["ema"])
        self.last_centered = float(state.get("last_centered", 0.0))


class AdaptiveClip:
    """AGPO's adaptive PPO clip radius ε from probe statistics, policy entropy and drift.

    Per prompt: ``h = clip(max(H, f)/(max(H_ref, f) + f), h_min, h_max)`` with f = 1e-8, H the
    token-mean policy entropy of the training group before the update and H_ref its EMA
    (α_H = 0.01; the first H starts it, and H_ref = H for that call); then ε from
    :func:`clip_epsilon` with D the drift EMA (α_D = 0.1, starts at 0) fed by
    :meth:`observe_drift` after each update. The ε applies symmetrically
    (``ppo_clip(eps_low=ε, eps_high=ε)``, AGPO code). Defaults: ε_base 0.2, [0.05, 0.4],
    δ_E 0.1, α_var 1.0, γ_KL 0.5, ζ 0, h in [0.5, 1.5] (AGPO README and config).
    """

    def __init__(
        self,
        *,
        eps_base: float = 0.2,
        eps_min: float = 0.05,
        eps_max: float = 0.4,
        delta_e: float = 0.1,
        alpha_var: float = 1.0,
        gamma_kl: float = 0.5,
        zeta: float = 0.0,
        h_min: float = 0.5,
        h_max: float = 1.5,
        entropy_alpha: float = 0.01,
        drift_alpha: float = 0.1,
        floor: float = FLOOR,
    ) -> None:
        if not 0 <= eps_min <= eps_base <= eps_max:
            raise ValueError(
                f"need 0 <= eps_min <= eps_base <= eps_max, got {eps_min}, {eps_base}, {eps_max}"
            )
        self.params = {
            "eps_base": eps_base,
            "eps_min": eps_min,
            "eps_max": eps_max,
            "delta_e": delta_e,
            "alpha_var": alpha_var,
            "gamma_kl": gamma_kl,
            "zeta": zeta,
        }
        self.h_min, self.h_max, self.floor = h_min, h_max, floor
        self.entropy_alpha, self.drift_alpha = entropy_alpha, drift_alpha
        self.entropy_ref = 0.0
        self.drift = 0.0

    def update(
        self, dispersion: float, vote_entropy: float, abs_skew: float, entropy: float
    ) -> float:
        """ε for one prompt from its probe stats and its policy entropy H; advances H_ref."""
        f = self.floor
        h_ref = self.entropy_ref if self.entropy_ref > f else entropy
        h = min(max(max(entropy, f) / (max(h_ref, f) + f), self.h_min), self.h_max)
        eps = clip_epsilon(
            dispersion=dispersion,
            vote_entropy=vote_entropy,
            abs_skew=abs(abs_skew),
            h=h,
            drift=self.drift,
            **self.params,
        )
        if self.entropy_ref <= f:
            self.entropy_ref = float(entropy)
        else:
            a = self.entropy_alpha
            self.entropy_ref = a * float(entropy) + (1.0 - a) * self.entropy_ref
        return eps

    def update_batch(self, stats: ProbeStats, entropy: torch.Tensor) -> torch.Tensor:
        """``[P]`` ε per prompt, in order (AGPO code); use as ``eps_low = eps_high`` per sample."""
        rows = zip(
            stats.dispersion.tolist(),
            stats.vote_entropy.tolist(),
            stats.skewness.tolist(),
            entropy.tolist(),
        )
        return torch.tensor([self.update(*r) for r in rows], dtype=torch.float32)

    def observe_drift(self, drift: float) -> float:
        """Fold one post-update drift (:func:`step_drift`) into D's EMA; return the new D."""
        self.drift = self.drift_alpha * float(drift) + (1.0 - self.drift_alpha) * self.drift
        return self.drift

    def state_dict(self) -> dict[str, float]:
        return {"entropy_ref": self.entropy_ref, "drift": self.drift}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.entropy_ref = float(state["entropy_ref"])
        self.drift = float(state["drift"])


class AGPO:
    """Both AGPO controllers behind one object, run as the AGPO code runs them (ALGORITHMS.md §4).

    Per step (P prompts, G completions each, prompt-major)::

        taus, m = agpo.temperature_from_probe(probe_rewards, probe_texts)  # [P], probe at τ_base
        ... sample prompt p's training group at taus[p]  (rollout.hf.generate(temperatures=taus)),
            behaviour log-probs at agpo.logprob_temperature (Sampling.logprob_temperature)
        H = group_token_mean(entropy, mask, G)      # [P] at logprob_temperature, before update
        clip = agpo.clip_params(H, G)               # {"eps_low": [P·G], "eps_high": [P·G]}
        ... minibatches × ppo_epochs steps of ppo_clip(**clip), ε sliced to each minibatch's rows;
            training log-probs, KL and entropy at logprob_temperature
        m2 = agpo.observe_update(old_logp, new_logp, mask, G)   # drift -> D, and ε stats

    The code's choices, each a parameter:

    - ``per_prompt=True``: each prompt's training group is sampled at its own τ_t and clipped
      with its own ε (``src/llamafactory/train/agpo/trainer.py:634-722``: the loop over
      prompts computes ``tau_t``, samples ``_generate_group(prompt, tau_t)`` and stores
      ``eps_adapt`` per rollout; ``_agpo_loss_from_rollout`` clips with it, :774-777).
      ``False`` is the batch-mean variant [OURS]: every prompt at the mean τ_t, one ε = the
      mean ε (the controllers still advance once per prompt, in order).
    - ``logprob_temperature=1.0``: log-probs, KL and entropy from the raw logits while the
      tokens are drawn at τ_t (``_sequence_logprobs``, trainer.py:304, ``log_softmax(logits)``
      with no division; the reference log-probs at :327 likewise). None divides by the
      sampling temperature (TRL / verl); it needs ``per_prompt=False`` (one τ per batch).
    - ``median="lower"``: the MAD of ``dispersion_mode="mad"`` takes ``torch.median``, the
      lower middle value for even G (trainer.py:344-345); ``"mean_of_middle"`` is the
      statistical median.
    - ``skew_moment_ddof=1``: the skewness divides by the Bessel std (trainer.py:391-397), so
      it is G1·((n−1)/n)^{3/2}; 0 gives the textbook G1 (:func:`skewness`).
    - ``dispersion_mode="std"`` (``agpo_use_robust_dispersion`` default), Bessel std.
    """

    def __init__(
        self,
        *,
        base_temperature: float = 1.0,
        per_prompt: bool = True,
        logprob_temperature: float | None = 1.0,
        dispersion_mode: str = "std",
        median: str = "lower",
        skew_moment_ddof: int = 1,
        temperature_params: dict[str, float] | None = None,
        clip_params: dict[str, float] | None = None,
    ) -> None:
        if logprob_temperature is None and per_prompt:
            raise ValueError(
                "AGPO(per_prompt=True) samples every prompt at its own temperature, so the "
                "log-probs need one fixed temperature: keep logprob_temperature=1.0 (the AGPO "
                "code's raw logits) or use per_prompt=False to divide by the batch's mean τ"
            )
        if logprob_temperature is not None and not logprob_temperature > 0:
            raise ValueError(f"logprob_temperature must be > 0 or None, got {logprob_temperature}")
        if median not in ("mean_of_middle", "lower"):
            raise ValueError(f"median must be 'mean_of_middle' or 'lower', got {median!r}")
        if dispersion_mode not in DISPERSIONS:
            raise ValueError(
                f"unknown dispersion {dispersion_mode!r}; valid dispersions: "
                f"{', '.join(DISPERSIONS)}"
            )
        tp = {"tau_base": base_temperature, **(temperature_params or {})}
        tp.setdefault("tau_min", min(0.5, tp["tau_base"]))
        tp.setdefault("tau_max", max(1.5, tp["tau_base"]))
        self.temperature = AdaptiveTemperature(**tp)
        self.clip = AdaptiveClip(**(clip_params or {}))
        self.per_prompt = per_prompt
        self.logprob_temperature = logprob_temperature
        self.dispersion_mode = dispersion_mode
        self.median = median
        self.skew_moment_ddof = skew_moment_ddof
        self.base_temperature = self.temperature.tau_base
        self.last_stats: ProbeStats | None = None
        self.last_eps: torch.Tensor | None = None

    def temperature_from_probe(
        self, rewards: torch.Tensor, texts: Sequence[str]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """``[P]`` sampling temperatures of the training groups from the probe, and metrics.

        ``rewards``: the probe's ``[P, G]`` rewards (sampled at τ_base, never trained on);
        ``texts``: its P·G completions, prompt-major. The temperature controller advances
        once per prompt, in order (the AGPO code's loop). Per-prompt mode returns each
        prompt's τ_t; the batch-mean mode returns their mean, repeated P times.
        """
        stats = probe_stats(
            rewards,
            texts,
            dispersion_mode=self.dispersion_mode,
            median=self.median,
            skew_params={"moment_ddof": self.skew_moment_ddof},
        )
        self.last_stats = stats
        taus = self.temperature.update_batch(self.temperature.uncertainty(stats))  # [P]
        metrics = {f"agpo/{k}": v for k, v in stats.as_dict().items()}
        metrics.update(
            {
                "agpo/temperature": float(taus.mean()),
                "agpo/temperature_min": float(taus.min()),
                "agpo/temperature_max": float(taus.max()),
                "agpo/uncertainty_ema": self.temperature.ema,
            }
        )
        if not self.per_prompt:
            taus = taus.mean().expand(taus.shape[0]).clone()
        return taus, metrics

    def clip_params(
        self, policy_entropy: torch.Tensor | float, group_size: int
    ) -> dict[str, float | torch.Tensor]:
        """``{"eps_low": ε, "eps_high": ε}`` for ``ppo_clip`` from the last probe and H.

        ``policy_entropy``: ``[P]`` token-mean entropy of each training group before the
        update, at ``logprob_temperature`` (:func:`group_token_mean`), or one float for every
        group. Per-prompt mode: ``[P·G]`` tensors, prompt p's ε on its G rows (slice them with
        the minibatch's rows); batch-mean mode: the mean ε as a float. Needs
        :meth:`temperature_from_probe` on this step first.
        """
        if self.last_stats is None:
            raise ValueError("AGPO.clip_params needs temperature_from_probe() on this step first")
        if int(group_size) != group_size or group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
        p = self.last_stats.dispersion.shape[0]
        h = torch.as_tensor(policy_entropy, dtype=torch.float32).reshape(-1)
        if h.numel() == 1:
            h = h.expand(p)
        if h.shape != (p,):
            raise ValueError(f"policy_entropy must be a float or [P]={p}, got {tuple(h.shape)}")
        eps = self.clip.update_batch(self.last_stats, h)  # [P]
        self.last_eps = eps
        if self.per_prompt:
            e = eps.repeat_interleave(int(group_size))  # [P·G]
            return {"eps_low": e, "eps_high": e}
        value = float(eps.mean())
        return {"eps_low": value, "eps_high": value}

    def observe_update(
        self,
        old_logp: torch.Tensor,
        new_logp: torch.Tensor,
        mask: torch.Tensor,
        group_size: int,
    ) -> dict[str, float]:
        """Fold the step's drift into D (after the last optimizer step); the step's AGPO metrics.

        ``new_logp``: the policy's log-probs after the update at ``logprob_temperature``
        (AGPO code ``_estimate_step_kl``, trainer.py:796-815, run once after all epochs).
        """
        drift = step_drift(old_logp, new_logp, mask, group_size)
        out = {"agpo/step_drift": drift, "agpo/drift_ema": self.clip.observe_drift(drift)}
        if self.last_eps is not None:
            out.update(
                {
                    "agpo/eps_mean": float(self.last_eps.mean()),
                    "agpo/eps_min": float(self.last_eps.min()),
                    "agpo/eps_max": float(self.last_eps.max()),
                    "agpo/entropy_ref": self.clip.entropy_ref,
                }
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature.state_dict(), "clip": self.clip.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.temperature.load_state_dict(state["temperature"])
        self.clip.load_state_dict(state["clip"])
