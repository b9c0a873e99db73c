"""The HumanEval task: canonical solutions pass, empty bodies fail, the sandbox decides, NaN only when it breaks."""

from __future__ import annotations

import math
import time

import pytest

import grouprl.tasks.code as code
from grouprl import tasks
from grouprl.tasks.code import HumanEvalTask, SandboxError, build_program, extract_code
from grouprl.tasks.verify import score_batch


@pytest.fixture(scope="module")
def task() -> HumanEvalTask:
    return HumanEvalTask()


@pytest.fixture(scope="module")
def refs(task):
    return [HumanEvalTask._example(p).reference for p in code.load_humaneval()]


@pytest.mark.slow
def test_all_canonical_solutions_pass_and_all_pass_bodies_fail(refs):
    # 328 sandboxed runs through score_batch (4 forked verifier workers): the canonical
    # body of each of the 164 problems must score 1, the same function with `pass` as its
    # body must score 0 (its tests must notice a function that returns None).
    task = HumanEvalTask(timeout_s=20.0)  # generous: 4 workers on a possibly loaded 2-core box
    completions = [r["canonical_solution"] for r in refs] + ["    pass\n"] * len(refs)
    t0 = time.monotonic()
    scores = score_batch(
        task.verify, completions, refs + refs, timeout_s=task.verify_timeout_s, workers=4
    )
    elapsed = time.monotonic() - t0
    canonical, empty = scores.rewards[:164], scores.rewards[164:]
    failed = [r["task_id"] for r, x in zip(refs, canonical) if x != 1.0]
    passed_empty = [r["task_id"] for r, x in zip(refs, empty) if x != 0.0]
    assert (failed, passed_empty, scores.unscorable) == ([], [], 0)
    print(f"\nHumanEval: 164/164 canonical pass, 0/164 `pass` bodies pass, {elapsed:.1f} s")


def test_there_are_164_problems_and_splits_are_disjoint(task):
    assert len(code.load_humaneval()) == 164
    train = {e.id for e in task.examples("train", 131, seed=0)}
    evals = {e.id for e in task.examples("eval", 33, seed=0)}
    assert len(train) == 131 and len(evals) == 33  # round(0.2 * 164) = 33 eval problems
    assert not train & evals and len(train | evals) == 164
    assert len({e.id for e in task.examples("test", 164, seed=0)}) == 164
    a = [e.id for e in task.examples("train", 20, seed=3)]
    assert a == [e.id for e in task.examples("train", 20, seed=3)]  # deterministic
    assert a != [e.id for e in task.examples("train", 20, seed=4)]
    cycled = [e.id for e in task.examples("eval", 40, seed=1)]  # n > size: a second pass
    assert len(cycled) == 40 and set(cycled) == evals
    with pytest.raises(ValueError, match="unknown split"):
        task.examples("dev", 1, seed=0)
    with pytest.raises(ValueError, match="eval_fraction"):
        HumanEvalTask(eval_fraction=1.0)


def test_registered_in_tasks():
    t = tasks.get("humaneval", timeout_s=3.0)
    assert isinstance(t, HumanEvalTask) and t.timeout_s == 3.0 and "humaneval" in tasks.names()


def _ref(task, task_id="HumanEval/0"):
    return next(e.reference for e in task.examples("test", 164, 0) if e.id == task_id)


def test_completion_formats(task):
    ref = _ref(task)
    body, prompt = ref["canonical_solution"], ref["prompt"]
    whole = prompt + body
    assert task.verify(body, ref) == 1.0  # continuation of the prompt (base models)
    assert task.verify(whole, ref) == 1.0  # the whole function, bare
    fenced = f"Here you go:\n```python\n{whole}```\nIt loops over pairs."
    assert task.verify(fenced, ref) == 1.0  # the whole function in a fence (chat models)
    helper_first = f"```python\nimport math\n```\n\n```python\n{whole}```"
    assert task.verify(helper_first, ref) == 1.0  # the block that defines entry_point wins
    assert task.verify("```python\n" + whole, ref) == 1.0  # unterminated fence (truncated)
    assert task.verify(task.demonstration(task._example(code.load_humaneval()[0])), ref) == 1.0
    assert task.verify("    return True\n", ref) == 0.0  # wrong
    assert task.verify("    return (\n", ref) == 0.0  # syntax error
    assert task.verify("", ref) == 0.0
    chatty = "    print('thinking...', end='')\n" + body  # output without a final newline
    assert task.verify(chatty, ref) == 1.0
    assert extract_code("no fence", "f") == "no fence"
    assert extract_code("```py\ndef g(): pass\n```\n```\ndef f(): pass\n```", "f") == (
        "def f(): pass\n"
    )


@pytest.mark.parametrize(
    "hack",
    [
        "    import os\n    os._exit(0)\n",
        "    raise SystemExit(0)\n",
        "    import sys\n    sys.exit(0)\n",
        "    pass\nimport os\nos._exit(0)\n",  # at module level, before the tests run
    ],
)
def test_exiting_early_with_status_zero_is_not_a_pass(task, hack):
    ref = _ref(task)
    res, token = task.run(hack, ref)
    assert res.status == "ok" and token not in res.stdout  # exit 0, but no pass token
    assert task.verify(hack, ref) == 0.0


def test_code_failures_are_zero_not_nan(task):
    ref = _ref(task)
    quick = HumanEvalTask(timeout_s=1.0, memory_mb=256)
    loop, _ = quick.run("    while True:\n        pass\n", ref)
    assert loop.status == "timeout"
    hog, _ = quick.run("    x = bytearray(1 << 30)\n", ref)
    assert hog.status == "memory"
    assert quick.verify("    while True:\n        pass\n", ref) == 0.0
    assert quick.verify("    x = bytearray(1 << 30)\n", ref) == 0.0


def test_sandbox_failure_is_nan_and_counted(task, monkeypatch):
    ref = _ref(task)

    def broken(*args, **kwargs):
        raise SandboxError("the sandbox could not start (simulated)")

    monkeypatch.setattr(code, "run_untrusted", broken)
    assert math.isnan(task.verify(ref["canonical_solution"], ref))
    scores = score_batch(task.verify, ["x", "y"], [ref, ref], max_unscorable_frac=1.0, workers=1)
    assert scores.unscorable == 2 and "returned NaN" in scores.errors[0]


def test_program_layout():
    ref = {"prompt": "def f(x):\n", "entry_point": "f", "test": "def check(c):\n    assert c(1)"}
    prog = build_program(ref, "    return x\n", "tok")
    assert prog == (
        "def f(x):\n    return x\n\n\ndef check(c):\n    assert c(1)\n\ncheck(f)\nprint()\nprint('tok')\n"
    )


class _ChatTokenizer:
    chat_template = "chatml"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_render(task):
    ex = task.examples("train", 1, seed=0)[0]
    assert task.render(ex, None) == ex.reference["prompt"]  # base model: continue the code
    chat = task.render(ex, _ChatTokenizer())
    assert chat.startswith("<user>Complete the following Python function.")
    assert ex.reference["prompt"] in chat and chat.endswith("```<assistant>")
