"""GroupRLGRPOTrainer as a drop-in for TRL's GRPOTrainer, checked against TRL's installed trainer.

The reference is TRL's own ``GRPOTrainer`` run side by side on the same tiny Llama (built from a
config), seed, data and reward: swapping the class with no grouprl keyword must leave every
number TRL logs unchanged and add the ``grouprl/*`` diagnostics; grouprl's estimator that
:func:`trl_estimator` names must give TRL's advantages; grouprl's loss path must give TRL's loss,
gradient norm and loss metrics under gradient accumulation, an all-masked batch and a MoE model;
a preset must name each config field it changes and refuse a user-set one unless told.
"""

import logging
import os
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.peer

os.environ["HF_HUB_OFFLINE"] = "1"
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("trl")
from tiny_lm import WORDS, tiny_model, tiny_tokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl_doubles import RecordingReward, config, dataset, run  # noqa: E402

from grouprl import presets  # noqa: E402
from grouprl.integrations import trl as gt  # noqa: E402

TIMING = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


class Capture:
    """Keeps the advantages each generation batch hands to the loss (this process's rows)."""

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.__dict__.setdefault("captured", []).append(output["advantages"].detach().clone())
        return output


class TRLCapture(Capture, GRPOTrainer):
    pass


class OursCapture(Capture, gt.GroupRLGRPOTrainer):
    pass


def length_reward(prompts, completions, **kwargs):
    """A second reward function: the completion's share of its 4-token budget."""
    return [len(c.split()) / 4 for c in completions]


def side_by_side(tmp_path, targs, ours=None, reward=None, model=None):
    """TRL's GRPOTrainer and ours (keywords ``ours``) on the same seed and data."""
    ours = ours or {}
    reward = reward or (lambda: RecordingReward(nan_every=5))
    if model is None or isinstance(model, str):
        make = lambda: model  # noqa: E731 - None = tiny_model() inside run(), or a folder
    else:
        make = model
    a, _ = run(
        tmp_path / "trl",
        reward=reward(),
        trainer_cls=TRLCapture,
        model=make(),
        args=config(tmp_path / "trl", **targs),
    )
    b, _ = run(
        tmp_path / "ours",
        reward=reward(),
        trainer_cls=OursCapture,
        model=make(),
        args=config(tmp_path / "ours", **targs),
        **ours,
    )
    return a, b


def step_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def model_folder(tmp_path):
    """TRL builds its reference model (beta > 0) from a model folder."""
    folder = tmp_path / "model"
    tiny_model().save_pretrained(folder)
    return str(folder)


