"""The example plugin (examples/plugins/my_method.py) through the adapters: verl's registries
(``grouprl_<name>``) and TRL's ``GroupRLGRPOTrainer(preset=...)``, with no other change."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.peer, pytest.mark.usefixtures("clean_registry")]

os.environ["HF_HUB_OFFLINE"] = "1"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plugins" / "my_method.py"

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    pytest.importorskip("trl")
    from grouprl.integrations import verl as gv

from grouprl import advantages, plugins  # noqa: E402


def test_the_plugins_estimator_and_surrogate_join_verls_registries():
    plugins.load(EXAMPLE)
    est = core_algos.get_adv_estimator_fn("grouprl_mean_centered")
    # two groups of verl's flat layout (uid per sample), the score on the last valid token
    scores = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    uids = np.array(["a", "b", "a", "b", "a", "b"], dtype=object)
    mask = torch.ones(6, 3)
    tlr = torch.zeros(6, 3)
    tlr[:, -1] = torch.tensor(scores)
    adv, _ = est(token_level_rewards=tlr, response_mask=mask, index=uids)
    # group a: (1, 1, 0) mean 2/3; group b: (0, 0, 1) mean 1/3; each token carries its A
    want = torch.tensor([1 / 3, -1 / 3, 1 / 3, -1 / 3, -2 / 3, 2 / 3])
    torch.testing.assert_close(adv[:, 0], want)
    torch.testing.assert_close(adv, want[:, None].expand(6, 3))
    loss_fn = core_algos.get_policy_loss_fn("grouprl_clipped_reinforce")
    logp = torch.full((2, 2), -1.0, requires_grad=True)
    from verl.workers.config import ActorConfig

    cfg = ActorConfig(strategy="fsdp", rollout_n=2, ppo_micro_batch_size_per_gpu=2)
    loss, _ = loss_fn(logp.detach(), logp, torch.tensor([[9.0, 9.0], [-1.0, -1.0]]),
                      torch.ones(2, 2), "token-mean", cfg)  # fmt: skip
    # −clamp(A, ±5)·logp token mean: (5 + 5 − 1 − 1)/4 · 1 = 2
    assert float(loss.detach()) == pytest.approx(2.0)


def test_the_names_the_adapter_exports_follow_a_plugin_loaded_after_it():
    # grouprl.integrations.verl was imported above, before the plugin: its exported names
    # (LOSS_NAMES, estimator_names(), REGISTERED) and verl's registries take the plugin in
    assert "grouprl_clipped_reinforce" not in gv.LOSS_NAMES
    assert "grouprl_mean_centered" not in gv.estimator_names()
    before = list(gv.REGISTERED)
    plugins.load(EXAMPLE)
    from grouprl.integrations.verl import LOSS_NAMES

    assert "grouprl_clipped_reinforce" in LOSS_NAMES and gv.loss_names() == LOSS_NAMES
    assert "grouprl_mean_centered" in gv.estimator_names()
    assert [*before, "grouprl_mean_centered", "grouprl_clipped_reinforce"] == gv.REGISTERED
    for name in LOSS_NAMES:
        assert core_algos.get_policy_loss_fn(name)._grouprl_surrogate == name[len("grouprl_") :]
    for name in gv.estimator_names():
        assert core_algos.get_adv_estimator_fn(name)._grouprl_estimator == name[len("grouprl_") :]
    with pytest.raises(AttributeError, match="no attribute 'NO_SUCH'"):
        gv.NO_SUCH  # noqa: B018


def test_trl_trains_the_plugins_preset(tmp_path, monkeypatch):
    from trl_doubles import run

    from grouprl import losses

    plugins.load(EXAMPLE)
    real, calls = losses.SURROGATES["clipped_reinforce"], []

    def spy(*a, **k):  # TRL's loss is the plugin's surrogate (the table is read per call)
        calls.append(k.get("clip"))
        return real(*a, **k)

    monkeypatch.setitem(losses.SURROGATES, "clipped_reinforce", spy)
    trainer, _ = run(tmp_path, preset="my_method")
    assert trainer.state.global_step == 3 and len(trainer.produced) == 3
    assert len(calls) >= 3 and set(calls) == {5.0}  # the preset's clip, every step
    for grid, adv, _ in trainer.produced:  # TRL trained on the plugin's advantages
        want = advantages.compute("mean_centered", grid).values.reshape(-1)
        torch.testing.assert_close(adv.reshape(-1), want)
