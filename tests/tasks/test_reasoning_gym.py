"""reasoning-gym adapter: lenient extraction, binary rewards, config handling, task registry."""

from __future__ import annotations

import pytest

from grouprl import tasks
from grouprl.tasks.reasoning_gym import ReasoningGymTask, extract_answer


@pytest.mark.parametrize(
    ("text", "numeric", "expected"),
    [
        ("The answer is 42.", True, "42"),
        ("5 - 3 = 2", True, "2"),  # last number, not the first
        ("<answer>7</answer> and later 9", True, "7"),  # the tag wins over later numbers
        ("so \\boxed{-3} it is, not 5", True, "-3"),
        ("Total: 1,234 apples", True, "1234"),  # thousands comma dropped
        ("It is 7.0", True, "7"),  # trailing .0 trimmed
        ("2.50", True, "2.5"),
        ("\u22124", True, "-4"),  # unicode minus
        ("-0", True, "0"),
        ("no digits here", True, None),
        ("", True, None),
        ("Answer: yes.", False, "yes"),
        ("thinking...\nThe answer is: abc", False, "abc"),
        ("<answer> A B </answer>", False, "A B"),
        ("   \n  ", False, None),
    ],
)
def test_extract_answer(text, numeric, expected):
    assert extract_answer(text, numeric) == expected


def test_scorer_trap_and_binary_reward():
    task = tasks.get("basic_arithmetic")
    entry = {"question": "Calculate 4 - 3.", "answer": "1", "metadata": {}}
    # reasoning-gym's own scorer gives len(gold)/len(reply) = 1/2 to " 1": not binary
    assert task._scorer.score_answer(answer=" 1", entry=entry) == pytest.approx(0.5)
    assert task.verify(" 1", entry) == 1.0  # extracted "1" -> exact match
    assert task.verify("4 - 3 = 1", entry) == 1.0
    assert task.verify("11", entry) == 0.0
    assert task.verify("The answer is 2", entry) == 0.0
    assert task.verify("I don't know", entry) == 0.0
    assert task.verify("1", {"no": "answer"}) != task.verify("1", {"no": "answer"})  # NaN
    partial = ReasoningGymTask("basic_arithmetic", binary=False)
    assert partial.verify("1", entry) == 1.0


def test_default_config_is_one_digit_add_subtract():
    task = tasks.get("basic_arithmetic")
    assert task.name == "basic_arithmetic" and task.reward_range == (0.0, 1.0)
    examples = task.examples("train", 30, seed=0)
    assert examples == task.examples("train", 30, seed=0)
    assert examples != task.examples("eval", 30, seed=0)
    for ex in examples:
        expr = ex.reference["metadata"]["expression"]
        assert ex.reference["metadata"]["num_terms"] == 2
        assert "*" not in expr and "/" not in expr and "(" not in expr
        assert task.verify(ex.reference["answer"], ex.reference) == 1.0
        assert task.verify(task.demonstration(ex), ex.reference) == 1.0


def test_any_dataset_by_name_with_config():
    task = tasks.get("count_bits", max_n=16)
    ex = task.examples("train", 5, seed=1)
    assert all(int(e.reference["answer"]) <= 5 for e in ex)  # at most 5 one-bits below 17
    assert task.verify(f"There are {ex[0].reference['answer']} ones.", ex[0].reference) == 1.0


def test_bad_names_and_config():
    with pytest.raises(ValueError, match=r"no config field.*bogus"):
        tasks.get("basic_arithmetic", bogus=1)
    with pytest.raises(ValueError) as err:
        tasks.get("not_a_task")
    assert "maze" in str(err.value) and "basic_arithmetic" in str(err.value)
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset"):
        ReasoningGymTask("nope")
    with pytest.raises(ValueError, match="n must be"):
        tasks.get("basic_arithmetic").examples("train", 0, 0)
