"""Where each value of a run's configuration comes from, and ``grouprl train --print-config``.

The layers are the dataclass defaults, the model profile and the task profile (YAML files in
``grouprl/configs/``), the config file and the command line; each test derives the expected
source of a field by hand from which layer sets it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from grouprl.cli import main
from grouprl.train import config as C

ROOT = Path(__file__).resolve().parents[2]
TASK = "task profile tiny+maze (grouprl/configs/task_tiny_maze.yaml)"
TINY = "model profile tiny (grouprl/configs/model_tiny.yaml)"


def test_the_bare_command_reads_its_profiles_from_yaml_files():
    assert C.PROFILES["tiny"] == yaml.safe_load(C.PROFILE_FILES["tiny"].read_text())
    assert C.MAZE_MINIATURE["optim"]["steps"] == 100
    assert [w for w, _ in C.config_layers()] == [TINY, TASK]
    s = C.config_sources()
    assert s["optim.steps"] == TASK  # 100, not OptimConfig's 300
    assert s["sampling.verify_timeout_s"] == TINY
    assert "optim.lr" not in s  # the dataclass default
    assert C.load_config().optim.steps == 100


def test_a_file_and_the_command_line_override_the_profiles_and_say_so():
    path = ROOT / "configs" / "maze_focal.yaml"
    s = C.config_sources(path, ["optim.lr=1e-4", "task.params.size=5"])
    assert s["optim.lr"] == "command line"
    assert s["task.params.size"] == "command line"
    assert s["task.params.min_path"] == f"config file {path}"
    # the file gives task.params: no task profile under it
    assert [w for w, _ in C.config_layers(path)] == [TINY, f"config file {path}"]


def test_a_real_model_takes_the_pretrained_profile():
    s = C.config_sources(None, ["model.name=smollm2"])
    assert s["optim.lr"] == "model profile pretrained (grouprl/configs/model_pretrained.yaml)"
    assert s["model.name"] == "command line"


def test_describe_config_names_every_field_and_its_source():
    cfg = C.load_config(None, ["optim.lr=1e-4"])
    lines = C.describe_config(cfg, C.config_sources(None, ["optim.lr=1e-4"])).splitlines()
    assert "optim.lr: 0.0001  # command line" in lines
    assert f"optim.steps: 100  # {TASK}" in lines
    assert "optim.weight_decay: 0.0  # default (OptimConfig.weight_decay)" in lines
    fields = [ln for ln in lines if not ln.startswith("#")]
    assert len(fields) == len(C._leaves(cfg.to_dict()))
    assert lines[-1].startswith("# update schedule: 1 minibatch(es) x 1 epoch(s)")


def test_a_lowered_minibatch_count_is_printed():
    # DAPO takes 16 minibatches; 8 prompts split into whole groups only by 8
    cfg = C.load_config(None, ["algorithm.preset=dapo", "sampling.prompts_per_step=8"])
    text = C.describe_config(cfg, {})
    assert "# update schedule: 8 minibatch(es)" in text
    assert "takes 16 minibatches" in text


def test_print_config_prints_and_trains_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--print-config", "--steps", "7", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "optim.steps: 7  # command line" in text
    assert f"sampling.group_size: 16  # {TASK}" in text
    assert not out.exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.steps=1.5", "optim.steps must be int"),
        ("optim.lr=fast", "optim.lr must be float"),
        ("model.warm_start=1", "model.warm_start must be bool"),
        ("optim.minibatches=two", "optim.minibatches must be int or None"),
        ("optim.betas=0.9", "optim.betas must be a list of 2 floats, got 0.9$"),
        ("optim.betas=[0.9]", r"optim.betas must be a list of 2 floats, got \[0.9\]"),
        (
            "optim.recompute=mlp",
            r"a list of str, got 'mlp'; .* list of one: optim.recompute=\[mlp\]",
        ),
        ("eval.ks=8", r"eval.ks must be a list of int, got 8; .* eval.ks=\[8\]"),
    ],
)
def test_types_are_checked_by_the_field_types(override, message):
    with pytest.raises(C.ConfigError, match=message):
        C.load_config(None, [override])


def test_valid_names_come_from_the_registries(monkeypatch):
    from grouprl.rollout import hf
    from grouprl.train import policy

    with pytest.raises(
        C.ConfigError, match=re.escape(f"sampling.draw must be one of {', '.join(hf.DRAWS)}")
    ):
        C.load_config(None, ["sampling.draw=gumbel"])
    monkeypatch.setattr(hf, "DRAWS", (*hf.DRAWS, "gumbel"))
    assert C.load_config(None, ["sampling.draw=gumbel"]).sampling.draw == "gumbel"
    with pytest.raises(C.ConfigError, match=r"model\.autocast must be one of none, bfloat16, bf16"):
        C.load_config(None, ["model.autocast=fp8"])
    monkeypatch.setattr(policy, "PRECISIONS", {**policy.PRECISIONS, "fp8": None})
    assert C.load_config(None, ["model.autocast=fp8"]).model.autocast == "fp8"
    assert C.load_config(None, ["model.rollout_precision=fp8"]).model.rollout_precision == "fp8"
