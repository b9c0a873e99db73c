"""The registration pattern (grouprl.registry): one way onto every axis, checked at registration."""

from __future__ import annotations

import math

import pytest
import torch

from grouprl import advantages, losses, presets, registry
from grouprl.cli.listing import catalogue
from grouprl.registry import INPUTS, RegistrationError, Setting
from grouprl.types import Advantages

pytestmark = pytest.mark.usefixtures("clean_registry")


def _halved(rewards, valid, *, factor: float = 0.5, lengths=None):
    """(r − 1/2)·factor, with the lengths read (for the test)."""
    ones = torch.ones(rewards.shape[0])
    values = (rewards.nan_to_num(0.5) - 0.5) * factor
    if lengths is not None:
        values = values / lengths.clamp(min=1)
    return Advantages(values, ones.bool(), ones, ones)


def test_a_registered_estimator_is_in_the_public_table_and_computes():
    advantages.register_estimator(
        "halved", _halved, reads={"lengths"}, sources={"factor": "my paper eq. 3"}
    )
    assert advantages.ESTIMATORS["halved"] is _halved and "halved" in advantages.names()
    decl = advantages.estimator_axis.get("halved")
    assert decl.reads == {"lengths"} and not decl.builtin
    # the settings: the keyword parameters with a default, minus the declared inputs
    assert decl.settings == (Setting("factor", 0.5, "float", "my paper eq. 3"),)
    assert advantages.needs("halved") == {"lengths"}
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    lengths = torch.tensor([[1.0, 2.0], [4.0, 1.0]])
    out = advantages.compute("halved", rewards, lengths=lengths, factor=2.0)
    # (r − 1/2)·2 / length: [[1, −1/2], [1/4, 1]]
    assert out.values.tolist() == [[1.0, -0.5], [0.25, 1.0]]
    assert out.stats["updated_frac"] == 1.0  # no updated mask given: the kept groups with signal
    with pytest.raises(ValueError, match=r"reads lengths: pass lengths="):
        advantages.compute("halved", rewards)  # a declared input left out


def test_the_decorator_form_registers_and_returns_the_function():
    @losses.register_surrogate("plain_pg")
    def plain_pg(logp, old_logp, adv, mask, *, stats: bool = True):
        """−A·logp."""
        a = adv if adv.dim() == 2 else adv[:, None]
        return -a * logp * mask, {}

    assert losses.SURROGATES["plain_pg"] is plain_pg
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = losses.objective(
        logp, logp.detach(), torch.tensor([2.0]), torch.ones(1, 2), surrogate="plain_pg",
        aggregation="token_sum",
    )  # fmt: skip
    assert float(out.loss.detach()) == pytest.approx(6.0)  # −2·(−1 − 2)
    out.loss.backward()
    assert logp.grad.tolist() == [[-2.0, -2.0]]


@pytest.mark.parametrize(
    ("register", "name"),
    [
        (advantages.register_estimator, "grpo"),
        (advantages.register_token_estimator, "optimal_token_baseline"),
        (losses.register_surrogate, "ppo_clip"),
        (losses.register_aggregation, "token_mean"),
        (losses.register_kl, "k3"),
        (losses.register_correction, "icepop"),
    ],
)
def test_a_name_that_collides_with_a_built_in_is_refused_naming_another(register, name):
    with pytest.raises(RegistrationError, match=rf"{name!r} is a built-in.*'my_{name}'"):
        register(name, lambda *a, **k: None)


def test_a_second_registration_of_a_plugin_name_needs_replace():
    advantages.register_estimator("mine", _halved)
    with pytest.raises(RegistrationError, match=r"already registered.*replace=True"):
        advantages.register_estimator("mine", lambda rewards, valid: None)
    advantages.register_estimator("mine", _halved)  # the same function again: idempotent

    def other(rewards, valid):
        return _halved(rewards, valid)

    advantages.register_estimator("mine", other, replace=True)
    assert advantages.ESTIMATORS["mine"] is other


