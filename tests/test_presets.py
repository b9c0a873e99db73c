"""Every preset matches ALGORITHMS.md §3, cites a source per field, and runs through the axes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grouprl import advantages, losses, presets, sampling

GRPO = (0.2, 0.2)
DAPO = (0.2, 0.28)
CISPO = (1.0, 5.0)
GSPO = (3e-4, 4e-4)
TM, SMTM, SUMNORM = "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"

# Transcribed from the ALGORITHMS.md §3 preset table (and §1-§2, §4 for the parameters):
# name: (estimator, focal_gamma, delta_res, virtual, surrogate, (eps_low, eps_high),
#        aggregation, dynamic_sampling, overlong, controller, kl, beta)
EXPECTED = {
    "grpo": ("grpo", 0.0, None, None, "ppo_clip", GRPO, SMTM, False, None, None, "k3", 0.0),
    "dr_grpo": (
        "dr_grpo",
        0.0,
        None,
        None,
        "ppo_clip",
        GRPO,
        SUMNORM,
        False,
        None,
        None,
        "k3",
        0.0,
    ),
    "dapo": ("grpo", 0.0, None, None, "ppo_clip", DAPO, TM, True, "soft", None, "k3", 0.0),
    "cispo": ("grpo", 0.0, None, None, "cispo", CISPO, TM, False, None, None, "k3", 0.0),
    "gspo": ("grpo", 0.0, None, None, "gspo", GSPO, SMTM, False, None, None, "k3", 0.0),
    "rloo": ("rloo", 0.0, None, None, "ppo_clip", GRPO, TM, False, None, None, "k3", 0.0),
    "reinforce_pp": (
        "reinforce_pp",
        0.0,
        None,
        None,
        "ppo_clip",
        GRPO,
        TM,
        False,
        None,
        None,
        "k3",
        0.0,
    ),
    "f_grpo": ("grpo", 0.5, None, None, "ppo_clip", GRPO, TM, False, None, None, "k3", 0.0),
    "f_dapo": ("grpo", 0.5, None, None, "ppo_clip", DAPO, TM, True, "soft", None, "k3", 0.0),
    "f_cispo": ("grpo", 0.5, None, None, "cispo", CISPO, TM, False, None, None, "k3", 0.0),
    "avspo": ("grpo", 0.0, None, "symmetric", "ppo_clip", GRPO, TM, False, None, None, "k3", 0.0),
    "avspo_code": ("grpo", 0.0, None, "code", "ppo_clip", GRPO, TM, False, None, None, "k3", 0.0),
    "maxnorm_rloo": (
        "maxnorm_rloo",
        0.0,
        1e-2,
        None,
        "ppo_clip",
        GRPO,
        TM,
        False,
        None,
        None,
        "k3",
        0.0,
    ),
    "maxnorm_dr_grpo": (
        "maxnorm_dr_grpo",
        0.0,
        1e-2,
        None,
        "ppo_clip",
        GRPO,
        TM,
        False,
        None,
        None,
        "k3",
        0.0,
    ),
    "p90": ("p90", 0.0, None, None, "ppo_clip", GRPO, TM, False, None, None, "k3", 0.0),
    "gopo": ("gopo", 0.0, None, None, "ppo_clip", GRPO, TM, False, None, None, "k3", 0.0),
    "grpo_beta_comp": (
        "grpo_beta_comp",
        0.0,
        None,
        None,
        "ppo_clip",
        GRPO,
        TM,
        False,
        None,
        None,
        "k3",
        0.0,
    ),
    # IS-GRPO: plain GRPO advantages; its difference is the prompt sampler (SAMPLER below)
    "is_grpo": ("grpo", 0.0, None, None, "ppo_clip", GRPO, TM, False, None, None, "k3", 0.0),
    # AGPO: ε_base 0.2 (replaced per step by the controller), k1 KL β = 0.03 (§3-§4);
    # aggregation from the AGPO code (per-sequence token mean, mean over sequences)
    "agpo": ("grpo", 0.0, None, None, "ppo_clip", GRPO, SMTM, False, None, "agpo", "k1", 0.03),
}

# (reward_combination, reward_kl_coef, reward_kl, reward_kl_controller): ALGORITHMS.md §3-§4
REWARD_SIDE = {name: (None, 0.0, "k1", "fixed") for name in EXPECTED}

# The prompt sampler of each preset (ALGORITHMS.md §1): uniform unless named here.
SAMPLER = {"is_grpo": "sigma"}

FIELDS = (
    "estimator",
    "focal_gamma",
    "delta_res",
    "virtual",
    "surrogate",
    "surrogate_params",
    "aggregation",
    "dynamic_sampling",
    "overlong",
    "controller",
    "kl",
    "beta",
)


def test_every_preset_of_the_table_exists_and_nothing_else():
    assert presets.names() == list(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_preset_parameters_match_algorithms_md(name):
    p = presets.get(name)
    got = tuple(
        (p.surrogate_params.get("eps_low"), p.surrogate_params.get("eps_high"))
        if f == "surrogate_params"
        else getattr(p, f)
        for f in FIELDS
    )
    assert got == EXPECTED[name]
    assert dict(p.estimator_params) == {}
    side = (p.reward_combination, p.reward_kl_coef, p.reward_kl, p.reward_kl_controller)
    assert side == REWARD_SIDE[name]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_preset_prompt_sampler(name):
    p = presets.get(name)
    assert p.sampler == SAMPLER.get(name, "uniform")
    sampler = sampling.make(p.sampler, pool_size=16)  # every named sampler exists
    assert sampler.sample(4, torch.Generator().manual_seed(0)).shape == (4,)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_axis_field_cites_a_source(name):
    p = presets.get(name)
    axis = {f.name for f in dataclasses.fields(presets.Preset)} - {"name", "description", "sources"}
    assert set(p.sources) == axis
    assert all(isinstance(v, str) and len(v) > 3 for v in p.sources.values())
    assert p.description and "\n" not in p.description


@pytest.mark.parametrize("name", list(EXPECTED))
def test_preset_runs_through_every_axis(name):
    # advantages from the preset's estimator and transforms, then the objective it names
    p = presets.get(name)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.2, 0.9, 0.4, 0.4], [1.0, 1.0, 1.0, 1.0]])
    kwargs = p.advantage_kwargs()
    if p.virtual:
        kwargs["trigger"] = advantages.VirtualTrigger()
    g = torch.Generator().manual_seed(0)
    n, t = 12, 5
    if "baseline" in advantages.needs(p.estimator):
        kwargs["baseline"] = torch.tensor([0.5, 0.5, 1.0])  # greedy completions' rewards
    if p.token_level:  # per-token advantages: mask, KL in the reward, the OTB's inputs
        mask = torch.ones(3, 4, t, dtype=torch.bool)
        logits = torch.randn(3, 4, t, 7, generator=g)
        old_all = torch.log_softmax(logits, -1)
        old_tok, ref_tok = old_all[..., 0], old_all[..., 1]
        ctrl = p.kl_controller()
        if ctrl is not None:
            kwargs["token_rewards"], _ = advantages.kl_reward(
                old_tok, ref_tok, mask, ctrl.value, p.reward_kl
            )
        if "sum_pi_squared" in advantages.needs(p.estimator):
            kwargs.update(old_logp=old_tok, sum_pi_squared=old_all.exp().square().sum(-1))
        adv = advantages.compute_tokens(p.estimator, rewards, mask, **kwargs)
        per = adv.per_token
    else:
        lengths = torch.tensor([[3, 5, 2, 4]] * 3)
        adv = advantages.compute(p.estimator, rewards, lengths=lengths, **kwargs)
        per = adv.per_sample
    logp = (-torch.rand(n, t, generator=g)).requires_grad_()
    old = logp.detach() + 0.01 * torch.randn(n, t, generator=g)
    out = losses.objective(
        logp,
        old,
        per,
        torch.ones(n, t),
        surrogate=p.surrogate,
        surrogate_params=p.surrogate_params,
        aggregation=p.aggregation,
        keep=adv.keep.repeat_interleave(4),
        ref_logp=old,
        kl=p.kl,
        beta=p.beta,
        kl_weight=adv.kl_weight.repeat_interleave(4).float(),
    )
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logp.grad).all()
    assert logp.grad.abs().sum() > 0


def test_with_and_unknown():
    dapo = presets.get("dapo").with_(beta=0.01, surrogate_params={"eps_low": 0.1, "eps_high": 0.3})
    assert dapo.beta == 0.01 and dapo.surrogate_params["eps_high"] == 0.3
    assert presets.get("dapo").beta == 0.0  # the original is frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        presets.get("grpo").beta = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        presets.get("grpo").surrogate_params["eps_low"] = 0.5  # type: ignore[index]
    with pytest.raises(ValueError, match="valid presets: grpo, dr_grpo, dapo"):
        presets.get("ppo")
    assert presets.get("f_grpo").advantage_kwargs() == {"focal_gamma": 0.5}
    assert presets.get("maxnorm_rloo").advantage_kwargs() == {"delta_res": 1e-2}
    # the authors' AVSPO: the code rule on each group as its own generation batch
    assert presets.get("avspo_code").advantage_kwargs() == {
        "virtual": "code",
        "virtual_batch_groups": 1,
    }


# The update schedule of each preset, transcribed from the ALGORITHMS.md §3 "Update schedule"
# table: (minibatches per generation batch, ppo_epochs). The sources: DAPO §4.1 (512 prompts,
# mini-batch 32 prompts -> 16), MiniMax-M1 §3.1 (16 off-policy updates per generation batch),
# GSPO §5.1 (four minibatches), F-GRPO Table 5 (batch 256 / mini-batch 64 -> 4 for F-GRPO,
# F-DAPO, F-CISPO), AGPO's code (agpo_update_epochs = 4, one step per epoch), DeepSeekMath §4.2
# and the ACR script (one update per batch).
SCHEDULES = {name: (1, 1) for name in EXPECTED}
SCHEDULES.update({"dapo": (16, 1), "cispo": (16, 1), "gspo": (4, 1)})
SCHEDULES.update({"f_grpo": (4, 1), "f_dapo": (4, 1), "f_cispo": (4, 1)})
SCHEDULES["agpo"] = (1, 4)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_preset_update_schedule_matches_algorithms_md(name):
    p = presets.get(name)
    assert (p.minibatches, p.ppo_epochs) == SCHEDULES[name]
    assert p.optimizer_steps == SCHEDULES[name][0] * SCHEDULES[name][1]
    # a schedule that is not the source's own says so ([OURS]); a sourced one cites a place
    for key in ("minibatches", "ppo_epochs"):
        src = p.sources[key]
        assert "[OURS]" in src or any(
            m in src for m in (".sh:", ".py:", ".yaml:", ".md:", "§", "App. ")
        )


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_preset_schedule_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="minibatches must be an integer >= 1"):
        presets.get("dapo").with_(minibatches=bad)
    with pytest.raises(ValueError, match="ppo_epochs must be an integer >= 1"):
        presets.get("agpo").with_(ppo_epochs=bad)
