"""TRL-style reward functions: TRL's contract and weighting, and failures as counted NaN."""

from __future__ import annotations

import math
import time

import pytest
import torch
import trl_doc_rewards as docs
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl.tasks.rewards import (
    RewardBatch,
    Rewards,
    combine,
    default_range,
    load_reward,
    trainer_state,
)
from grouprl.tasks.verify import UnscorableError

NAN = math.nan


def _batch(completions, **columns):
    n = len(completions)
    return RewardBatch([f"p{i}" for i in range(n)], list(completions), [[i] for i in range(n)],
                       {k: list(v) for k, v in columns.items()})  # fmt: skip


def _same(a, b):
    return all((math.isnan(x) and math.isnan(y)) or x == pytest.approx(y) for x, y in zip(a, b))


# ---- the weighting ------------------------------------------------------------------------


def test_combine_by_hand():
    # weights (1, 0.1). Row 0: 1·1 + 0.1·NaN(None) -> nansum = 1.0.  Row 1: both None -> NaN.
    # Row 2: 0.5 and 2, but function 2 failed on it -> NaN.  Row 3: 1·0 + 0.1·1 = 0.1.
    values = torch.tensor([[1.0, NAN], [NAN, NAN], [0.5, 2.0], [0.0, 1.0]])
    failed = torch.tensor([[False, False], [False, False], [False, True], [False, False]])
    out = combine(values, failed, torch.tensor([1.0, 0.1]))
    assert _same(out.tolist(), [1.0, NAN, NAN, 0.1])


finite_or_nan = st.one_of(st.just(NAN), st.floats(-5, 5, allow_nan=False))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda k: st.tuples(
            st.lists(st.lists(finite_or_nan, min_size=k, max_size=k), min_size=1, max_size=6),
            st.lists(st.floats(-2, 2, allow_nan=False), min_size=k, max_size=k),
        )
    )
)
def test_combine_is_trls_sum_then_normalize_reward(data):
    rows, weights = data
    values, w = torch.tensor(rows, dtype=torch.float64), torch.tensor(weights, dtype=torch.float64)
    # TRL 1.16 grpo_trainer.py, _generate_and_score_completions (sum_then_normalize):
    #   unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    #   rewards = (rewards_per_func * self.reward_weights.unsqueeze(0)).nansum(dim=1)
    #   rewards[unscorable_mask] = torch.nan
    trl = (values * w.unsqueeze(0)).nansum(dim=1)
    trl[torch.isnan(values).all(dim=1)] = NAN
    ours = combine(values, torch.zeros_like(values, dtype=torch.bool), w)
    assert _same(ours.tolist(), trl.tolist())


def test_default_range_assumes_functions_in_zero_one():
    assert default_range([1.0, 0.1]) == pytest.approx((0.0, 1.1))
    assert default_range([1.0, -0.5]) == pytest.approx((-0.5, 1.0))


def test_weights_must_match_the_functions():
    with pytest.raises(ValueError, match=r"2 reward weight.*1 reward function"):
        Rewards([docs.reward_func], [1.0, 2.0])
    with pytest.raises(ValueError, match="numbers"):
        Rewards([docs.reward_func], ["a"])
    assert Rewards([docs.reward_func, docs.reward_func], "1, 0.5").weights == (1.0, 0.5)


# ---- TRL's documented functions, unchanged ------------------------------------------------


@pytest.mark.parametrize("timeout", [0.0, 10.0])
def test_trl_docs_functions_run_unchanged(timeout):
    # the docs' own examples: lengths 6 and 12; \boxed{2} vs "2" right, \boxed{6} vs "5" wrong
    r = Rewards([docs.reward_func])
    out = r.score(_batch([" blue.", " in the sky."]), timeout_s=timeout)
    assert out.rewards == [6.0, 12.0] and out.unscorable == 0
    r = Rewards([docs.boxed_reward_func])
    out = r.score(_batch([r" The solution is \boxed{2}.", r" The solution is \boxed{6}."],
                         ground_truth=["2", "5"]), timeout_s=timeout)  # fmt: skip
    assert out.rewards == [1.0, 0.0]
    chat = [[{"role": "assistant", "content": "<think>a</think><answer>b</answer>"}],
            [{"role": "assistant", "content": "no tags"}]]  # fmt: skip
    assert Rewards([docs.format_reward_func]).score(_batch(chat), timeout_s=timeout).rewards == [
        1.0,
        0.0,
    ]


