"""grouprl inside TRL's GRPOTrainer: a tiny Llama built from a config, a tokenizer made here.

The runs are 3 optimizer steps on CPU. What is checked is numbers: the advantages TRL trains on
are exactly ``advantages.compute`` on the rewards the reward function returned; TRL's metrics
are still logged next to ours; our loss path equals TRL's where both express the same loss.
"""

import json
import os
import warnings

import pytest
import torch

pytestmark = pytest.mark.peer

os.environ["HF_HUB_OFFLINE"] = "1"
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("trl")
from tiny_lm import tiny_model, tiny_tokenizer  # noqa: E402
from trl_doubles import RecordingReward, config, dataset, run  # noqa: E402

from grouprl import advantages, presets  # noqa: E402
from grouprl.integrations import trl as gt  # noqa: E402

TRL_KEYS = (
    "loss",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "entropy",
    "clip_ratio/region_mean",
)
OUR_KEYS = (
    "grouprl/acr/rate",
    "grouprl/acr/all_wrong",
    "grouprl/scale/inv_p95",
    "grouprl/tailmiss/risk",
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "estimator", "kwargs"),
    [
        ({"estimator": "rloo"}, "rloo", {}),
        ({"preset": "f_grpo"}, "grpo", {"focal_gamma": 0.5}),
        ({"preset": "maxnorm_rloo"}, "maxnorm_rloo", {"delta_res": 0.01}),
    ],
)
def test_trl_trains_on_grouprl_advantages(tmp_path, spec, estimator, kwargs):
    trainer, reward = run(tmp_path, reward=RecordingReward(nan_every=5), **spec)
    assert trainer.state.global_step == 3
    assert len(trainer.produced) == 3 == len(reward.calls)
    for (grid, adv, _), returned in zip(trainer.produced, reward.calls):
        # the [P, G] grid is what the reward function returned (None -> NaN), prompt-major
        want_grid = torch.tensor([float("nan") if r is None else r for r in returned]).view(-1, 4)
        torch.testing.assert_close(grid, want_grid, equal_nan=True)
        want = advantages.compute(estimator, want_grid, **kwargs).values.reshape(-1)
        torch.testing.assert_close(adv, want, atol=1e-6, rtol=1e-6)
        assert torch.isnan(want_grid).any()  # the NaN path was exercised
    assert any(a.abs().sum() > 0 for _, a, _ in trainer.produced)
    # what the loss consumed is the produced advantages (TRL shuffles rows, so compare sorted)
    consumed = torch.sort(torch.cat(trainer.consumed)).values
    produced = torch.sort(torch.cat([a for _, a, _ in trainer.produced])).values
    torch.testing.assert_close(consumed, produced)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    for h in logs:
        for key in TRL_KEYS + OUR_KEYS:
            assert key in h, key
    # our ACR equals the collapsed share of the groups actually produced
    for h, (grid, _, out) in zip(logs, trainer.produced):
        assert h["grouprl/acr/groups"] == grid.shape[0] == 2
        assert h["grouprl/adv/updated_frac"] == pytest.approx(float(out.updated.float().mean()))