# --------------------------------------------------------------------------- swap the class
SWAP_CONFIGS = {
    "defaults": {},
    "scale_batch": {"scale_rewards": "batch"},
    "scale_none": {"scale_rewards": "none"},
    "grpo": {"loss_type": "grpo"},
    "bnpo": {"loss_type": "bnpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "luspo_seq": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "cispo": {"loss_type": "cispo", "epsilon_high": 5.0},
    "sapo": {"loss_type": "sapo"},
    "vespo": {"loss_type": "vespo"},
    "sequence": {"importance_sampling_level": "sequence"},
    "accum_offpolicy": {
        "gradient_accumulation_steps": 2,
        "per_device_train_batch_size": 4,
        "steps_per_generation": 4,
        "num_iterations": 2,
        "delta": 1.5,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SWAP_CONFIGS))
def test_swapping_the_class_changes_no_number_trl_logs(tmp_path, name):
    # The class swapped, no keyword: TRL's advantages, loss, gradient and every metric it logs
    # are the same bits; grouprl's diagnostics are added beside them.
    a, b = side_by_side(tmp_path, SWAP_CONFIGS[name])
    assert b.grouprl_mode == "trl" and not b._grouprl_loss
    assert len(a.captured) == len(b.captured) >= 1
    for x, y in zip(a.captured, b.captured):
        assert torch.equal(x, y)
    la, lb = a.state.log_history, b.state.log_history
    assert len(la) == len(lb) == 4  # 3 steps + the summary
    for x, y in zip(la, lb):
        for key, value in x.items():
            assert key in y, key
            if key not in TIMING:
                assert y[key] == value, key
        extra = set(y) - set(x)
        assert all(k.startswith("grouprl/") for k in extra), extra
    for h in step_logs(b):  # on the steps that generated (TRL logs `reward` on those only)
        if "reward" not in h:
            continue
        for key in ("grouprl/acr/rate", "grouprl/scale/inv_p95", "grouprl/tailmiss/risk"):
            assert key in h
    # the diagnostics read the advantages TRL trained on
    _, out = b.grouprl_last
    torch.testing.assert_close(out.values.reshape(-1), b.captured[-1])


@pytest.mark.slow
def test_swapping_the_class_keeps_trls_kl_and_two_reward_functions(tmp_path):
    targs = {
        "beta": 0.04,
        "multi_objective_aggregation": "normalize_then_sum",
        "reward_weights": [1.0, 0.5],
    }
    folder = model_folder(tmp_path)
    a, b = side_by_side(
        tmp_path,
        targs,
        reward=lambda: [RecordingReward(nan_every=5), length_reward],
        model=folder,
    )
    for x, y in zip(a.captured, b.captured):
        assert torch.equal(x, y)
    for x, y in zip(step_logs(a), step_logs(b)):
        assert "kl" in x
        assert {k: v for k, v in x.items() if k not in TIMING} == {
            k: y[k] for k in x if k not in TIMING
        }


# --------------------------------------------------------------------------- TRL's advantages
@pytest.mark.slow
@pytest.mark.parametrize(
    "targs",
    [
        {"scale_rewards": "group"},
        {"scale_rewards": "batch"},
        {"scale_rewards": "none"},
        {"multi_objective_aggregation": "normalize_then_sum", "reward_weights": [1.0, 0.5]},
    ],
    ids=["group", "batch", "none", "normalize_then_sum"],
)
def test_trl_estimator_reproduces_trls_advantages(tmp_path, targs):
    # grouprl's estimator named by trl_estimator() replaces TRL's advantage step: the
    # advantages (NaN rewards included) and hence the loss are TRL's to rounding.
    name, params = gt.trl_estimator(config(tmp_path, **targs))
    two = "multi_objective_aggregation" in targs
    a, b = side_by_side(
        tmp_path,
        targs,
        ours={"estimator": name, "advantage_kwargs": params},
        reward=(lambda: [RecordingReward(nan_every=5), length_reward])
        if two
        else (lambda: RecordingReward(nan_every=5)),
    )
    assert b.grouprl_mode == "estimator"
    for x, y in zip(a.captured, b.captured):
        torch.testing.assert_close(y, x, atol=2e-6, rtol=1e-6)
    if not two:  # an all-None row (one function) is unscorable: 0 in both
        assert any(bool((x == 0).any()) for x in a.captured)
    for x, y in zip(step_logs(a), step_logs(b)):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-7)


