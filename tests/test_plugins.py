"""Plugins (grouprl.plugins): the example file trains through ``grouprl train --plugin``, is
listed by ``grouprl list``, loads from ``grouprl.train.run(plugins=...)`` and from an installed
package's entry point, all from outside ``src/``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from grouprl import advantages, losses, plugins, presets, registry
from grouprl.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "plugins" / "my_method.py"
TINY = "tiny:d=16,layers=2,heads=2,ctx=32"

pytestmark = pytest.mark.usefixtures("clean_registry")


def test_the_example_is_the_documented_size_and_registers_three_things():
    assert len(EXAMPLE.read_text().splitlines()) <= 42  # docs/extending.md: about 40 lines
    module = plugins.load(EXAMPLE)
    assert plugins.load(str(EXAMPLE)) is module  # once per process
    assert advantages.estimator_axis.get("mean_centered").fn is module.mean_centered
    assert losses.surrogate_axis.get("clipped_reinforce").settings[0].source.startswith("5:")
    p = presets.get("my_method")
    assert (p.estimator, p.surrogate, dict(p.surrogate_params)) == (
        "mean_centered", "clipped_reinforce", {"clip": 5.0}
    )  # fmt: skip


def test_extending_md_shows_the_example_file_as_it_is():
    # the page's code block is the file without its docstring: the two cannot drift apart
    page = (ROOT / "docs" / "extending.md").read_text()
    block = page.split("```python\n", 1)[1].split("```", 1)[0]
    code = EXAMPLE.read_text().split('"""', 2)[2].lstrip("\n")
    assert block == code
    n = len(EXAMPLE.read_text().splitlines())
    assert f"my_method.py), {n} lines:" in page


def test_the_example_estimator_and_surrogate_compute_their_hand_derived_values():
    plugins.load(EXAMPLE)
    rewards = torch.tensor([[1.0, 0.0, float("nan"), 1.0], [0.0, 0.0, 0.0, 0.0]])
    out = advantages.compute("mean_centered", rewards, scale=2.0)
    # group 0: mean of (1, 0, 1) = 2/3 -> (1/3, −2/3, 0, 1/3) / 2; group 1: all 0
    torch.testing.assert_close(
        out.values, torch.tensor([[1 / 6, -1 / 3, 0.0, 1 / 6], [0.0, 0.0, 0.0, 0.0]])
    )
    assert out.stats["updated_frac"] == 0.5  # the collapsed group carries no signal
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], requires_grad=True)
    per_token, _ = losses.surrogate(
        "clipped_reinforce", logp, logp.detach(), torch.tensor([9.0, -1.0]), torch.ones(2, 2)
    )
    # −clamp(A, ±5)·logp: A 9 -> 5
    assert per_token.detach().tolist() == [[5.0, 10.0], [-0.5, -0.5]]


def test_a_missing_plugin_is_a_clear_error():
    with pytest.raises(plugins.PluginError, match=r"not found.*path of a .py file"):
        plugins.load("no_such_plugin.py")
    with pytest.raises(plugins.PluginError, match=r"cannot be imported.*needs its .py suffix"):
        plugins.load("no_such_plugin_module")


def test_a_plugin_that_raises_while_loading_says_which(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from grouprl.advantages import register_estimator\n"
                   "register_estimator('grpo', lambda rewards, valid: None)\n")  # fmt: skip
    with pytest.raises(plugins.PluginError, match=r"bad.py' failed while loading.*built-in"):
        plugins.load(bad)


def test_an_installed_packages_entry_point_is_loaded(tmp_path, monkeypatch):
    # an installed distribution, as pip leaves it: a dist-info folder with entry_points.txt
    (tmp_path / "ep_methods.py").write_text(
        textwrap.dedent(
            """
            from grouprl.advantages import register_estimator
            from grouprl.types import Advantages

            @register_estimator("ep_centered")
            def ep_centered(rewards, valid):
                ones = rewards.new_ones(rewards.shape[0])
                return Advantages(rewards - rewards.mean(-1, keepdim=True), ones.bool(), ones, ones)
            """
        )
    )
    info = tmp_path / "ep_methods-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-methods\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[grouprl.plugins]\nep = ep_methods\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert plugins.load_entry_points(again=True) == ["ep"]
    out = advantages.compute("ep_centered", torch.tensor([[1.0, 0.0]]))
    assert out.values.tolist() == [[0.5, -0.5]]
    sys.modules.pop("ep_methods", None)


def _spy_when_registered(monkeypatch, calls):
    """Record each call of the example's estimator and surrogate, spied on as each is
    registered (by ``--plugin``, then the only thing that loads the file; the tables are read
    at call time)."""

    def follow(decl):
        if decl.name in ("mean_centered", "clipped_reinforce"):
            table = registry.AXES[decl.axis].table
            real = table[decl.name]

            def spy(*a, _real=real, _name=decl.name, **k):
                calls.append(_name)
                return _real(*a, **k)

            monkeypatch.setitem(table, decl.name, spy)

    registry.on_register(follow)  # (clean_registry removes the listener after the test)