@pytest.mark.parametrize(
    ("register", "fn", "needle"),
    [
        (advantages.register_estimator, lambda rewards: None, "2 positional argument"),
        (advantages.register_estimator, lambda r, v, extra: None, "give every other parameter"),
        (losses.register_surrogate, lambda logp, old, adv: None, "(logp, old_logp, adv, mask)"),
        (losses.register_kl, lambda logp: None, "(logp, ref_logp)"),
        (losses.register_correction, lambda log_ratio: None, "(log_ratio, mask, adv)"),
        (advantages.register_estimator, 3.0, "must be a function"),
    ],
)
def test_a_function_whose_signature_does_not_fit_its_axis_is_refused(register, fn, needle):
    with pytest.raises(RegistrationError, match=r"does not fit|must be a function") as err:
        register("bad_fit", fn)
    assert needle in str(err.value)


def test_a_declared_input_the_trainer_cannot_provide_is_refused_with_the_valid_ones():
    with pytest.raises(RegistrationError, match=r"\['greedy_rollouts'\].*may read: baseline"):
        advantages.register_estimator("x", _halved, reads={"greedy_rollouts"})
    # an input of another axis: said so
    with pytest.raises(RegistrationError, match=r"another axis reads them"):
        advantages.register_estimator("x", _halved, reads={"sum_pi_squared"})
    # declared but no parameter to receive it
    with pytest.raises(RegistrationError, match=r"has no parameter baseline: add.*baseline=None"):
        advantages.register_estimator("x", _halved, reads={"baseline"})
    assert "x" not in advantages.ESTIMATORS  # nothing half-registered


def test_a_step_selection_needs_its_select_function_and_arrives_as_selected():
    def sur(logp, old_logp, adv, mask, *, selected=None, stats=True):
        return -logp * mask, {}

    with pytest.raises(RegistrationError, match=r"pass select=fn"):
        losses.register_surrogate("sel", sur, reads={"step_selection"})
    with pytest.raises(RegistrationError, match=r"add reads=\{'step_selection'\}"):
        losses.register_surrogate("sel", sur, select=lambda *a, **k: None)
    losses.register_surrogate("sel", sur, reads={"step_selection"}, select=lambda *a, **k: [])
    assert callable(losses.surrogate_axis.get("sel").extra["select"])


def test_sources_for_a_setting_the_function_does_not_have_are_refused():
    with pytest.raises(RegistrationError, match=r"sources= names \['gamma'\].*factor"):
        advantages.register_estimator("x", _halved, sources={"gamma": "?"})


def test_a_name_must_be_an_identifier():
    with pytest.raises(RegistrationError, match=r"must be an identifier"):
        advantages.register_estimator("my-est", _halved)


def test_every_built_in_preset_passes_the_checks_a_registered_one_gets():
    for p in presets.PRESETS.values():
        assert presets.check(p) is p


def test_the_presets_inputs_follow_from_their_methods_declarations():
    # hand-derived from the methods: ReMax's greedy baseline, GDPO's default combination,
    # OPO's lengths, the optimal token baseline's Σπ², AVSPO's trigger, the focal weight's
    # verifier rewards, IS-GRPO-exact's draw weights; GRPO reads nothing
    want = {
        "grpo": set(),
        "remax": {"baseline"},
        "gdpo": {"reward_parts"},
        "opo": {"lengths"},
        "otb": {"old_logp", "sum_pi_squared"},
        "avspo": {"trigger"},
        "f_grpo": {"verifier_rewards"},
        "f_grpo_baseline": set(),
        "is_grpo_exact": {"draw_weights"},
    }
    assert {n: set(presets.get(n).reads) for n in want} == want
    clip_cov = presets.get("grpo").with_(surrogate="clip_cov", surrogate_params={})
    opsm = presets.get("grpo").with_(rollout_correction="opsm:threshold=0.5+icepop")
    assert clip_cov.reads == {"step_selection"} and opsm.reads == {"current_logp"}
    assert set().union(*(a.inputs for a in registry.AXES.values())) <= set(INPUTS)


