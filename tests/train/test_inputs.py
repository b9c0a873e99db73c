"""The trainer provides inputs by their declared names and knows no method by name."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch
from hand_policy import BASE, HandPolicy, HandTask, HandTokenizer, first_is

from grouprl import advantages, losses, presets, registry
from grouprl.train import inputs, update
from grouprl.train.config import load_config
from grouprl.train.loop import Timer, collect_batch, step_advantages
from grouprl.train.state import setup
from grouprl.train.targets import Targets
from grouprl.types import Advantages

TRAIN = Path(__file__).resolve().parents[2] / "src" / "grouprl" / "train"

ALLOWED = {
    ("controllers.py", "agpo"): "the controller axis lives here: its own table",
    ("state.py", "agpo"): "the key of the controller's state in older checkpoints",
}
"""(file, name) -> why that file may hold that string."""


def test_every_input_a_method_may_declare_has_a_provider():
    provided = set(inputs.ROUND) | set(inputs.STEP) | set(inputs.LOSS)
    assert provided == set(registry.INPUTS)
    for axis in registry.AXES.values():
        assert axis.inputs <= provided, axis.name


def _strings(tree: ast.AST) -> set[str]:
    """The string constants of a module that are not docstrings."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docs.add(id(body[0].value))
    return {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    }


def test_nothing_under_train_names_an_estimator_surrogate_correction_or_preset():
    names = (
        set(advantages.ESTIMATORS) | set(advantages.TOKEN_ESTIMATORS) | set(losses.SURROGATES)
        | set(losses.CORRECTIONS) | set(presets.PRESETS)
    )  # fmt: skip
    found = {
        (path.name, s)
        for path in sorted(TRAIN.glob("*.py"))
        for s in _strings(ast.parse(path.read_text()))
        if s in names
    }
    assert found - set(ALLOWED) == set()


def test_the_check_sees_a_method_name_written_in_train(tmp_path):
    # the check itself can fail: a branch on a surrogate's name is found
    code = (
        'def f(p):\n    """grpo in a docstring is fine."""\n    return p.surrogate == "clip_cov"\n'
    )
    assert _strings(ast.parse(code)) == {"clip_cov"}


SRC = TRAIN.parent

OBJECTIVE_CALLS = {
    ("train/update.py", "LossSpec.objective"): "the trainer's one call of losses.objective",
    ("train/update.py", "micro_batch_loss"): "the trainer's one call of LossSpec.objective",
    ("integrations/trl.py", "GroupRLGRPOTrainer._compute_loss"): "TRL's loop, not ours",
    ("simulate/low_variance.py", "train"): "the Table 3 simulation's linear policy",
    ("simulate/maxnorm.py", "train"): "the MaxNorm accuracy simulation's two-layer policy",
}
"""(module, enclosing function) -> the call of an ``objective`` there: one per engine."""


def _function_name(name: str) -> str:
    """A function's own name; under mutation testing (``scripts/mutation.sh``) mutmut copies
    each function as ``x_<name>__mutmut_<n>`` (a method as ``xǁ<Class>ǁ<name>__mutmut_<n>``),
    and a copy is read as the function it copies."""
    return re.sub(r"^x(?:_|ǁ\w+ǁ)(\w+?)__mutmut_\w+$", r"\1", name)