def test_grouprl_train_with_the_plugin_trains_the_plugins_methods(tmp_path, monkeypatch):
    # in a folder outside src/, by the file's path, as a user runs it: --plugin loads it
    monkeypatch.chdir(tmp_path)
    calls: list[str] = []
    assert "my_method" not in presets.PRESETS
    _spy_when_registered(monkeypatch, calls)
    out = tmp_path / "run"
    argv = ["train", "--plugin", str(EXAMPLE), "--preset", "my_method", "--model", TINY,
            "--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--out", str(out),
            "--no-progress", "--set", "eval.every=0", "--set", "model.warm_start=false",
            "--set", "run.save_final=false", "--set", "run.report=false"]  # fmt: skip
    assert cli_main(argv) == 0
    # one estimator call per step; the surrogate once per optimizer step (one micro-batch)
    assert calls.count("mean_centered") == 2 and calls.count("clipped_reinforce") == 2
    recorded = yaml.safe_load((out / "config.yaml").read_text())
    assert recorded["algorithm"]["preset"] == "my_method"
    assert recorded["run"]["plugins"] == [str(EXAMPLE)]  # absolute: --config finds it again
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


@pytest.mark.slow  # two fresh interpreters (and out of a mutation run's reach: a subprocess)
def test_grouprl_list_with_the_plugin_shows_its_methods(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"}
    out = subprocess.run(
        [sys.executable, "-m", "grouprl", "list", "--plugin", str(EXAMPLE)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    for name in ("mean_centered", "clipped_reinforce", "my_method"):
        assert name in out
    assert "REINFORCE with bounded advantages" in out
    bare = subprocess.run(
        [sys.executable, "-m", "grouprl", "list", "presets"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    assert "my_method" not in bare


def test_a_config_that_names_a_plugin_preset_without_the_plugin_lists_the_valid_ones(tmp_path):
    from grouprl.train.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"unknown preset 'my_method'; valid presets: grpo"):
        load_config(None, ["algorithm.preset=my_method", f"run.out={tmp_path}"])
    cfg = load_config(
        None, ["algorithm.preset=my_method", f"run.plugins=[{json.dumps(str(EXAMPLE))}]"]
    )
    assert cfg.algorithm.resolve().surrogate == "clipped_reinforce"
    with pytest.raises(ConfigError, match=r"run.plugins: plugin file 'gone.py' not found"):
        load_config(None, ["run.plugins=[gone.py]"])


def test_a_preset_override_is_checked_against_the_methods_it_names(tmp_path):
    from grouprl.train.config import ConfigError, load_config

    plugins.load(EXAMPLE)
    base = ["algorithm.preset=grpo", "algorithm.surrogate=clipped_reinforce"]
    with pytest.raises(ConfigError, match=r"\['eps_high', 'eps_low'\] are not settings.*clip"):
        load_config(None, base)
    cfg = load_config(None, [*base, "algorithm.surrogate_params={clip: 3.0}"])
    assert dict(cfg.algorithm.resolve().surrogate_params) == {"clip": 3.0}


def test_algorithm_dot_a_methods_setting_sets_it_from_its_registration():
    from grouprl.train.config import ConfigError, load_config

    plugins.load(EXAMPLE)
    cfg = load_config(None, ["algorithm.preset=my_method", "algorithm.clip=2.5",
                             "algorithm.scale=4"])  # fmt: skip
    p = cfg.algorithm.resolve()
    assert dict(p.surrogate_params) == {"clip": 2.5} and dict(p.estimator_params) == {"scale": 4}
    with pytest.raises(ConfigError, match=r"unknown algorithm override\(s\) \['eps_high'\].*clip"):
        load_config(None, ["algorithm.preset=my_method", "algorithm.eps_high=0.3"])


def test_run_with_plugins_trains_the_plugins_preset(tmp_path):
    from grouprl.train import run

    rows = [{"prompt": f"say {w}", "answer": w} for w in ("a", "b", "c", "d") * 3]

    def correct(completions, answer, **kwargs):
        return [float(a in c) for c, a in zip(completions, answer)]

    result = run(
        model=TINY, dataset=rows, reward_funcs=[correct], preset="my_method",
        plugins=[str(EXAMPLE)], sampling={"group_size": 2, "prompts_per_step": 2,
        "max_new_tokens": 4}, optim={"steps": 1}, eval={"every": 0},
        run={"out": str(tmp_path / "r"), "save_final": False, "report": False},
    )  # fmt: skip
    assert result.step == 1
    recorded = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert recorded["run"]["plugins"] == [str(EXAMPLE)]
    assert recorded["algorithm"]["preset"] == "my_method"
