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
    "f_grpo_baseline": ("grpo", 0.0, None, None, "ppo_clip", GRPO, TM, False, None, None, "k3", 0),
    # F-GRPO App. B describes its DAPO by the clip only: no dynamic sampling, no overlong shaping
    "f_dapo": ("grpo", 0.5, None, None, "ppo_clip", DAPO, TM, False, None, None, "k3", 0.0),
    "f_dapo_baseline": ("grpo", 0.0, None, None, "ppo_clip", DAPO, TM, False, None, None, "k3", 0),
    # [OURS] F-DAPO with full DAPO's additions, labelled
    "f_dapo_full": ("grpo", 0.5, None, None, "ppo_clip", DAPO, TM, True, "soft", None, "k3", 0.0),
    "f_dapo_full_baseline": (
        "grpo",
        0.0,
        None,
        None,
        "ppo_clip",
        DAPO,
        TM,
        True,
        "soft",
        None,
        "k3",
        0.0,
    ),
    "f_cispo": ("grpo", 0.5, None, None, "cispo", CISPO, TM, False, None, None, "k3", 0.0),
    "f_cispo_baseline": ("grpo", 0.0, None, None, "cispo", CISPO, TM, False, None, None, "k3", 0),
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
    # its fair baseline: GRPO over the same pool, drawn uniformly
    "is_grpo_baseline": ("grpo", 0, None, None, "ppo_clip", GRPO, TM, False, None, None, "k3", 0),
    # one σ: Dr.GRPO's r − r̄ times the draw's importance weight 1/(|pool|·p_x)
    "is_grpo_exact": ("dr_grpo", 0, None, None, "ppo_clip", GRPO, TM, False, None, None, "k3", 0),
    # AGPO: ε_base 0.2 (replaced per step by the controller), k1 KL β = 0.03 (§3-§4);
    # aggregation from the AGPO code (per-sequence token mean, mean over sequences)
    "agpo": ("grpo", 0.0, None, None, "ppo_clip", GRPO, SMTM, False, None, "agpo", "k1", 0.03),
    # the peers' methods, estimator / reward side (ALGORITHMS.md §3 table; reward side in REWARD_SIDE)
    "reinforce_pp_global": (
        "reinforce_pp_global",
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
    "gdpo": ("gdpo", 0.0, None, None, "ppo_clip", GRPO, TM, False, None, None, "k3", 0.0),
    "remax": ("remax", 0.0, None, None, "ppo_clip", GRPO, TM, False, None, None, "k3", 0.0),
    "opo": ("opo", 0.0, None, None, "ppo_clip", GRPO, TM, False, None, None, "k3", 0.0),
    "gpg": ("gpg", 0.0, None, None, "reinforce", (None, None), TM, False, None, None, "k3", 0.0),
    "otb": (
        "optimal_token_baseline",
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
    # the peers' methods, loss side: surrogate_params given in full where they are not clip bounds
    "sapo": (
        "grpo", 0.0, None, None, "sapo", {"tau_pos": 1.0, "tau_neg": 1.05}, SMTM, False, None,
        None, "k3", 0.0,
    ),
    "gmpo": ("grpo", 0.0, None, None, "gmpo", (0.4, 0.4), SMTM, False, None, None, "k3", 0.0),
    "vespo": (
        "grpo", 0.0, None, None, "vespo",
        {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}, TM, False, None,
        None, "k3", 0.0,
    ),
    "luspo": (
        "grpo", 0.0, None, None, "gspo", GSPO, "seq_mean_token_sum", False, None, None, "k3", 0.0,
    ),
}  # fmt: skip

# (reward_combination, reward_kl_coef, reward_kl, reward_kl_controller): ALGORITHMS.md §3-§4
REWARD_SIDE = {name: (None, 0.0, "k1", "fixed") for name in EXPECTED}
REWARD_SIDE["gdpo"] = ("normalize_then_sum", 0.0, "k1", "fixed")
REWARD_SIDE["remax"] = (None, 0.001, "k1", "fixed")  # verl's ReMax example
REWARD_SIDE["reinforce_pp_global"] = (None, 0.01, "k1", "fixed")  # OpenRLHF's defaults

# The prompt sampler of each preset (ALGORITHMS.md §1): uniform unless named here.
SAMPLER = {"is_grpo": "sigma", "is_grpo_exact": "sigma"}

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
    full = isinstance(EXPECTED[name][FIELDS.index("surrogate_params")], dict)
    got = tuple(
        (
            dict(p.surrogate_params)
            if full
            else (p.surrogate_params.get("eps_low"), p.surrogate_params.get("eps_high"))
        )
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
SCHEDULES.update({n: (4, 1) for n in EXPECTED if n.startswith("f_")})
SCHEDULES["agpo"] = (1, 4)
SCHEDULES.update({"gdpo": (4, 1), "remax": (4, 1), "gpg": (4, 1)})  # 512/128, 512/128, 1024/256
# GMPO's authors' script (1,024 samples / 128 per step); SAPO, VESPO, LUSPO [OURS]: GSPO's four
SCHEDULES.update({"gmpo": (8, 1), "sapo": (4, 1), "vespo": (4, 1), "luspo": (4, 1)})


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


FOCAL = ("f_grpo", "f_dapo", "f_dapo_full", "f_cispo")


@pytest.mark.parametrize("name", FOCAL)
def test_each_f_preset_has_a_baseline_equal_in_every_field_but_gamma(name):
    # F-GRPO App. L.2: the GRPO, DAPO and CISPO baselines run the same schedule, token mean
    # and no KL as their focal variants, so the fair comparison changes γ and nothing else.
    p, b = presets.get(name), presets.baseline_of(name)
    assert b is presets.get(name + "_baseline") and b.name == name + "_baseline"
    assert p.focal_gamma > 0 and b.focal_gamma == 0.0
    differ = {
        f.name
        for f in dataclasses.fields(presets.Preset)
        if getattr(p, f.name) != getattr(b, f.name)
    }
    assert differ == {"name", "description", "focal_gamma", "sources"}
    assert {k for k in p.sources if p.sources[k] != b.sources[k]} == {"focal_gamma"}
    assert "App. L.2" in b.sources["focal_gamma"]
    assert b.advantage_kwargs() == {}  # γ = 0: no focal transform at all
    # the baseline sits right after its F-preset in the listing
    assert presets.names().index(b.name) == presets.names().index(name) + 1


def test_baseline_of_a_preset_without_focal_weight_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no fair baseline.*presets with one: f_grpo, f_dapo"):
        presets.baseline_of("grpo")
    with pytest.raises(ValueError, match="valid presets"):
        presets.baseline_of("nope")
    # every preset with a focal weight has one, and is_grpo; no other preset is *_baseline
    assert sorted(n for n in presets.names() if n.endswith("_baseline")) == sorted(
        [n + "_baseline" for n in presets.names() if presets.get(n).focal_gamma]
        + ["is_grpo_baseline"]
    )
    assert presets.baseline_of("is_grpo") is presets.get("is_grpo_baseline")


def test_f_dapo_follows_app_b_and_its_additions_are_labelled_ours():
    # F-GRPO App. B describes its DAPO by the asymmetric clip only
    p = presets.get("f_dapo")
    assert (p.dynamic_sampling, p.overlong) == (False, None)
    assert "App. B" in p.sources["dynamic_sampling"] and "App. B" in p.sources["overlong"]
    full = presets.get("f_dapo_full")
    assert (full.dynamic_sampling, full.overlong) == (True, "soft")
    assert "[OURS]" in full.sources["dynamic_sampling"] and "[OURS]" in full.sources["overlong"]
    assert "[OURS]" in full.description
    # the F-presets cite F-GRPO for β = 0 and token-mean aggregation (App. L.2)
    for name in FOCAL:
        q = presets.get(name)
        assert "App. L.2" in q.sources["beta"] and "App. L.2" in q.sources["aggregation"]


def test_is_grpo_and_its_baseline_draw_one_pool_and_the_exact_variant_weights():
    # IS-GRPO is compared with GRPO over the *same* finite pool (a preset field),
    # the baseline differing only in the sampler
    p, b, e = (presets.get(n) for n in ("is_grpo", "is_grpo_baseline", "is_grpo_exact"))
    assert p.pool_size == b.pool_size == e.pool_size == 1024
    differ = {
        f.name
        for f in dataclasses.fields(presets.Preset)
        if getattr(p, f.name) != getattr(b, f.name)
    }
    assert differ == {"name", "description", "sampler", "sources"}
    assert (e.sampler, e.sampler_weight, e.estimator) == ("sigma", True, "dr_grpo")
    assert not any(presets.get(n).sampler_weight for n in presets.names() if n != "is_grpo_exact")
    # every other preset streams fresh prompts
    assert {n for n in presets.names() if presets.get(n).pool_size} == {
        "is_grpo", "is_grpo_baseline", "is_grpo_exact",
    }  # fmt: skip
    with pytest.raises(ValueError, match="pool_size must be an integer >= 0"):
        presets.get("grpo").with_(pool_size=-1)
