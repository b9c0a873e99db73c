"""The prompt-sampler axis: which prompts of a finite pool a training step draws.

    from grouprl import sampling
    sampler = sampling.make("sigma", pool_size=4096)          # or "uniform" (the default axis)
    idx = sampler.sample(32, generator)                        # [P] long, indices into the pool
    ... generate G completions for each idx, score them, compute advantages ...
    sampler.observe(idx, sigma)                                # [P] within-group reward std
    ckpt["sampler"] = sampler.state_dict()                     # sampling.load(state) restores it

:data:`SAMPLERS` maps a name to a sampler class; every sampler draws ``n`` indices from
``[0, pool_size)`` with a caller-owned ``torch.Generator`` (so a run's stream is reproducible),
is told each group's observed reward std after the step, and checkpoints its state.

**IS-GRPO** ["Why GRPO needs normalization", Ge et al., arXiv 2601.23135; the seed abstract:
"IS-GRPO, an importance-sampling variant of GRPO whose expected update remains aligned with the
full gradient"; ALGORITHMS.md §1] is GRPO's per-prompt normalisation with prompts drawn by
:class:`SigmaSampler`. Why no extra importance weight is applied — the derivation [OURS: the
paper's full text with the IS-GRPO section was not reachable; only its abstract, so this is
the reading the abstract's claim forces]. Let J = (1/|X|) Σ_x J_x be the pool's expected
reward. GRPO's per-prompt update is, in expectation over the group (large-G limit, population
mean and std), u_x = E[(r − J_x)/σ_x · ∇log π(y|x)] = ∇J_x / σ_x. Drawing x with probability
p_x:

    E_x[u_x] = Σ_x p_x ∇J_x / σ_x.

Uniform p_x = 1/|X| gives (1/|X|) Σ_x ∇J_x / σ_x: every prompt's gradient re-weighted by
1/σ_x, *not* parallel to ∇J. With p_x = σ_x / Σ_y σ_y it is (1/Σ_y σ_y) Σ_x ∇J_x =
(1/σ̄)·∇J, σ̄ the pool's mean σ: parallel to the full gradient, with step scale 1/σ̄. The
importance weight that turns draws from p into an unbiased estimate of ∇J is
1/(|X| p_x) = σ̄/σ_x, i.e. GRPO's own 1/σ_x up to the constant σ̄: the std normalisation *is*
the importance weight. Multiplying by 1/(|X| p_x) on top would give back uniform GRPO's
expectation, so IS-GRPO applies none; the advantages are plain ``grpo``.

Finite groups [OURS, measured in docs/advantages.md]: with G samples the per-prompt expected
update is c_G(J_x)·∇J_x with c_G ≠ 1/σ_x where σ_x is small (most groups are collapsed; at G = 8
c_G·σ ranges from 0.24 at J = 0.01 to 0.87 at J = 0.5), and σ̂_x estimates E[σ̂_G], which is
biased low there. Worse, the σ that draws (the EMA σ̂_x, floored) is not the σ that divides
(this group's σ_q). So ``is_grpo``'s alignment is exact only in the large-G limit with a
perfect σ̂, and approximate where prompts are nearly always solved or never solved.

**Exact variant** [OURS] (``is_grpo_exact``): the same sampler, Dr.GRPO's advantage
r − r̄ (whose per-prompt expectation is ((G − 1)/G)·∇J_x at every G, no σ in it) times the
importance weight of the draw, 1/(|X|·p_x) with p_x the probability the sampler really drew x
with (:meth:`PromptSampler.importance_weights`). One quantity then both draws and divides:
1/(|X| p_x) = (Σ_y s_y/|X|)/s_x with s the sampler's floored σ̂, and
E[update] = Σ_x p_x·((G − 1)/G)·∇J_x/(|X| p_x) = ((G − 1)/G)·∇J exactly, for every G and
whatever σ̂ has learned (tested: cosine 1 with ∇J at G = 2 … 64, where ``is_grpo`` gets 0.975
at G = 4). The sampling then shapes only the variance.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, ClassVar

import torch

__all__ = [
    "SAMPLERS",
    "CurriculumSampler",
    "PromptSampler",
    "SigmaSampler",
    "UniformSampler",
    "load",
    "make",
    "names",
]

DEFAULT_SIGMA_FLOOR = 0.05
"""[OURS] σ_floor for rewards in [0, 1]: a prompt whose estimate is 0 (every visit collapsed) is
drawn with weight 0.05 against ~0.5 for a half-solved one, so it stays reachable (≈ 1/10)."""

DEFAULT_MOMENTUM = 0.5
"""[OURS] weight of the old estimate in σ̂_x ← m·σ̂_x + (1 − m)·σ_obs: a prompt is revisited
rarely, so each visit counts for half; the policy moves between visits, so old ones fade."""


def _check_pool_size(pool_size: Any) -> int:
    if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
        raise ValueError(
            f"pool_size must be a positive int (the number of prompts in the pool), got "
            f"{pool_size!r}; procedural tasks need a finite pool for a prompt sampler"
        )
    return pool_size


class PromptSampler:
    """Base of every sampler: draw indices into ``[0, pool_size)``; observe; checkpoint.

    Subclasses define :meth:`probabilities` and may override :meth:`observe` and the state.
    ``replacement``: whether one call to :meth:`sample` may draw a prompt twice.
    """

    name: ClassVar[str] = ""

    def __init__(self, pool_size: int, *, replacement: bool) -> None:
        self.pool_size = _check_pool_size(pool_size)
        self.replacement = bool(replacement)

    def probabilities(self) -> torch.Tensor:
        """``[pool_size]`` float64: the probability of each prompt on one draw (sums to 1)."""
        raise NotImplementedError

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """``[n]`` long: ``n`` prompt indices drawn with :meth:`probabilities` from ``generator``."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n (prompts per step) must be a positive int, got {n!r}")
        if not self.replacement and n > self.pool_size:
            raise ValueError(
                f"cannot draw {n} distinct prompts from a pool of {self.pool_size}: enlarge the "
                "pool, draw fewer prompts per step, or use replacement=True"
            )
        p = self.probabilities()  # [pool]
        return torch.multinomial(p, n, replacement=self.replacement, generator=generator)

    def importance_weights(self, indices: torch.Tensor) -> torch.Tensor:
        """``[P]`` float64 1/(|pool|·p_x) of prompts ``indices``: the importance weight that makes
        a draw from :meth:`probabilities` unbiased for the pool's uniform average.

        Call it with the indices :meth:`sample` just drew, before :meth:`observe` changes p:
        these are the probabilities the draw was made with (1 for every prompt of a uniform
        sampler). ``is_grpo_exact`` multiplies each group's advantages by it.
        """
        if not isinstance(indices, torch.Tensor) or indices.dim() != 1:
            raise ValueError("indices must be a [P] tensor of prompt indices (what sample drew)")
        _check_observation(indices, torch.zeros(indices.shape, dtype=torch.float64), self.pool_size)
        p = self.probabilities()  # [pool]
        return 1.0 / (self.pool_size * p[indices.long().cpu()])

    def observe(self, indices: torch.Tensor, sigma: torch.Tensor) -> None:
        """Record the observed within-group reward std ``sigma [P]`` of prompts ``indices [P]``.

        NaN marks a group without a usable std (fewer than 2 valid rewards): it is skipped.
        The base sampler only checks the input.
        """
        _check_observation(indices, sigma, self.pool_size)

    def begin_step(self, step: int) -> None:
        """A new training step starts (before its first draw); memoryless samplers ignore it."""

    def observe_groups(
        self,
        indices: torch.Tensor,
        sigma: torch.Tensor,
        successes: torch.Tensor,
        trials: torch.Tensor,
    ) -> None:
        """Everything the trainer knows of the groups ``indices [P]`` drew: the within-group
        reward std ``sigma [P]``, the summed success (valid rewards rescaled to [0, 1])
        ``successes [P]`` and the number of valid rewards ``trials [P]``. The default hands
        ``sigma`` to :meth:`observe`."""
        self.observe(indices, sigma)

    def stats(self) -> dict[str, float]:
        """Numbers worth logging: ``sampler/p_max_over_uniform`` (max p · pool) and
        ``sampler/effective_pool`` (1/Σp², the pool size a uniform draw would have)."""
        p = self.probabilities()
        return {
            "sampler/p_max_over_uniform": float(p.max() * self.pool_size),
            "sampler/effective_pool": float(1.0 / p.square().sum()),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "pool_size": self.pool_size, "replacement": self.replacement}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(
                f"checkpoint holds a {state.get('name')!r} sampler state, this run uses "
                f"{self.name!r}: resume with the same sampler"
            )
        if int(state["pool_size"]) != self.pool_size:
            raise ValueError(
                f"checkpoint sampler has a pool of {state['pool_size']} prompts, this run "
                f"{self.pool_size}: resume with the same pool size"
            )
        self.replacement = bool(state["replacement"])


