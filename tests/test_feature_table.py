"""The feature table of docs/methods.md (grouprl vs TRL vs verl vs OpenRLHF) is true of the code.

The table between the ``feature-table`` markers in docs/methods.md is the one data structure: one
markdown row per method. Every backticked token in a cell is a claim this test checks:

- grouprl: ``axis=name`` (a name in the registry ``grouprl list`` prints for that axis; ``kl=``
  takes any name :func:`grouprl.losses.kl` accepts, aliases and ``+`` forms included),
  ``axis=name(param)`` (that entry takes the keyword ``param``) and ``fn(param)`` for the
  public functions in :data:`GROUPRL_CALLABLES`;
- TRL: ``field`` (a ``GRPOConfig`` field), ``field=value`` (a value TRL's own code compares that
  field with), ``trl.experimental.x`` (an importable module);
- verl: ``adv_estimator=`` / ``policy_loss=`` (verl's registries), ``loss_agg_mode=``,
  ``kl_penalty=`` (with verl's ``+`` suffix), ``kl_ctrl.type=`` (the values verl's code
  dispatches on) and ``section.field`` (a field of that verl config dataclass);
- OpenRLHF (not installed: it needs DeepSpeed): ``option`` / ``option=choice`` checked against
  ``tests/data/openrlhf-0.11.2.json``, extracted from its source by
  ``scripts/openrlhf_listing.py``.

And the other way round: every entry of grouprl's method registries and every value of the
peers' method registries (:data:`TRL_COMPLETE`, :data:`VERL_COMPLETE`,
:data:`OPENRLHF_COMPLETE`) must appear in some row, so a method added on either side without a
row fails here. Adding a method is one line in that table.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- feature-table:start -->", "<!-- feature-table:end -->"
COLUMNS = ("axis", "method", "grouprl", "TRL", "verl", "OpenRLHF")
OPENRLHF = ROOT / "tests" / "data" / "openrlhf-0.11.2.json"
LISTING_SCRIPT = ROOT / "scripts" / "openrlhf_listing.py"
TOKEN = re.compile(r"^(?P<key>[\w.]+)(?:=(?P<value>[\w.+\-]+))?(?:\((?P<param>\w+)\))?$")

GROUPRL_AXES: dict[str, tuple[str, str]] = {
    "estimator": ("grouprl.advantages", "ESTIMATORS"),
    "token_estimator": ("grouprl.advantages", "TOKEN_ESTIMATORS"),
    "reward_combination": ("grouprl.advantages", "REWARD_COMBINATIONS"),
    "kl_controller": ("grouprl.control", "KL_CONTROLLERS"),
    "transform": ("grouprl.advantages", "TRANSFORMS"),
    "surrogate": ("grouprl.losses", "SURROGATES"),
    "aggregation": ("grouprl.losses", "AGGREGATIONS"),
    "kl": ("grouprl.losses", "KL_ESTIMATORS"),
    "correction": ("grouprl.losses", "CORRECTIONS"),
    "preset": ("grouprl.presets", "PRESETS"),
}
"""Token key -> the registry ``grouprl list`` prints (cli/listing.py SECTIONS)."""
GROUPRL_COMPLETE = (
    "estimator",
    "token_estimator",
    "reward_combination",
    "kl_controller",
    "transform",
    "surrogate",
    "aggregation",
    "kl",
    "correction",
)
"""Axes whose every entry needs a row (a preset is a combination, not a method)."""
GROUPRL_CALLABLES: dict[str, tuple[str, str]] = {
    "objective": ("grouprl.losses", "objective"),
    "step_totals": ("grouprl.losses", "step_totals"),
    "compute": ("grouprl.advantages", "compute"),
    "compute_tokens": ("grouprl.advantages", "compute_tokens"),
    "kl_reward": ("grouprl.advantages", "kl_reward"),
    "Preset": ("grouprl.presets", "Preset"),
}

TRL_COMPLETE = (
    "loss_type",
    "importance_sampling_level",
    "scale_rewards",
    "multi_objective_aggregation",
    "vllm_importance_sampling_mode",
)
VERL_COMPLETE = ("adv_estimator", "policy_loss", "loss_agg_mode", "kl_penalty", "kl_ctrl.type")
VERL_UNSUPPORTED = {"kl_penalty": {"full": "raises NotImplementedError in verl 0.9.1"}}
OPENRLHF_COMPLETE = (
    "algo.advantage.estimator",
    "algo.kl.estimator",
    "actor.policy_loss_type",
    "actor.loss_agg_mode",
    "algo.advantage.is_correction_level",
    "algo.advantage.is_correction_mode",
    "algo.advantage.is_correction_gating",
)


# ----------------------------------------------------------------------------- the table
def table() -> list[dict[str, str]]:
    """The table's rows as ``{column: cell}``."""
    text = (ROOT / "docs" / "methods.md").read_text()
    assert START in text and END in text, "docs/methods.md lost its feature-table markers"
    body = text.split(START, 1)[1].split(END, 1)[0]
    lines = [ln for ln in body.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert tuple(header) == COLUMNS, f"feature table columns must be {COLUMNS}, got {header}"
    out = []
    for ln in lines[2:]:
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", ln.strip()[1:-1])]
        assert len(cells) == len(COLUMNS), f"row has {len(cells)} cells, not {len(COLUMNS)}: {ln}"
        out.append(dict(zip(COLUMNS, cells)))
    return out


def tokens(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def column(name: str) -> list[tuple[str, str]]:
    """``(method, token)`` for every token of the column."""
    return [(row["method"], tok) for row in table() for tok in tokens(row[name])]


def _parse(tok: str) -> tuple[str, str | None, str | None]:
    m = TOKEN.match(tok)
    assert m, f"unreadable token `{tok}`"
    return m["key"], m["value"], m["param"]


def _accepts(fn: Callable, param: str) -> bool:
    target = fn
    if dataclasses.is_dataclass(fn):
        return param in {f.name for f in dataclasses.fields(fn)}
    return param in inspect.signature(target).parameters


def test_table_rows_are_unique_and_well_formed():
    rows = table()
    assert len(rows) >= 60
    methods = [r["method"] for r in rows]
    assert len(set(methods)) == len(methods), "two rows name the same method"
    for row in rows:
        for name in COLUMNS[2:]:
            cell = row[name]
            assert cell.startswith("—") or tokens(cell), f"{row['method']}/{name}: — or `tokens`"


# ----------------------------------------------------------------------------- grouprl
def _registry(axis: str) -> dict:
    module, attr = GROUPRL_AXES[axis]
    return getattr(importlib.import_module(module), attr)


def _check_grouprl(tok: str) -> str | None:
    key, value, param = _parse(tok)
    if key in GROUPRL_CALLABLES and value is None:
        module, attr = GROUPRL_CALLABLES[key]
        fn = getattr(importlib.import_module(module), attr)
        return None if param and _accepts(fn, param) else f"{key} has no parameter {param!r}"
    if key not in GROUPRL_AXES or value is None:
        return f"unknown grouprl token kind {key!r}"
    if key == "kl":
        from grouprl import losses

        try:
            losses.kl(value, torch.zeros(1, 1), torch.zeros(1, 1))
        except ValueError as err:
            return str(err)
        return None
    registry = _registry(key)
    if value not in registry:
        return f"{value!r} is not in grouprl's {key} registry"
    if param and not _accepts(registry[value], param):
        return f"{key} {value!r} takes no parameter {param!r}"
    return None


def test_grouprl_column_names_what_exists():
    bad = [f"{m}: `{t}`: {e}" for m, t in column("grouprl") if (e := _check_grouprl(t))]
    assert bad == []


def test_every_grouprl_method_has_a_row():
    named = {_parse(t)[:2] for _, t in column("grouprl")}
    missing = [
        f"{axis}={name}"
        for axis in GROUPRL_COMPLETE
        for name in _registry(axis)
        if (axis, name) not in named
    ]
    assert missing == [], "add a feature-table row in docs/methods.md for each"


# ----------------------------------------------------------------------------- peers
def _load_listing_script():
    spec = importlib.util.spec_from_file_location("openrlhf_listing", LISTING_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compared(source: str, attr: str) -> set[str]:
    """String constants that code compares (==, in) with a name or attribute ``attr`` (the
    same AST reading that extracted the OpenRLHF listing)."""
    return set(_load_listing_script().compared(source, attr))


@pytest.fixture(scope="module")
def trl_knobs() -> tuple[set[str], dict[str, set[str]]]:
    trl = pytest.importorskip("trl")
    from trl.trainer import grpo_config, grpo_trainer

    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    source = inspect.getsource(grpo_trainer) + inspect.getsource(grpo_config)
    choices = {k: compared(source, k) for k in TRL_COMPLETE}
    return fields, choices


def _check_trl(tok: str, fields: set[str], choices: dict[str, set[str]]) -> str | None:
    if tok.startswith("trl.experimental."):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                importlib.import_module(tok)
        except ImportError:
            return "no such TRL module"
        return None
    key, value, param = _parse(tok)
    if param or key not in fields:
        return f"GRPOConfig has no field {key!r}"
    if value is not None and value not in choices.get(key, set()):
        return f"TRL's code never compares {key} with {value!r} ({sorted(choices.get(key, []))})"
    return None


def test_trl_column_names_what_exists(trl_knobs):
    fields, choices = trl_knobs
    bad = [f"{m}: `{t}`: {e}" for m, t in column("TRL") if (e := _check_trl(t, fields, choices))]
    assert bad == []


def test_every_trl_method_has_a_row(trl_knobs):
    _, choices = trl_knobs
    named = {_parse(t)[:2] for _, t in column("TRL") if not t.startswith("trl.")}
    missing = [f"{k}={v}" for k in TRL_COMPLETE for v in sorted(choices[k]) if (k, v) not in named]
    assert all(choices[k] for k in TRL_COMPLETE), "the AST extraction found nothing"
    assert missing == []


VERL_SECTIONS = {
    "algorithm": ("verl.trainer.config", "AlgoConfig"),
    "kl_ctrl": ("verl.trainer.config", "KLControlConfig"),
    "actor": ("verl.workers.config", "ActorConfig"),
    "policy_loss": ("verl.workers.config", "PolicyLossConfig"),
    "rollout_correction": ("verl.trainer.config", "RolloutCorrectionConfig"),
}


@pytest.fixture(scope="module")
def verl_knobs() -> dict[str, set[str]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        core = pytest.importorskip("verl.trainer.ppo.core_algos")
    ours = "grouprl_"  # grouprl registers its own names in verl's registries
    out = {
        "adv_estimator": {k for k in core.ADV_ESTIMATOR_REGISTRY if not k.startswith(ours)},
        "policy_loss": {k for k in core.POLICY_LOSS_REGISTRY if not k.startswith(ours)},
        "loss_agg_mode": compared(inspect.getsource(core.agg_loss), "loss_agg_mode"),
        "kl_penalty": compared(inspect.getsource(core.kl_penalty_forward), "kl_penalty"),
        "kl_ctrl.type": compared(inspect.getsource(core.get_kl_controller), "type"),
    }
    for key, skip in VERL_UNSUPPORTED.items():
        out[key] -= set(skip)
    return out


def _verl_field(key: str) -> bool:
    section, _, name = key.partition(".")
    if section not in VERL_SECTIONS or not name or "." in name:
        return False
    module, attr = VERL_SECTIONS[section]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = getattr(importlib.import_module(module), attr)
    return name in {f.name for f in dataclasses.fields(cls)}


def _check_verl(tok: str, knobs: dict[str, set[str]]) -> str | None:
    key, value, param = _parse(tok)
    if param:
        return "no (param) form for verl"
    if key in knobs:
        base = value.removesuffix("+") if key == "kl_penalty" and value else value
        return None if base in knobs[key] else f"verl has no {key} {value!r}"
    if value is not None:
        return f"verl's values of {key!r} are not enumerated here"
    return None if _verl_field(key) else f"no verl config field {key!r}"


def test_verl_column_names_what_exists(verl_knobs):
    bad = [f"{m}: `{t}`: {e}" for m, t in column("verl") if (e := _check_verl(t, verl_knobs))]
    assert bad == []


def test_every_verl_method_has_a_row(verl_knobs):
    named = {_parse(t)[:2] for _, t in column("verl")}
    missing = [
        f"{k}={v}" for k in VERL_COMPLETE for v in sorted(verl_knobs[k]) if (k, v) not in named
    ]
    assert missing == []


@pytest.fixture(scope="module")
def openrlhf_options() -> dict[str, list[str] | None]:
    return json.loads(OPENRLHF.read_text())["options"]


def _check_openrlhf(tok: str, options: dict[str, list[str] | None]) -> str | None:
    key, value, param = _parse(tok)
    if param or key not in options:
        return f"OpenRLHF 0.11.2 has no option --{key}"
    if value is not None and value not in (options[key] or []):
        return f"--{key} takes {options[key]}, not {value!r}"
    return None


def test_openrlhf_column_names_what_exists(openrlhf_options):
    bad = [
        f"{m}: `{t}`: {e}"
        for m, t in column("OpenRLHF")
        if (e := _check_openrlhf(t, openrlhf_options))
    ]
    assert bad == []


def test_every_openrlhf_method_has_a_row(openrlhf_options):
    named = {_parse(t)[:2] for _, t in column("OpenRLHF")}
    missing = [
        f"{k}={v}" for k in OPENRLHF_COMPLETE for v in openrlhf_options[k] if (k, v) not in named
    ]
    assert missing == []


def test_the_checks_can_fail(trl_knobs, verl_knobs, openrlhf_options):
    # one wrong token per kind is caught: the table test is not vacuous
    assert _check_grouprl("surrogate=no_such_loss")
    assert _check_grouprl("surrogate=ppo_clip(no_such_param)")
    assert _check_grouprl("kl=k9")
    assert _check_grouprl("objective(no_such_param)")
    assert _check_trl("loss_type=no_such_loss", *trl_knobs)
    assert _check_trl("no_such_field", *trl_knobs)
    assert _check_verl("policy_loss=no_such_loss", verl_knobs)
    assert _check_verl("kl_penalty=k9+", verl_knobs)
    assert _check_verl("actor.no_such_field", verl_knobs)
    assert _check_openrlhf("algo.kl.estimator=k9", openrlhf_options)
    assert {"sapo", "vespo", "luspo", "bnpo"} <= trl_knobs[1]["loss_type"]
    assert {"k1", "k2", "k3", "abs", "mse", "kl", "low_var_kl"} == verl_knobs["kl_penalty"]
    assert verl_knobs["kl_ctrl.type"] == {"fixed", "adaptive"}