def test_a_registered_preset_is_checked_like_a_built_in():
    with pytest.raises(ValueError, match=r"unknown estimator 'nope'"):
        presets.register_preset(name="p1", estimator="nope")
    with pytest.raises(ValueError, match=r"surrogate_params \['eps'\] are not settings.*eps_low"):
        presets.register_preset(name="p1", surrogate_params={"eps": 0.1})
    with pytest.raises(RegistrationError, match=r"'grpo' is a built-in"):
        presets.register_preset(presets.get("grpo"))
    with pytest.raises(ValueError, match=r"sources for unknown fields"):
        presets.register_preset(name="p1", sources={"lr": "x"})
    p = presets.register_preset(
        name="p1", description="focal on rloo", estimator="rloo", focal_gamma=0.5
    )
    assert (
        presets.get("p1") is p
        and p.sources["estimator"] == presets.get("grpo").sources["estimator"]
    )
    # a focal preset brings its fair baseline, as the built-in F-presets do
    assert presets.baseline_of("p1").focal_gamma == 0.0
    assert "p1" in catalogue(["presets"])["Presets"]


def test_grouprl_list_shows_a_registered_method_with_its_first_doc_line():
    advantages.register_estimator("halved", _halved)
    assert catalogue(["estimators"])["Advantage estimators"]["halved"].startswith("(r − 1/2)")


def test_the_objective_hands_entropy_to_a_surrogate_that_declares_it():
    seen = {}

    def ent(logp, old_logp, adv, mask, *, entropy=None, stats=True):
        seen["entropy"] = entropy
        return -logp * mask * 0.0, {}

    losses.register_surrogate("ent", ent, reads={"entropy"})
    logp = torch.zeros(1, 2, requires_grad=True)
    h = torch.tensor([[math.log(2), 0.0]])
    losses.objective(logp, logp.detach(), torch.ones(1), torch.ones(1, 2), surrogate="ent",
                     entropy=h)  # fmt: skip
    assert seen["entropy"] is h
    losses.objective(
        logp, logp.detach(), torch.ones(1), torch.ones(1, 2), surrogate="reinforce", entropy=h
    )  # fmt: skip  (a built-in that does not declare it: not passed)


def _clip_adv(rewards, valid, values, *, bound: float = 0.5):
    """Advantages clipped to [−bound, bound]."""
    return values.clamp(-bound, bound)


def test_a_registered_transform_runs_on_the_estimators_advantages_in_its_place():
    advantages.register_transform("clip_adv", _clip_adv, sources={"bound": "my paper §4"})
    decl = advantages.transform_axis.get("clip_adv")
    assert decl.settings == (Setting("bound", 0.5, "float", "my paper §4"),)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    # Dr.GRPO: r − mean = 0.75, −0.25 ×3; clipped at 0.5 ...
    out = advantages.compute("dr_grpo", rewards, transforms={"clip_adv": {}})
    assert out.values.tolist() == [[0.5, -0.25, -0.25, -0.25]]
    out = advantages.compute("dr_grpo", rewards, transforms={"clip_adv": {"bound": 0.2}})
    assert out.values[0].tolist() == pytest.approx([0.2, -0.2, -0.2, -0.2])
    # ... after the focal weight (μ̂ = 1/4, (1 − 1/4)^1 = 0.75: 0.5625 → 0.5, −0.1875) and
    # before the group weight (× 2 after the clip: 1.0, not 0.5 clipped from 1.5)
    out = advantages.compute(
        "dr_grpo", rewards, focal_gamma=1.0, group_weight=torch.tensor([2.0]),
        transforms={"clip_adv": {}},
    )  # fmt: skip
    assert out.values[0].tolist() == pytest.approx([1.0, -0.375, -0.375, -0.375])
    assert catalogue(["transforms"])[next(iter(catalogue(["transforms"])))]["clip_adv"] == (
        "Advantages clipped to [−bound, bound]."
    )


def test_a_registered_transform_gets_what_it_declares_and_is_checked():
    seen = {}

    def shaped(rewards, valid, values, *, verifier_rewards=None):
        """Records the verifier's rewards; the advantages unchanged."""
        seen["v"] = verifier_rewards
        return values

    advantages.register_transform("shaped", shaped, reads={"verifier_rewards"})
    rewards, verified = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]])
    advantages.compute("grpo", rewards, verifier_rewards=verified, transforms={"shaped": {}})
    assert seen["v"] is verified
    with pytest.raises(ValueError, match=r"unknown transform 'nope'; valid: .*shaped"):
        advantages.compute("grpo", rewards, transforms={"nope": {}})
    with pytest.raises(ValueError, match=r"'focal_gamma' is a built-in transform: pass it as"):
        advantages.compute("grpo", rewards, transforms={"focal_gamma": {}})
    with pytest.raises(ValueError, match=r"transform 'shaped' got unknown setting\(s\) \['x'\]"):
        advantages.compute("grpo", rewards, transforms={"shaped": {"x": 1}})
    advantages.register_transform("flat", lambda rewards, valid, values: values.reshape(-1))
    with pytest.raises(ValueError, match=r"'flat' must return the advantages' shape \(1, 2\)"):
        advantages.compute("grpo", rewards, transforms={"flat": {}})
    with pytest.raises(RegistrationError, match=r"3 positional argument\(s\) \(rewards, valid"):
        advantages.register_transform("two", lambda rewards, valid: rewards)
    with pytest.raises(RegistrationError, match=r"reads=\['lengths'\].*may read: trigger"):
        advantages.register_transform("long", shaped, reads={"lengths"})


