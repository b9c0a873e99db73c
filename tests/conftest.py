"""Suite-wide settings: one torch thread (the suite's models are tiny; on a loaded 2-core
machine two threads ran an SFT step 14x slower than one), no model hub, and the Hypothesis
profiles.

Hypothesis profiles: ``ci``, the default (so the README's test command is exactly what CI
runs), is Hypothesis's own (derandomized: the same examples every run, so CI is
reproducible) with 200 examples for the properties that take their count from the profile
(``tests/advantages/test_properties.py``); ``HYPOTHESIS_PROFILE=dev`` draws 100 new random
examples each run and replays failures from the local example database, for hunting new
counterexamples while developing. The scale-invariance
property that was stated too broadly fails within 10 derandomized examples of
its strategy.
"""

import os
import sys

import pytest
from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads; run.threads=0 (auto) reads it
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

torch.set_num_threads(1)

settings.register_profile("ci", settings.get_profile("ci"), max_examples=200)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or "ci")


def _under_wide_meta_defaults(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with torch's default device "meta" and default dtype float64:
    a tensor made without an explicit device lands on meta (and fails when used with real
    ones); one made without a dtype is float64 and widens a float32 result."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            return fn(*args, **kwargs)
    finally:
        torch.set_default_dtype(old)


@pytest.fixture
def under_wide_meta_defaults():
    """The call above: tests that a function makes its tensors on its inputs' device and in
    their dtype, never on torch's default device or in its default dtype."""
    return _under_wide_meta_defaults


@pytest.fixture
def clean_registry():
    """Every registry put back as it was after the test (tests register methods of their
    own): each axis's table and declarations, the registration listeners, the plugins
    loaded."""
    from grouprl import advantages, losses, plugins, presets, registry  # noqa: F401

    saved = {n: (dict(a.table), dict(a.declarations)) for n, a in registry.AXES.items()}
    listeners, loaded = list(registry._LISTENERS), dict(plugins._LOADED)
    verl = sys.modules.get("grouprl.integrations.verl")  # it follows registrations
    if verl is not None:
        peer = verl.core_algos
        verl_saved = (
            list(verl.REGISTERED),
            dict(peer.ADV_ESTIMATOR_REGISTRY),
            dict(peer.POLICY_LOSS_REGISTRY),
        )
    yield registry
    if verl is not None:
        verl.REGISTERED[:] = verl_saved[0]
        for table, before in zip(
            (peer.ADV_ESTIMATOR_REGISTRY, peer.POLICY_LOSS_REGISTRY), verl_saved[1:]
        ):
            table.clear()
            table.update(before)
    plugins._LOADED.clear()
    plugins._LOADED.update(loaded)  # a plugin loaded by the test loads (registers) again
    for name, (table, declarations) in saved.items():
        axis = registry.AXES[name]
        axis.table.clear()
        axis.table.update(table)
        axis.declarations.clear()
        axis.declarations.update(declarations)
    registry._LISTENERS[:] = listeners


@pytest.fixture(autouse=True)
def _process_env_restored():
    """``grouprl.cli.main`` sets its process environment (``PROCESS_ENV``) for the process
    it runs in; called in-process by a test, it would leave it for every later test and
    every subprocess they start (a page-fault probe saw half its faults). Each test gets the
    environment's values for those keys back."""
    from grouprl.cli import PROCESS_ENV

    before = {key: os.environ.get(key) for key in PROCESS_ENV}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