def test_trl_docs_multi_task_none_semantics():
    # Example 4: each function returns None off its task. Rows: math right (4), math wrong,
    # coding works, and a row of neither task: every function None -> NaN, counted.
    r = Rewards([docs.math_reward_func, docs.coding_reward_func])
    out = r.score(_batch(["4", "5", "def f(): pass", "x"], task=["math", "math", "coding", "x"]))
    assert _same(out.rewards, [1.0, -1.0, 1.0, NAN])
    assert out.unscorable == 1 and "every reward function returned None" in out.errors[0]
    m = out.metrics()
    assert (
        m["reward/math_reward_func/mean"] == 0.0 and m["reward/math_reward_func/none_frac"] == 0.5
    )
    assert m["reward/coding_reward_func/mean"] == 1.0


def test_trls_own_shipped_reward_runs():
    trl_rewards = pytest.importorskip("trl.rewards")
    chat = [[{"role": "assistant", "content": "<think>\nhm\n</think>\nok"}],
            [{"role": "assistant", "content": "ok"}]]  # fmt: skip
    out = Rewards([trl_rewards.think_format_reward]).score(_batch(chat), timeout_s=0)
    assert out.rewards == [1.0, 0.0]


def test_what_every_function_receives():
    seen = {}

    def spy(prompts, completions, completion_ids, trainer_state, answer, **kwargs):
        seen.update(prompts=prompts, ids=completion_ids, step=trainer_state.global_step,
                    max_steps=trainer_state.max_steps, answer=answer, extra=sorted(kwargs))  # fmt: skip
        kwargs["log_metric"]("calls", 1.0)
        return [0.0] * len(completions)

    def named_only(completions):  # no **kwargs: gets only what it names
        return [1.0] * len(completions)

    async def later(completions, **kwargs):  # TRL awaits async functions
        return [0.5] * len(completions)

    r = Rewards([spy, named_only, later])
    r.check_columns(["answer"])
    out = r.score(_batch(["a", "b"], answer=["1", "2"]), state=trainer_state(7, 10), timeout_s=0)
    assert out.rewards == [1.5, 1.5]
    assert seen == {"prompts": ["p0", "p1"], "ids": [[0], [1]], "step": 7, "max_steps": 10,
                    "answer": ["1", "2"], "extra": ["log_metric"]}  # fmt: skip
    assert out.metrics()["reward/spy/calls"] == 1.0


def test_a_function_needing_a_missing_column_is_an_error():
    with pytest.raises(
        ValueError, match=r"needs argument\(s\) \['ground_truth'\].*columns \(answer\)"
    ):
        Rewards([docs.boxed_reward_func]).check_columns(["answer"])


# ---- failures are counted NaN -------------------------------------------------------------


def _raises_on_x(completions, **kwargs):
    return [0.0 if c != "x" else 1 / 0 for c in completions]


def _hangs(completions, **kwargs):
    time.sleep(60)


def _short(completions, **kwargs):
    return [1.0]


def _text(completions, **kwargs):
    return "1.0"


def _infinite(completions, **kwargs):
    return [math.inf if c == "x" else 1.0 for c in completions]


