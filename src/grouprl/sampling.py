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

__all__ = ["SAMPLERS", "PromptSampler", "SigmaSampler", "UniformSampler", "load", "make", "names"]

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


SAMPLERS: dict[str, type[PromptSampler]] = {"uniform": UniformSampler, "sigma": SigmaSampler}
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
    sampler.load_state_dict(state)
    return sampler
