"""grouprl's estimators and surrogates in verl's registries (verl >= 0.9).

Importing this module registers, in the importing process:

- every estimator of :data:`grouprl.advantages.ESTIMATORS` and
  :data:`grouprl.advantages.TOKEN_ESTIMATORS` as ``grouprl_<name>`` in verl's
  advantage-estimator registry (``core_algos.ADV_ESTIMATOR_REGISTRY``);
- every surrogate of :data:`grouprl.losses.SURROGATES` as ``grouprl_<name>`` in verl's
  policy-loss registry (``core_algos.POLICY_LOSS_REGISTRY``).

verl's registries live in each process (driver and Ray workers alike), so name this module
in ``VERL_USE_EXTERNAL_MODULES`` (verl imports it at ``import verl`` in every process), or
rely on the ``verl.plugins`` entry point that grouprl's package metadata declares::

    VERL_USE_EXTERNAL_MODULES=grouprl.integrations.verl python -m verl.trainer.main_ppo \\
        algorithm.adv_estimator=grouprl_grpo +algorithm.grouprl.preset=f_grpo ...

Options come from verl's algorithm config, section ``algorithm.grouprl`` (all optional):
``preset`` (a grouprl preset whose advantage half is applied: its estimator must be the
registered one), ``focal_gamma``, ``delta_res``, ``virtual``, ``virtual_alpha``,
``reward_range``, ``singleton`` (``"zero"`` ours, ``"verl"`` verl's rule) and any estimator
parameter (``eps``, ``ddof``, ``tau``, ``tau_res``...), validated by
:func:`grouprl.advantages.compute`.

verl's input is flat: ``token_level_rewards [N, T]`` and ``index [N]`` (the prompt ``uid``);
:func:`group_layout` maps it to our ``[P, G]`` without a Python loop (ragged and
non-contiguous groups, NaN padding), and the advantages come back per token, times the
response mask, as verl's own outcome estimators return them, in the caller's dtype (float64
is computed in float64). The second output is verl's namesake's: the return-to-go for
``grouprl_reinforce_pp_global`` (verl ``reinforce_plus_plus``) and ``grouprl_remax``, the
advantages for every other estimator (verl's return ``(scores, scores)``). verl's call
keywords are honoured: ``epsilon`` (our ``eps``) and ``norm_adv_by_std_in_grpo`` (keyword or
``algorithm.norm_adv_by_std_in_grpo``: ``False`` runs Dr. GRPO for ``grouprl_grpo`` and sets
``norm_by_std`` for ``grouprl_grpo_passk``); any keyword an estimator cannot honour is a
ValueError naming it. ``grouprl_reinforce_pp_global`` and ``grouprl_remax`` run without
``index``, as verl's ``reinforce_plus_plus`` and ``remax`` do.

Two readings differ from verl's by design (both tested in
tests/integrations/test_verl_conventions.py): ``grouprl_remax`` gives every token the
sequence's ``Σ_t r_t − b`` (ReMax Alg. 1, one reward per sequence), where verl's ``remax``
gives token t its reward-to-go minus b; the two are equal on outcome rewards (the score on
the last valid token) and differ when verl puts its KL penalty in the reward. The whitened
REINFORCE++ estimators divide by the exact token count, verl's ``masked_mean`` by
``count + 1e-8`` (≤ 1e-8/count relative).

Next to TRL 1.x (``grouprl[peers]`` installs both), verl 0.9 cannot build its actor: its
model patch imports TRL's ``AutoModelForCausalLMWithValueHead``, which TRL 1.x removed.
Importing this module applies :func:`fix_trl_probe`, so verl only reaches for that class when
the installed TRL has it.

Token-level estimators (``TOKEN_ESTIMATORS``: ``reinforce_pp_global``,
``reinforce_pp_baseline``, the optimal token baselines) run per token on verl's
``token_level_rewards`` (KL penalty included when ``algorithm.use_kl_in_reward``), with
``gamma`` from ``algorithm.gamma``; every other estimator runs on the summed score, as verl's
outcome estimators do (``reinforce_pp``, the old name, keeps that sample-level form).
Per-sample inputs: ``lengths`` from ``response_mask`` (``opo``, ``weighting=token``),
``reward_baselines`` (``remax``), ``old_log_probs`` / ``sum_pi_squared`` /
``rollout_is_weights`` (optimal token baselines).

Rollout correction (verl's ``algorithm.rollout_correction``, decoupled mode): verl computes
the weights and the rejection mask in the driver (``rollout_corr_helper``); grouprl's
policy losses multiply their per-token loss by ``rollout_is_weights`` and aggregate over
the rewritten ``response_mask`` (a micro-batch whose tokens were all rejected adds a zero
loss), as verl's own losses do; ``grouprl_gmpo`` weights each sequence by the geometric mean
of its token weights, as verl's ``geo_mean`` does. In *bypass* mode
(``algorithm.rollout_correction.bypass_mode=true``) verl replaces
``actor.policy_loss.loss_mode`` by its own ``bypass_mode`` loss, so a ``grouprl_*`` policy
loss does not run; the grouprl estimators log a warning once when they see bypass mode.

Limits: verl's estimator API returns advantages only, so ``Advantages.keep`` zeroes a
skipped group's reward branch but cannot remove it from verl's KL loss, and
``Advantages.kl_weight`` (``grpo_beta_comp``) is not applied to verl's KL term. verl's
trainer (``ray_trainer.py``) generates the greedy baselines only for its own ``remax``,
passes ``sum_pi_squared`` only to its own optimal-token-baseline names and the per-key
rewards only to its own ``gdpo``: ``grouprl_remax`` and ``grouprl_optimal_token_baseline``
stop with an error naming verl's estimator (equal to ours on outcome rewards:
tests/advantages/test_peers_verl_methods.py) when the input is missing, and ``grouprl_gdpo`` sees one summed
score (it refuses ``algorithm.gdpo_reward_keys``, whose rewards it cannot receive).
"""