def test_trl_estimator_and_loss_half_read_the_config(tmp_path):
    assert gt.trl_estimator(config(tmp_path)) == ("grpo", {"eps": 1e-4})
    assert gt.trl_estimator(config(tmp_path, scale_rewards=False)) == ("dr_grpo", {})
    assert gt.trl_estimator(config(tmp_path, scale_rewards="batch"))[0] == "batch_std"
    half = gt.trl_loss_half(config(tmp_path))  # TRL's defaults: dapo, eps 0.2 both sides
    assert half["aggregation"] == "token_mean" and half["surrogate"] == "ppo_clip"
    assert dict(half["surrogate_params"]) == {"eps_low": 0.2, "eps_high": 0.2}
    cispo = gt.trl_loss_half(config(tmp_path, loss_type="cispo", epsilon_high=5.0))
    assert cispo["surrogate_params"]["eps_high"] == 4.0  # TRL's bound is absolute
    with pytest.raises(ValueError, match=r"delta=1\.1"):
        gt.trl_loss_half(config(tmp_path, delta=1.1))
    with pytest.raises(ValueError, match="sequence"):
        gt.trl_loss_half(config(tmp_path, loss_type="cispo", importance_sampling_level="sequence"))
    with pytest.raises(ValueError, match=r"epsilon_high=0\.2\) caps every token's weight below 1"):
        gt.trl_loss_half(config(tmp_path, loss_type="cispo"))  # TRL's default epsilon_high
    # mapping back onto TRL's knobs gives the config's own fields again
    for loss_type in ("grpo", "dapo", "bnpo", "dr_grpo", "luspo", "sapo", "vespo"):
        targs = config(tmp_path, loss_type=loss_type, epsilon_high=0.28, delta=2.0)
        spec = gt.preset_from_trl_config(targs)
        back = gt.trl_loss_settings(spec)
        for key, value in back.items():
            if key != "use_bias_correction_kl" and key != "delta" and hasattr(targs, key):
                assert gt._config_value(targs, key) == pytest.approx(value), (loss_type, key)


# --------------------------------------------------------------------------- our loss path
LOSS_CONFIGS = {
    name: {"loss_type": name}
    for name in ("grpo", "dapo", "bnpo", "dr_grpo", "sapo", "vespo", "luspo")
}
LOSS_CONFIGS["luspo"]["importance_sampling_level"] = "sequence"
LOSS_CONFIGS["cispo"] = {"loss_type": "cispo", "epsilon_high": 3.0}
LOSS_CONFIGS["dapo_delta"] = {"loss_type": "dapo", "delta": 1.3, "epsilon_high": 0.28}
LOSS_CONFIGS["gspo"] = {"loss_type": "grpo", "importance_sampling_level": "sequence"}