@pytest.mark.parametrize("timeout", [0.0, 5.0])
def test_one_bad_completion_costs_one_nan(timeout):
    # the batch call raises; each completion is retried alone: only "x" is unscorable
    out = Rewards([_raises_on_x, docs.reward_func]).score(
        _batch(["a", "x", "bb"]), timeout_s=timeout
    )
    assert _same(out.rewards, [1.0, NAN, 2.0])  # a failed term makes the sum NaN, not 1.0
    assert out.unscorable == 1 and out.errors == [
        "[1] _raises_on_x: ZeroDivisionError: division by zero"
    ]
    assert out.metrics()["reward/_raises_on_x/failed_frac"] == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (_hangs, "reward function timed out after 0.5 s"),
        (_short, "returned 1 rewards for 3 completions"),
        (_text, "returned str, not a list of rewards"),
    ],
)
def test_a_broken_function_makes_the_batch_unscorable(fn, reason):
    t0 = time.monotonic()
    out = Rewards([fn, docs.reward_func]).score(_batch(["a", "b", "c"]), timeout_s=0.5)
    assert time.monotonic() - t0 < 10
    assert all(math.isnan(x) for x in out.rewards) and out.unscorable == 3
    assert reason in out.errors[0]
    with pytest.raises(UnscorableError, match="3 of 3 completions"):
        Rewards([fn]).score(_batch(["a", "b", "c"]), timeout_s=0.5, max_unscorable_frac=0.5)


def _raises(completions, **kw):
    raise ZeroDivisionError("boom")


def test_the_stop_message_asks_for_what_the_failure_needs():
    # a function that raised must not be told "raise the timeout, now 0 s per call"
    for timeout in (0, 0.5):
        with pytest.raises(UnscorableError) as err:
            Rewards([_raises]).score(_batch(["a", "b"]), timeout_s=timeout, max_unscorable_frac=0)
        text = str(err.value)
        assert "ZeroDivisionError: boom" in text
        assert text.endswith("Fix the reward function(s): see the first errors.")
        assert "timeout" not in text.split("first errors:")[0] and "raise " not in text
    with pytest.raises(UnscorableError) as err:  # a hang: the timeout is the thing to change
        Rewards([_hangs]).score(_batch(["a"]), timeout_s=0.5, max_unscorable_frac=0)
    assert str(err.value).endswith(
        "1 call(s) ran past the timeout: make the reward function(s) faster or raise "
        "sampling.verify_timeout_s (now 0.5 s per call)."
    )
    assert "Fix the reward" not in str(err.value)


def test_infinite_reward_is_a_failure_and_nan_is_none():
    out = Rewards([_infinite]).score(_batch(["a", "x"]), timeout_s=0)
    assert _same(out.rewards, [1.0, NAN]) and "returned inf" in out.errors[0]
    nan_fn = lambda completions, **kw: [NAN, 2.0]  # noqa: E731  TRL reads NaN as None
    out = Rewards([nan_fn, docs.reward_func]).score(_batch(["a", "b"]), timeout_s=0)
    assert out.rewards == [1.0, 3.0]


def test_probe_catches_a_broken_function_before_training():
    with pytest.raises(ValueError, match="returned 1 rewards for 2 completions"):
        Rewards([_short]).probe(_batch(["", ""]))
    with pytest.raises(ValueError, match="timed out"):
        Rewards([_hangs]).probe(_batch(["", ""]), timeout_s=0.5)
    with pytest.raises(ValueError, match=r"'_raises_on_x' failed on a trial call.*ZeroDivision"):
        Rewards([_raises_on_x]).probe(_batch(["x", "x"]), timeout_s=0)
    Rewards([docs.reward_func]).probe(_batch(["", ""]))  # a good one passes


# ---- loading FILE.py:NAME -----------------------------------------------------------------


def test_load_reward_from_a_file_and_its_errors(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text("def correct(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    assert load_reward(f"{f}:correct")(completions=["a"]) == [1.0]
    with pytest.raises(ValueError, match=r"must look like FILE\.py:FUNCTION"):
        load_reward(str(f))
    with pytest.raises(ValueError, match="does not exist"):
        load_reward(f"{tmp_path}/nope.py:correct")
    with pytest.raises(ValueError, match="has no function 'wrong'; its functions: correct"):
        load_reward(f"{f}:wrong")
    with pytest.raises(ValueError, match="raised while being imported: ModuleNotFoundError"):
        load_reward(f"{tmp_path}/broken.py:f")
    with pytest.raises(ValueError, match="reward module 'no_such_module' cannot be imported"):
        load_reward("no_such_module:f")
    assert load_reward("math:sqrt")(4.0) == 2.0  # a module on the path works too