def _check_observation(indices: torch.Tensor, sigma: torch.Tensor, pool_size: int) -> None:
    if not isinstance(indices, torch.Tensor) or not isinstance(sigma, torch.Tensor):
        raise ValueError("observe(indices, sigma) takes two tensors of shape [P]")
    if indices.dim() != 1 or sigma.shape != indices.shape:
        raise ValueError(
            f"indices and sigma must both be [P], got {tuple(indices.shape)} and "
            f"{tuple(sigma.shape)}; pass the per-group std, one value per drawn prompt"
        )
    if indices.dtype in (torch.bool,) or indices.is_floating_point():
        raise ValueError(f"indices must be integer prompt indices, got {indices.dtype}")
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= pool_size):
        raise ValueError(
            f"indices must lie in [0, {pool_size}), got range "
            f"[{int(indices.min())}, {int(indices.max())}]"
        )
    if bool((sigma < 0).any()) or bool(torch.isinf(sigma).any()):
        raise ValueError("sigma must be a std: >= 0 and finite (NaN = not scorable, skipped)")


class UniformSampler(PromptSampler):
    """Every prompt with probability 1/|pool|; without replacement within a step by default.

    What GRPO, DAPO and every other preset assume (``Preset.sampler = "uniform"``). ``observe``
    records nothing; the draws depend on the generator only.
    """

    name = "uniform"

    def __init__(self, pool_size: int, *, replacement: bool = False) -> None:
        super().__init__(pool_size, replacement=replacement)

    def probabilities(self) -> torch.Tensor:
        return torch.full((self.pool_size,), 1.0 / self.pool_size, dtype=torch.float64)