from __future__ import annotations

import functools
import logging
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from grouprl import advantages as adv_lib
from grouprl import losses as loss_lib
from grouprl import presets as preset_lib
from grouprl import registry
from grouprl.advantages import VirtualTrigger
from grouprl.types import Advantages

try:
    from verl.trainer.ppo import core_algos
except ImportError as err:  # pragma: no cover - exercised only without verl
    raise ImportError(
        "grouprl.integrations.verl needs verl (>= 0.9): run scripts/install-peers.sh, or "
        "`pip install verl` in a verl environment"
    ) from err

__all__ = [
    "BYPASS_NOTE",
    "LOSS_NAMES",  # noqa: F822 (module __getattr__: read live)
    "OPTION_KEYS",
    "PREFIX",
    "SINGLETON_RULES",
    "TRL_PROBE_MODULES",
    "GroupLayout",
    "estimator_names",
    "fix_trl_probe",
    "group_layout",
    "last_result",
    "load_trigger_state_dict",
    "loss_names",
    "make_estimator",
    "make_policy_loss",
    "register",
    "trigger_state_dict",
    "trl_value_head_available",
]

log = logging.getLogger(__name__)

PREFIX = "grouprl_"
"""Prefix of every name grouprl registers in verl (``grouprl_grpo``, ``grouprl_cispo``...)."""

SINGLETON_RULES = ("zero", "verl")
"""What a group with a single sample gets.

``"zero"`` (default, ALGORITHMS.md §0): no baseline exists, advantage 0. ``"verl"``: verl's
rule (``compute_grpo_outcome_advantage`` / ``group_mean_std``: mean 0, std 1 for a
singleton): the raw reward, divided by ``1 + eps`` (in float32, verl's ``torch.tensor(1.0)``)
for the estimators that divide by a per-group ``σ + eps`` (:data:`_SIGMA_EPS_ESTIMATORS`).
"""

_SIGMA_EPS_ESTIMATORS = frozenset({"grpo", "grpo_beta_comp"})

OPTION_KEYS = (
    "preset",
    "singleton",
    "focal_gamma",
    "delta_res",
    "virtual",
    "virtual_alpha",
    "reward_range",
)
"""Keys of ``algorithm.grouprl`` handled here; any other key is an estimator parameter."""


def loss_names() -> tuple[str, ...]:
    """The names grouprl registers in verl's policy-loss registry, one per surrogate, those
    registered after this import (a plugin's) included. Also ``LOSS_NAMES``, read live."""
    return tuple(PREFIX + name for name in loss_lib.SURROGATES)


def __getattr__(name: str) -> Any:
    # LOSS_NAMES is computed at each read, so that a surrogate registered after this import
    # (a plugin) is in it: a tuple built once at import would miss it
    if name == "LOSS_NAMES":
        return loss_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_TRIGGERS: dict[str, VirtualTrigger] = {}
_LAST: dict[str, Advantages] = {}


# --------------------------------------------------------------------------- flat <-> [P, G]
@dataclass(frozen=True)
class GroupLayout:
    """Where each of verl's N flat samples sits in a ``[P, W]`` grid (W = largest group).

    Attributes:
        group: ``[N]`` long, the sample's group (0..P-1; the order of groups is unspecified).
        pos: ``[N]`` long, its column: rank within the group in batch order.
        counts: ``[P]`` long, samples per group.
        width: W, the largest group size; smaller groups are NaN-padded.
        dense: True when sample ``i`` sits at ``(i // W, i % W)`` (verl's usual layout: equal
            groups, each uid repeated in a run, runs in group order); the grid is then a view.
    """

    counts: torch.Tensor  # [P]
    width: int
    dense: bool = False
    group_ids: torch.Tensor | None = None  # [N]; None: derived from the dense layout
    positions: torch.Tensor | None = None  # [N]; None: derived from the dense layout

    @property
    def num_groups(self) -> int:
        return int(self.counts.shape[0])

    @property
    def group(self) -> torch.Tensor:
        """``[N]`` long, each sample's group (row of the grid)."""
        if self.group_ids is not None:
            return self.group_ids
        return torch.arange(self.num_groups * self.width, device=self.counts.device) // self.width

    @property
    def pos(self) -> torch.Tensor:
        """``[N]`` long, each sample's column: its rank within the group in batch order."""
        if self.positions is not None:
            return self.positions
        return torch.arange(self.num_groups * self.width, device=self.counts.device) % self.width

    def to_grid(self, flat: torch.Tensor) -> torch.Tensor:
        """``[N]`` -> ``[P, W]``, NaN where a group has fewer than W samples."""
        if self.dense:
            return flat.reshape(self.num_groups, self.width)
        grid = torch.full(
            (self.num_groups, self.width), float("nan"), dtype=flat.dtype, device=flat.device
        )
        grid[self.group, self.pos] = flat
        return grid

    def to_flat(self, grid: torch.Tensor) -> torch.Tensor:
        """``[P, W]`` -> ``[N]`` in verl's original sample order."""
        if self.dense:
            return grid.reshape(-1)
        return grid[self.group, self.pos]


