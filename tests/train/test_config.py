"""Config: YAML and --set overrides load into the same frozen classes; bad configs fail at load."""

from __future__ import annotations

import dataclasses

import pytest

from grouprl.train import config as C


def test_defaults_are_the_maze_miniature_and_validate():
    cfg = C.load_config()
    assert (cfg.model.name, cfg.task.name, cfg.algorithm.preset) == ("tiny", "maze", "grpo")
    # the maze miniature (config.MAZE_MINIATURE): 16 mazes x 16; lr 5e-5
    assert (cfg.sampling.prompts_per_step, cfg.sampling.group_size, cfg.optim.lr) == (16, 16, 5e-5)
    assert cfg.batch_size == 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim.lr = 1.0


def test_yaml_and_overrides_load_into_the_same_classes(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "optim: {lr: 1.0e-4, betas: [0.8, 0.9]}\n"
        "sampling: {group_size: 4}\n"
        "algorithm: {preset: dapo, beta: 0.04}\n"
        "task: {name: maze, params: {size: 4}}\n"
    )
    a = C.load_config(path)
    b = C.load_config(
        None,
        [
            "optim.lr=1e-4",
            "optim.betas=[0.8, 0.9]",
            "sampling.group_size=4",
            "algorithm.preset=dapo",
            "algorithm.beta=0.04",
            "task.params.size=4",
        ],
    )
    assert a == b
    assert a.optim.betas == (0.8, 0.9) and isinstance(a.optim.betas, tuple)
    assert a.algorithm.resolve().beta == 0.04
    assert a.algorithm.resolve().surrogate_params["eps_high"] == 0.28  # DAPO's clip-higher
    assert dict(a.task.params) == {"size": 4}
    # overrides win over the file; the round trip through to_dict is lossless
    c = C.load_config(path, ["optim.lr=3e-4"])
    assert c.optim.lr == 3e-4 and c.sampling.group_size == 4
    assert C.from_dict(c.to_dict()) == c


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.preset=nope"], "valid presets: grpo"),
        (["task.name=nope"], "valid tasks: maze"),
        (["model.name=nope"], "unknown model 'nope'; give one of: tiny"),
        (["optim.minibatches=3"], "does not divide sampling.prompts_per_step=16"),
        (["optim.micro_batch_size=12"], "not a multiple of the group size sampling.group_size=16"),
        (["optim.micro_batch_size=-8"], "micro_batch_size=-8"),
        (["sampling.group_size=1"], "group_size must be >= 2"),
        (["optim.bogus=1"], "unknown field optim.bogus; valid fields: steps"),
        (["bogus.x=1"], "SECTION one of model"),
        (["algorithm.not_a_field=1"], "unknown algorithm override(s) ['not_a_field']"),
        (["eval.samples=4"], "pass@k needs n >= k"),
        (["model.dtype=int8"], "model.dtype must be"),
        (["run.threads=-1"], "run.threads must be >= 0 (0 = auto)"),
    ],
)
def test_bad_configs_fail_at_load_with_the_fix(overrides, message):
    with pytest.raises(C.ConfigError) as err:
        C.load_config(None, overrides)
    assert message in str(err.value)


def test_lora_without_peft_is_rejected_before_any_model(monkeypatch):
    real = C.importlib.util.find_spec
    monkeypatch.setattr(
        C.importlib.util, "find_spec", lambda name: None if name == "peft" else real(name)
    )
    with pytest.raises(C.ConfigError, match="needs peft, which is not installed"):
        C.load_config(None, ["model.lora_rank=8"])


def test_reasoning_gym_names_and_model_paths_are_accepted(tmp_path):
    # A reasoning-gym dataset name and the registered smollm2 pass validation and pick the
    # "pretrained" profile (PROFILES): 8 x 8, 48 new tokens, lr 2e-6, 50 steps, a small eval.
    rg = C.load_config(None, ["task.name=basic_arithmetic", "model.name=smollm2"])
    assert (rg.task.name, dict(rg.task.params), rg.model.name) == (
        "basic_arithmetic",
        {},
        "smollm2",
    )
    assert (rg.sampling.prompts_per_step, rg.sampling.max_new_tokens) == (8, 48)
    assert (rg.optim.lr, rg.optim.steps, rg.eval.ks) == (2e-6, 50, (1, 8))
    # A tiny spec keeps the tiny profile (maze verifier in-process: no timeout)...
    tiny = C.load_config(None, ["model.name=tiny:d=32,layers=2"])
    assert tiny.model.name == "tiny:d=32,layers=2" and tiny.sampling.verify_timeout_s == 0.0
    assert tiny.optim.lr == C.OptimConfig.lr
    # ... and a model folder (one with config.json, checked at load) is a pretrained model.
    (tmp_path / "config.json").write_text("{}")
    folder = C.load_config(None, [f"model.name={tmp_path}"])
    assert folder.model.name == str(tmp_path) and folder.optim.lr == 2e-6


# ----------------------------------------------------------------------------- update schedule


