"""grouprl inside verl: registry names, the flat -> [P, G] adapter, parity with verl's own code.

Every estimator is called through verl's real ``compute_advantage`` (ray_trainer) with a
DataProto, as verl's trainer calls it, and compared with ``advantages.compute`` on a grid
built by a plain Python loop in the test.
"""

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.peer

with warnings.catch_warnings():  # verl warns about missing GPUs / engines at import
    warnings.simplefilter("ignore")
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    ray_trainer = pytest.importorskip("verl.trainer.ppo.ray_trainer")
from omegaconf import OmegaConf  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

from grouprl import advantages, losses  # noqa: E402
from grouprl.integrations import verl as gv  # noqa: E402

T = 5
VERL_VERSION = tuple(int(x) for x in __import__("verl").__version__.split(".")[:2])


def ragged_batch(seed, sizes=(1, 2, 3, 4, 5, 8, 8, 6, 1, 3), nan=False, values=None):
    """A verl-style flat batch: groups of the given sizes, samples shuffled across the batch.

    Returns (token_level_rewards [N, T], response_mask [N, T], uid object array [N], scores [N]).
    The score sits on the last valid token, as verl's reward managers put it.
    """
    rng = np.random.default_rng(seed)
    uids = np.concatenate([[f"uid-{k}"] * s for k, s in enumerate(sizes)])
    n = len(uids)
    if values is None:
        scores = np.where(rng.random(n) < 0.5, rng.integers(0, 2, n), rng.random(n))
    else:
        scores = rng.choice(values, n)
    if nan:
        scores[rng.random(n) < 0.1] = np.nan
    perm = rng.permutation(n)  # non-contiguous groups
    uids, scores = uids[perm].astype(object), scores[perm]
    lengths = rng.integers(1, T + 1, n)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    tlr = np.zeros((n, T), np.float32)
    tlr[np.arange(n), lengths - 1] = scores
    return torch.tensor(tlr), torch.tensor(mask), uids, torch.tensor(scores, dtype=torch.float32)


def loop_reference(name, scores, uids, mask, singleton="zero", baseline=None, **kwargs):
    """Plain-loop reference: group by uid in first-seen order, NaN-pad, compute, scatter back.

    ``baseline [N]`` (remax: verl's per-sample reward_baselines); a token-level estimator
    runs on the grid of verl's token rewards (the score on the last valid token).
    """
    order, members = [], {}
    for i, u in enumerate(uids):
        if u not in members:
            members[u] = []
            order.append(u)
        members[u].append(i)
    width = max(len(v) for v in members.values())
    grid = torch.full((len(order), width), float("nan"))
    for p, u in enumerate(order):
        for g, i in enumerate(members[u]):
            grid[p, g] = scores[i]
    lengths = torch.zeros(grid.shape)
    tok_mask = torch.zeros(*grid.shape, mask.shape[1], dtype=torch.bool)
    base = torch.zeros(grid.shape[0])
    for p, u in enumerate(order):
        for g, i in enumerate(members[u]):
            lengths[p, g] = mask[i].sum()
            tok_mask[p, g] = mask[i] > 0
            base[p] = float("nan") if baseline is None else baseline[i]
    if name in advantages.TOKEN_ESTIMATORS:
        rewards = torch.where(torch.isnan(grid), grid, torch.zeros_like(grid))
        dense = advantages.tokens.outcome_to_tokens(grid, tok_mask)
        kwargs.setdefault("gamma", 1.0) if name == "reinforce_pp_global" else None
        tok = advantages.compute_tokens(name, rewards, tok_mask, token_rewards=dense, **kwargs)
        out_tok = tok.token_values
        flat_tok = torch.zeros(len(uids), mask.shape[1])
        for p, u in enumerate(order):
            for g, i in enumerate(members[u]):
                flat_tok[i] = out_tok[p, g]
        return flat_tok * mask
    extra = {"lengths": lengths} if "lengths" in advantages.needs(name, **kwargs) else {}
    if name == "remax":
        extra = {"baseline": base}
    out = advantages.compute(name, grid, **extra, **kwargs).values
    flat = torch.zeros(len(uids))
    for p, u in enumerate(order):
        for g, i in enumerate(members[u]):
            flat[i] = out[p, g]
            if singleton == "verl" and len(members[u]) == 1 and not torch.isnan(scores[i]):
                eps = kwargs.get("eps", 1e-6) if name in ("grpo", "grpo_beta_comp") else 0.0
                flat[i] = scores[i] / (1.0 + eps)
    return flat[:, None] * mask