def test_trl_loss_settings_map_presets_onto_trl():
    s = gt.trl_loss_settings
    assert s(presets.get("grpo")) == {
        "loss_type": "grpo",
        "epsilon": 0.2,
        "epsilon_high": 0.2,
        "importance_sampling_level": "token",
        "delta": None,
        "beta": 0.0,
        "use_bias_correction_kl": False,  # the preset's KL is the plain k3 (TRL default: True)
    }
    # SAPO, VESPO, LUSPO, BNPO and the dual clip have TRL knobs; GMPO, Clip-Cov,
    # KL-Cov, DPPO and DRO run through grouprl's loss
    sapo = s(presets.get("sapo"))
    assert sapo["loss_type"] == "sapo" and sapo["sapo_temperature_neg"] == 1.05
    seq_sapo = presets.get("sapo").with_(surrogate_params={"tau_pos": 1.0, "level": "sequence"})
    assert s(seq_sapo)["importance_sampling_level"] == "sequence"
    assert s(presets.get("sapo").with_(aggregation="token_mean")) is None  # TRL: grpo's mean
    vespo = s(presets.get("vespo"))
    assert vespo["loss_type"] == "vespo" and vespo["vespo_k_neg"] == 3.0
    luspo = s(presets.get("luspo"))
    assert (luspo["loss_type"], luspo["importance_sampling_level"]) == ("luspo", "sequence")
    assert s(presets.get("dapo").with_(aggregation="micro_token_mean"))["loss_type"] == "bnpo"
    dual = {"eps_low": 0.2, "eps_high": 0.28, "clip_ratio_c": 3.0}
    assert s(presets.get("dapo").with_(surrogate_params=dual))["delta"] == 3.0
    dual["clip_ratio_c"] = 1.1  # below 1 + eps_high TRL's delta is another loss
    assert s(presets.get("dapo").with_(surrogate_params=dual)) is None
    for name in ("gmpo", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "dro"):
        assert s(presets.get("grpo").with_(surrogate=name, surrogate_params={})) is None
    assert s(presets.get("dapo").with_(aggregation="token_sum")) is None
    assert s(presets.get("f_grpo"))["loss_type"] == "dapo"
    assert s(presets.get("dapo"))["epsilon_high"] == 0.28
    assert s(presets.get("dr_grpo"))["loss_type"] == "dr_grpo"
    cispo = s(presets.get("cispo"))
    assert cispo["loss_type"] == "cispo" and cispo["epsilon_high"] == 6.0  # TRL: absolute bound
    gspo = s(presets.get("gspo"))
    assert gspo["importance_sampling_level"] == "sequence" and gspo["epsilon"] == 3e-4
    assert s(presets.get("agpo")) is None  # k1 KL with beta > 0
    assert s(presets.get("grpo").with_(surrogate="reinforce", surrogate_params={})) is None
    assert s(presets.get("cispo").with_(surrogate_params={"eps_low": 0.2, "eps_high": 5.0})) is None
    assert not gt._needs_grouprl_loss(presets.get("f_grpo"))
    assert gt._needs_grouprl_loss(presets.get("grpo_beta_comp").with_(beta=0.04))
    assert gt._needs_grouprl_loss(presets.get("maxnorm_rloo").with_(beta=0.04))


def test_combine_rewards_is_trls_sum_then_normalize_rule():
    # weights (1, 0.5): row 0 = 1 + 0.5*2; row 1: one None -> nansum keeps 3; row 2: all None -> NaN
    r = torch.tensor([[1.0, 2.0], [3.0, float("nan")], [float("nan"), float("nan")]])
    got = gt.combine_rewards(r, torch.tensor([1.0, 0.5]))
    torch.testing.assert_close(got, torch.tensor([2.0, 3.0, float("nan")]), equal_nan=True)


def test_resolve_preset_and_bad_arguments():
    assert gt.resolve_preset(None, "p90").estimator == "p90"
    spec = gt.resolve_preset("f_grpo", None, {"focal_gamma": 1.0, "eps": 1e-4})
    assert spec.focal_gamma == 1.0 and dict(spec.estimator_params) == {"eps": 1e-4}
    with pytest.raises(ValueError, match="exactly one"):
        gt.resolve_preset("f_grpo", "grpo")
    with pytest.raises(ValueError, match="valid estimators"):
        gt.resolve_preset(None, "grpoo")
    with pytest.raises(ValueError, match="valid presets"):
        gt.resolve_preset("fgrpo", None)