def _factorize(arr: np.ndarray) -> np.ndarray:
    """``[N]`` int64 codes of a uid array (strings or numbers), equal codes = equal uids.

    verl repeats each prompt's uid G times in a row (``repeat(interleave=True)``), so the
    uids come in runs: one vectorised comparison of neighbours finds the runs, and only the
    P run heads need factorising (~10x faster than ``np.unique`` over N strings). Batches
    that are not in runs go through ``pandas.factorize`` (a C hash table; pandas is a verl
    dependency), or ``np.unique`` without pandas.
    """
    n = arr.shape[0]
    try:
        starts = np.empty(n, dtype=bool)
        starts[:1] = True
        np.not_equal(arr[1:], arr[:-1], out=starts[1:])
    except TypeError:  # uids that do not compare: compare their strings
        return _factorize(np.array([str(x) for x in arr], dtype=object))
    if int(starts.sum()) <= n // 2:
        heads = _factorize_unordered(arr[starts])  # [runs]
        return heads[np.cumsum(starts) - 1]
    return _factorize_unordered(arr)


def _factorize_unordered(arr: np.ndarray) -> np.ndarray:
    try:
        import pandas as pd

        return pd.factorize(arr)[0].astype(np.int64, copy=False)
    except ImportError:  # pragma: no cover - pandas comes with verl
        return np.unique(arr, return_inverse=True)[1].reshape(-1).astype(np.int64)