class SigmaSampler(PromptSampler):
    """IS-GRPO's sampler: p_x ∝ max(σ̂_x, σ_floor) (module docstring for the derivation).

    - σ̂_x: running estimate of prompt x's within-group reward std, an exponential moving
      average of the std observed at each visit, σ̂_x ← m·σ̂_x + (1 − m)·σ_obs, the first
      visit setting it [OURS: the paper's estimator of σ_x was not reachable; ``momentum`` m,
      default 0.5]. ``momentum=0`` keeps the last visit only.
    - unvisited prompts get the mean of σ̂ over the visited ones (uniform before any visit),
      so a new prompt is drawn like an average one [OURS].
    - ``sigma_floor`` (default 0.05 for rewards in [0, 1], [OURS]) keeps every prompt reachable:
      a prompt whose groups always collapse would otherwise never be drawn again.
    - draws are **with replacement** by default: i.i.d. draws from p are what make
      E[update] = Σ_x p_x u_x; sequential draws without replacement have inclusion
      probabilities that are not ∝ p [OURS]. ``replacement=False`` is allowed.
    """

    name = "sigma"

    def __init__(
        self,
        pool_size: int,
        *,
        sigma_floor: float = DEFAULT_SIGMA_FLOOR,
        momentum: float = DEFAULT_MOMENTUM,
        replacement: bool = True,
    ) -> None:
        super().__init__(pool_size, replacement=replacement)
        if not (isinstance(sigma_floor, int | float) and math.isfinite(sigma_floor)) or not (
            sigma_floor > 0
        ):
            raise ValueError(
                f"sigma_floor must be > 0 (it keeps every prompt reachable), got {sigma_floor!r}"
            )
        if not (isinstance(momentum, int | float) and 0.0 <= momentum < 1.0):
            raise ValueError(f"momentum must be in [0, 1) (0 = last visit only), got {momentum!r}")
        self.sigma_floor = float(sigma_floor)
        self.momentum = float(momentum)
        self.sigma_hat = torch.full((self.pool_size,), math.nan, dtype=torch.float64)  # [pool]
        self.visits = torch.zeros(self.pool_size, dtype=torch.long)  # [pool]

    def weights(self) -> torch.Tensor:
        """``[pool]`` float64 unnormalised weights max(σ̂_x, σ_floor), unvisited = visited mean."""
        seen = self.visits > 0  # [pool]
        if not bool(seen.any()):
            return torch.ones(self.pool_size, dtype=torch.float64)
        fill = self.sigma_hat[seen].mean()  # [] running mean of the visited estimates
        est = torch.where(seen, self.sigma_hat, fill)  # [pool]
        return est.clamp_min(self.sigma_floor)

    def probabilities(self) -> torch.Tensor:
        w = self.weights()
        return w / w.sum()

    def observe(self, indices: torch.Tensor, sigma: torch.Tensor) -> None:
        """EMA update of σ̂ for each (index, σ) pair in order; NaN σ is skipped, not a visit.

        A prompt drawn twice in one step is updated twice, in the order given.
        """
        _check_observation(indices, sigma, self.pool_size)
        m = self.momentum
        for i, s in zip(indices.tolist(), sigma.detach().to(torch.float64).cpu().tolist()):
            if math.isnan(s):
                continue
            old = float(self.sigma_hat[i])
            self.sigma_hat[i] = s if self.visits[i] == 0 else m * old + (1.0 - m) * s
            self.visits[i] += 1

    def stats(self) -> dict[str, float]:
        seen = self.visits > 0
        out = super().stats()
        out["sampler/visited_frac"] = float(seen.double().mean())
        out["sampler/sigma_hat_mean"] = (
            float(self.sigma_hat[seen].mean()) if bool(seen.any()) else math.nan
        )
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "sigma_floor": self.sigma_floor,
            "momentum": self.momentum,
            "sigma_hat": self.sigma_hat.clone(),
            "visits": self.visits.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.sigma_floor = float(state["sigma_floor"])
        self.momentum = float(state["momentum"])
        self.sigma_hat = torch.as_tensor(state["sigma_hat"], dtype=torch.float64).clone()
        self.visits = torch.as_tensor(state["visits"], dtype=torch.long).clone()
        if self.sigma_hat.shape != (self.pool_size,) or self.visits.shape != (self.pool_size,):
            raise ValueError("sampler state has per-prompt arrays of the wrong length")