def test_trainer_rejects_what_it_cannot_run(tmp_path):
    common = dict(
        model=tiny_model(),
        reward_funcs=RecordingReward(),
        args=config(tmp_path),
        train_dataset=dataset(),
        processing_class=tiny_tokenizer(),
    )
    with pytest.raises(ValueError, match="controller"):
        gt.GroupRLGRPOTrainer(preset="agpo", **common)
    with pytest.raises(ValueError, match="'sigma' sampler"):  # IS-GRPO needs its prompt sampler
        gt.GroupRLGRPOTrainer(preset="is_grpo", **common)
    with pytest.raises(ValueError, match="unknown parameter"):
        gt.GroupRLGRPOTrainer(estimator="grpo", advantage_kwargs={"gamma": 1.0}, **common)
    with pytest.raises(ValueError, match="loss must be"):
        gt.GroupRLGRPOTrainer(preset="grpo", loss="ours", **common)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "targs"),
    [
        ({"preset": "grpo"}, {}),
        ({"preset": "sapo"}, {}),  # TRL's sapo vs grouprl's, on TRL's tensors
        ({"preset": "vespo"}, {}),
        ({"preset": "luspo"}, {}),
        # TRL's token mask and its ratio-weighted k3 KL (use_bias_correction_kl) on both paths
        (
            {"estimator": "grpo"},
            {"loss_type": "grpo", "beta": 0.04, "top_entropy_quantile": 0.5},
        ),
    ],
    ids=["grpo", "sapo", "vespo", "luspo", "kl+entropy_mask"],
)
def test_grouprl_loss_path_equals_trls_loss(tmp_path, spec, targs):
    # The same loss through TRL's code (the preset's knobs set by trl_loss_settings) and through
    # grouprl's objective: same seed, same generations, so the two paths must give the same
    # losses and gradient norms. gradient_accumulation_steps=2 checks that the StepTotals
    # follow TRL's normalisers.
    kw = dict(gradient_accumulation_steps=2, per_device_train_batch_size=4, num_iterations=2)
    model = None
    if targs.get("beta"):  # TRL builds its reference model from a model folder
        model = str(tmp_path / "model")
        tiny_model().save_pretrained(model)
    a, _ = run(
        tmp_path / "trl",
        trainer_cls=gt.GroupRLGRPOTrainer,
        loss="trl",
        model=model,
        args=config(tmp_path / "trl", **kw, **targs),
        **spec,
    )
    b, _ = run(
        tmp_path / "ours",
        trainer_cls=gt.GroupRLGRPOTrainer,
        loss="grouprl",
        model=model,
        args=config(tmp_path / "ours", **kw, **targs),
        **spec,
    )
    assert not a._grouprl_loss and b._grouprl_loss
    la = [h for h in a.state.log_history if "loss" in h]
    lb = [h for h in b.state.log_history if "loss" in h]
    assert len(la) == len(lb) == 3
    for x, y in zip(la, lb):
        assert y.get("reward") == x.get("reward")  # logged on generation steps only
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4, abs=1e-7)
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-7)
        assert y["entropy"] == pytest.approx(x["entropy"], rel=1e-5)
        assert "grouprl/loss/pg_loss" in y
    assert any(abs(h["loss"]) > 1e-3 for h in la)  # an off-policy step with a real loss value


@pytest.mark.slow
def test_avspo_trigger_advances_and_is_saved_with_the_checkpoint(tmp_path):
    args = config(tmp_path, save_strategy="steps", save_steps=3)
    trainer, _ = run(tmp_path, preset="avspo", args=args)
    trig = trainer.grouprl_trigger
    assert trig.steps == 3  # one update per generation batch
    # the trigger state that produced step k's advantages: replaying compute with a fresh
    # trigger over the recorded grids reproduces every advantage TRL trained on
    replay = advantages.VirtualTrigger()
    for grid, adv, _ in trainer.produced:
        want = advantages.compute("grpo", grid, virtual="symmetric", trigger=replay).values
        torch.testing.assert_close(adv, want.reshape(-1), atol=1e-6, rtol=1e-6)
    assert replay.state_dict() == trig.state_dict()
    path = tmp_path / "checkpoint-3" / gt.STATE_FILE
    state = json.loads(path.read_text())
    assert state["trigger"] == trig.state_dict()
    assert state["callback"]["health"] == trainer.grouprl_callback.health.state_dict()
    fresh = gt.GroupRLGRPOTrainer(
        preset="avspo",
        model=tiny_model(),
        reward_funcs=RecordingReward(),
        args=config(tmp_path),
        train_dataset=dataset(),
        processing_class=tiny_tokenizer(),
    )
    assert fresh.grouprl_trigger.steps == 0
    fresh.create_optimizer_and_scheduler(num_training_steps=3)
    fresh._load_optimizer_and_scheduler(str(tmp_path / "checkpoint-3"))
    assert fresh.grouprl_trigger.state_dict() == trig.state_dict()