TOKEN_MEAN = ("dapo", "cispo", "vespo", "dapo_delta")
"""TRL divides these by the generation batch's tokens per accumulation window, grouprl's loss
path by the step's own tokens (exact: tests/integrations/test_trl_conformance.py)."""


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LOSS_CONFIGS))
def test_grouprl_loss_path_is_trls_under_accumulation(tmp_path, name):
    # grouprl's objective computing the GRPOConfig's loss (loss="grouprl", no preset) against
    # TRL's own: 2 accumulation steps, 2 iterations (off-policy ratios): the loss, gradient
    # norm and every loss metric TRL logs agree. steps_per_generation 4 != accumulation, except
    # for the token means, whose normaliser is the step's own tokens in grouprl's path: with
    # steps_per_generation = accumulation it is TRL's, and otherwise only the loss's scale moves.
    per_generation = 2 if name in TOKEN_MEAN else 4
    targs = {
        "gradient_accumulation_steps": 2,
        "per_device_train_batch_size": 4,
        "steps_per_generation": per_generation,
        "num_iterations": 2,
        "learning_rate": 5e-2,
        **LOSS_CONFIGS[name],
    }
    a, b = side_by_side(tmp_path, targs, ours={"loss": "grouprl"})
    assert b._grouprl_loss
    la, lb = step_logs(a), step_logs(b)
    assert len(la) == len(lb) == 3
    for x, y in zip(la, lb):
        for key, value in x.items():
            assert key in y, key
            if key not in TIMING:
                assert y[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert any(abs(h["loss"]) > 1e-3 for h in la)
    if name in ("grpo", "dapo", "bnpo", "dr_grpo", "luspo", "dapo_delta", "gspo"):
        assert all("clip_ratio/low_min" in h and "clip_ratio/high_max" in h for h in lb)
    if name == "cispo":
        assert all("cispo_clip_ratio" in h for h in lb)
    if name == "vespo":
        assert all("vespo/phi_seq_mean" in h for h in lb)


@pytest.mark.slow
def test_grouprl_loss_path_logs_trls_kl(tmp_path):
    # beta > 0 with TRL's default use_bias_correction_kl: the k3 KL times the ratio, both in
    # the loss and in the logged `kl`
    targs = {"beta": 0.04, "num_iterations": 2, "loss_type": "grpo"}
    a, b = side_by_side(tmp_path, targs, ours={"loss": "grouprl"}, model=model_folder(tmp_path))
    for x, y in zip(step_logs(a), step_logs(b)):
        for key in ("loss", "grad_norm", "kl", "entropy", "clip_ratio/region_mean"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-7), key
    assert max(h["kl"] for h in step_logs(a)) > 0


@pytest.mark.slow
def test_all_masked_batch_is_a_zero_loss_on_both_paths(tmp_path):
    # No EOS can be sampled (suppressed), every completion is truncated, and
    # mask_truncated_completions masks them all: TRL trains with a loss of 0, and so do we.
    targs = {
        "mask_truncated_completions": True,
        "generation_kwargs": {"suppress_tokens": [1]},
        "loss_type": "bnpo",
    }
    a, b = side_by_side(tmp_path, targs, ours={"loss": "grouprl"})
    la, lb = step_logs(a), step_logs(b)
    assert [h["completions/clipped_ratio"] for h in la] == [1.0] * 3
    for x, y in zip(la, lb):
        assert x["loss"] == 0.0 == y["loss"]
        assert y["entropy"] == x["entropy"] and y["clip_ratio/region_mean"] == 0.0


def tiny_moe(seed: int = 0):
    """A one-layer Mixtral (4 experts, top-2) from a config: TRL adds its router loss."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(
        vocab_size=len(WORDS) + 3,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.5,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return MixtralForCausalLM(cfg)


@pytest.mark.slow
def test_moe_router_loss_is_kept_and_logged_on_our_path(tmp_path):
    targs = {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 4}
    a, b = side_by_side(tmp_path, targs, ours={"loss": "grouprl"}, model=tiny_moe)
    assert a.aux_loss_enabled and b.aux_loss_enabled
    for x, y in zip(step_logs(a), step_logs(b)):
        assert x["aux_loss"] > 0
        for key in ("loss", "grad_norm", "aux_loss"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-7), key


# --------------------------------------------------------------------------- presets, loudly
def make(cls, tmp_path, *, args=None, model=None, **kw):
    return cls(
        model=tiny_model() if model is None else model,
        reward_funcs=RecordingReward(),
        args=config(tmp_path) if args is None else args,
        train_dataset=dataset(),
        processing_class=tiny_tokenizer(),
        **kw,
    )


def test_a_preset_names_each_field_it_changes_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="grouprl.integrations.trl"):
        t = make(gt.GroupRLGRPOTrainer, tmp_path, preset="grpo")
    # TRL's default loss_type is dapo (the token mean); GRPO's is the per-sequence mean. With
    # beta = 0 the KL fields are unused and left alone.
    assert t.grouprl_config_changes == [("loss_type", "dapo", "grpo")]
    assert "loss_type 'dapo' -> 'grpo'" in caplog.text
    assert caplog.text.count("loss_type") == 1
    assert t.args.loss_type == "grpo" and t.loss_type == "grpo"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grouprl.integrations.trl"):
        t = make(
            gt.GroupRLGRPOTrainer,
            tmp_path,
            model=model_folder(tmp_path),  # TRL loads its reference model from a folder
            preset=presets.get("dapo").with_(beta=0.04),
        )
    assert t.grouprl_config_changes == [
        ("epsilon_high", 0.2, 0.28),
        ("beta", 0.0, 0.04),
        ("use_bias_correction_kl", True, False),  # the preset's KL is the plain k3
    ]
    assert "epsilon_high 0.2 -> 0.28, beta 0.0 -> 0.04, use_bias_correction_kl True" in caplog.text
    # f_grpo's loss half is TRL's default loss: nothing to change, nothing said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grouprl.integrations.trl"):
        t = make(gt.GroupRLGRPOTrainer, tmp_path, preset="f_grpo")
    assert t.grouprl_config_changes == [] and "changes the GRPOConfig" not in caplog.text


DOCS_TABLE = {
    "f_grpo": [],
    "avspo": [],
    "maxnorm_rloo": [],
    "rloo": [],
    "p90": [],
    "gdpo": [("multi_objective_aggregation", "sum_then_normalize", "normalize_then_sum")],
    "grpo": [("loss_type", "dapo", "grpo")],
    "dr_grpo": [("loss_type", "dapo", "dr_grpo")],
    "dapo": [("epsilon_high", 0.2, 0.28)],
    "cispo": [("loss_type", "dapo", "cispo"), ("epsilon_high", 0.2, 6.0)],
    "gspo": [
        ("loss_type", "dapo", "grpo"),
        ("epsilon", 0.2, 3e-4),
        ("epsilon_high", 0.2, 4e-4),
        ("importance_sampling_level", "token", "sequence"),
    ],
    "sapo": [("loss_type", "dapo", "sapo")],
    "vespo": [("loss_type", "dapo", "vespo")],
}


def test_the_docs_table_of_what_each_preset_changes(tmp_path):
    docs = (Path(__file__).parents[2] / "docs" / "integrations.md").read_text()
    docs = docs.split("### A preset changes your config, loudly")[1].split("###")[0]
    for name, want in DOCS_TABLE.items():
        t = make(gt.GroupRLGRPOTrainer, tmp_path, preset=name)
        assert t.grouprl_config_changes == want, name
        row = next(
            line for line in docs.splitlines() if line.startswith("| ") and f"`{name}`" in line
        )
        for key, _, _ in want:
            assert f"`{key}`" in row, (name, key)
        assert ("none" in row) == (not want), name


def test_a_preset_refuses_a_field_the_user_set_unless_told(tmp_path, caplog):
    mine = config(tmp_path, importance_sampling_level="sequence", loss_type="dapo")
    with pytest.raises(ValueError, match="importance_sampling_level: yours 'sequence'"):
        make(gt.GroupRLGRPOTrainer, tmp_path, args=mine, preset="cispo")
    with caplog.at_level(logging.WARNING, logger="grouprl.integrations.trl"):
        t = make(gt.GroupRLGRPOTrainer, tmp_path, args=mine, preset="cispo", override_config=True)
    assert ("importance_sampling_level", "sequence", "token") in t.grouprl_config_changes
    assert t.args.importance_sampling_level == "token"
    assert mine.importance_sampling_level == "sequence"  # the caller's config is untouched
    assert "importance_sampling_level 'sequence' -> 'token'" in caplog.text
    # a user beta the preset would change is refused too
    with pytest.raises(ValueError, match=r"beta: yours 0\.1"):
        make(gt.GroupRLGRPOTrainer, tmp_path, args=config(tmp_path, beta=0.1), preset="dapo")


def test_a_preset_that_matches_the_config_changes_nothing(tmp_path, caplog):
    mine = config(tmp_path, loss_type="grpo")
    with caplog.at_level(logging.WARNING, logger="grouprl.integrations.trl"):
        t = make(gt.GroupRLGRPOTrainer, tmp_path, args=mine, preset="grpo")
    assert t.grouprl_config_changes == [] and "changes the GRPOConfig" not in caplog.text
    assert t.args is mine


def test_no_preset_equals_trls_defaults_and_the_docs_say_so(tmp_path):
    # TRL's defaults: grpo advantages with eps 1e-4, dapo's token mean, eps 0.2 / 0.2, k3 KL with
    # the ratio correction. A preset equals them when its estimator is TRL's and its loss
    # settings leave the default config unchanged.
    defaults = config(tmp_path)
    trl_adv = gt.trl_estimator(defaults)
    equal = []
    nearest = gt.resolve_preset("f_grpo", None, {"focal_gamma": 0.0, "eps": 1e-4})
    for name, spec in [(n, presets.get(n)) for n in presets.names()] + [("nearest", nearest)]:
        settings = gt.trl_loss_settings(spec)
        if settings is None or (spec.estimator, dict(spec.estimator_params)) != trl_adv:
            continue
        if spec.focal_gamma or spec.virtual or spec.delta_res is not None:
            continue  # a transform on the advantages
        if settings["beta"] == 0.0:
            settings.pop("use_bias_correction_kl")  # unused without a KL term
        changed, _ = gt.config_changes(settings, defaults, gt.trl_default_values())
        if not changed:
            equal.append(name)
    assert equal == ["nearest"]
    docs = (Path(__file__).parents[2] / "docs" / "integrations.md").read_text()
    assert "No preset equals TRL's defaults" in docs
    assert 'preset="f_grpo", advantage_kwargs={"focal_gamma": 0.0, "eps": 1e-4}' in docs


@pytest.mark.slow
def test_f_grpo_without_focal_weight_and_with_trls_eps_is_trls_default_run(tmp_path):
    kw = {"preset": "f_grpo", "advantage_kwargs": {"focal_gamma": 0.0, "eps": 1e-4}}
    a, b = side_by_side(tmp_path, {}, ours=kw)
    assert b.grouprl_config_changes == [] and not b._grouprl_loss
    for x, y in zip(a.captured, b.captured):
        torch.testing.assert_close(y, x, atol=2e-6, rtol=1e-6)
    for x, y in zip(step_logs(a), step_logs(b)):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-7)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)


# --------------------------------------------------------------------------- TRL's signature
def test_constructor_takes_trls_positional_arguments_and_default_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, reward, data, tok = tiny_model(), RecordingReward(), dataset(), tiny_tokenizer()
    cfg = config(tmp_path)
    t = gt.GroupRLGRPOTrainer(model, reward, cfg, data, None, tok)
    assert t.args is cfg and t.train_dataset is data and t.processing_class is tok
    t = gt.GroupRLGRPOTrainer(model, reward, cfg, data, None, tok, preset="grpo")
    assert t.args.loss_type == "grpo" and cfg.loss_type == "dapo"
    # args=None: TRL's default GRPOConfig, the same fields as TRL's own trainer builds (its
    # default bf16=True is refused on a machine without bf16 support, so claim it here)
    import transformers.training_args as ta

    monkeypatch.setattr(ta, "is_torch_bf16_gpu_available", lambda: True)
    ours = gt.GroupRLGRPOTrainer(model, reward, train_dataset=data, processing_class=tok)
    theirs = GRPOTrainer(model, reward, train_dataset=data, processing_class=tok)
    assert ours.args.output_dir == theirs.args.output_dir
    assert ours.args.to_dict() == theirs.args.to_dict()
    assert ours.loss_type == "dapo" and ours.grouprl_mode == "trl"


def test_bad_grouprl_keywords_are_named(tmp_path):
    with pytest.raises(ValueError, match="at most one of preset="):
        make(gt.GroupRLGRPOTrainer, tmp_path, preset="grpo", estimator="rloo")
    with pytest.raises(ValueError, match="advantage_kwargs= changes a grouprl estimator"):
        make(gt.GroupRLGRPOTrainer, tmp_path, advantage_kwargs={"eps": 1e-4})
    with pytest.raises(ValueError, match=r"delta=1\.1"):
        make(gt.GroupRLGRPOTrainer, tmp_path, args=config(tmp_path, delta=1.1), loss="grouprl")


def test_grpoconfig_is_still_trls(tmp_path):
    # the drop-in reads TRL's own GRPOConfig class, not a subclass of ours
    t = make(gt.GroupRLGRPOTrainer, tmp_path)
    assert type(t.args) is GRPOConfig
