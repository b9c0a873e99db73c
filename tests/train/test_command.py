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
    "maze.yaml": ("tiny", "maze", "grpo", 100, 0.0),
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


def test_progress_shows_without_a_terminal(tmp_path, monkeypatch, capsys):
    # with stdout going to a file the warm start and the run must not stay silent until
    # their end: plain lines (capsys's stdout is not a terminal)
    monkeypatch.setenv("GROUPRL_CACHE", str(tmp_path / "cache"))  # an empty SFT cache
    out = tmp_path / "run"
    argv = ["train", "--out", str(out), "--steps", "20", "--prompts-per-step", "2",
            "--group-size", "2", "--set", "model.sft_steps=20", "--set", "eval.every=0",
            "--set", "run.save_final=false", "--set", "run.threads=1"]  # fmt: skip
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "threads: 1 (run.threads; --set run.threads=N to choose)"
    assert lines[2] == (
        "config: defaults < model profile tiny (grouprl/configs/model_tiny.yaml) < task "
        "profile tiny+maze (grouprl/configs/task_tiny_maze.yaml) < command line "
        "(--print-config shows each value's source)"
    )
    assert any(
        x.startswith("SFT warm start: 20 steps of supervised training on maze") for x in lines
    )
    sft = [x for x in lines if x.startswith("SFT warm start ")]
    assert [x.split()[3] for x in sft][:2] == ["2/20", "4/20"] and sft[-1].split()[3] == "20/20"
    assert any(x.startswith("SFT warm start: done in ") for x in lines)
    steps = [x.split()[1] for x in lines if x.startswith("step ")]
    assert steps == [f"{k}/20" for k in range(2, 21, 2)]  # every tenth of the run
    assert all("reward" in x and "ACR" in x and "KL" not in x for x in lines if x[:5] == "step ")
    assert lines[-1] == f"report: {out / 'report.html'}"
    # the second run finds the warm start in the cache and says so
    assert cli.main([*argv, "--overwrite"]) == 0
    assert "SFT warm start: cached weights loaded" in capsys.readouterr().out


def test_the_default_run_is_the_maze_miniature_and_maze_yaml_spells_it_out():
    # `grouprl train` with no arguments, and configs/maze.yaml, are the same run
    default, yaml = load_config(), load_config(ROOT / "configs" / "maze.yaml")
    assert dict(default.task.params) == {"size": 4, "min_path": 1, "max_path": 5}
    assert (default.model.sft_steps, default.optim.steps, default.batch_size) == (550, 100, 256)
    assert default.sampling.max_new_tokens == 10 and default.sampling.verify_timeout_s == 0
    for section in ("model", "task", "sampling", "algorithm", "optim", "eval"):
        assert getattr(default, section) == getattr(yaml, section), section
    # a maze of your own starts from the plain defaults, not a mix with the miniature's
    own = load_config(None, ["task.params.size=5"])
    assert dict(own.task.params) == {"size": 5} and own.sampling.max_new_tokens == 32
    assert (own.model.sft_steps, own.optim.steps) == (1400, 300)
    # another task on the tiny model keeps only the tiny profile
    other = load_config(None, ["task.name=basic_arithmetic"])
    assert dict(other.task.params) == {} and other.sampling.group_size == 8
