"""The AGPO reproduction: its ablation controllers do what each arm's name says, its verdict
rule by hand, and its quick mode runs end to end through ``grouprl.diagnostics.compare``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2] / "reproductions"


@pytest.fixture(autouse=True)
def _put_back(clean_registry):
    """The script registers its presets and controllers in this process: put both back."""
    from grouprl.train import controllers

    saved = dict(controllers.CONTROLLERS)
    yield
    controllers.CONTROLLERS.clear()
    controllers.CONTROLLERS.update(saved)


def _load():
    spec = importlib.util.spec_from_file_location("repro_agpo", ROOT / "agpo" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _probe(examples, tau):
    # two prompts, G = 4: one mixed group (dispersion > 0) and one all-wrong group
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    texts = ["\\boxed{1}", "\\boxed{2}", "\\boxed{2}", "\\boxed{3}"] + ["\\boxed{0}"] * 4
    return SimpleNamespace(texts=texts), rewards


def _controller(name):
    from grouprl.train.controllers import make_controller

    return make_controller(name, SimpleNamespace(sampling=SimpleNamespace(temperature=1.0)))


def test_ablation_controllers_switch_one_module_each():
    mod = _load()
    mod.register()
    params = {"eps_low": 0.2, "eps_high": 0.2}
    # clip alone: the probe runs, the training groups stay at tau_base on every step
    clip = _controller("agpo_clip_only")
    for _ in range(3):
        taus, metrics = clip.temperature([None, None], _probe)
        assert taus.tolist() == [1.0, 1.0] and metrics["agpo/probe_dispersion"] > 0
    # temperature alone: the preset's clip comes back untouched and no drift is observed
    temp = _controller("agpo_temperature_only")
    temp.temperature([None, None], _probe)
    assert temp.clip_params(None, None, params) == (params, {})
    assert temp.after_update(None, None) == {}
    # the full controller moves tau off tau_base once its EMA has a reading (c != 0)
    full = _controller("agpo")
    full.temperature([None, None], _probe)
    taus, _ = full.temperature([None, None], _probe)
    assert taus.tolist() != [1.0, 1.0]
    # the skewness arm: zeta and w_k on, the authors' defaults (0, 0) elsewhere
    skew = _controller("agpo_skew")
    assert skew.agpo.clip.params["zeta"] == mod.ZETA > 0
    assert skew.agpo.temperature.w_k == mod.W_K > 0
    assert full.agpo.clip.params["zeta"] == 0 and full.agpo.temperature.w_k == 0


def test_verdict_rule_by_hand():
    mod = _load()
    d = {"n": 3, "mean": 0.03, "se": 0.01, "positive": 3, "negative": 0}
    assert mod._word(d) == "holds"  # 0.03 - 2·0.01 > 0 and 3/3 seeds
    assert mod._word({**d, "se": 0.02}) == "not shown (within 2 SE or signs disagree)"
    assert mod._word({**d, "positive": 2, "negative": 1}).startswith("not shown")
    assert mod._word({**d, "mean": -0.03, "positive": 0, "negative": 3}) == "reversed"
    assert mod._word({**d, "n": 1}) == "one seed: no verdict"


def test_quick_run_goes_through_compare(tmp_path):
    mod = _load()
    assert mod.main(["--quick", "--seeds", "2", "--jobs", "1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["seeds"] == [0, 1] and res["quick"] is True
    assert res["compare"]["baseline"] == "grpo"
    arms = {c["arm"] for c in res["compare"]["comparisons"]}
    assert arms == {"clip", "temperature", "agpo", "agpo+skew", "grpo_batch"}
    assert [c["holds"] for c in res["checks"]] and len(res["checks"]) == 6
    # each run folder is a grouprl run: config.yaml and metrics.jsonl with eval/pass@1
    rows = (tmp_path / "runs_quick" / "agpo" / "seed1" / "metrics.jsonl").read_text()
    assert '"eval/pass@1"' in rows
    assert (tmp_path / "figure.png").stat().st_size > 1000


@pytest.mark.parametrize("arm", ["grpo", "clip", "grpo_batch"])
def test_grpo_arm_generates_what_the_probe_arms_do(arm):
    mod = _load()
    s = mod.SETTINGS["full"]
    ov = dict(o.split("=", 1) for o in mod.overrides(s, arm, 0, Path("x")))
    # the probe arms sample P probe + P training groups a step; grpo samples 2P training
    # groups (the equal budget), grpo_batch P (the equal batch)
    want = 2 * s["prompts"] if arm == "grpo" else s["prompts"]
    assert int(ov["sampling.prompts_per_step"]) == want
    assert ov["algorithm.preset"] == mod._preset(arm)


def test_every_arm_is_the_agpo_preset_but_its_controller():
    from dataclasses import fields

    from grouprl import presets

    mod = _load()
    mod.register()
    base = presets.get("agpo")
    for arm, spec in mod.ARMS.items():
        p = presets.get(mod._preset(arm))
        differ = {f.name for f in fields(p) if getattr(p, f.name) != getattr(base, f.name)}
        assert differ <= {"name", "description", "controller"}, arm
        assert p.controller == spec["controller"]