def via_compute_advantage(estimator, tlr, mask, uids, grouprl_options=None, tensors=None, **algo):
    data = DataProto.from_dict(
        tensors={
            "token_level_rewards": tlr.clone(),
            "response_mask": mask.clone(),
            **(tensors or {}),
        },
        non_tensors={"uid": uids},
    )
    cfg = OmegaConf.create({"adv_estimator": estimator, **algo})
    if grouprl_options is not None:
        cfg.grouprl = grouprl_options
    out = ray_trainer.compute_advantage(data, adv_estimator=estimator, config=cfg, **algo)
    return out.batch["advantages"], out.batch["returns"]


# --------------------------------------------------------------------------- registration
def test_every_estimator_and_surrogate_is_registered():
    for name in advantages.token_names():
        fn = core_algos.get_adv_estimator_fn(f"grouprl_{name}")
        assert fn._grouprl_estimator == name
        assert fn.__doc__.startswith(f"grouprl {name} in verl: ")
    for name in losses.SURROGATES:
        assert core_algos.get_policy_loss_fn(f"grouprl_{name}")._grouprl_surrogate == name
    assert gv.register() == gv.REGISTERED  # idempotent: re-registering our own names is fine


def test_register_refuses_to_shadow_a_foreign_entry(monkeypatch):
    monkeypatch.setitem(core_algos.ADV_ESTIMATOR_REGISTRY, "grouprl_grpo", lambda **kw: None)
    with pytest.raises(ValueError, match="not grouprl's"):
        gv.register()


