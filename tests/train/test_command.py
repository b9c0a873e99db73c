"""``grouprl train``: flags map to config fields; bad input fails before any model loads."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from grouprl import cli
from grouprl.cli import train as command
from grouprl.train.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_become_overrides_in_precedence_order():
    args = _args(
        "--model",
        "smollm2",
        "--task",
        "basic_arithmetic",
        "--preset",
        "f_grpo",
        "--steps",
        "7",
        "--group-size",
        "4",
        "--prompts-per-step",
        "2",
        "--seed",
        "3",
        "--out",
        "x",
        "--resume",
        "--set",
        "optim.steps=9",
    )
    cfg = load_config(None, command.overrides_from_args(args))
    assert (cfg.model.name, cfg.task.name, cfg.algorithm.preset) == (
        "smollm2",
        "basic_arithmetic",
        "f_grpo",
    )
    assert (cfg.sampling.group_size, cfg.sampling.prompts_per_step, cfg.run.seed) == (4, 2, 3)
    assert cfg.run.resume and cfg.run.out == "x"
    assert cfg.optim.steps == 9  # --set wins over --steps
    assert cfg.optim.lr == 2e-6  # the pretrained profile, since the model is not tiny


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "nope"], "valid presets: grpo, dr_grpo"),
        (["--task", "nope"], "valid tasks: maze"),
        (["--model", "nope"], "unknown model 'nope'; give one of: tiny, smollm2"),
        (["--prompts-per-step", "6", "--set", "optim.minibatches=4"], "does not divide"),
    ],
)
def test_bad_input_exits_2_with_the_choices_before_loading_a_model(
    argv, message, capsys, monkeypatch
):
    import grouprl.models

    monkeypatch.setattr(grouprl.models, "load", lambda *a, **k: pytest.fail("model loaded"))
    assert cli.main(["train", *argv]) == 2
    assert message in capsys.readouterr().err


CONFIGS = {  # what each example config says it runs (read off the files)
    "maze.yaml": ("tiny", "maze", "grpo", 300, 0.0),
    "maze_f_grpo.yaml": ("tiny", "maze", "f_grpo", 300, 0.0),
    "maze_focal.yaml": ("tiny", "maze", "f_grpo", 400, 0.0),
    "smollm2_arithmetic.yaml": ("smollm2", "basic_arithmetic", "f_grpo", 50, 0.0),
    "smollm2_lora_dapo.yaml": ("smollm2", "basic_arithmetic", "dapo", 50, 0.01),
}


def test_every_example_config_is_listed():
    assert sorted(p.name for p in (ROOT / "configs").glob("*.yaml")) == sorted(CONFIGS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_example_configs_load_and_validate(name):
    cfg = load_config(ROOT / "configs" / name)
    got = (
        cfg.model.name,
        cfg.task.name,
        cfg.algorithm.preset,
        cfg.optim.steps,
        cfg.algorithm.resolve().beta,
    )
    assert got == CONFIGS[name] and cfg.run.out.startswith("runs/")