def test_diagnostics_callback_metrics_hand_case():
    # 3 groups of 4 in [0, 1]: all-correct, all-wrong, mixed (mu = 0.5)
    r = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    out = advantages.compute("grpo", r)
    cb = gt.GroupRLDiagnosticsCallback()
    m = cb.observe(r, out)
    assert m["acr/rate"] == pytest.approx(2 / 3)
    assert m["acr/all_correct"] == pytest.approx(1 / 3) and m["acr/all_wrong"] == pytest.approx(
        1 / 3
    )
    # tail-miss (rho = 0.1): mu=1 -> (0.9^4 - 0.9^4 - 0) = 0; mu=0 -> 1 - 1 = 0 (tau = 0);
    # mu=0.5, tau=0.05 -> 0.95^4 - 0.45^4 - 0.5^4 = 0.711 (ALGORITHMS.md check value)
    assert m["tailmiss/risk"] == pytest.approx((0.95**4 - 0.45**4 - 0.5**4) / 3, abs=1e-9)
    assert m["tailmiss/p_active"] == pytest.approx((1 - 2 * 0.5**4) / 3, abs=1e-9)
    assert m["scale/inv_p95"] > 0


@pytest.mark.slow
def test_per_group_kl_weight_reaches_the_kl_branch(tmp_path):
    # grpo_beta_comp with beta > 0: TRL's loss has no per-group KL weight, so ours runs, and
    # each row carries kl_weight = 1 / (sigma_q + eps) of its group through TRL's shuffle/split
    folder = tmp_path / "model"
    tiny_model().save_pretrained(folder)
    spec = presets.get("grpo_beta_comp").with_(beta=0.04)
    trainer, _ = run(
        tmp_path, model=str(folder), preset=spec, args=config(tmp_path, num_iterations=2)
    )
    assert trainer._grouprl_loss and trainer.beta == 0.04 and trainer.ref_model is not None
    # num_iterations=2: generation 1 is trained on at steps 1 and 2, generation 2 at step 3
    gens = [out.kl_weight.repeat_interleave(4) for _, _, out in trainer.produced]
    assert len(gens) == 2 and len(trainer.kl_weights) == 3
    for consumed, produced in zip(trainer.kl_weights, [gens[0], gens[0], gens[1]]):
        torch.testing.assert_close(torch.sort(consumed).values, torch.sort(produced).values)
    assert (
        torch.cat(gens) > 1
    ).any()  # sigma < 1: the KL branch is up-weighted like the reward branch
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all("kl" in h and "grouprl/loss/kl_loss" in h for h in logs)
    assert max(h["kl"] for h in logs) > 0  # the policy moved away from the reference


def test_schedule_note_says_which_grpoconfig_runs_the_presets_schedule():
    from types import SimpleNamespace

    # TRL: minibatches = steps_per_generation / gradient_accumulation_steps, epochs =
    # num_iterations; its defaults (steps_per_generation = accumulation, 1 iteration) are 1 x 1
    default = SimpleNamespace(
        gradient_accumulation_steps=2, steps_per_generation=2, num_iterations=1
    )
    assert gt.trl_schedule(default) == (1, 1)
    assert gt.schedule_note(presets.get("grpo"), default) is None  # GRPO's own 1 x 1
    note = gt.schedule_note(presets.get("dapo"), default)  # DAPO's sources: 16 x 1
    assert "16 minibatch(es) x 1 epoch(s)" in note and "runs 1 x 1" in note
    assert "steps_per_generation=32, num_iterations=1" in note
    fixed = SimpleNamespace(
        gradient_accumulation_steps=2, steps_per_generation=32, num_iterations=1
    )
    assert (
        gt.trl_schedule(fixed) == (16, 1) and gt.schedule_note(presets.get("dapo"), fixed) is None
    )
    agpo = SimpleNamespace(gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=4)
    assert gt.schedule_note(presets.get("agpo"), agpo) is None  # AGPO's 1 x 4


def test_trainer_warns_when_its_schedule_is_not_the_presets(tmp_path, caplog):
    common = dict(
        model=tiny_model(),
        reward_funcs=RecordingReward(),
        args=config(tmp_path),
        train_dataset=dataset(),
        processing_class=tiny_tokenizer(),
    )
    with caplog.at_level("WARNING", logger="grouprl.integrations.trl"):
        t = gt.GroupRLGRPOTrainer(preset="gspo", **common)
    assert t.grouprl_schedule_note is not None and "4 minibatch(es)" in t.grouprl_schedule_note
    assert t.grouprl_schedule_note in caplog.text
