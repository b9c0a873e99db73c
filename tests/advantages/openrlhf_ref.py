"""OpenRLHF's own advantage code, run from the installed package without importing it.

OpenRLHF 0.11 imports DeepSpeed, Ray actors and vLLM at module level, none of which a CPU
test environment has. Its advantage code itself is plain torch: this module reads the
installed source files, takes the named functions and methods out of them (``ast``), and
executes exactly those definitions with torch / NumPy in scope. Nothing of OpenRLHF is
copied into this repository; without ``openrlhf`` installed (``pip install --no-deps
openrlhf==0.11.2``) :func:`available` is False and the tests skip.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import logging
import typing
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch


def root() -> Path | None:
    """The installed ``openrlhf`` package folder (None when not installed)."""
    spec = importlib.util.find_spec("openrlhf")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def available() -> bool:
    r = root()
    return r is not None and (r / "trainer/ppo_utils/experience_maker.py").exists()


def _defs(path: Path, names: set[str], cls: str | None = None) -> list[ast.stmt]:
    tree = ast.parse(path.read_text())
    body = tree.body
    if cls is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    found = [n for n in body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    missing = names - {n.name for n in found}
    if missing:
        raise LookupError(f"{sorted(missing)} not found in {path}")
    for node in found:  # decorators (torch.no_grad) reference names we provide
        node.decorator_list = [d for d in node.decorator_list if "no_grad" in ast.unparse(d)]
    return found


def load(rel: str, names: set[str], cls: str | None = None, **scope) -> dict:
    """Execute the definitions ``names`` of ``openrlhf/<rel>`` (methods of ``cls``)."""
    path = root() / rel
    module = ast.Module(body=_defs(path, names, cls), type_ignores=[])
    ns = {
        "torch": torch,
        "np": np,
        "itertools": itertools,
        "logger": logging.getLogger("openrlhf-ref"),
        "Tuple": tuple,  # OpenRLHF's annotations: typing.Tuple[...] / List[...] / Optional[...]
        "List": list,
        "Optional": typing.Optional,
        "Union": typing.Union,
        **scope,
    }
    exec(compile(module, str(path), "exec"), ns)
    return {n: ns[n] for n in names}


def kl_controllers() -> tuple[type, type]:
    got = load("trainer/ppo_utils/kl_controller.py", {"AdaptiveKLController", "FixedKLController"})
    return got["AdaptiveKLController"], got["FixedKLController"]


def compute_approx_kl():
    return load("models/utils.py", {"compute_approx_kl"}, KL_IS_WEIGHT_CLIP=10.0)[
        "compute_approx_kl"
    ]


def advantages(
    estimator: str,
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    no_std_norm: bool = False,
) -> torch.Tensor:
    """OpenRLHF's ``compute_advantages_and_returns`` on one experience: ``[N, T]`` advantages.

    ``rewards [P, G]`` (prompt-major, as OpenRLHF reshapes them), ``action_mask [N, T]``,
    ``kl [N, T]`` the per-token KL that ``compute_reward`` folds in with ``kl_coef``.
    """
    utils = load("models/utils.py", {"compute_reward"})
    lp = load(
        "trainer/ppo_utils/length_penalty.py",
        {"apply_length_penalties"},
        logger=logging.getLogger("openrlhf-ref"),
    )
    methods = load(
        "trainer/ppo_utils/experience_maker.py",
        {"compute_advantages_and_returns", "get_cumulative_returns", "get_advantages_and_returns"},
        cls="RemoteExperienceMaker",
        compute_reward=utils["compute_reward"],
        apply_length_penalties=lp["apply_length_penalties"],
    )
    p, g = rewards.shape
    n = p * g
    args = SimpleNamespace(
        algo=SimpleNamespace(
            advantage=SimpleNamespace(
                estimator=estimator, gamma=gamma, lambd=1.0, no_std_norm=no_std_norm
            )
        ),
        rollout=SimpleNamespace(n_samples_per_prompt=g, max_new_tokens=None),
        reward=SimpleNamespace(
            clip_range=None, overlong_buffer_len=None, stop_properly_penalty_coef=None
        ),
        data=SimpleNamespace(max_len=None),
    )
    exp = SimpleNamespace(
        rewards=rewards.reshape(-1).clone(),
        index=list(range(n)),
        info={},
        kl=torch.zeros(n, action_mask.shape[1], dtype=rewards.dtype) if kl is None else kl,
        action_mask=action_mask.bool(),
        values=None,
    )
    maker = SimpleNamespace(
        strategy=SimpleNamespace(args=args),
        advantage_estimator=estimator,
        kl_ctl=SimpleNamespace(value=kl_coef),
    )
    for name in ("get_cumulative_returns", "get_advantages_and_returns"):
        setattr(maker, name, methods[name].__get__(maker))
    (out,) = methods["compute_advantages_and_returns"](maker, [exp])
    return out.advantages