def test_schedule_is_the_presets_unless_optim_sets_it():
    # null (the default) takes the preset's sources' schedule (ALGORITHMS.md §3)
    for preset, want in (("grpo", (1, 1)), ("dapo", (16, 1)), ("gspo", (4, 1)), ("agpo", (1, 4))):
        cfg = C.load_config(None, [f"algorithm.preset={preset}"])
        s = cfg.schedule()
        assert (s.minibatches, s.ppo_epochs) == want and s.note is None
        assert dict(s.source) == {"minibatches": "preset", "ppo_epochs": "preset"}
    # optim.* set explicitly wins, each field on its own
    s = C.load_config(None, ["algorithm.preset=dapo", "optim.minibatches=4"]).schedule()
    assert (s.minibatches, s.ppo_epochs, s.source["minibatches"]) == (4, 1, "optim")
    s = C.load_config(None, ["algorithm.preset=agpo", "optim.ppo_epochs=1"]).schedule()
    assert (s.minibatches, s.ppo_epochs, s.optimizer_steps) == (1, 1, 1)
    # an algorithm override changes the preset itself
    s = C.load_config(None, ["algorithm.preset=grpo", "algorithm.minibatches=8"]).schedule()
    assert s.minibatches == 8 and s.source["minibatches"] == "preset"
    # null in YAML / --set is the default
    cfg = C.load_config(None, ["optim.minibatches=null", "optim.ppo_epochs=null"])
    assert cfg.optim.minibatches is None and cfg.optim.ppo_epochs is None
    assert C.from_dict(cfg.to_dict()) == cfg


def test_preset_minibatches_that_do_not_divide_the_prompts_take_the_largest_divisor():
    # DAPO's 16 at 8 prompts -> 8 (8 | 8); at 12 prompts -> 12 (largest divisor of 12 <= 16);
    # GSPO's 4 at 6 prompts -> 3 (divisors of 6: 1, 2, 3, 6); at 32 prompts -> 4 unchanged
    for preset, prompts, want in (
        ("dapo", 8, 8),
        ("dapo", 12, 12),
        ("gspo", 6, 3),
        ("gspo", 32, 4),
    ):
        cfg = C.load_config(
            None, [f"algorithm.preset={preset}", f"sampling.prompts_per_step={prompts}"]
        )
        s = cfg.schedule()
        assert s.minibatches == want
        assert (s.note is None) == (want == cfg.algorithm.resolve().minibatches)
    note = C.load_config(None, ["algorithm.preset=gspo", "sampling.prompts_per_step=6"])
    assert "takes 3" in note.schedule().note and "optim.minibatches" in note.schedule().note
    # a count set in optim must divide the prompts: a clear error, not an adaptation
    with pytest.raises(C.ConfigError, match=r"optim\.minibatches=4 does not divide"):
        C.load_config(None, ["sampling.prompts_per_step=6", "optim.minibatches=4"])
    with pytest.raises(C.ConfigError, match=r"optim\.ppo_epochs must be >= 1 \(or null"):
        C.load_config(None, ["optim.ppo_epochs=0"])
    with pytest.raises(C.ConfigError, match=r"optim\.minibatches must be int"):
        C.load_config(None, ["optim.minibatches=two"])


def test_threads_zero_is_auto(monkeypatch):
    """run.threads defaults to 0 (auto, grouprl._threads): setup sets one thread per physical
    core, at most torch's own count, whatever the load; a positive count is set as it is."""
    import torch

    from grouprl import _threads
    from grouprl.train import state

    assert C.load_config().run.threads == 0
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(state, "TORCH_THREADS", 2)
    base = ["model.warm_start=false", "sampling.prompts_per_step=2", "sampling.group_size=2"]
    for cores, load, expected in ((2, 0.2, 2), (2, 3.5, 2), (4, 0.0, 2), (1, 9.0, 1)):
        monkeypatch.setattr(_threads, "physical_cores", lambda n=cores: n)
        monkeypatch.setattr(_threads.os, "getloadavg", lambda x=load: (x, x, x), raising=False)
        state.setup(C.load_config(None, base))
        assert calls[-1] == expected, (cores, load)
    state.setup(C.load_config(None, [*base, "run.threads=3"]))
    assert calls[-1] == 3


def test_a_logger_asked_for_but_not_installed_is_an_error_before_the_run(
    tmp_path, monkeypatch, capsys
):
    # run.wandb=true without wandb must not run to the end without a word
    import importlib.util

    from grouprl.cli import main

    real = importlib.util.find_spec
    missing = {"wandb", "tensorboard"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a)
    )
    with pytest.raises(C.ConfigError) as err:
        C.load_config(None, ["run.wandb=true"])
    assert str(err.value) == (
        "run.wandb=true but wandb is not installed: pip install wandb, or set run.wandb=false"
    )
    with pytest.raises(C.ConfigError, match=r"pip install 'grouprl\[logging\]'"):
        C.load_config(None, ["run.tensorboard=true"])
    # the default (None) writes TensorBoard events only where tensorboard is installed
    assert C.load_config().run.tensorboard is None
    C.load_config(None, ["run.tensorboard=false"])
    # the command line: exit code 2 and the message, before any model loads or folder exists
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--set", "run.wandb=true"]) == 2
    err_text = capsys.readouterr().err
    assert "pip install wandb" in err_text and not out.exists()