class CurriculumSampler(PromptSampler):
    """A pass-rate curriculum: prompts whose estimated pass rate leaves a band are set aside and
    revisited on a schedule; each step draws distinct prompts, in-band ones first.

    The difficulty filters and curricula of the peers (prime-rl's ``easy_threshold`` /
    ``hard_threshold`` buffer, AReaL's and NeMo-RL's dynamic filtering, verl's curriculum
    sampler) keep per-prompt pass rates and drop the always-solved and never-solved prompts;
    this is one such sampler, its rules [OURS] where the peers differ:

    - **pass rate per prompt**, online: a Beta(a_x, b_x) whose counts decay at each visit,
      a ← λ·a + successes, b ← λ·b + failures (``decay`` λ, default 0.5: the policy moves
      between visits, so old visits fade); p̂_x = a/(a + b). An unseen prompt starts from the
      **prior** Beta(k·m, k·(1 − m)), k = ``prior_strength`` (default 2) and m the mean p̂ of
      the visited prompts (0.5 before any visit), so it is eligible while the pool is.
    - **band**: after a visit, a prompt with p̂ < ``band[0]`` or p̂ > ``band[1]`` (default
      0.05, 0.95: with λ = 0.5 and k = 2 one all-wrong or all-correct group of G ≥ 16 puts it
      out) is set aside for ``revisit`` steps (default 20); then it is eligible again and its
      next visit decides anew.
    - **each step** (:meth:`begin_step`): :meth:`sample` draws eligible prompts uniformly
      without replacement, never one drawn earlier in the same step (dynamic sampling's later
      rounds included), and **backfills** with set-aside prompts, soonest due first, when too
      few are eligible; only a step that has drawn the whole pool draws a prompt again
      (``sampler/repeated``), eligible ones first.
      Uniform among the eligible keeps the in-band distribution the data's.

    Composable with dynamic sampling: the sampler only chooses which prompts are generated;
    the filter still drops the groups that came out collapsed. Its draws are not i.i.d. from
    :meth:`probabilities`, so it gives no importance weight (``sampler_weight`` needs
    ``uniform`` or ``sigma``). The whole state (counts, set-aside schedule, the step and what
    it has drawn) is in :meth:`state_dict`: a resumed run draws exactly what an uninterrupted
    one would.
    """

    name = "curriculum"

    def __init__(
        self,
        pool_size: int,
        *,
        band: tuple[float, float] = (0.05, 0.95),
        revisit: int = 20,
        decay: float = 0.5,
        prior_strength: float = 2.0,
    ) -> None:
        super().__init__(pool_size, replacement=False)
        lo, hi = (float(x) for x in band)
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(
                f"band must be (low, high) pass rates with 0 <= low < high <= 1, got {band!r}"
            )
        if isinstance(revisit, bool) or not isinstance(revisit, int) or revisit < 1:
            raise ValueError(f"revisit must be a positive number of steps, got {revisit!r}")
        if not 0.0 <= float(decay) <= 1.0:
            raise ValueError(f"decay must be in [0, 1] (1 = never forget), got {decay!r}")
        if not float(prior_strength) > 0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength!r}")
        self.band = (lo, hi)
        self.revisit = revisit
        self.decay = float(decay)
        self.prior_strength = float(prior_strength)
        self.a = torch.zeros(pool_size, dtype=torch.float64)  # [pool] success counts
        self.b = torch.zeros(pool_size, dtype=torch.float64)  # [pool] failure counts
        self.visits = torch.zeros(pool_size, dtype=torch.long)  # [pool]
        self.aside_until = torch.zeros(pool_size, dtype=torch.long)  # [pool] eligible from
        self.step = 0
        self.drawn = torch.zeros(pool_size, dtype=torch.bool)  # [pool] drawn this step
        self.backfilled = 0
        self.repeated = 0

    def pass_rate(self) -> torch.Tensor:
        """``[pool]`` float64 p̂: the posterior mean; the prior mean m for unseen prompts."""
        seen = self.visits > 0
        est = self.a / (self.a + self.b).clamp_min(1e-12)
        return torch.where(seen, est, torch.full_like(est, self._prior_mean()))

    def _prior_mean(self) -> float:
        seen = self.visits > 0
        if not bool(seen.any()):
            return 0.5
        return float((self.a[seen] / (self.a[seen] + self.b[seen]).clamp_min(1e-12)).mean())

    def eligible(self) -> torch.Tensor:
        """``[pool]`` bool: not set aside at the current step."""
        return self.aside_until <= self.step

    def probabilities(self) -> torch.Tensor:
        """Uniform over the eligible prompts (over the pool when none is): the distribution of
        one draw at the start of a step."""
        ok = self.eligible().to(torch.float64)
        if not bool(ok.any()):
            ok = torch.ones_like(ok)
        return ok / ok.sum()

    def begin_step(self, step: int) -> None:
        if int(step) != self.step:
            self.drawn.zero_()
        self.step = int(step)

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n (prompts per step) must be a positive int, got {n!r}")
        order = torch.randperm(self.pool_size, generator=generator)  # [pool] random ties
        ok, free = self.eligible()[order], ~self.drawn[order]  # [pool] in that order
        # classes: 0 eligible and not drawn this step; 1 set aside, not drawn (soonest due
        # first); 2, 3 the same two once drawn this step (repeats, only when the rest is spent)
        key = (~ok).long() + 2 * (~free).long()  # [pool]
        due = torch.where(ok, 0, self.aside_until[order])  # [pool]
        by_due = torch.sort(due, stable=True).indices
        by_key = by_due[torch.sort(key[by_due], stable=True).indices]  # (key, due, random)
        pos = by_key[torch.arange(n) % self.pool_size]  # [n] a draw above the pool cycles it
        taken = order[pos]  # [n]
        self.backfilled = int((key[pos] == 1).sum())
        self.repeated = int((key[pos] >= 2).sum()) + max(0, n - self.pool_size)
        self.drawn[taken] = True
        return taken

    def importance_weights(self, indices: torch.Tensor) -> torch.Tensor:
        """``[P]`` NaN: draws without replacement from a moving eligible set carry no
        importance weight (a run cannot combine this sampler with ``sampler_weight``)."""
        _check_observation(indices, torch.zeros(indices.shape, dtype=torch.float64), self.pool_size)
        return torch.full(indices.shape, math.nan, dtype=torch.float64)

    def observe(self, indices: torch.Tensor, sigma: torch.Tensor) -> None:
        """Checks only: the curriculum learns from :meth:`observe_groups` (pass rates)."""
        _check_observation(indices, sigma, self.pool_size)

    def observe_groups(
        self,
        indices: torch.Tensor,
        sigma: torch.Tensor,
        successes: torch.Tensor,
        trials: torch.Tensor,
    ) -> None:
        """Update each visited prompt's pass rate and set aside those outside the band.

        ``successes [P]`` and ``trials [P]``: summed success in [0, 1] units and valid rewards
        of each group; a group with no valid reward is not a visit."""
        _check_observation(indices, sigma, self.pool_size)
        if successes.shape != indices.shape or trials.shape != indices.shape:
            raise ValueError("successes and trials must be [P] like indices")
        lam, k, (lo, hi) = self.decay, self.prior_strength, self.band
        for i, s, t in zip(indices.tolist(), successes.double().tolist(), trials.double().tolist()):
            if not t > 0:
                continue
            if self.visits[i] == 0:
                m = self._prior_mean()
                self.a[i], self.b[i] = k * m, k * (1.0 - m)
            self.a[i] = lam * self.a[i] + s
            self.b[i] = lam * self.b[i] + (t - s)
            self.visits[i] += 1
            p = float(self.a[i] / (self.a[i] + self.b[i]))
            if p < lo or p > hi:
                self.aside_until[i] = self.step + 1 + self.revisit
            else:
                self.aside_until[i] = 0

    def stats(self) -> dict[str, float]:
        seen = self.visits > 0
        return {
            "sampler/eligible_frac": float(self.eligible().double().mean()),
            "sampler/visited_frac": float(seen.double().mean()),
            "sampler/pass_rate_mean": self._prior_mean() if bool(seen.any()) else math.nan,
            "sampler/backfilled": float(self.backfilled),
            "sampler/repeated": float(self.repeated),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "band": list(self.band),
            "revisit": self.revisit,
            "decay": self.decay,
            "prior_strength": self.prior_strength,
            "a": self.a.clone(),
            "b": self.b.clone(),
            "visits": self.visits.clone(),
            "aside_until": self.aside_until.clone(),
            "step": self.step,
            "drawn": self.drawn.clone(),
            "backfilled": self.backfilled,
            "repeated": self.repeated,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.band = (float(state["band"][0]), float(state["band"][1]))
        self.revisit = int(state["revisit"])
        self.decay = float(state["decay"])
        self.prior_strength = float(state["prior_strength"])
        for key, dtype in (("a", torch.float64), ("b", torch.float64), ("visits", torch.long),
                           ("aside_until", torch.long), ("drawn", torch.bool)):  # fmt: skip
            t = torch.as_tensor(state[key], dtype=dtype).clone()
            if t.shape != (self.pool_size,):
                raise ValueError(f"sampler state {key!r} has the wrong length for the pool")
            setattr(self, key, t)
        self.step = int(state["step"])
        self.backfilled = int(state.get("backfilled", 0))
        self.repeated = int(state.get("repeated", 0))


SAMPLERS: dict[str, type[PromptSampler]] = {
    "uniform": UniformSampler,
    "sigma": SigmaSampler,
    "curriculum": CurriculumSampler,
}
"""Sampler name -> class ``(pool_size, **params)`` (``Preset.sampler`` names one)."""


def names() -> list[str]:
    """Every sampler name."""
    return list(SAMPLERS)


def make(name: str, pool_size: int, **params: Any) -> PromptSampler:
    """The sampler called ``name`` over a pool of ``pool_size`` prompts, with its ``params``."""
    try:
        cls = SAMPLERS[name]
    except KeyError:
        raise ValueError(
            f"unknown prompt sampler {name!r}; valid samplers: {', '.join(SAMPLERS)}"
        ) from None
    accepted = [
        k for k in inspect.signature(cls.__init__).parameters if k not in ("self", "pool_size")
    ]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"sampler {name!r} got unknown parameter(s) {unknown}; it accepts {accepted}"
        )
    return cls(pool_size, **params)


def load(state: dict[str, Any]) -> PromptSampler:
    """A sampler rebuilt from :meth:`PromptSampler.state_dict` (name and pool size included)."""
    if not isinstance(state, dict) or state.get("name") not in SAMPLERS:
        raise ValueError(
            f"not a sampler state (need a dict with 'name' in {', '.join(SAMPLERS)}), got "
            f"{type(state).__name__}"
        )
    sampler = SAMPLERS[state["name"]](int(state["pool_size"]))
    sampler.load_state_dict(state)  # its parameters come with the state
    return sampler