@pytest.mark.slow
def test_verl_use_external_modules_registers_in_a_fresh_process():
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "grouprl.integrations.verl"}
    code = (
        "import warnings; warnings.filterwarnings('ignore'); import verl\n"
        "from verl.trainer.ppo import core_algos as c\n"
        "print(sorted(k for k in c.ADV_ESTIMATOR_REGISTRY if k.startswith('grouprl_')))\n"
        "print(sorted(k for k in c.POLICY_LOSS_REGISTRY if k.startswith('grouprl_')))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()[-2:]
    assert lines[0] == str(sorted(f"grouprl_{n}" for n in advantages.token_names()))
    assert lines[1] == str(sorted(f"grouprl_{n}" for n in losses.SURROGATES))


# --------------------------------------------------------------------------- TRL next to verl
def test_trl_probe_asks_for_the_value_head_class(monkeypatch):
    # importing grouprl.integrations.verl (above) replaced verl's probe in every module holding it
    import verl.models.transformers.monkey_patch as mp
    import verl.utils.import_utils as iu
    import verl.utils.model as vm

    assert mp.is_trl_available is iu.is_trl_available is vm.is_trl_available
    assert iu.is_trl_available._grouprl_probe and gv.fix_trl_probe() is False  # idempotent
    fake = type(sys)("trl.experimental.ppo")
    monkeypatch.setitem(sys.modules, "trl.experimental.ppo", fake)
    assert gv.trl_value_head_available() is False  # the module without the class
    fake.AutoModelForCausalLMWithValueHead = object
    assert gv.trl_value_head_available() is True  # a TRL that has it (verl's own pin, 0.27)


PATCH_A_MODEL = (
    "import importlib.util, sys, warnings; warnings.filterwarnings('ignore')\n"
    "sys.path.insert(0, {here!r})\n"
    "import verl  # its verl.plugins entry point loads grouprl.integrations.verl\n"
    "import verl.models.transformers.monkey_patch as mp\n"
    "from tiny_lm import tiny_model\n"
    "mp.apply_monkey_patch(model=tiny_model(), use_remove_padding=False)\n"
    "print('PATCHED')\n"
    "# verl's own probe (verl/utils/import_utils.py is_trl_available): a package named trl exists\n"
    "mp.is_trl_available = lambda: importlib.util.find_spec('trl') is not None\n"
    "try:\n"
    "    mp.apply_monkey_patch(model=tiny_model(), use_remove_padding=False)\n"
    "except ImportError as err:\n"
    "    print('WITHOUT GROUPRL:', err)\n"
)


@pytest.mark.slow
def test_verl_builds_its_model_patch_next_to_trl_1x():
    """verl's ``apply_monkey_patch`` (what building the FSDP actor runs) with TRL 1.x installed,
    in a fresh process where ``import verl`` loaded grouprl through the entry point, as
    ``pip install grouprl`` next to verl gives it: it runs; with verl's own probe put back it
    fails on ``from trl import AutoModelForCausalLMWithValueHead``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("trl")
    if gv.trl_value_head_available():
        pytest.skip("the installed TRL still has AutoModelForCausalLMWithValueHead: no conflict")
    from importlib.metadata import entry_points

    assert "grouprl" in {ep.name for ep in entry_points(group="verl.plugins")}
    code = PATCH_A_MODEL.format(here=str(os.path.dirname(__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "PATCHED" in res.stdout
    want = "WITHOUT GROUPRL: cannot import name 'AutoModelForCausalLMWithValueHead'"
    assert want in res.stdout


# --------------------------------------------------------------------------- the layout
def test_group_layout_hand_case():
    # uids b a b c a b -> groups {b: rows 0 2 5, a: rows 1 4, c: row 3}; columns = rank within
    # the group in batch order; group ids are dense, in no promised order
    layout = gv.group_layout(np.array(list("babcab"), dtype=object), 6)
    gid = {u: int(layout.group[i]) for i, u in enumerate("babcab")}
    assert sorted(gid.values()) == [0, 1, 2]
    assert layout.pos.tolist() == [0, 0, 1, 0, 1, 2]
    assert layout.counts[gid["a"]] == 2 and layout.counts[gid["b"]] == 3
    assert layout.counts[gid["c"]] == 1 and layout.width == 3
    grid = layout.to_grid(torch.arange(6.0))
    nan = float("nan")
    torch.testing.assert_close(grid[gid["a"]], torch.tensor([1.0, 4.0, nan]), equal_nan=True)
    torch.testing.assert_close(grid[gid["b"]], torch.tensor([0.0, 2.0, 5.0]))
    torch.testing.assert_close(grid[gid["c"]], torch.tensor([3.0, nan, nan]), equal_nan=True)
    torch.testing.assert_close(layout.to_flat(grid), torch.arange(6.0))
    assert not layout.dense


def test_verls_repeat_interleave_layout_is_dense_and_equals_the_general_path():
    # verl: batch.repeat(n, interleave=True) -> each uid G times in a run: the grid is a view
    rng = np.random.default_rng(0)
    p, g = 6, 4
    uids = np.repeat(np.array([f"{rng.random()}" for _ in range(p)], dtype=object), g)
    scores = torch.tensor(rng.integers(0, 2, p * g), dtype=torch.float32)
    mask = torch.ones(p * g, T)
    tlr = torch.zeros(p * g, T)
    tlr[:, -1] = scores
    layout = gv.group_layout(uids, p * g)
    assert layout.dense and layout.width == g
    for name in ("grpo", "maxnorm_rloo", "reinforce_pp"):
        adv, _ = via_compute_advantage(f"grouprl_{name}", tlr, mask, uids)
        want = advantages.compute(name, scores.view(p, g)).values.reshape(-1)
        torch.testing.assert_close(adv, want[:, None] * mask, atol=1e-6, rtol=1e-6)
    # ragged runs in group order take the no-sort path but are not dense
    ragged = gv.group_layout(np.array(list("aabbbc"), dtype=object), 6)
    assert not ragged.dense and ragged.pos.tolist() == [0, 1, 0, 1, 2, 0]


@pytest.mark.parametrize("index_kind", ["str", "str_runs", "unicode", "int", "tensor"])
def test_group_layout_round_trip_any_index_type(index_kind):
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 50, 400)
    if index_kind == "str_runs":  # verl's layout: each uid repeated in a run, one uid twice
        raw = np.concatenate([np.repeat(rng.permutation(50), 7), np.repeat([3], 50)])
    index = {
        "str": np.array([f"u{x}" for x in raw], dtype=object),
        "str_runs": np.array([f"u{x}" for x in raw], dtype=object),
        "unicode": np.array([f"u{x}" for x in raw]),
        "int": raw,
        "tensor": torch.tensor(raw),
    }[index_kind]
    layout = gv.group_layout(index, len(raw))
    x = torch.tensor(rng.random(len(raw)), dtype=torch.float32)
    torch.testing.assert_close(layout.to_flat(layout.to_grid(x)), x)
    # every row of the grid holds exactly one uid's samples, all of them
    assert layout.num_groups == len(np.unique(raw))
    group = layout.group.numpy()
    for i in range(0, len(raw), 7):
        same = raw == raw[i]
        assert (group[same] == group[i]).all() and (group[~same] != group[i]).all()
        assert int(layout.counts[group[i]]) == int(same.sum())


def test_group_layout_rejects_bad_index():
    with pytest.raises(ValueError, match="index has 3 entries"):
        gv.group_layout(np.array(["a", "b", "c"], dtype=object), 4)
    with pytest.raises(ValueError, match="1-D"):
        gv.group_layout(np.zeros((2, 2)), 4)


# --------------------------------------------------------------------------- estimator parity
OTB = ("optimal_token_baseline", "tir_optimal_token_baseline")


@pytest.mark.parametrize("name", [n for n in advantages.token_names() if n not in OTB])
def test_every_estimator_through_compute_advantage_equals_ours(name):
    tlr, mask, uids, scores = ragged_batch(seed=advantages.token_names().index(name), nan=True)
    extra, baseline = {}, None
    if name == "remax":  # verl repeats each prompt's greedy reward over its samples
        by_uid = {u: float(i % 3) / 2 for i, u in enumerate(dict.fromkeys(uids))}
        baseline = torch.tensor([by_uid[u] for u in uids])
        extra = {"reward_baselines": baseline}
    adv, ret = via_compute_advantage(f"grouprl_{name}", tlr, mask, uids, tensors=extra)
    want = loop_reference(name, scores, uids, mask, baseline=baseline)
    torch.testing.assert_close(adv, want, atol=1e-6, rtol=1e-6)
    if name not in ("reinforce_pp_global", "remax"):  # verl's return (scores, scores)
        assert torch.equal(adv, ret)  # the two return-to-go ones: test_verl_conventions.py
    assert (adv[mask == 0] == 0).all()


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("grpo", {"focal_gamma": 0.5}),
        ("maxnorm_rloo", {"delta_res": 0.01}),
        ("grpo", {"virtual": "symmetric", "singleton": "verl"}),
        ("rloo", {"reward_range": [0.0, 2.0], "focal_gamma": 1.0}),
        ("grpo", {"eps": 1e-4, "ddof": 0}),
    ],
)
def test_options_come_from_the_algorithm_config(name, options):
    tlr, mask, uids, scores = ragged_batch(seed=11, values=[0.0, 1.0])
    adv, _ = via_compute_advantage(f"grouprl_{name}", tlr, mask, uids, options)
    kwargs = {k: v for k, v in options.items() if k != "singleton"}
    if "reward_range" in kwargs:
        kwargs["reward_range"] = tuple(kwargs["reward_range"])
    if "virtual" in kwargs:
        kwargs["trigger"] = advantages.VirtualTrigger()  # a fresh trigger, as the adapter's
        gv._TRIGGERS.pop(name, None)
    want = loop_reference(name, scores, uids, mask, options.get("singleton", "zero"), **kwargs)
    torch.testing.assert_close(adv, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("preset", "estimator", "kwargs"),
    [
        ("f_grpo", "grpo", {"focal_gamma": 0.5}),
        ("maxnorm_rloo", "maxnorm_rloo", {"delta_res": 0.01}),
    ],
)
def test_preset_option_applies_the_advantage_half(preset, estimator, kwargs):
    tlr, mask, uids, scores = ragged_batch(seed=5)
    adv, _ = via_compute_advantage(f"grouprl_{estimator}", tlr, mask, uids, {"preset": preset})
    torch.testing.assert_close(
        adv, loop_reference(estimator, scores, uids, mask, **kwargs), atol=1e-6, rtol=1e-6
    )


def test_bad_options_fail_loudly():
    tlr, mask, uids, _ = ragged_batch(seed=1)
    with pytest.raises(ValueError, match="adv_estimator=grouprl_maxnorm_rloo"):
        via_compute_advantage("grouprl_grpo", tlr, mask, uids, {"preset": "maxnorm_rloo"})
    with pytest.raises(ValueError, match="'sigma' sampler"):  # IS-GRPO needs its prompt sampler
        via_compute_advantage("grouprl_grpo", tlr, mask, uids, {"preset": "is_grpo"})
    with pytest.raises(ValueError, match="singleton"):
        via_compute_advantage("grouprl_grpo", tlr, mask, uids, {"singleton": "raw"})
    with pytest.raises(ValueError, match="unknown parameter"):
        via_compute_advantage("grouprl_grpo", tlr, mask, uids, {"focal": 0.5})
    with pytest.raises(ValueError, match="norm_adv_by_std_in_grpo=False does not change"):
        core_algos.get_adv_estimator_fn("grouprl_rloo")(
            tlr, mask, index=uids, norm_adv_by_std_in_grpo=False
        )
    fn = core_algos.get_adv_estimator_fn("grouprl_grpo")
    with pytest.raises(ValueError, match="uid"):
        fn(token_level_rewards=tlr, response_mask=mask)


@pytest.mark.parametrize("verl_name", ["grpo", "grpo_vectorized"])
def test_our_grpo_with_verls_singleton_rule_equals_verls_grpo(verl_name):
    # singletons (raw score / (1 + eps) in verl), collapsed groups (0 in both) and mixed ones
    tlr, mask, uids, _ = ragged_batch(seed=7, values=[0.0, 0.25, 0.5, 1.0])
    theirs, _ = via_compute_advantage(verl_name, tlr, mask, uids)
    ours, _ = via_compute_advantage("grouprl_grpo", tlr, mask, uids, {"singleton": "verl"})
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    # and our default rule differs exactly on the singletons
    default, _ = via_compute_advantage("grouprl_grpo", tlr, mask, uids)
    counts = {u: int((uids == u).sum()) for u in uids}
    lone = torch.tensor([counts[u] == 1 for u in uids])
    assert torch.equal(default[~lone], ours[~lone]) and (default[lone] == 0).all()


def test_dr_grpo_and_rloo_with_singleton_rule_equal_verls():
    tlr, mask, uids, _ = ragged_batch(seed=8, values=[0.0, 0.25, 0.5, 1.0])
    theirs, _ = via_compute_advantage("grpo", tlr, mask, uids, norm_adv_by_std_in_grpo=False)
    ours, _ = via_compute_advantage("grouprl_dr_grpo", tlr, mask, uids, {"singleton": "verl"})
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    theirs, _ = via_compute_advantage("rloo", tlr, mask, uids)
    ours, _ = via_compute_advantage("grouprl_rloo", tlr, mask, uids, {"singleton": "verl"})
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


def test_avspo_trigger_advances_per_call_and_round_trips():
    gv._TRIGGERS.clear()
    fn = core_algos.get_adv_estimator_fn("grouprl_grpo")
    cfg = OmegaConf.create({"grouprl": {"virtual": "symmetric"}})
    tlr, mask, uids, _ = ragged_batch(seed=2, values=[0.0, 1.0])
    for _ in range(3):
        fn(token_level_rewards=tlr, response_mask=mask, index=uids, config=cfg)
    state = gv.trigger_state_dict()
    assert state["grpo"]["steps"] == 3
    assert gv.last_result("grouprl_grpo").stats["virtual/acr"] >= 0.0
    gv._TRIGGERS.clear()
    gv.load_trigger_state_dict(state)
    assert gv.trigger_state_dict() == state


# --------------------------------------------------------------------------- policy losses
def actor_config(**kw):
    base = {"strategy": "fsdp", "rollout_n": 4, "ppo_micro_batch_size_per_gpu": 2}
    return ActorConfig(**{**base, **kw})


def loss_inputs(seed=0, n=6, t=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g) * 3
    logp = (old + 0.4 * torch.randn(n, t, generator=g)).requires_grad_(True)
    adv = torch.randn(n, generator=g)[:, None].expand(n, t).contiguous()
    mask = (torch.arange(t)[None, :] < torch.randint(1, t + 1, (n,), generator=g)[:, None]).float()
    return old, logp, adv * mask, mask


@pytest.mark.parametrize(
    ("ours", "theirs", "config"),
    [
        ("grouprl_ppo_clip", "vanilla", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}),
        ("grouprl_cispo", "cispo", {"clip_ratio_low": 1.0, "clip_ratio_high": 5.0}),
        ("grouprl_gspo", "gspo", {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}),
    ],
)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_registered_losses_equal_verls_and_backpropagate(ours, theirs, config, mode):
    if theirs == "gspo" and mode != "seq-mean-token-mean" and VERL_VERSION < (0, 9):
        pytest.skip("verl < 0.9's gspo ignores loss_agg_mode (always seq-mean-token-mean)")
    cfg = actor_config(**config)
    old, logp, adv, mask = loss_inputs()
    loss, metrics = core_algos.get_policy_loss_fn(ours)(old, logp, adv, mask, mode, cfg)
    (grad,) = torch.autograd.grad(loss, logp)
    old2, logp2, _, _ = loss_inputs()
    want, their_metrics = core_algos.get_policy_loss_fn(theirs)(old2, logp2, adv, mask, mode, cfg)
    (want_grad,) = torch.autograd.grad(want, logp2)
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-6)
    assert grad.abs().sum() > 0
    assert set(their_metrics) <= set(metrics)
    assert metrics["actor/ppo_kl"] == pytest.approx(their_metrics["actor/ppo_kl"], abs=1e-6)


NEW_LOSSES = [
    # the peers' methods: (grouprl name, verl name, ActorConfig fields, PolicyLossConfig fields, modes)
    ("grouprl_sapo", "sapo", {"tau_pos": 1.0, "tau_neg": 1.05}, {}, ["seq-mean-token-mean"]),
    ("grouprl_gmpo", "geo_mean", {"clip_ratio_low": 0.4, "clip_ratio_high": 0.3}, {}, ["seq-mean-token-mean"]),
    ("grouprl_clip_cov", "clip_cov", {}, {"clip_cov_ratio": 0.2, "clip_cov_lb": -1.0}, ["token-mean", "token-sum"]),
    ("grouprl_kl_cov", "kl_cov", {}, {"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.5}, ["token-mean", "seq-mean-token-sum"]),
    ("grouprl_dppo_tv", "dppo_tv", {"clip_ratio_low": 0.05, "clip_ratio_high": 0.1}, {}, ["token-mean"]),
    ("grouprl_dppo_kl", "dppo_kl", {"clip_ratio_low": 0.02, "clip_ratio_high": 0.03}, {}, ["token-mean"]),
    ("grouprl_dro", "dro", {}, {"dro_beta": 0.3}, ["token-mean", "seq-mean-token-mean"]),
]  # fmt: skip


@pytest.mark.parametrize(("ours", "theirs", "actor", "policy", "modes"), NEW_LOSSES)
def test_new_registered_losses_read_verls_config_and_equal_verls(
    ours, theirs, actor, policy, modes
):
    from verl.workers.config import PolicyLossConfig

    cfg = actor_config(**actor, policy_loss=PolicyLossConfig(loss_mode=ours, **policy))
    old, logp, adv, mask = loss_inputs(seed=5)
    old = old.clamp(max=-0.05)
    for mode in modes:
        lp1 = logp.detach().clamp(max=-1e-3).requires_grad_()
        lp2 = lp1.detach().clone().requires_grad_()
        torch.manual_seed(3)  # Clip-Cov's random draw, the same on both sides
        loss, metrics = core_algos.get_policy_loss_fn(ours)(old, lp1, adv, mask, mode, cfg)
        torch.manual_seed(3)
        want, _ = core_algos.get_policy_loss_fn(theirs)(old, lp2, adv, mask, mode, cfg)
        (grad,) = torch.autograd.grad(loss, lp1)
        (want_grad,) = torch.autograd.grad(want, lp2)
        torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
        assert grad.abs().sum() > 0 and "actor/ppo_kl" in metrics


def test_vespo_registers_with_trls_defaults_and_dro_needs_its_beta():
    old, logp, adv, mask = loss_inputs(seed=6)
    loss, _ = core_algos.get_policy_loss_fn("grouprl_vespo")(
        old, logp, adv, mask, "token-mean", actor_config()
    )
    per_token, _ = losses.surrogate("vespo", logp, old, adv, mask)
    torch.testing.assert_close(loss, losses.aggregate("token_mean", per_token, mask))
    with pytest.raises(ValueError, match="DRO needs beta > 0"):
        core_algos.get_policy_loss_fn("grouprl_dro")(
            old, logp, adv, mask, "token-mean", actor_config()
        )


def test_registered_losses_follow_verls_global_batch_info_and_is_weights():
    cfg = actor_config()
    cfg.global_batch_info.update({"dp_size": 2, "batch_num_tokens": 50, "global_batch_size": 12})
    old, logp, adv, mask = loss_inputs(seed=4)
    w = torch.rand_like(mask)
    ours, _ = core_algos.get_policy_loss_fn("grouprl_ppo_clip")(
        old, logp, adv, mask, "token-mean", cfg, rollout_is_weights=w
    )
    want, _ = core_algos.get_policy_loss_fn("vanilla")(
        old, logp, adv, mask, "token-mean", cfg, rollout_is_weights=w
    )
    torch.testing.assert_close(ours, want, atol=1e-6, rtol=1e-6)


def test_reinforce_loss_is_minus_adv_logp():
    cfg = actor_config()
    old, logp, adv, mask = loss_inputs(seed=9)
    loss, _ = core_algos.get_policy_loss_fn("grouprl_reinforce")(
        old, logp, adv, mask, "token-mean", cfg
    )
    want = (-(adv * logp) * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv * mask / mask.sum(), atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_hydra_overrides_from_the_docs_reach_the_estimator_and_the_loss():
    # the command-line overrides of docs/integrations.md, composed on verl's own ppo_trainer
    # config; the trainer passes config.algorithm (a DictConfig) and an ActorConfig built
    # from actor_rollout_ref.actor
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    overrides = [
        "algorithm.adv_estimator=grouprl_grpo",
        "+algorithm.grouprl.preset=f_grpo",
        "actor_rollout_ref.actor.policy_loss.loss_mode=grouprl_cispo",
        "actor_rollout_ref.actor.clip_ratio_low=1.0",
        "actor_rollout_ref.actor.clip_ratio_high=5.0",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.n=4",
    ]
    folder = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=folder, version_base=None):
        cfg = compose("ppo_trainer", overrides=overrides)
    tlr, mask, uids, scores = ragged_batch(seed=21, values=[0.0, 1.0])
    data = DataProto.from_dict(
        tensors={"token_level_rewards": tlr, "response_mask": mask}, non_tensors={"uid": uids}
    )
    adv = ray_trainer.compute_advantage(
        data, adv_estimator=cfg.algorithm.adv_estimator, config=cfg.algorithm
    ).batch["advantages"]
    want = loop_reference("grpo", scores, uids, mask, focal_gamma=0.5)
    torch.testing.assert_close(adv, want, atol=1e-6, rtol=1e-6)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    loss_fn = core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode)
    old, logp, a, m = loss_inputs(seed=3)
    loss, _ = loss_fn(old, logp, a, m, actor.loss_agg_mode, actor)
    want_loss, _ = core_algos.get_policy_loss_fn("cispo")(old, logp, a, m, "token-mean", actor)
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=1e-6)


def test_equal_runs_fast_path_only_for_verls_layout():
    # equal runs of distinct uids: a dense view, group/pos derived without per-sample codes
    layout = gv.group_layout(np.array(list("aabbcc"), dtype=object), 6)
    assert layout.dense and layout.group_ids is None
    assert layout.group.tolist() == [0, 0, 1, 1, 2, 2] and layout.pos.tolist() == [0, 1] * 3
    # equal runs, but uid "a" heads two of them: one group of 4 split across the batch
    split = gv.group_layout(np.array(list("aabbaa"), dtype=object), 6)
    assert not split.dense and sorted(split.counts.tolist()) == [2, 4]
    x = torch.arange(6, dtype=torch.float32)
    torch.testing.assert_close(split.to_flat(split.to_grid(x)), x)
    # equal-length runs that do not start at multiples of W are not mistaken for the layout
    odd = gv.group_layout(np.array([1, 2, 2, 3, 3, 4]), 6)
    assert not odd.dense and sorted(odd.counts.tolist()) == [1, 1, 2, 2]


@pytest.mark.parametrize(
    ("name", "verl_name"),
    [
        ("remax", "remax"),
        ("optimal_token_baseline", "optimal_token_baseline"),
        ("tir_optimal_token_baseline", "tir_optimal_token_baseline"),
    ],
)
def test_inputs_verl_makes_only_for_its_own_estimator_are_a_clear_error(name, verl_name):
    tlr, mask, uids, _ = ragged_batch(seed=2)
    with pytest.raises(ValueError, match=f"algorithm.adv_estimator={verl_name}"):
        via_compute_advantage(f"grouprl_{name}", tlr, mask, uids)


def test_gdpo_refuses_per_key_rewards_it_cannot_receive():
    tlr, mask, uids, scores = ragged_batch(seed=3)
    fn = core_algos.get_adv_estimator_fn("grouprl_gdpo")
    cfg = OmegaConf.create({"gdpo_reward_keys": ["a", "b"]})
    with pytest.raises(ValueError, match=r"per-key rewards.*adv_estimator=gdpo"):
        fn(tlr, mask, uids, config=cfg)
    adv, _ = via_compute_advantage("grouprl_gdpo", tlr, mask, uids)  # one summed score
    torch.testing.assert_close(
        adv, loop_reference("gdpo", scores, uids, mask), atol=1e-6, rtol=1e-6
    )


def test_token_estimators_take_gamma_and_the_kl_penalised_token_rewards():
    # verl's reinforce_plus_plus on the same token rewards (KL penalty spread over the tokens)
    tlr, mask, uids, _ = ragged_batch(seed=4, sizes=(4, 4, 4))
    tlr = tlr - 0.01 * torch.rand(tlr.shape) * mask
    theirs, _ = via_compute_advantage("reinforce_plus_plus", tlr, mask, uids, gamma=0.9)
    ours, _ = via_compute_advantage("grouprl_reinforce_pp_global", tlr, mask, uids, gamma=0.9)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    theirs, _ = via_compute_advantage("reinforce_plus_plus_baseline", tlr, mask, uids)
    ours, _ = via_compute_advantage(
        "grouprl_reinforce_pp_baseline", tlr, mask, uids, {"zero_collapsed": False}
    )
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- rollout correction
def _corrected_inputs(seed):
    """Loss inputs plus verl's own rollout correction of them: IcePop weights and a token-k3
    rejection mask from ``rollout_corr_helper`` (decoupled mode: old vs rollout)."""
    from verl.trainer.ppo import rollout_corr_helper as rch

    old, logp, adv, mask = loss_inputs(seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    rollout = old + 0.5 * torch.randn(old.shape, generator=g)
    proto, new_mask, _ = rch.compute_rollout_correction_and_rejection_mask(
        old,
        rollout,
        mask,
        rollout_is="token",
        rollout_is_threshold="0.5_5.0",
        rollout_rs="token_k3",
        rollout_rs_threshold=0.3,
    )
    return old, logp, adv, mask, rollout, proto.batch["rollout_is_weights"], new_mask


@pytest.mark.parametrize(
    ("ours", "theirs", "config"),
    [
        ("grouprl_ppo_clip", "vanilla", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}),
        ("grouprl_cispo", "cispo", {"clip_ratio_low": 1.0, "clip_ratio_high": 5.0}),
    ],
)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_registered_losses_honour_verls_rollout_correction(ours, theirs, config, mode):
    old, logp, adv, mask, rollout, w, new_mask = _corrected_inputs(seed=6)
    assert float((w == 0).float()[mask.bool()].mean()) > 0  # IcePop zeroed some tokens
    assert bool((new_mask < mask).any())  # the rejection removed some
    cfg = actor_config(**config)
    lp1, lp2 = logp.detach().clone().requires_grad_(), logp.detach().clone().requires_grad_()
    got, _ = core_algos.get_policy_loss_fn(ours)(old, lp1, adv, new_mask, mode, cfg, w)
    want, _ = core_algos.get_policy_loss_fn(theirs)(old, lp2, adv, new_mask, mode, cfg, w)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    (g1,) = torch.autograd.grad(got, lp1)
    (g2,) = torch.autograd.grad(want, lp2)
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-6)
    # the same loss as grouprl's own objective with our correction of the same log-probs
    from grouprl.losses import correction

    corr = correction.compute(
        "icepop+rejection:stat=k3,level=token,threshold=0.3", old, rollout, mask
    )
    torch.testing.assert_close(corr.weight * new_mask, w * new_mask, atol=1e-6, rtol=1e-6)
    assert torch.equal(corr.loss_mask(mask), new_mask)


def test_a_micro_batch_whose_tokens_were_all_rejected_adds_zero():
    old, logp, adv, mask = loss_inputs(seed=2)
    lp = logp.detach().clone().requires_grad_()
    cfg = actor_config()
    cfg.global_batch_info.update({"dp_size": 1, "batch_num_tokens": 20, "global_batch_size": 6})
    empty = torch.zeros_like(mask)
    loss, metrics = core_algos.get_policy_loss_fn("grouprl_ppo_clip")(
        old, lp, adv, empty, "token-mean", cfg
    )
    want, _ = core_algos.get_policy_loss_fn("vanilla")(old, logp, adv, empty, "token-mean", cfg)
    assert float(loss.detach()) == float(want.detach()) == 0.0
    loss.backward()
    assert (lp.grad == 0).all() and metrics["actor/ppo_kl"] == 0.0


def test_bypass_mode_is_named_once(caplog):
    gv._WARNED.discard("bypass")
    tlr, mask, uids, _ = ragged_batch(0)
    data = DataProto.from_dict(
        tensors={"token_level_rewards": tlr, "response_mask": mask}, non_tensors={"uid": uids}
    )
    cfg = OmegaConf.create(
        {"adv_estimator": "grouprl_grpo", "rollout_correction": {"bypass_mode": True}}
    )
    with caplog.at_level("WARNING", logger="grouprl.integrations.verl"):
        for _ in range(2):
            ray_trainer.compute_advantage(data, adv_estimator="grouprl_grpo", config=cfg)
    notes = [r.message for r in caplog.records if "bypass" in r.message]
    assert notes == [gv.BYPASS_NOTE]
