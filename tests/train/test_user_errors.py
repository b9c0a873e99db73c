"""``grouprl train`` on a user's mistake: one line that says what and where, exit code 2."""

from __future__ import annotations

import pytest
from train_toy import TINY_MAZE_ARGS

from grouprl import cli
from grouprl.train.runlock import RunLock


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        # an unclosed list: found at the next key, started on line 2
        (
            "optim:\n  ks: [1, 8\nrun:\n  out: x\n",
            "line 3, column 4",
            "expected ',' or ']', but got ':' (while parsing a flow sequence that starts "
            "at line 2, column 7)",
        ),
        # a key indented under a scalar
        ("optim:\n  lr: 1e-4\n   steps: 3\n", "line 3, column 9", "mapping values are not allowed"),
        # a tab
        ("optim:\n\tlr: 1e-4\n", "line 2, column 1", "found character '\\t'"),
    ],
)
def test_malformed_yaml_names_the_file_line_and_problem(tmp_path, capsys, text, where, what):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert cli.main(["train", "--config", str(path)]) == 2
    err = _one_line_error(capsys)
    assert err.startswith(f"grouprl train: {path}, {where}: not valid YAML: {what}"), err
    assert err.endswith("fix the file (a config is a mapping of sections, see configs/maze.yaml)")


def test_unreadable_config_files(tmp_path, capsys):
    assert cli.main(["train", "--config", str(tmp_path / "none.yaml")]) == 2
    assert _one_line_error(capsys) == (
        f"grouprl train: config file {tmp_path / 'none.yaml'} not found; check the path "
        "(examples are in configs/)"
    )
    assert cli.main(["train", "--config", str(tmp_path)]) == 2
    assert _one_line_error(capsys) == (
        f"grouprl train: cannot read config file {tmp_path}: Is a directory"
    )


def test_a_hub_id_neither_cached_nor_reachable_is_one_line_and_exit_2(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", *TINY_MAZE_ARGS, "--model", "someorg/not-cached", "--out", str(out)]
    assert cli.main(argv) == 2
    assert "model 'someorg/not-cached' is not a folder" in _one_line_error(capsys)
    assert not out.exists()  # refused before the run folder was made


def test_a_folder_in_use_is_refused_by_the_command(tmp_path, capsys):
    with RunLock(tmp_path):
        assert cli.main(["train", *TINY_MAZE_ARGS, "--steps", "1", "--out", str(tmp_path)]) == 2
    assert " is in use by pid " in _one_line_error(capsys)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_resume_refusals_exit_2(tmp_path, capsys):
    out = ["--out", str(tmp_path)]
    assert cli.main(["train", *TINY_MAZE_ARGS, "--steps", "1", *out]) == 0
    capsys.readouterr()
    assert (
        cli.main(["train", *TINY_MAZE_ARGS, "--steps", "2", "--preset", "dapo", "--resume", *out])
        == 2
    )
    err = capsys.readouterr().err
    assert "algorithm.preset: grpo (checkpoint) -> dapo (now)" in err
    for p in sorted((tmp_path / "checkpoints").rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    assert cli.main(["train", *TINY_MAZE_ARGS, "--steps", "2", "--resume", *out]) == 2
    assert "holds a run (1 step in metrics.jsonl) but no usable checkpoint" in (
        _one_line_error(capsys)
    )


def test_a_second_fresh_run_in_a_used_folder_is_refused_until_overwrite(tmp_path, capsys):
    argv = ["train", *TINY_MAZE_ARGS, "--steps", "1", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = _one_line_error(capsys)
    assert "already holds a run (1 checkpoint, 1 logged step)" in err
    assert "--overwrite" in err
    assert cli.main([*argv, "--overwrite"]) == 0


def test_resume_anyway_flag_sets_both_fields():
    import argparse

    from grouprl.cli import train as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    overrides = command.overrides_from_args(parser.parse_args(["--resume-anyway"]))
    assert overrides == ["run.resume=true", "run.resume_anyway=true"]


def test_switching_a_presets_surrogate_names_its_stale_parameters_and_the_fix(tmp_path, capsys):
    # grpo's clip bounds belong to ppo_clip, which algorithm.surrogate=topr replaces: the error
    # says which parameters, topr's settings, and the override that fixes it
    sets = ["--set", "algorithm.preset=grpo", "--set", "algorithm.surrogate=topr"]
    assert cli.main(["train", *TINY_MAZE_ARGS, *sets, "--set", f"run.out={tmp_path}"]) == 2
    err = _one_line_error(capsys)
    assert err == (
        "grouprl train: algorithm overrides: algorithm.surrogate=topr replaces the surrogate "
        "of preset 'grpo', whose surrogate_params ['eps_high', 'eps_low'] are not settings of "
        "surrogate 'topr' (its settings and defaults: ratio_low: 0.0, ratio_high: 1.0, "
        "ratio_level: 'seq_mean'). Set them with the override: --set "
        "'algorithm.surrogate_params={}' for topr's defaults, or --set "
        "'algorithm.surrogate_params={ratio_low: ...}'"
    )
    # the fix is a valid config: topr with its defaults, or with a setting of its own
    from grouprl.train.config import load_config

    base = ["algorithm.preset=grpo", "algorithm.surrogate=topr", "task.name=maze"]
    cfg = load_config(None, [*base, "algorithm.surrogate_params={}"])
    assert dict(cfg.algorithm.resolve().surrogate_params) == {}
    cfg = load_config(None, [*base, "algorithm.surrogate_params={ratio_low: 0.5}"])
    assert dict(cfg.algorithm.resolve().surrogate_params) == {"ratio_low": 0.5}


def test_switching_a_presets_estimator_names_its_stale_parameters(clean_registry):
    from grouprl import presets
    from grouprl.train.config import ConfigError, load_config

    presets.register_preset(
        name="my_floor", estimator="maxnorm_rloo", estimator_params={"tau_res": 0.05}
    )
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.preset=my_floor", "algorithm.estimator=gopo"])
    assert "algorithm.estimator=gopo replaces the estimator of preset 'my_floor', whose " in str(
        err.value
    )
    assert "estimator_params ['tau_res'] are not settings of estimator 'gopo'" in str(err.value)
    assert "--set 'algorithm.estimator_params={}' for gopo's defaults" in str(err.value)
    # an override that keeps a setting of the new method passes the check
    cfg = load_config(None, ["algorithm.preset=my_floor", "algorithm.estimator=maxnorm_dr_grpo"])
    assert cfg.algorithm.resolve().estimator == "maxnorm_dr_grpo"
