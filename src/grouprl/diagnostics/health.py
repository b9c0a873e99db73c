"""Run health across steps: rules that turn logged numbers into warnings with an action.

:class:`RunHealth` is fed the flat metric dict of each step (``step_metrics`` output plus
anything else the trainer logs: ``loss``, ``balance/r_over_kl``, ...) and returns the
warnings that fire at that step. Every rule is a named threshold with its source; rules
whose metric is absent stay silent. Warnings repeat at most once per ``cooldown`` steps.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["STALL_ADVICE", "HealthConfig", "RunHealth"]


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
    """Window (steps) of the ACR std divergence rule [PAPER: ACR paper]."""
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
    """R/KL below this = reward branch KL-dominated [PAPER seed: RLOO/Dr.GRPO at 0.48-0.51]."""
    r_over_kl_high: float = 3.0
    """R/KL above this = KL calibration lost [PAPER seed: GRPO at 3.1 in Table 3]."""
    entropy_frac: float = 0.1
    """Policy entropy below this share of its first logged value = entropy collapse [OURS]."""
    truncated_frac: float = 0.5
    """Share of completions cut at the token limit above this = length budget too small [OURS]."""
    cooldown: int = 50
    """A rule that fired stays quiet this many steps [OURS: keeps logs readable]."""
    mismatch_kl: float = 1e-3
    """``mismatch/kl_k3`` (KL of the rollout engine's policy from the trainer's) above this =
    the samples come from another policy than the one trained [OURS: bf16 sampling of our
    fp32 maze model measures ~1e-4 to 1e-3 (reproductions/rollout_correction)]. Said once when
    it starts, again only when it has doubled since, and anew after it fell below half."""


class RunHealth:
    """Stateful health monitor: cumulative ACR, ACR_100, stall alarm, window std, tails.

    Usage::

        health = RunHealth()
        for step ...:
            metrics = diagnostics.step_metrics(rewards, adv)
            for line in health.update(step, metrics):
                log.warning(line)
            metrics.update(health.metrics())

    Each warning is one line: ``"[rule] step S: what was seen -> what to do"``.
    ``state_dict()`` / ``load_state_dict()`` carry everything across a checkpoint resume.
    """

    def __init__(self, config: HealthConfig | None = None) -> None:
        self.config = config or HealthConfig()
        self.steps = 0
        self.acr_sum = 0.0
        self.first_sum = 0.0
        self.first_count = 0
        self.stall_run = 0
        self.window: deque[float] = deque(maxlen=self.config.window)
        self.last_fired: dict[str, int] = {}
        self.fired_total: dict[str, int] = {}
        self.entropy_ref: float | None = None
        self.mismatch_said: float | None = None

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

    def metrics(self) -> dict[str, float]:
        """The derived numbers as flat ``health/*`` metrics for the step's log line."""
        return {
            "health/acr_cumulative": self.acr_cumulative,
            "health/acr_100": self.acr_100,
            "health/acr_window_std": self.acr_window_std,
            "health/stall_run": float(self.stall_run),
        }

    # -- the rules -------------------------------------------------------------------------

    def update(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Feed one step's metrics; return the warnings that fire now (each with its action)."""
        out: list[str] = []
        # the ACR of every generated group when the trainer logs it (with dynamic sampling the
        # kept batch's acr/rate hides the groups that were generated and dropped)
        acr_rate = metrics.get("acr/sampled_rate", metrics.get("acr/rate"))
        if acr_rate is not None and math.isfinite(acr_rate):
            self._track_acr(float(acr_rate))
            out += self._acr_rules(step, metrics)
        out += self._scale_rule(step, metrics)
        out += self._nan_rule(step, metrics)
        out += self._balance_rule(step, metrics)
        out += self._loss_rule(step, metrics)
        out += self._policy_rules(step, metrics)
        out += self._mismatch_rule(step, metrics)
        return out

    def _track_acr(self, rate: float) -> None:
        self.steps += 1
        self.acr_sum += rate
        if self.first_count < self.config.acr_first:
            self.first_sum += rate
            self.first_count += 1
        self.window.append(rate)
        self.stall_run = self.stall_run + 1 if rate > self.config.stall_acr else 0

    def _fire(self, rule: str, step: int, text: str) -> list[str]:
        last = self.last_fired.get(rule)
        if last is not None and step - last < self.config.cooldown:
            return []
        self.last_fired[rule] = step
        self.fired_total[rule] = self.fired_total.get(rule, 0) + 1
        return [f"[{rule}] step {step}: {text}"]

    def _acr_rules(self, step: int, m: dict[str, float]) -> list[str]:
        c = self.config
        out: list[str] = []
        if self.stall_run >= c.stall_steps:
            wrong, right = m.get("acr/all_wrong", 0.0), m.get("acr/all_correct", 0.0)
            rate = m.get("acr/sampled_rate", m.get("acr/rate", 0.0))
            if rate > m.get("acr/rate", 0.0) + 1e-9:  # a filter dropped the collapsed groups
                why = (
                    f"dynamic sampling discards {rate:.0%} of the generated groups, "
                    "and their rollouts"
                )
                fix = STALL_ADVICE["filtered"]
            elif wrong >= right:
                why = f"mostly all-wrong groups ({wrong:.0%}): prompts too hard for the model"
                fix = STALL_ADVICE["all_wrong"]
            else:
                why = f"mostly all-correct groups ({right:.0%}): prompts already solved"
                fix = STALL_ADVICE["all_correct"]
            out += self._fire(
                "acr_stall",
                step,
                f"ACR > {c.stall_acr:g} for {self.stall_run} consecutive steps (now "
                f"{rate:.2f}; {why}) -> {fix}",
            )
        if len(self.window) >= c.window and self.acr_window_std > c.window_std:
            out += self._fire(
                "acr_unstable",
                step,
                f"ACR std over the last {c.window} steps is {self.acr_window_std:.3f} > "
                f"{c.window_std:g}: divergence risk -> lower the learning rate, tighten the "
                "clip range, or raise the KL coefficient beta",
            )
        return out

    def _scale_rule(self, step: int, m: dict[str, float]) -> list[str]:
        p99 = m.get("scale/inv_p99")
        if p99 is None or not p99 > self.config.inv_scale_p99:
            return []
        return self._fire(
            "inv_scale_tail",
            step,
            f"P99 of 1/scale is {p99:.3g} > {self.config.inv_scale_p99:g}: near-constant groups "
            "are amplified into full-size updates -> use estimator maxnorm_rloo (bounded), or "
            "delta_res=1e-2 (resolution protocol) to skip sub-resolution jitter",
        )

    def _nan_rule(self, step: int, m: dict[str, float]) -> list[str]:
        frac = m.get("reward/nan_frac")
        if frac is None or not frac > self.config.nan_frac:
            return []
        return self._fire(
            "nan_rewards",
            step,
            f"{frac:.1%} of rewards are unscorable (NaN) -> check the verifier: timeouts, "
            "answer extraction, sandbox errors (NaN rewards are excluded, not scored 0)",
        )

    def _balance_rule(self, step: int, m: dict[str, float]) -> list[str]:
        ratio = m.get("balance/r_over_kl")
        if ratio is None or not math.isfinite(ratio):
            return []
        c = self.config
        if ratio < c.r_over_kl_low:
            return self._fire(
                "kl_dominated",
                step,
                f"R/KL = {ratio:.3g} < {c.r_over_kl_low:g}: the KL branch outweighs the reward "
                "signal -> lower beta, or use maxnorm_rloo to recover small credible gaps",
            )
        if ratio > c.r_over_kl_high:
            return self._fire(
                "kl_overwhelmed",
                step,
                f"R/KL = {ratio:.3g} > {c.r_over_kl_high:g}: std-normalised advantages overwhelm "
                "the KL anchor -> use maxnorm_rloo or grpo_beta_comp, or raise beta",
            )
        return []

    def _loss_rule(self, step: int, m: dict[str, float]) -> list[str]:
        loss = m.get("loss", m.get("loss/total"))
        if loss is None or math.isfinite(loss):
            return []
        return self._fire(
            "nonfinite_loss",
            step,
            f"loss is {loss}: -> lower the learning rate, check for inf rewards or log-probs, "
            "and resume from the last checkpoint",
        )

    def _policy_rules(self, step: int, m: dict[str, float]) -> list[str]:
        out: list[str] = []
        ent = m.get("policy/entropy_mean")
        if ent is not None and math.isfinite(ent):
            if self.entropy_ref is None:
                self.entropy_ref = float(ent)
            elif self.entropy_ref > 0 and ent < self.config.entropy_frac * self.entropy_ref:
                out += self._fire(
                    "entropy_collapse",
                    step,
                    f"policy entropy {ent:.3g} fell below {self.config.entropy_frac:g}x its "
                    f"first value {self.entropy_ref:.3g}: exploration is gone -> clip-higher "
                    "(eps_high 0.28, preset dapo), a focal weight, a higher temperature or a "
                    "lower learning rate",
                )
        trunc = m.get("length/truncated_frac")
        if trunc is not None and trunc > self.config.truncated_frac:
            out += self._fire(
                "truncation",
                step,
                f"{trunc:.0%} of completions hit the token limit -> raise max_new_tokens, or "
                "use overlong shaping (mask / soft penalty) so cut-off answers are not scored "
                "as wrong",
            )
        return out

    def _mismatch_rule(self, step: int, m: dict[str, float]) -> list[str]:
        kl = m.get("mismatch/kl_k3")
        limit = self.config.mismatch_kl
        if kl is None or not math.isfinite(kl):
            return []
        said = self.mismatch_said
        if kl < limit / 2:
            self.mismatch_said = None  # gone: a later rise is news again
            return []
        if kl <= limit or (said is not None and kl < 2 * said):
            return []
        self.mismatch_said = kl
        p99 = m.get("mismatch/ratio_p99", float("nan"))
        seen = f"KL(rollout||train) {kl:.2g} > {limit:g}, token ratio p99 {p99:.3g}"
        if said is not None:
            seen = f"grew to {seen} (was {said:.2g})"
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
        self.last_fired["rollout_mismatch"] = step
        self.fired_total["rollout_mismatch"] = self.fired_total.get("rollout_mismatch", 0) + 1
        return [f"[rollout_mismatch] step {step}: {seen} -> {fix}"]

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
            "last_fired": dict(self.last_fired),
            "fired_total": dict(self.fired_total),
            "entropy_ref": self.entropy_ref,
            "mismatch_said": self.mismatch_said,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` (the config comes with it)."""
        self.config = HealthConfig(**state["config"])
        self.steps = int(state["steps"])
        self.acr_sum = float(state["acr_sum"])
        self.first_sum = float(state["first_sum"])
        self.first_count = int(state["first_count"])
        self.stall_run = int(state["stall_run"])
        self.window = deque((float(x) for x in state["window"]), maxlen=self.config.window)
        self.last_fired = {str(k): int(v) for k, v in state["last_fired"].items()}
        self.fired_total = {str(k): int(v) for k, v in state["fired_total"].items()}
        ref = state.get("entropy_ref")
        self.entropy_ref = None if ref is None else float(ref)
        said = state.get("mismatch_said")
        self.mismatch_said = None if said is None else float(said)