def _group_ids(index: Any, device: torch.device) -> torch.Tensor:
    """``[N]`` long group id per sample from verl's ``index`` (uids: str, int, or a tensor)."""
    if isinstance(index, torch.Tensor):
        if index.dim() != 1:
            raise ValueError(f"index must be 1-D [N], got shape {tuple(index.shape)}")
        return torch.unique(index, return_inverse=True)[1].to(device)
    arr = np.asarray(index)
    if arr.ndim != 1:
        raise ValueError(f"index must be 1-D [N], got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise ValueError("index is empty: verl passed a batch without samples")
    if arr.dtype == object or arr.dtype.kind in "US":
        arr = arr.astype(object, copy=False)
    codes = _factorize(arr)  # runs first (verl's layout), a hash table otherwise
    return torch.from_numpy(codes).to(device)


def _equal_runs(index: Any, n: int, device: torch.device) -> GroupLayout | None:
    """verl's usual batch recognised without per-sample codes: the uids come in runs of one
    length W, run i starting at i·W, and no uid heads two runs. Then the grid is a plain view
    of the flat batch (``dense``). None when the batch is laid out any other way."""
    if isinstance(index, torch.Tensor):
        return None
    arr = np.asarray(index)
    if arr.ndim != 1 or arr.shape[0] != n or n == 0:
        return None
    try:
        differs = np.asarray(arr[1:] != arr[:-1], dtype=bool)  # [N-1]
    except (TypeError, ValueError):
        return None
    if differs.shape != (n - 1,):
        return None
    starts = np.flatnonzero(differs) + 1  # run starts after the first
    width = int(starts[0]) if starts.size else n
    if n % width or starts.size != n // width - 1:
        return None
    if not np.array_equal(starts, np.arange(width, n, width)):
        return None
    heads = arr[::width]  # [P] one uid per run
    if int(_factorize_unordered(heads).max()) + 1 != heads.shape[0]:
        return None  # a uid heads two runs: one group split across the batch
    counts = torch.full((n // width,), width, dtype=torch.long, device=device)
    return GroupLayout(counts, width, dense=True)


def group_layout(index: Any, n: int, device: torch.device | str = "cpu") -> GroupLayout:
    """Map verl's flat ``index [N]`` (one uid per sample) to a ``[P, W]`` grid layout.

    Vectorised: a factorisation of the uids gives the group of each sample (group ids are
    dense but in no promised order), a stable sort by group gives each sample's rank within
    its group; when the groups already come in runs (verl's layout) no sort is needed, and
    equal runs make the grid a plain view. Groups may be ragged (different sizes) and
    non-contiguous (a group's samples anywhere in the batch).
    """
    device = torch.device(device)
    fast = _equal_runs(index, n, device)
    if fast is not None:
        return fast
    group = _group_ids(index, device)  # [N]
    if group.shape[0] != n:
        raise ValueError(
            f"index has {group.shape[0]} entries but token_level_rewards has {n} rows; "
            "pass data.non_tensor_batch['uid'] as index"
        )
    counts = torch.bincount(group)  # [P]
    starts = torch.cumsum(counts, 0) - counts  # [P]
    arange = torch.arange(n, device=device)
    width = int(counts.max())
    if bool((group[1:] >= group[:-1]).all()):  # runs in group order: no sort needed
        pos = arange - starts[group]
        dense = bool((counts == width).all())
        return GroupLayout(counts, width, dense, group_ids=group, positions=pos)
    order = torch.argsort(group, stable=True)  # [N] samples sorted by group, batch order kept
    pos = torch.empty_like(group)
    pos[order] = arange - starts[group[order]]
    return GroupLayout(counts, width, group_ids=group, positions=pos)


# --------------------------------------------------------------------------- options
def _as_dict(section: Any) -> dict[str, Any]:
    if section is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(section, DictConfig):
            return dict(OmegaConf.to_container(section, resolve=True))
    except ImportError:  # pragma: no cover
        pass
    if isinstance(section, Mapping):
        return dict(section)
    raise ValueError(
        f"algorithm.grouprl must be a mapping of options, got {type(section).__name__}; "
        "e.g. +algorithm.grouprl.focal_gamma=0.5"
    )


_WARNED: set[str] = set()

BYPASS_NOTE = (
    "verl's rollout correction runs in bypass mode (algorithm.rollout_correction.bypass_mode"
    "=true): verl then replaces actor.policy_loss.loss_mode by its own 'bypass_mode' loss, so "
    "a grouprl_* policy loss does not run; set bypass_mode=false (verl's decoupled mode) to "
    "train with it"
)


def _warn_bypass(config: Any) -> None:
    """Warn once per process when verl's bypass mode would replace a grouprl policy loss."""
    corr = config.get("rollout_correction", None) if config is not None else None
    if corr is not None and bool(corr.get("bypass_mode", False)) and "bypass" not in _WARNED:
        _WARNED.add("bypass")
        log.warning(BYPASS_NOTE)


def _options(name: str, config: Any) -> tuple[str, dict[str, Any]]:
    """``(singleton_rule, compute kwargs)`` from verl's algorithm config for estimator ``name``."""
    section = config.get("grouprl", None) if config is not None else None
    opts = _as_dict(section)
    kwargs: dict[str, Any] = {}
    preset_name = opts.pop("preset", None)
    if preset_name is not None:
        preset = preset_lib.get(preset_name)
        if preset.estimator != name:
            raise ValueError(
                f"preset {preset_name!r} uses the estimator {preset.estimator!r}, but "
                f"algorithm.adv_estimator is {PREFIX + name!r}; set "
                f"algorithm.adv_estimator={PREFIX + preset.estimator}"
            )
        if preset.sampler != "uniform":
            raise ValueError(
                f"preset {preset_name!r} draws prompts with the {preset.sampler!r} sampler "
                "(grouprl.sampling, IS-GRPO), which verl's dataloader does not do; without it "
                "the preset is plain GRPO: use algorithm.adv_estimator=grouprl_grpo without it"
            )
        kwargs.update(preset.advantage_kwargs())
    singleton = opts.pop("singleton", "zero")
    if singleton not in SINGLETON_RULES:
        raise ValueError(
            f"algorithm.grouprl.singleton must be one of {', '.join(SINGLETON_RULES)}, "
            f"got {singleton!r}"
        )
    if "reward_range" in opts:
        opts["reward_range"] = tuple(opts["reward_range"])
    kwargs.update(opts)
    return singleton, kwargs


def _trigger(name: str) -> VirtualTrigger:
    if name not in _TRIGGERS:
        _TRIGGERS[name] = VirtualTrigger()
    return _TRIGGERS[name]


def trigger_state_dict() -> dict[str, dict]:
    """AVSPO trigger state of every registered estimator in this process (for checkpoints)."""
    return {name: trig.state_dict() for name, trig in _TRIGGERS.items()}


def load_trigger_state_dict(state: Mapping[str, Mapping]) -> None:
    """Restore what :func:`trigger_state_dict` returned (e.g. after resuming a verl run)."""
    for name, sub in state.items():
        _trigger(name).load_state_dict(dict(sub))


def last_result(name: str) -> Advantages | None:
    """The :class:`Advantages` the estimator ``name`` computed last in this process (or None).

    verl's estimator API returns tensors only; read ``.stats`` / ``.scale`` here to log them.
    """
    return _LAST.get(name.removeprefix(PREFIX))


# --------------------------------------------------------------------------- estimators
def _apply_singleton_rule(
    name: str, values: torch.Tensor, rewards: torch.Tensor, counts: torch.Tensor, eps: float
) -> torch.Tensor:
    """verl's singleton rule on ``values [P, W]``: a lone sample's advantage is its reward."""
    single = (counts == 1)[:, None] & ~torch.isnan(rewards)  # [P, W]
    # verl's singleton std is torch.tensor(1.0), float32: 1 + eps in float32, as verl has it
    denom = (torch.tensor(1.0) + eps).to(rewards.device)
    lone = rewards / denom if name in _SIGMA_EPS_ESTIMATORS else rewards
    return torch.where(single, lone, values)


_VERL_OWN = {
    "remax": "remax",
    "optimal_token_baseline": "optimal_token_baseline",
    "tir_optimal_token_baseline": "tir_optimal_token_baseline",
    "gdpo": "gdpo",
}
"""grouprl estimator -> the verl estimator whose inputs verl's trainer produces only for
itself (``ray_trainer.py``: greedy baselines, Σπ², per-key rewards)."""


def _needs_verl_own(name: str, what: str) -> ValueError:
    return ValueError(
        f"{PREFIX + name} needs {what}, which verl's trainer produces only for its own "
        f"algorithm.adv_estimator={_VERL_OWN[name]} (equal to grouprl's on outcome rewards, "
        "parity-tested); use "
        f"that, or grouprl's own trainer"
    )


def _inputs(name, layout, response_mask, extra, token):
    """The per-sample inputs ``name`` reads, from verl's keyword arguments, on the grid."""
    out: dict[str, torch.Tensor] = {}
    if name == "remax":
        base = extra.get("reward_baselines")
        if base is None:
            raise _needs_verl_own(name, "reward_baselines (one greedy completion per prompt)")
        grid = layout.to_grid(base.to(response_mask.dtype).reshape(-1))  # [P, W]
        first = grid[:, :1]
        if not bool(((grid == first) | torch.isnan(grid)).all()):
            raise ValueError(
                "reward_baselines differ within a group (index): verl repeats each prompt's "
                "greedy reward over its samples; pass one baseline per prompt"
            )
        out["baseline"] = first[:, 0]  # [P]
    if token and name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        keys = {
            "old_logp": "old_log_probs",
            "sum_pi_squared": "sum_pi_squared",
            "is_weights": "rollout_is_weights",
        }
        for ours, theirs in keys.items():
            x = extra.get(theirs)
            if x is None and ours != "is_weights":
                raise _needs_verl_own(name, f"{theirs} (actor.calculate_sum_pi_squared=True)")
            if x is not None:
                out[ours] = _token_grid(layout, x.to(response_mask.dtype))
    if not token and "lengths" in (adv_lib.ESTIMATORS[name].__kwdefaults__ or {}):
        out["lengths"] = layout.to_grid(response_mask.sum(-1)).nan_to_num(0.0)
    return out


def _token_grid(layout: GroupLayout, x: torch.Tensor) -> torch.Tensor:
    """``[N, T]`` -> ``[P, W, T]`` (0 where a group has fewer than W samples)."""
    if layout.dense:
        return x.reshape(layout.num_groups, layout.width, -1)
    grid = x.new_zeros((layout.num_groups, layout.width, x.shape[-1]))
    grid[layout.group, layout.pos] = x
    return grid


def _token_flat(layout: GroupLayout, grid: torch.Tensor) -> torch.Tensor:
    """``[P, W, T]`` -> ``[N, T]`` in verl's sample order."""
    if layout.dense:
        return grid.reshape(-1, grid.shape[-1])
    return grid[layout.group, layout.pos]


def _token_advantages(name, kwargs, tlr, response_mask, layout, extra, config):
    """A token estimator on verl's token rewards ``tlr [N, T]`` (the compute dtype)."""
    finite = torch.isfinite(tlr).all(-1)  # [N]
    rewards = layout.to_grid(torch.where(finite, 0.0, float("nan")).to(tlr.dtype))  # NaN: no score
    dense = _token_grid(layout, torch.where(finite[:, None], tlr, 0.0))
    mask = _token_grid(layout, response_mask.to(tlr.dtype)) > 0
    inputs = _inputs(name, layout, response_mask, extra, token=True)
    out = adv_lib.compute_tokens(name, rewards, mask, token_rewards=dense, **inputs, **kwargs)
    return out, _token_flat(layout, out.token_values)


_INPUT_KEYWORDS: dict[str, tuple[str, ...]] = {
    "remax": ("reward_baselines",),
    "optimal_token_baseline": ("old_log_probs", "sum_pi_squared", "rollout_is_weights"),
    "tir_optimal_token_baseline": ("old_log_probs", "sum_pi_squared", "rollout_is_weights"),
}
"""Estimator -> the per-sample inputs it reads from verl's keyword arguments (ray_trainer.py
``compute_advantage``); any other keyword but ``epsilon`` / ``norm_adv_by_std_in_grpo`` is
refused by name."""

_NO_INDEX = frozenset({"reinforce_pp_global", "remax"})
"""Estimators without a group statistic: like verl's ``reinforce_plus_plus`` and ``remax``
(which take no ``index``), they run without ``index``, each sample its own row."""

_STD_SWITCH = {"grpo": "dr_grpo"}
"""``norm_adv_by_std_in_grpo=False``: the estimator that runs instead (verl
``compute_grpo_outcome_advantage``: ``scores - mean`` without the division, Dr. GRPO)."""


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 stays float64 (verl computes in the caller's dtype); other dtypes run in
    float32 and come back in their own dtype."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _call_keywords(name: str, extra: dict[str, Any], config: Any, kwargs: dict[str, Any]) -> str:
    """Apply verl's call keywords to ``kwargs``; return the estimator that runs.

    ``epsilon`` (verl's σ floor, 1e-6) is our ``eps``; ``norm_adv_by_std_in_grpo`` (the
    keyword, else ``config.norm_adv_by_std_in_grpo``) selects Dr. GRPO for ``grpo`` and sets
    ``norm_by_std`` for ``grpo_passk`` (verl reads it from the config there); ``False`` for
    ``grpo_beta_comp`` (config or keyword) or as a keyword for any other estimator is a
    ValueError naming it, as is any keyword the estimator cannot honour.
    """
    params = adv_lib.TOKEN_ESTIMATORS.get(name, adv_lib.ESTIMATORS.get(name))
    params = params.__kwdefaults__ or {}
    allowed = set(_INPUT_KEYWORDS.get(name, ())) | {"epsilon", "norm_adv_by_std_in_grpo"}
    unknown = sorted(set(extra) - allowed)
    if unknown:
        reads = ", ".join(_INPUT_KEYWORDS.get(name, ())) or "no per-sample input"
        raise ValueError(
            f"{PREFIX + name} does not take {', '.join(unknown)} (it reads token_level_rewards, "
            f"response_mask, index, config and {reads}); set its options under "
            "algorithm.grouprl instead"
        )
    if "epsilon" in extra:
        if "eps" not in params:
            raise ValueError(f"{PREFIX + name} has no epsilon (no σ + eps division): drop epsilon=")
        kwargs["eps"] = float(extra.pop("epsilon"))
    norm = extra.pop("norm_adv_by_std_in_grpo", None)
    explicit = norm is not None
    if norm is None and config is not None:
        norm = config.get("norm_adv_by_std_in_grpo", True)
    norm = True if norm is None else bool(norm)
    if name in _STD_SWITCH and not norm:
        kwargs.pop("eps", None)  # verl ignores epsilon without the division
        return _STD_SWITCH[name]
    if name == "grpo_passk":
        kwargs["norm_by_std"] = norm
    elif not norm and (explicit or name in _SIGMA_EPS_ESTIMATORS):
        raise ValueError(
            f"norm_adv_by_std_in_grpo=False does not change {PREFIX + name}; it applies to "
            f"{PREFIX}grpo (Dr. GRPO) and {PREFIX}grpo_passk"
        )
    return name


def _verl_returns(name: str, tlr: torch.Tensor, mask: torch.Tensor, gamma: float, adv):
    """verl's second output for ``name``: the return-to-go where verl's namesake returns it
    (``reinforce_plus_plus``: discounted, a masked token carries the return through, times
    the mask; ``remax``: ``(r·mask)`` reversed cumulative sum, not masked), else the
    advantages (every other verl outcome estimator returns ``(scores, scores)``)."""
    if name == "reinforce_pp_global":
        finite = torch.isfinite(tlr).all(-1, keepdim=True)  # [N, 1]
        return adv_lib.tokens.reward_to_go(torch.where(finite, tlr, 0.0), mask > 0, gamma)
    if name == "remax":
        return (tlr * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return adv


def make_estimator(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """verl advantage estimator running grouprl's ``name`` (called as verl calls estimators).

    ``fn(token_level_rewards [N, T], response_mask [N, T], index [N], config=None, **kw)
    -> (advantages [N, T], returns [N, T])``. A sequence-level estimator: score = the sum of
    the token rewards (verl's outcome estimators), grouped by ``index``, estimated on
    ``[P, W]`` by :func:`grouprl.advantages.compute`, broadcast over tokens and multiplied by
    the mask. A token-level estimator (``TOKEN_ESTIMATORS``): the token rewards themselves
    through :func:`grouprl.advantages.compute_tokens`. NaN scores are excluded from the
    statistics and get 0 (grouprl's rule). float64 inputs are computed in float64.

    ``returns`` follows verl's namesake: the return-to-go for ``reinforce_pp_global``
    (verl ``reinforce_plus_plus``) and ``remax``, the advantages otherwise. ``index`` may be
    omitted for ``reinforce_pp_global`` and ``remax`` (verl's take none). Keywords:
    ``epsilon``, ``norm_adv_by_std_in_grpo`` and the inputs of :data:`_INPUT_KEYWORDS`; any
    other is a ValueError naming it.
    """
    token = name in adv_lib.TOKEN_ESTIMATORS
    estimator = adv_lib.TOKEN_ESTIMATORS[name] if token else adv_lib.ESTIMATORS[name]
    default_eps = (estimator.__kwdefaults__ or {}).get("eps", 0.0)

    def fn(
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        index: Any = None,
        config: Any = None,
        **extra: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if index is None and name not in _NO_INDEX:
            raise ValueError(
                f"{PREFIX + name} is a group estimator: verl must pass index "
                "(data.non_tensor_batch['uid'])"
            )
        if name == "gdpo" and config is not None and config.get("gdpo_reward_keys", None):
            raise _needs_verl_own(name, "the per-key rewards of algorithm.gdpo_reward_keys")
        singleton, kwargs = _options(name, config)
        runs = _call_keywords(name, dict(extra), config, kwargs)
        extra = {k: v for k, v in extra.items() if k in _INPUT_KEYWORDS.get(name, ())}
        _warn_bypass(config)
        if kwargs.get("virtual") is not None:
            kwargs["trigger"] = _trigger(name)
        out_dtype = token_level_rewards.dtype
        tlr = token_level_rewards.to(_compute_dtype(token_level_rewards))
        mask = response_mask.to(tlr.dtype)
        gamma = float(config.get("gamma", 1.0)) if config is not None else 1.0
        if name == "reinforce_pp_global":
            kwargs.setdefault("gamma", gamma)
            gamma = kwargs["gamma"]
        with torch.no_grad():
            scores = tlr.sum(dim=-1)  # [N]
            if index is None:  # one row per sample
                n = scores.shape[0]
                counts = torch.ones(n, dtype=torch.long, device=scores.device)
                layout = GroupLayout(counts, 1, dense=True)
            else:
                layout = group_layout(index, scores.shape[0], scores.device)
            if token:
                out, flat_tok = _token_advantages(runs, kwargs, tlr, mask, layout, extra, config)
                _LAST[name] = out
                advantages = flat_tok * mask
            else:
                rewards = layout.to_grid(scores)  # [P, W]
                inputs = _inputs(runs, layout, mask, extra, token=False)
                out = adv_lib.compute(runs, rewards, **inputs, **kwargs)
                values = out.values  # [P, W]
                if singleton == "verl" and runs not in _NO_INDEX:
                    eps = float(kwargs.get("eps", default_eps))
                    values = _apply_singleton_rule(runs, values, rewards, layout.counts, eps)
                _LAST[name] = out
                advantages = layout.to_flat(values)[:, None] * mask  # [N, T]
            returns = _verl_returns(name, tlr, mask, gamma, advantages)
        return advantages.to(out_dtype), returns.to(out_dtype)

    fn.__name__ = fn.__qualname__ = PREFIX + name
    first = (estimator.__doc__ or name).strip().splitlines()[0]
    fn.__doc__ = f"grouprl {name} in verl: {first}"
    fn._grouprl_estimator = name  # type: ignore[attr-defined]
    return fn


def _all_estimators() -> list[str]:
    return list(adv_lib.ESTIMATORS) + [
        n for n in adv_lib.TOKEN_ESTIMATORS if n not in adv_lib.ESTIMATORS
    ]


def estimator_names() -> list[str]:
    """The names grouprl registers in verl's advantage-estimator registry."""
    return [PREFIX + name for name in _all_estimators()]


# --------------------------------------------------------------------------- policy losses
def _clip_bounds(config: Any) -> dict[str, float]:
    clip = config.get("clip_ratio", 0.2)
    low = config.get("clip_ratio_low", None)
    high = config.get("clip_ratio_high", None)
    return {"eps_low": clip if low is None else low, "eps_high": clip if high is None else high}


def _policy_loss_fields(config: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """The given fields of ``config.policy_loss`` that are set (verl's PolicyLossConfig)."""
    section = config.get("policy_loss", None)
    if section is None:
        return {}
    return {k: section.get(k, None) for k in keys if section.get(k, None) is not None}


def _dppo_params(config: Any) -> dict[str, float]:
    bounds = _clip_bounds(config)
    return {
        "delta_low": bounds["eps_low"],
        "delta_high": bounds["eps_high"],
        "clip_ratio_c": config.get("clip_ratio_c", 20.0),
    }


_LOSS_PARAMS: dict[str, Callable[[Any], dict[str, float]]] = {
    # verl ``compute_policy_loss_vanilla``: clip_ratio_low/high, dual clip clip_ratio_c = 3.0
    "ppo_clip": lambda c: {**_clip_bounds(c), "clip_ratio_c": c.get("clip_ratio_c", 3.0)},
    # verl ``compute_policy_loss_cispo``: weight clipped to [1 - low, 1 + high]
    "cispo": _clip_bounds,
    # verl ``compute_policy_loss_gspo``: the same clip_ratio_low/high on the sequence ratio
    "gspo": _clip_bounds,
    "reinforce": lambda c: {},
    # verl ``compute_policy_loss_sapo``: ActorConfig.tau_pos / tau_neg
    "sapo": lambda c: {"tau_pos": c.get("tau_pos", 1.0), "tau_neg": c.get("tau_neg", 1.05)},
    # verl ``compute_policy_loss_geo_mean``: clip_ratio_low/high as log-space bounds
    "gmpo": _clip_bounds,
    # verl ``compute_policy_loss_clip_cov`` / ``_kl_cov``: PolicyLossConfig's fields
    "clip_cov": lambda c: {
        **_clip_bounds(c),
        **_policy_loss_fields(c, ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")),
    },
    "kl_cov": lambda c: _policy_loss_fields(c, ("kl_cov_ratio", "ppo_kl_coef")),
    # verl ``compute_policy_loss_dppo_*``: clip_ratio_low/high are the divergence thresholds,
    # clip_ratio_c the IS-weight truncation (20.0 when the config has none)
    "dppo_tv": _dppo_params,
    "dppo_kl": _dppo_params,
    # verl ``compute_policy_loss_dro``: policy_loss.dro_beta (required)
    "dro": lambda c: {"beta": _policy_loss_fields(c, ("dro_beta",)).get("dro_beta")},
    # vespo: no verl counterpart and no ActorConfig field; TRL's defaults
    "vespo": lambda c: {},
    # topr: verl pull request 6986's PolicyLossConfig fields (absent from verl 0.9.1: 0 / 1)
    "topr": lambda c: {
        ours: value
        for theirs, ours in (
            ("topr_negative_ratio_lower", "ratio_low"),
            ("topr_negative_ratio_upper", "ratio_high"),
        )
        for value in _policy_loss_fields(c, (theirs,)).values()
    },
}
"""Surrogate -> its parameters read from verl's ActorConfig (same meaning as verl's losses)."""


SEQUENCE_IS_WEIGHTS = frozenset({"gmpo"})
"""Surrogates whose rollout IS weight is one per sequence: the geometric mean of its token
weights, as verl's ``compute_policy_loss_geo_mean`` applies ``rollout_is_weights`` to
GMPO's sequence loss (core_algos.py, "Aggregate token-level weights to sequence level using
geometric mean"); every other surrogate weights each token, as verl's other losses do."""


def _is_weights(name: str, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[N, T]`` rollout IS weights as verl's namesake loss applies them: per token, or for
    :data:`SEQUENCE_IS_WEIGHTS` ``exp(Σ_t m·log(w + 1e-10) / (Σ_t m + 1e-8))`` broadcast over
    the sequence (verl's constants)."""
    if name not in SEQUENCE_IS_WEIGHTS:
        return weights
    m = mask.to(weights.dtype)
    log_w = torch.where(mask.bool(), torch.log(weights + 1e-10), 0.0)  # [N, T]
    seq = torch.exp(log_w.sum(-1) / (m.sum(-1) + 1e-8))  # [N]
    return seq[:, None].expand_as(weights)


def make_policy_loss(name: str) -> Callable[..., tuple[torch.Tensor, dict[str, Any]]]:
    """verl policy loss running grouprl's surrogate ``name`` and verl's ``agg_loss``.

    The per-token loss is :func:`grouprl.losses.surrogate`; the aggregation is verl's own
    ``agg_loss(..., **config.global_batch_info)``, so ``loss_agg_mode`` and the global token /
    sequence counts across data-parallel ranks and micro-batches mean what they mean in verl.
    Metrics: verl's ``actor/pg_clipfrac`` (our ``clip_frac_region``), ``actor/ppo_kl``,
    ``actor/pg_clipfrac_lower`` (dual clip), plus ``actor/grouprl/<stat>``.

    Unlike verl's own ``sapo`` and ``geo_mean``, which force a per-sequence mean whatever
    ``loss_agg_mode`` says, every grouprl loss follows ``loss_agg_mode``: set
    ``actor.loss_agg_mode=seq-mean-token-mean`` for SAPO's and GMPO's own aggregation.
    ``grouprl_clip_cov`` / ``grouprl_kl_cov`` select their tokens within verl's micro-batch, as
    verl's do. ``rollout_is_weights`` multiply the per-token loss (``grouprl_gmpo``: by the
    sequence's geometric-mean weight, :func:`_is_weights`, as verl's ``geo_mean``).
    """
    if name not in loss_lib.SURROGATES:
        raise ValueError(
            f"unknown surrogate {name!r}; valid surrogates: {', '.join(loss_lib.SURROGATES)}"
        )
    params_of = _LOSS_PARAMS.get(name, lambda c: {})

    def fn(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        if config is None:
            raise ValueError(f"{PREFIX + name} needs verl's ActorConfig as config")
        if not bool(response_mask.any()):
            # every token of this micro-batch rejected (verl's rollout_rs rewrites
            # response_mask): it adds nothing, as verl's own losses do
            zero = {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0, "actor/pg_clipfrac_lower": 0.0}
            return log_prob.sum() * 0.0, zero
        per_token, stats = loss_lib.surrogate(
            name, log_prob, old_log_prob, advantages, response_mask, **params_of(config)
        )
        if rollout_is_weights is not None:
            # verl's rollout correction: TIS / IcePop weights on the policy term only
            per_token = per_token * _is_weights(name, rollout_is_weights, response_mask)
        batch_info = dict(config.get("global_batch_info", None) or {})
        loss = core_algos.agg_loss(
            loss_mat=per_token,
            loss_mask=response_mask,
            loss_agg_mode=loss_agg_mode,
            **batch_info,
        )
        metrics: dict[str, Any] = {
            "actor/pg_clipfrac": stats.get("clip_frac_region", 0.0),
            "actor/ppo_kl": stats.get("approx_kl", 0.0),
            "actor/pg_clipfrac_lower": stats.get("clip_frac_dual", 0.0),
        }
        metrics.update({f"actor/grouprl/{key}": value for key, value in stats.items()})
        return loss, metrics

    fn.__name__ = fn.__qualname__ = PREFIX + name
    first = (loss_lib.SURROGATES[name].__doc__ or name).strip().splitlines()[0]
    fn.__doc__ = f"grouprl {name} surrogate in verl: {first}"
    fn._grouprl_surrogate = name  # type: ignore[attr-defined]
    return fn


# --------------------------------------------------------------------------- registration
def _put(registry: dict[str, Any], name: str, fn: Callable, register: Callable) -> None:
    current = registry.get(name)
    if current is not None and not (
        hasattr(current, "_grouprl_estimator") or hasattr(current, "_grouprl_surrogate")
    ):
        raise ValueError(f"verl already has a {name!r} that is not grouprl's: {current!r}")
    if current is None:
        register(name)(fn)
    else:  # re-import / reload: replace our own earlier registration
        registry[name] = fn


def register() -> list[str]:
    """Register every grouprl estimator and surrogate in verl's registries (idempotent).

    Returns the registered names. Called when this module is imported.
    """
    names = []
    for name in _all_estimators():
        _put(
            core_algos.ADV_ESTIMATOR_REGISTRY,
            PREFIX + name,
            make_estimator(name),
            core_algos.register_adv_est,
        )
        names.append(PREFIX + name)
    for name in loss_lib.SURROGATES:
        _put(
            core_algos.POLICY_LOSS_REGISTRY,
            PREFIX + name,
            make_policy_loss(name),
            core_algos.register_policy_loss,
        )
        names.append(PREFIX + name)
    log.debug("grouprl registered in verl: %s", ", ".join(names))
    return names


# --------------------------------------------------------------------------- TRL next to verl
TRL_PROBE_MODULES = (
    "verl.utils.import_utils",
    "verl.models.transformers.monkey_patch",
    "verl.utils.model",
)
"""Modules that hold verl's ``is_trl_available`` (the two users import it by name)."""


def trl_value_head_available() -> bool:
    """True when TRL is installed *and* still has ``AutoModelForCausalLMWithValueHead``.

    The only thing verl 0.9 takes from TRL is that class (``models/transformers/monkey_patch.py``
    patches its ``state_dict``; ``utils/model.py`` builds critics with it), looked up in
    ``trl.experimental.ppo`` and then ``trl``. TRL 1.x has neither (its PPO trainer is gone).
    """
    with warnings.catch_warnings():  # TRL warns on any import from trl.experimental
        warnings.simplefilter("ignore")
        try:
            from trl.experimental.ppo import AutoModelForCausalLMWithValueHead
        except ImportError:
            try:
                from trl import AutoModelForCausalLMWithValueHead  # noqa: F401
            except ImportError:
                return False
    return True


def fix_trl_probe() -> bool:
    """Make verl ask "does TRL have the value-head class?" instead of "is TRL installed?".

    verl 0.9's ``apply_monkey_patch`` (run when the FSDP actor is built, on GPUs as on CPUs)
    does ``if is_trl_available(): from trl import AutoModelForCausalLMWithValueHead``, where
    ``is_trl_available`` only checks that a package named ``trl`` exists. With TRL 1.x in the
    same environment (``grouprl[peers]`` installs both) that import fails and verl cannot build
    its actor. Replacing the probe by :func:`trl_value_head_available` changes verl's answer
    only in that case, where verl would otherwise stop; with a TRL that has the class (e.g.
    verl's own pin, TRL 0.27) nothing changes. Idempotent; returns True when it replaced the
    probe in this call. Applied when this module is imported, i.e. in every verl process
    through the ``verl.plugins`` entry point or ``VERL_USE_EXTERNAL_MODULES`` [OURS].
    """
    try:
        import verl.utils.import_utils as import_utils
    except ImportError:  # pragma: no cover - verl without utils.import_utils
        return False
    if getattr(import_utils.is_trl_available, "_grouprl_probe", False):
        return False
    probe = functools.cache(trl_value_head_available)
    probe._grouprl_probe = True  # type: ignore[attr-defined]
    for name in TRL_PROBE_MODULES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "is_trl_available"):
            module.is_trl_available = probe
    return True


REGISTERED: list[str] = register()
"""Every name grouprl registered in verl: this import's, then each later registration's
(:func:`_follow`)."""


def _follow(declaration: Any) -> None:
    """A method registered after this import (a plugin) joins verl's registries too, and
    :data:`REGISTERED` (``LOSS_NAMES`` and :func:`estimator_names` read the tables live)."""
    name = declaration.name
    if declaration.axis in ("estimator", "token estimator"):
        _put(
            core_algos.ADV_ESTIMATOR_REGISTRY,
            PREFIX + name,
            make_estimator(name),
            core_algos.register_adv_est,
        )
    elif declaration.axis == "surrogate":
        _put(
            core_algos.POLICY_LOSS_REGISTRY,
            PREFIX + name,
            make_policy_loss(name),
            core_algos.register_policy_loss,
        )
    else:
        return
    if PREFIX + name not in REGISTERED:
        REGISTERED.append(PREFIX + name)


registry.on_register(_follow)
fix_trl_probe()