def test_a_preset_turns_a_registered_transform_on_and_is_checked():
    advantages.register_transform("clip_adv", _clip_adv)
    p = presets.register_preset(
        name="clipped_dr", estimator="dr_grpo", transforms={"clip_adv": {"bound": 0.2}}
    )
    assert p.advantage_kwargs() == {"transforms": {"clip_adv": {"bound": 0.2}}}
    out = advantages.compute(p.estimator, torch.tensor([[1.0, 0.0]]), **p.advantage_kwargs())
    assert out.values[0].tolist() == pytest.approx([0.2, -0.2])
    with pytest.raises(ValueError, match=r"preset 'bad': transforms: unknown transform 'nope'"):
        presets.register_preset(name="bad", transforms={"nope": {}})
    with pytest.raises(ValueError, match=r"preset 'bad': transforms: transform 'clip_adv' got"):
        presets.register_preset(name="bad", transforms={"clip_adv": {"cap": 1}})
    with pytest.raises(ValueError, match=r"'optimal_token_baseline' is a token-level estimator"):
        presets.register_preset(
            name="bad", estimator="optimal_token_baseline", transforms={"clip_adv": {}}
        )


def test_a_fresh_axis_declares_its_tables_built_ins_with_their_settings():
    # what every package does at import, run here (mutation testing forks after the import)
    def tool(x, *, k=1, when=None, ignored=None):
        """A tool."""
        return x

    tool.__annotations__.update(k=int, when=int | None)  # evaluated, not string annotations
    table = {"tool": tool}
    axis = registry.Axis(
        "toy axis",
        table,
        positional=("x",),
        inputs=("entropy",),
        example="(x) -> x",
        skip=("ignored",),
    )
    try:
        assert registry.AXES["toy axis"] is axis and axis.name == "toy axis"
        assert axis.table is table and axis.example == "(x) -> x"
        d = axis.get("tool")
        assert (d.axis, d.name, d.fn, d.builtin, d.reads) == ("toy axis", "tool", tool, True, set())
        assert d.settings == (Setting("k", 1, "int", ""), Setting("when", None, "int | None", ""))
        axis.declare("tool", reads="entropy", note="x")  # one name for a set of one
        d = axis.get("tool")
        assert (d.axis, d.reads, d.builtin, dict(d.extra)) == (
            "toy axis", {"entropy"}, True, {"note": "x"}
        )  # fmt: skip
        assert d.settings[0] == Setting("k", 1, "int", "")
        assert axis.reads("tool") == {"entropy"} and axis.reads("no_such") == frozenset()
    finally:
        registry.AXES.pop("toy axis")


def test_the_decorator_form_passes_reads_replace_and_the_axis_facts_on():
    def select(logps, old_logps, advs, masks):
        return [None] * len(masks)

    def sur(logp, old_logp, adv, mask, *, selected=None, stats=True):
        """−A·logp."""
        return -adv[:, None] * logp * mask, {}

    deco = losses.surrogate_axis.register("deco", reads={"step_selection"}, select=select)
    deco(sur)
    d = losses.surrogate_axis.get("deco")
    assert d.reads == {"step_selection"} and d.extra["select"] is select
    again = losses.surrogate_axis.register("deco", replace=True, reads={"step_selection"},
                                           select=select)  # fmt: skip
    again(lambda logp, old_logp, adv, mask, *, selected=None, stats=True: (logp, {}))
    assert losses.surrogate_axis.get("deco").fn is not sur  # replaced, as asked