def _objective_calls(tree: ast.AST) -> set[str]:
    """The enclosing ``Class.function`` of every call of something named ``objective``
    (``losses.objective(...)``, ``spec.objective(...)``, ``objective(...)``)."""
    out: set[str] = set()

    def walk(node: ast.AST, where: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                walk(child, [*where, _function_name(child.name)])
                continue
            if isinstance(child, ast.Call):
                f = child.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name == "objective":
                    out.add(".".join(where))
            walk(child, where)

    walk(tree, [])
    return out


def test_the_objective_is_called_in_one_place_per_engine():
    # the trainer computes its loss in one call (the R/KL diagnostic reuses that call's
    # branches, train.update.BalanceProbe); a second copy anywhere in src/ fails here
    found = {
        (str(path.relative_to(SRC)), where)
        for path in sorted(SRC.rglob("*.py"))
        for where in _objective_calls(ast.parse(path.read_text()))
    }
    assert found == set(OBJECTIVE_CALLS)


def test_the_objective_call_check_sees_a_second_call():
    code = (
        "class LossSpec:\n    def objective(self):\n        return losses.objective(1)\n"
        "def probe(spec):\n    return spec.objective() + objective(2)\n"
    )
    assert _objective_calls(ast.parse(code)) == {"LossSpec.objective", "probe"}
    copies = "def x_probe__mutmut_3(spec):\n    return spec.objective()\n"
    assert _objective_calls(ast.parse(copies)) == {"probe"}


@pytest.fixture
def hand_run(tmp_path):
    def make(*overrides):
        task = HandTask({"ab": first_is("a")})
        cfg = load_config(None, [*BASE, f"run.out={tmp_path}", *overrides], validate=False)
        run = setup(cfg, model=HandPolicy(), tokenizer=HandTokenizer(), task=task)
        run.step = 1
        return run

    return make


def test_a_registered_estimator_gets_the_inputs_it_declares_from_the_batch(
    clean_registry, hand_run
):
    seen = {}

    def reads_all(rewards, valid, *, lengths=None, verifier_rewards=None, draw_weights=None):
        """Records its inputs; advantages r − 1/2."""
        seen.update(lengths=lengths, verifier_rewards=verifier_rewards, draw_weights=draw_weights)
        ones = torch.ones(rewards.shape[0])
        return Advantages(rewards - 0.5, ones.bool(), ones, ones)

    advantages.register_estimator(
        "reads_all", reads_all, reads={"lengths", "verifier_rewards", "draw_weights"}
    )
    presets.register_preset(name="reads_all_preset", estimator="reads_all")
    run = hand_run("algorithm.preset=reads_all_preset")
    batch, _ = collect_batch(run, Timer(run.device))
    lengths = [1, 3, 2, 2, 1, 1, 1, 1]
    mask = torch.tensor([[1.0] * n + [0.0] * (3 - n) for n in lengths])
    verified = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    weights = torch.tensor([0.5, 2.0])
    batch = dataclasses.replace(batch, mask=mask, verifier_rewards=verified, draw_weights=weights)
    _, adv_n, _ = step_advantages(run, batch, None)
    assert seen["lengths"].tolist() == [[1, 3, 2, 2], [1, 1, 1, 1]]
    assert seen["verifier_rewards"] is verified and seen["draw_weights"] is weights
    assert adv_n.tolist() == (batch.rewards - 0.5).reshape(-1).tolist()  # not weighted


def test_a_registered_surrogates_step_selection_spans_every_micro_batch(clean_registry, hand_run):
    calls = []

    def select(logps, old_logps, advs, masks, **params):
        calls.append(([len(x) for x in logps], params))
        return [torch.zeros_like(m, dtype=torch.bool) for m in masks]

    def sur(logp, old_logp, adv, mask, *, cut: float = 1.0, selected=None, stats=True):
        """−A·logp, 0 at the selected tokens."""
        a = adv if adv.dim() == 2 else adv[:, None]
        keep = mask if selected is None else mask * (~selected).to(mask.dtype)
        return -a * logp * keep, {"selected_seen": float(selected is not None)}

    losses.register_surrogate("sel", sur, reads={"step_selection"}, select=select)
    presets.register_preset(name="sel_preset", surrogate="sel", surrogate_params={"cut": 2.0})
    run = hand_run("algorithm.preset=sel_preset", "optim.micro_batch_size=4")
    batch, _ = collect_batch(run, Timer(run.device))
    n = batch.mask.shape[0]
    targets = Targets(torch.tensor([1.0, -1.0] * 4), torch.ones(n, dtype=torch.bool),
                      torch.ones(n), None, {"cut": 2.0})  # fmt: skip
    log = update.UpdateLog()
    spec = update.LossSpec.of(run.preset, run.cfg)
    assert spec.select is select and not spec.every_row
    update.optimizer_step(
        run.policy, run.optimizer, batch, targets, spec, torch.arange(n),
        timer=Timer(run.device), log=log,
    )  # fmt: skip
    # one selection for the step, over its two micro-batches of 4, with the surrogate's params
    assert calls == [([4, 4], {"cut": 2.0})]
    assert log.taken == 1 and log.policy["selected_seen"] == 1.0


def test_a_registered_transform_trains_from_a_preset_or_an_override(clean_registry, hand_run):
    def clip_adv(rewards, valid, values, *, bound: float = 0.5):
        """Advantages clipped to [−bound, bound]."""
        return values.clamp(-bound, bound)

    advantages.register_transform("clip_adv", clip_adv)
    for overrides in (
        ["algorithm.preset=grpo", "algorithm.transforms={clip_adv: {bound: 0.1}}"],
        ["algorithm.preset=clipped"],
    ):
        if "clipped" not in presets.PRESETS:
            presets.register_preset(name="clipped", transforms={"clip_adv": {"bound": 0.1}})
        run = hand_run(*overrides)
        batch, _ = collect_batch(run, Timer(run.device))
        _, adv_n, _ = step_advantages(run, batch, None)
        plain = advantages.compute("grpo", batch.rewards).values.reshape(-1)  # [N]
        assert bool((plain.abs() > 0.1).any())  # the clip acts
        assert adv_n.tolist() == plain.clamp(-0.1, 0.1).tolist()


def test_a_length_reading_estimator_at_token_level_counts_its_lengths_once(hand_run):
    # OPO reads the completions' lengths; a KL in the reward makes the preset token level,
    # where compute_tokens counts the lengths from the mask itself (the step's are dropped)
    run = hand_run("algorithm.preset=opo", "algorithm.reward_kl_coef=0.1")
    assert run.preset.token_level and "lengths" in run.preset.reads
    batch, _ = collect_batch(run, Timer(run.device))
    ref = run.reference.logprobs(run.policy, batch)  # the policy itself at step 1: KL = 0
    _, adv_n, _ = step_advantages(run, batch, ref)
    mask = batch.mask.view(batch.num_prompts, batch.group_size, -1) > 0  # [P, G, T]
    want = advantages.compute_tokens("opo", batch.rewards, mask, token_rewards=mask * 0.0)
    torch.testing.assert_close(adv_n, want.per_token.float())
