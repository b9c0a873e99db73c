"""Run health across steps: rules that turn logged numbers into messages with an action.

:class:`RunHealth` is fed the flat metric dict of each step (``step_metrics`` output plus
anything else the trainer logs: ``loss``, ``balance/low_sigma/r_over_kl``, ...). Every rule is
a named threshold with its source; rules whose metric is absent stay silent. A condition that
persists is one *episode*: ``update`` returns its full message (what was seen and what to
do) once, on the step it starts, then a short update only when it changes materially (its
number moves past ``HealthConfig.change_abs`` / ``change_factor``, or its kind changes, at
most once per ``gap`` steps), and one line when it clears (``gap`` steps without it).
:meth:`RunHealth.episodes` lists each episode once with its span, for the run report.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["STALL_ADVICE", "Episode", "Finding", "HealthConfig", "RunHealth"]


STALL_ADVICE: dict[str, str] = {
    "all_wrong": (
        "easier prompts, a stronger warm start, or a larger group size G (more groups then "
        "hold a correct sample); virtual samples (preset avspo) are untested as a fix: they "
        "cut wasted groups in our simulation but did worst of 7 presets on our maze miniature"
    ),
    "all_correct": (
        "harder prompts; dynamic sampling (preset dapo) drops these groups from the update "
        "but still spends their rollouts"
    ),
    "filtered": (
        "prompts matched to the model, or a larger group size G: the filter keeps each update "
        "informative, but the rollouts it discards are spent"
    ),
}
"""What the ``acr_stall`` warning recommends, by what dominates the collapsed groups. It
follows our own evidence (docs/diagnostics.md, "Health rules"): on the maze miniature
(reproductions/maze/low_success, 12,800 rollouts × 5 seeds) avspo had the lowest pass@k of the seven
presets at every k from 1 to 64 (pass@1 +0.015 over the SFT start, grpo +0.036), and dapo took
27 optimizer steps to grpo's 100 for the same rollouts; in the ACR simulation (reproductions/acr,
GRPO's ACR calibrated to the ACR paper's 28-45 %) virtual samples cut the groups without
gradient (36 % -> 27 % behind the adaptive trigger, -> 0 with the code rule at one group per
batch) but not the raw ACR, for +0.2 to +0.5 points of pool accuracy. A
larger G raises the chance that a group holds a correct sample, 1 − (1 − p)^G [OURS]."""


@dataclass(frozen=True)
class HealthConfig:
    """Thresholds of the health rules; each default cites its source."""

    stall_acr: float = 0.35
    """ACR above this for ``stall_steps`` consecutive steps = stalled [PAPER: ACR paper]."""
    stall_steps: int = 50
    """Consecutive steps for the stall alarm [PAPER: ACR paper]."""
    window: int = 25
    """Window (steps) of the ACR std divergence rule [PAPER: ACR paper]; the stall's updates
    report the mean ACR over the same window."""
    window_std: float = 0.15
    """ACR std over ``window`` steps above this flags divergence risk [PAPER: ACR paper]."""
    acr_first: int = 100
    """ACR_100 averages the first this-many steps [PAPER: ACR paper]."""
    inv_scale_p99: float = 100.0
    """P99 of 1/scale above this = low-variance groups amplified without bound [OURS: 100 =
    1/tau_res at MaxNorm's tau_res = 1e-2, the bound the p90 reference reaches in Table 3]."""
    nan_frac: float = 0.05
    """Share of unscorable (NaN) rewards above this = verifier trouble [OURS]."""
    r_over_kl_low: float = 0.5
    """R/KL (``balance/low_sigma/r_over_kl``, on Table 3's subset) below this = reward branch
    KL-dominated [PAPER seed: RLOO/Dr.GRPO at 0.48-0.51]."""
    r_over_kl_high: float = 3.0
    """R/KL above this = KL calibration lost [PAPER seed: GRPO at 3.1 in Table 3]."""
    entropy_frac: float = 0.1
    """Policy entropy below this share of its first logged value = entropy collapse [OURS]."""
    truncated_frac: float = 0.5
    """Share of completions cut at the token limit above this = length budget too small [OURS]."""
    gap: int = 10
    """An episode clears after this many consecutive steps without its condition; a shorter
    gap belongs to the same episode. Also the least number of steps between two lines of one
    episode [OURS: a condition that flickers from step to step is one message, not many]."""
    change_abs: float = 0.1
    """A share (ACR, NaN or truncated fraction, ACR std) that moved by at least this since the
    episode's last line is a material change, printed as a short update [OURS]."""
    change_factor: float = 2.0
    """A ratio-scale number (1/scale P99, R/KL, entropy, mismatch KL) that moved by at least
    this factor since the episode's last line is a material change [OURS]."""
    mismatch_kl: float = 1e-3
    """``mismatch/kl_k3`` (KL of the rollout engine's policy from the trainer's) above this =
    the samples come from another policy than the one trained [OURS: bf16 sampling of our
    fp32 maze model measures ~1e-4 (reproductions/rollout_correction), where TIS, MIS and
    IcePop at their published bounds never act; ten times that calls for a correction]. Once
    on, the condition holds down to half of it (so a KL that hovers at the limit is one
    episode)."""
    truncated_ratio_max: float = 1.0 + 1e-4
    """Every token ratio π_train/π_rollout at most this (``mismatch/ratio_max``, or a peer's
    logged ``corr/weight_max``), ... [OURS: an engine's numerical noise scatters ratios to
    both sides of 1; a renormalised truncated support puts every one at the kept mass ≤ 1]"""
    truncated_gap: float = 1e-4
    """... with a mean |log ρ| (``mismatch/kl_k1``, or ``mismatch/logp_diff_mean``) above
    this = the rollout log-probs look renormalised over a truncated top-p / top-k support."""
    clip_frac: float = 0.2
    """Share of tokens clipped (``policy/clip_frac_low`` + ``policy/clip_frac_high``, or
    ``policy/clip_frac_region`` where a trainer logs no direction) above this = the update is
    cut by its trust region on a large share of tokens [OURS: at one epoch on fresh samples
    the first minibatch clips nothing; a fifth of the tokens cut means steps large for the
    clip range]."""
    clip_side: float = 2 / 3
    """One bound holding at least this share of the clipped tokens names the direction
    (``high`` / ``low``); below it, ``both`` [OURS]."""
    trend_window: int = 10
    """Steps per window of the trend rules (entropy, length, shaped vs verified reward): the
    mean of the latest ``trend_window`` logged values against the mean of the first
    ``trend_window``; a rule needs ``2 × trend_window`` logged values [OURS]."""
    entropy_fall: float = 0.5
    """Latest window's entropy below this share of the first window's = entropy falling
    (before ``entropy_frac`` calls it a collapse) [OURS]."""
    entropy_rise: float = 2.0
    """Latest window's entropy above this multiple of the first window's = entropy rising
    (the policy spreading towards noise) [OURS]."""
    length_factor: float = 2.0
    """Mean response length of the latest window above this multiple, or below its inverse,
    of the first window's = length drift [OURS]."""
    hack_rise: float = 0.1
    """Shaped reward (``reward/mean``) risen by at least this (its own units) between the
    windows, while ... [OURS]"""
    hack_share: float = 0.25
    """... the verifier's correctness (``reward/correct_mean``) rose by at most this share of
    that rise = the shaped reward is being gamed [OURS]."""
    trunc_floor_min: float = 0.05
    """Least share of trained-on completions that were cut at the token limit for the
    ``truncation_zeroed`` rule to look at them [OURS]."""
    trunc_floor: float = 0.95
    """Truncated completions scoring the reward floor at least this often, ... [OURS]"""
    trunc_floor_chance: float = 0.01
    """... where the chance that that many would if truncation did not matter (the finished
    ones' floor share to the power of the number of truncated ones at the floor) is at most
    this = the verifier zeroes
    cut-off answers: the update teaches "shorter", not "correct" [OURS: a one-sided binomial
    bound, so a handful of cut samples in a mostly-wrong batch stays quiet]."""


TREND_KEYS = ("policy/entropy_mean", "length/mean", "reward/mean", "reward/correct_mean")
"""The metrics whose first and latest windows the trend rules compare."""


@dataclass(frozen=True)
class Finding:
    """A rule's condition holding at one step: what was seen, and what to do about it."""

    rule: str
    value: float
    """The number the condition is about (compared with the episode's last line)."""
    detail: str
    """What was seen, for the first line of an episode."""
    action: str
    """What to do (after ``->`` in the first line)."""
    short: str
    """The number in a few words, for the updates."""
    kind: str = ""
    """A category whose change is material by itself (the stall's all-wrong / all-correct)."""
    log_scale: bool = False
    """Judge changes of ``value`` by ratio (``change_factor``) instead of difference."""


@dataclass
class Episode:
    """One persisting condition: first and last step it held, its messages."""

    rule: str
    start: int
    last: int
    message: str
    """The full first line (what was seen -> what to do)."""
    updates: list[str]
    """The short lines printed while it lasted, in order."""
    said: str = ""
    """The number in words at the latest line (``Finding.short``)."""
    open: bool = True
    """Still holding (or within ``gap`` steps of its last step)."""
    printed_at: int = 0
    """The step of the episode's latest line."""
    value: float = 0.0
    """The value at the latest line."""
    kind: str = ""
    absent: int = 0
    """Consecutive steps without the condition."""

    @property
    def span(self) -> str:
        """``steps a–b`` (``step a`` for one step)."""
        return (
            f"step {self.start}" if self.start == self.last else f"steps {self.start}–{self.last}"
        )


class RunHealth:
    """Stateful health monitor: cumulative ACR, ACR_100, stall alarm, window std, tails.

    Usage::

        health = RunHealth()
        for step ...:
            metrics = diagnostics.step_metrics(rewards, adv)
            for line in health.update(step, metrics):
                log.warning(line)
            metrics.update(health.metrics())
        health.episodes()            # each condition once, with its span

    Each line starts ``"[rule] step S: "``: the first line of an episode says what was seen
    ``-> what to do``; updates say ``still on since step A: <number>``; the last line says
    ``cleared``. ``state_dict()`` / ``load_state_dict()`` carry everything across a resume.
    """

    def __init__(self, config: HealthConfig | None = None) -> None:
        self.config = config or HealthConfig()
        self.steps = 0
        self.acr_sum = 0.0
        self.first_sum = 0.0
        self.first_count = 0
        self.stall_run = 0
        self.window: deque[float] = deque(maxlen=self.config.window)
        self.entropy_ref: float | None = None
        self.trends: dict[str, _Trend] = {k: _Trend(self.config.trend_window) for k in TREND_KEYS}
        self.open: dict[str, Episode] = {}
        self.closed: list[Episode] = []

    # -- derived numbers -------------------------------------------------------------------

    @property
    def acr_cumulative(self) -> float:
        """Mean per-step ACR over every step seen so far (0 before the first)."""
        return self.acr_sum / self.steps if self.steps else 0.0

    @property
    def acr_100(self) -> float:
        """Mean ACR over the first ``acr_first`` steps (running mean until then)."""
        return self.first_sum / self.first_count if self.first_count else 0.0

    @property
    def acr_window_std(self) -> float:
        """Population std of the last ``window`` per-step ACR values (0 with < 2)."""
        w = list(self.window)
        if len(w) < 2:
            return 0.0
        m = sum(w) / len(w)
        return math.sqrt(sum((x - m) ** 2 for x in w) / len(w))

    @property
    def acr_window_mean(self) -> float:
        """Mean of the last ``window`` per-step ACR values (0 before the first)."""
        return sum(self.window) / len(self.window) if self.window else 0.0

    def metrics(self) -> dict[str, float]:
        """The derived numbers as flat ``health/*`` metrics for the step's log line."""
        return {
            "health/acr_cumulative": self.acr_cumulative,
            "health/acr_100": self.acr_100,
            "health/acr_window_std": self.acr_window_std,
            "health/stall_run": float(self.stall_run),
        }

    @property
    def fired_total(self) -> dict[str, int]:
        """Episodes so far per rule (each condition counted once, however long it held)."""
        out: dict[str, int] = {}
        for ep in self.episodes():
            out[ep.rule] = out.get(ep.rule, 0) + 1
        return out

    def episodes(self) -> list[Episode]:
        """Every episode so far, closed and open, in the order they started."""
        return sorted([*self.closed, *self.open.values()], key=lambda e: (e.start, e.rule))

    # -- the rules -------------------------------------------------------------------------

    def update(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Feed one step's metrics; return the lines to print now (see the class docstring)."""
        findings: list[Finding] = []
        # the ACR of every generated group when the trainer logs it (with dynamic sampling the
        # kept batch's acr/rate hides the groups that were generated and dropped)
        acr_rate = metrics.get("acr/sampled_rate", metrics.get("acr/rate"))
        if acr_rate is not None and math.isfinite(acr_rate):
            self._track_acr(float(acr_rate))
            findings += self._acr_rules(metrics)
        findings += self._scale_rule(metrics)
        findings += self._nan_rule(metrics)
        findings += self._balance_rule(metrics)
        findings += self._loss_rule(metrics)
        findings += self._policy_rules(metrics)
        findings += self._mismatch_rule(metrics)
        for key, trend in self.trends.items():
            v = metrics.get(key)
            if v is not None and math.isfinite(v):
                trend.add(float(v))
        findings += self._clip_rule(metrics)
        findings += self._trend_rules(metrics)
        findings += self._truncation_zeroed_rule(metrics)
        findings += self._truncated_sampling_rule(metrics)
        return self._track(step, findings, metrics)

    def _track(self, step: int, findings: list[Finding], metrics: dict[str, float]) -> list[str]:
        """Open, update and close episodes from this step's findings; the lines to print."""
        c, out = self.config, []
        seen = {f.rule: f for f in findings}
        for f in findings:
            ep = self.open.get(f.rule)
            if ep is None:
                line = f"[{f.rule}] step {step}: {f.detail} -> {f.action}"
                self.open[f.rule] = Episode(
                    f.rule,
                    step,
                    step,
                    line,
                    [],
                    f.short,
                    printed_at=step,
                    value=f.value,
                    kind=f.kind,
                )
                out.append(line)
                continue
            ep.last, ep.absent = step, 0
            if step - ep.printed_at >= c.gap and self._material(ep, f):
                line = (
                    f"[{f.rule}] step {step}: still on since step {ep.start}, now {f.short} "
                    f"(was {ep.said} at step {ep.printed_at})"
                )
                ep.updates.append(line)
                ep.printed_at, ep.value, ep.kind, ep.said = step, f.value, f.kind, f.short
                out.append(line)
        for rule, ep in list(self.open.items()):
            if rule in seen or not any(metrics.get(k) is not None for k in _RULE_KEYS[rule]):
                continue  # a step without the rule's metric neither holds nor clears it
            ep.absent += 1
            if ep.absent >= c.gap:
                ep.open = False
                self.closed.append(self.open.pop(rule))
                out.append(f"[{rule}] step {step}: cleared; it held over {ep.span}")
        return out

    def _material(self, ep: Episode, f: Finding) -> bool:
        if f.kind != ep.kind:
            return True
        if f.log_scale:
            if ep.value <= 0 or f.value <= 0:
                return (ep.value <= 0) != (f.value <= 0)
            return max(f.value / ep.value, ep.value / f.value) >= self.config.change_factor
        return abs(f.value - ep.value) >= self.config.change_abs

    def _track_acr(self, rate: float) -> None:
        self.steps += 1
        self.acr_sum += rate
        if self.first_count < self.config.acr_first:
            self.first_sum += rate
            self.first_count += 1
        self.window.append(rate)
        self.stall_run = self.stall_run + 1 if rate > self.config.stall_acr else 0

    def _acr_rules(self, m: dict[str, float]) -> list[Finding]:
        c = self.config
        out: list[Finding] = []
        rate = m.get("acr/sampled_rate", m.get("acr/rate", 0.0))
        # a stall starts after stall_steps steps above the threshold and, once on, holds on
        # every step above it (it clears after ``gap`` steps at or below)
        if self.stall_run >= c.stall_steps or ("acr_stall" in self.open and self.stall_run):
            out.append(self._stall(m, rate))
        if len(self.window) >= c.window and self.acr_window_std > c.window_std:
            std = self.acr_window_std
            out.append(
                Finding(
                    "acr_unstable",
                    std,
                    f"ACR std over the last {c.window} steps is {std:.3f} > {c.window_std:g}: "
                    "divergence risk",
                    "lower the learning rate, tighten the clip range, or raise the KL "
                    "coefficient beta",
                    f"ACR std {std:.3f}",
                )
            )
        return out

    def _stall(self, m: dict[str, float], rate: float) -> Finding:
        c = self.config
        wrong, right = m.get("acr/all_wrong", 0.0), m.get("acr/all_correct", 0.0)
        if rate > m.get("acr/rate", 0.0) + 1e-9:  # a filter dropped the collapsed groups
            kind, why = (
                "filtered",
                (
                    f"dynamic sampling discards {rate:.0%} of the generated groups, and their rollouts"
                ),
            )
        elif wrong >= right:
            kind = "all_wrong"
            why = f"mostly all-wrong groups ({wrong:.0%}): prompts too hard for the model"
        else:
            kind = "all_correct"
            why = f"mostly all-correct groups ({right:.0%}): prompts already solved"
        mean = self.acr_window_mean
        return Finding(
            "acr_stall",
            mean,
            f"ACR > {c.stall_acr:g} for {self.stall_run} consecutive steps (now {rate:.2f}; {why})",
            STALL_ADVICE[kind],
            f"ACR {mean:.2f} (last {len(self.window)} steps), {kind.replace('_', '-')}",
            kind=kind,
        )

    def _scale_rule(self, m: dict[str, float]) -> list[Finding]:
        p99 = m.get("scale/inv_p99")
        if p99 is None or not p99 > self.config.inv_scale_p99:
            return []
        return [
            Finding(
                "inv_scale_tail",
                p99,
                f"P99 of 1/scale is {p99:.3g} > {self.config.inv_scale_p99:g}: near-constant "
                "groups are amplified into full-size updates",
                "use estimator maxnorm_rloo (bounded), or delta_res=1e-2 (resolution protocol) "
                "to skip sub-resolution jitter",
                f"P99 of 1/scale {p99:.3g}",
                log_scale=True,
            )
        ]

    def _nan_rule(self, m: dict[str, float]) -> list[Finding]:
        frac = m.get("reward/nan_frac")
        if frac is None or not frac > self.config.nan_frac:
            return []
        return [
            Finding(
                "nan_rewards",
                frac,
                f"{frac:.1%} of rewards are unscorable (NaN)",
                "check the verifier: timeouts, answer extraction, sandbox errors (NaN rewards "
                "are excluded, not scored 0)",
                f"{frac:.1%} unscorable",
            )
        ]

    def _balance_rule(self, m: dict[str, float]) -> list[Finding]:
        ratio = m.get("balance/low_sigma/r_over_kl")  # Table 3's subset: its thresholds
        if ratio is None or not math.isfinite(ratio):
            return []
        c = self.config
        if ratio < c.r_over_kl_low:
            return [
                Finding(
                    "kl_dominated",
                    ratio,
                    f"R/KL = {ratio:.3g} < {c.r_over_kl_low:g}: the KL branch outweighs the "
                    "reward signal",
                    "lower beta, or use maxnorm_rloo to recover small credible gaps",
                    f"R/KL {ratio:.3g}",
                    log_scale=True,
                )
            ]
        if ratio > c.r_over_kl_high:
            return [
                Finding(
                    "kl_overwhelmed",
                    ratio,
                    f"R/KL = {ratio:.3g} > {c.r_over_kl_high:g}: std-normalised advantages "
                    "overwhelm the KL anchor",
                    "use maxnorm_rloo or grpo_beta_comp, or raise beta",
                    f"R/KL {ratio:.3g}",
                    log_scale=True,
                )
            ]
        return []

    def _loss_rule(self, m: dict[str, float]) -> list[Finding]:
        loss = m.get("loss", m.get("loss/total"))
        if loss is None or math.isfinite(loss):
            return []
        return [
            Finding(
                "nonfinite_loss",
                1.0,
                f"loss is {loss}",
                "lower the learning rate, check for inf rewards or log-probs, and resume from "
                "the last checkpoint",
                f"loss {loss}",
            )
        ]

    def _policy_rules(self, m: dict[str, float]) -> list[Finding]:
        out: list[Finding] = []
        ent = m.get("policy/entropy_mean")
        if ent is not None and math.isfinite(ent):
            if self.entropy_ref is None:
                self.entropy_ref = float(ent)
            elif self.entropy_ref > 0 and ent < self.config.entropy_frac * self.entropy_ref:
                out.append(
                    Finding(
                        "entropy_collapse",
                        float(ent),
                        f"policy entropy {ent:.3g} fell below {self.config.entropy_frac:g}x its "
                        f"first value {self.entropy_ref:.3g}: exploration is gone",
                        "clip-higher (eps_high 0.28, preset dapo), a focal weight, a higher "
                        "temperature or a lower learning rate",
                        f"entropy {ent:.3g}",
                        log_scale=True,
                    )
                )
        trunc = m.get("length/truncated_frac")
        if trunc is not None and trunc > self.config.truncated_frac:
            out.append(
                Finding(
                    "truncation",
                    trunc,
                    f"{trunc:.0%} of completions hit the token limit",
                    "raise max_new_tokens, or use overlong shaping (mask / soft penalty) so "
                    "cut-off answers are not scored as wrong",
                    f"{trunc:.0%} truncated",
                )
            )
        return out

    def _mismatch_rule(self, m: dict[str, float]) -> list[Finding]:
        kl = m.get("mismatch/kl_k3")
        limit = self.config.mismatch_kl
        if kl is None or not math.isfinite(kl):
            return []
        if not (kl > limit or ("rollout_mismatch" in self.open and kl >= limit / 2)):
            return []
        p99 = m.get("mismatch/ratio_p99", float("nan"))
        if "corr/weight_mean" in m:
            lost = m.get("corr/zeroed_frac", 0.0) + m.get("corr/rejected_frac", 0.0)
            fix = (
                f"the correction is on ({lost:.1%} of tokens zeroed or rejected); if it keeps "
                "growing, lower the learning rate or sample in the training precision"
            )
        else:
            fix = (
                "turn on a rollout correction (algorithm.rollout_correction=icepop or "
                "seq_tis; TRL: vllm_importance_sampling_correction), or sample in the "
                "training precision"
            )
        return [
            Finding(
                "rollout_mismatch",
                kl,
                f"KL(rollout||train) {kl:.2g} > {limit:g}, token ratio p99 {p99:.3g}",
                fix,
                f"KL(rollout||train) {kl:.2g}",
                log_scale=True,
            )
        ]

    def _clip_rule(self, m: dict[str, float]) -> list[Finding]:
        c = self.config
        low, high = m.get("policy/clip_frac_low"), m.get("policy/clip_frac_high")
        if low is not None and high is not None:
            total = low + high
            if not total > c.clip_frac:
                return []
            side = (
                "high"
                if high >= c.clip_side * total
                else "low"
                if low >= c.clip_side * total
                else "both"
            )
            seen = (
                f"{total:.0%} of tokens clipped: {high:.0%} at the high bound (A > 0, ratio > "
                f"1 + eps_high), {low:.0%} at the low bound (A < 0, ratio < 1 - eps_low)"
            )
        else:
            total = m.get("policy/clip_frac_region")
            if total is None or not total > c.clip_frac:
                return []
            side = "unknown"
            seen = f"{total:.0%} of tokens clipped (this log does not say at which bound)"
        return [
            Finding(
                "clip_bound",
                total,
                seen,
                CLIP_ADVICE[side],
                f"{total:.0%} clipped, {side}" + (" bound" if side in ("high", "low") else ""),
                kind=side,
            )
        ]

    def _trend_rules(self, m: dict[str, float]) -> list[Finding]:
        c, out = self.config, []
        w = c.trend_window
        ent = self.trends["policy/entropy_mean"]
        if "policy/entropy_mean" in m and ent.ready and ent.first_mean > 0:
            r = ent.last_mean / ent.first_mean
            ref = self.entropy_ref or 0.0  # entropy_collapse says it, when it fires
            collapsed = m["policy/entropy_mean"] < self.config.entropy_frac * ref
            if (r < c.entropy_fall and not collapsed) or r > c.entropy_rise:
                kind = "falling" if r < 1 else "rising"
                out.append(
                    Finding(
                        "entropy_trend",
                        r,
                        f"policy entropy {kind}: {ent.last_mean:.3g} over the last {w} steps, "
                        f"{r:.2g}x the {ent.first_mean:.3g} of the first {w}",
                        ENTROPY_ADVICE[kind],
                        f"entropy {r:.2g}x the first {w} steps'",
                        kind=kind,
                        log_scale=True,
                    )
                )
        ln = self.trends["length/mean"]
        if "length/mean" in m and ln.ready and ln.first_mean > 0:
            r = ln.last_mean / ln.first_mean
            if r > c.length_factor or r < 1 / c.length_factor:
                kind = "growing" if r > 1 else "shrinking"
                out.append(
                    Finding(
                        "length_drift",
                        r,
                        f"mean response length {kind}: {ln.last_mean:.4g} tokens over the last "
                        f"{w} steps, {r:.2g}x the {ln.first_mean:.4g} of the first {w}",
                        LENGTH_ADVICE[kind],
                        f"length {r:.2g}x the first {w} steps'",
                        kind=kind,
                        log_scale=True,
                    )
                )
        rew, cor = self.trends["reward/mean"], self.trends["reward/correct_mean"]
        if "reward/correct_mean" in m and rew.ready and cor.ready:
            d_rew, d_cor = rew.last_mean - rew.first_mean, cor.last_mean - cor.first_mean
            if d_rew >= c.hack_rise and d_cor <= c.hack_share * d_rew:
                out.append(
                    Finding(
                        "reward_hacking",
                        d_rew,
                        f"the shaped reward rose by {d_rew:+.3g} (mean of the last {w} steps "
                        f"against the first {w}) while verified correctness moved by "
                        f"{d_cor:+.3g}",
                        "the policy is gaming the shaping (format, length or a learned reward): "
                        "read samples, lower the shaping weights or cap them, and select "
                        "checkpoints on the verifier's correctness, not the shaped reward",
                        f"shaped {d_rew:+.3g}, correct {d_cor:+.3g}",
                    )
                )
        return out

    def _truncated_sampling_rule(self, m: dict[str, float]) -> list[Finding]:
        c = self.config
        top = m.get("mismatch/ratio_max", m.get("corr/weight_max"))
        gap = m.get("mismatch/kl_k1", m.get("mismatch/logp_diff_mean"))
        if (
            top is None
            or gap is None
            or not (top <= c.truncated_ratio_max and gap > c.truncated_gap)
        ):
            return []
        kept = m.get("mismatch/ratio_mean", m.get("corr/weight_mean"))
        mass = f", mean ratio {kept:.3g} = the mean kept mass" if kept is not None else ""
        return [
            Finding(
                "truncated_sampling",
                gap,
                f"no token's ratio pi_train/pi_rollout exceeds 1 (max {top:.4g}{mass}): the "
                "rollout log-probs look renormalised over the top-p / top-k tokens the engine "
                "kept, so every ratio carries the log of the kept mass, not a policy difference",
                "score both sides on one support: full-softmax log-probs from the engine, or "
                "the trainer's log-probs over the same kept tokens (grouprl's trainer: "
                "sampling.logprob_support=truncated); a rollout correction would "
                "reweight by the kept mass; sampling with top_p=1, top_k off removes it",
                f"mean |log ratio| {gap:.2g}",
                log_scale=True,
            )
        ]

    def _truncation_zeroed_rule(self, m: dict[str, float]) -> list[Finding]:
        c = self.config
        share = m.get("truncated/trained_frac")
        floor = m.get("truncated/floor_frac")
        finished = m.get("truncated/finished_floor_frac")
        count = m.get("truncated/trained_count")
        if None in (share, floor, finished, count) or not share >= c.trunc_floor_min:
            return []
        chance = finished ** (count * floor)  # all of them at the floor by the base rate
        if not (floor >= c.trunc_floor and chance <= c.trunc_floor_chance):
            return []
        return [
            Finding(
                "truncation_zeroed",
                share,
                f"{share:.0%} of the trained completions were cut at the token limit and "
                f"{floor:.0%} of them score the reward floor ({finished:.0%} of finished ones "
                "do): the verifier reads a cut-off answer as wrong, so their negative "
                "advantages teach 'shorter', not 'correct'",
                "mask truncated completions out of the loss (preset field overlong='mask', "
                "DAPO's overlong filter; TRL: mask_truncated_completions=True), or raise "
                "max_new_tokens",
                f"{share:.0%} truncated, {floor:.0%} of them at the floor",
            )
        ]

    # -- checkpointing ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (JSON/torch.save friendly) to restore with ``load_state_dict``."""
        return {
            "config": asdict(self.config),
            "steps": self.steps,
            "acr_sum": self.acr_sum,
            "first_sum": self.first_sum,
            "first_count": self.first_count,
            "stall_run": self.stall_run,
            "window": list(self.window),
            "entropy_ref": self.entropy_ref,
            "trends": {k: t.state_dict() for k, t in self.trends.items()},
            "open": [asdict(e) for e in self.open.values()],
            "closed": [asdict(e) for e in self.closed],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` (the config comes with it).

        A state written before episodes existed (with ``last_fired``) loads with none open.
        """
        known = {f.name for f in fields(HealthConfig)}
        self.config = HealthConfig(**{k: v for k, v in state["config"].items() if k in known})
        self.steps = int(state["steps"])
        self.acr_sum = float(state["acr_sum"])
        self.first_sum = float(state["first_sum"])
        self.first_count = int(state["first_count"])
        self.stall_run = int(state["stall_run"])
        self.window = deque((float(x) for x in state["window"]), maxlen=self.config.window)
        ref = state.get("entropy_ref")
        self.entropy_ref = None if ref is None else float(ref)
        self.trends = {k: _Trend(self.config.trend_window) for k in TREND_KEYS}
        for k, t in state.get("trends", {}).items():
            if k in self.trends:
                self.trends[k].load_state_dict(t)
        self.open = {e["rule"]: _episode(e) for e in state.get("open", [])}
        self.closed = [_episode(e) for e in state.get("closed", [])]


_ACR_KEYS = ("acr/sampled_rate", "acr/rate")
_RULE_KEYS: dict[str, tuple[str, ...]] = {
    "acr_stall": _ACR_KEYS,
    "acr_unstable": _ACR_KEYS,
    "inv_scale_tail": ("scale/inv_p99",),
    "nan_rewards": ("reward/nan_frac",),
    "kl_dominated": ("balance/low_sigma/r_over_kl",),
    "kl_overwhelmed": ("balance/low_sigma/r_over_kl",),
    "nonfinite_loss": ("loss", "loss/total"),
    "entropy_collapse": ("policy/entropy_mean",),
    "truncation": ("length/truncated_frac",),
    "rollout_mismatch": ("mismatch/kl_k3",),
    "clip_bound": ("policy/clip_frac_low", "policy/clip_frac_high", "policy/clip_frac_region"),
    "entropy_trend": ("policy/entropy_mean",),
    "length_drift": ("length/mean",),
    "reward_hacking": ("reward/correct_mean",),
    "truncation_zeroed": ("truncated/trained_frac",),
    "truncated_sampling": ("mismatch/ratio_max", "corr/weight_max"),
}
"""Rule -> the metrics it reads. Only a step that logs one of them can clear the rule's
episode: an evaluation-only row, or a step between two R/KL measurements, leaves it as it is."""


CLIP_ADVICE: dict[str, str] = {
    "high": (
        "the upper bound stops reinforcing tokens whose probability already rose (exploration "
        "capped): clip-higher (eps_high 0.28, DAPO §3.1) or a lower learning rate"
    ),
    "low": (
        "the lower bound stops pushing down negative-advantage tokens the update already made "
        "rarer (the policy moves fast on wrong samples): a lower learning rate or fewer "
        "epochs / minibatches per generation batch; do not widen eps_low"
    ),
    "both": (
        "the update leaves the trust region on both sides: a lower learning rate, or fewer "
        "epochs / minibatches per generation batch"
    ),
    "unknown": (
        "steps too large for the clip range: a lower learning rate or fewer updates per "
        "generation batch; log the two bounds apart (TRL clip_ratio/low_mean and "
        "clip_ratio/high_mean) to see which one cuts"
    ),
}
"""What ``clip_bound`` recommends, by the bound that holds most clipped tokens
(DAPO §3.1 for clip-higher; the rest [OURS])."""

ENTROPY_ADVICE: dict[str, str] = {
    "falling": (
        "exploration is narrowing ahead of a collapse: clip-higher (eps_high 0.28), a focal "
        "weight, a higher temperature or a lower learning rate"
    ),
    "rising": (
        "the policy is spreading towards noise: a lower learning rate, a tighter clip, or a "
        "larger KL coefficient beta; read samples for gibberish"
    ),
}
"""What ``entropy_trend`` recommends [OURS; clip-higher: DAPO §3.1]."""

LENGTH_ADVICE: dict[str, str] = {
    "growing": (
        "watch truncation and repetition: raise max_new_tokens or use overlong shaping if "
        "answers are cut; a sequence-mean loss (1/|o|) down-weights the tokens of long wrong "
        "answers (Dr. GRPO §3.1): token-sum normalisation (dr_grpo) removes that bias"
    ),
    "shrinking": (
        "short answers are being rewarded or long ones punished: check for a length penalty, "
        "a verifier that zeroes truncated answers (truncation_zeroed), or a sequence-mean "
        "loss favouring short correct answers (Dr. GRPO §3.1)"
    ),
}
"""What ``length_drift`` recommends (Dr. GRPO §3.1 on the length bias of 1/|o|; the rest
[OURS])."""


class _Trend:
    """The first ``window`` values of a metric and the latest ``window`` (deque)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.first: list[float] = []
        self.last: deque[float] = deque(maxlen=window)
        self.n = 0

    def add(self, v: float) -> None:
        self.n += 1
        if len(self.first) < self.window:
            self.first.append(v)
        self.last.append(v)

    @property
    def ready(self) -> bool:
        """The two windows do not overlap: ``2 × window`` values seen."""
        return self.n >= 2 * self.window

    @property
    def first_mean(self) -> float:
        return sum(self.first) / len(self.first)

    @property
    def last_mean(self) -> float:
        return sum(self.last) / len(self.last)

    def state_dict(self) -> dict[str, Any]:
        return {"first": list(self.first), "last": list(self.last), "n": self.n}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.first = [float(x) for x in d["first"]]
        self.last = deque((float(x) for x in d["last"]), maxlen=self.window)
        self.n = int(d["n"])


def _episode(d: dict[str, Any]) -> Episode:
    return Episode(**{**d, "updates": list(d["updates"])})
