"""Math task: JSONL loading, column errors, math-verify rewards, splits."""

from __future__ import annotations

import json
import math

import pytest

from grouprl import tasks
from grouprl.tasks.math import math_verify_reward


@pytest.mark.parametrize(
    ("completion", "gold", "reward"),
    [
        ("The answer is 42.", "42", 1.0),
        ("so $\\boxed{0.5}$", "\\frac{1}{2}", 1.0),  # symbolic equality
        ("\\boxed{\\frac12}", "1/2", 1.0),
        ("$\\boxed{1+x^2}$", "x^2+1", 1.0),  # plain-text gold read as inline math
        ("41", "42", 0.0),
        ("no answer here", "42", 0.0),  # unparseable completion: wrong, not NaN
    ],
)
def test_math_verify_reward(completion, gold, reward):
    assert math_verify_reward(completion, gold) == reward


def test_unparseable_gold_is_nan():
    assert math.isnan(math_verify_reward("42", ""))


def write_rows(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_jsonl_task_splits_and_verify(tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(200)]
    task = tasks.get("math", path=write_rows(tmp_path / "p.jsonl", rows), eval_fraction=0.2)
    train = task.examples("train", 500, seed=0)  # more than the rows: cycles
    held = task.examples("eval", 10, seed=0)
    assert {e.prompt for e in train}.isdisjoint({e.prompt for e in held})
    n_train = len({e.prompt for e in train})
    assert 140 <= n_train <= 180  # ~80 % of 200 rows, every one used when n > rows
    assert task.examples("eval", 10, seed=0) == held
    ex = held[0]
    assert task.verify(task.demonstration(ex), ex.reference) == 1.0
    assert task.verify("\\boxed{-1}", ex.reference) == 0.0


def test_custom_columns_and_eval_path(tmp_path):
    rows = [{"problem": "1+1?", "solution": "2"}]
    path = write_rows(tmp_path / "a.jsonl", rows)
    task = tasks.get("math", path=path, eval_path=path, question="problem", answer="solution")
    assert task.examples("eval", 1, 0)[0].reference == "2"


def test_missing_column_is_named(tmp_path):
    path = write_rows(tmp_path / "b.jsonl", [{"question": "1+1?", "solution": "2"}])
    with pytest.raises(ValueError, match=r"no column 'answer'.*question, solution"):
        tasks.get("math", path=path)


def test_bad_sources(tmp_path):
    with pytest.raises(ValueError, match="needs path"):
        tasks.get("math")
    with pytest.raises(ValueError, match="does not exist"):
        tasks.get("math", path=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "c.jsonl"
    bad.write_text("{not json}\n")
    with pytest.raises(ValueError, match=r"c\.jsonl:1"):
        tasks.get("math", path=str(bad))


def test_math_verify_failure_is_a_counted_nan_not_zero(monkeypatch):
    # math-verify swallows its own timeouts and returns False (a silent 0) unless asked to
    # raise; a hang or crash inside it must reach score_batch as an unscorable NaN.
    import math_verify

    from grouprl.tasks.verify import score_batch

    def hanging_verify(*args, **kwargs):
        assert kwargs.get("raise_on_error") is True
        raise TimeoutError("sympy took too long")

    monkeypatch.setattr(math_verify, "verify", hanging_verify)
    with pytest.raises(TimeoutError):
        math_verify_reward("The answer is $\\boxed{2}$", "2")
    scores = score_batch(
        math_verify_reward,
        ["$\\boxed{2}$", "$\\boxed{3}$"],
        ["2", "2"],
        timeout_s=5,
        max_unscorable_frac=1.0,
        workers=1,
    )
    assert all(math.isnan(r) for r in scores.rewards)
    assert scores.metrics()["reward/unscorable_frac"] == 1.0
