"""score_batch / safe_verify: failures of the verifier are counted NaN, never 0."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl.tasks.verify import BatchScores, UnscorableError, safe_verify, score_batch


def flaky(completion: str, reference: str) -> float:
    """Behaves according to the completion text; 'a'/'b' are ordinary answers."""
    if completion == "raise":
        raise ZeroDivisionError("boom")
    if completion == "hang":
        while True:
            pass
    if completion == "sleep":
        time.sleep(60)
    if completion == "die":
        os._exit(3)
    if completion == "nan":
        return math.nan
    if completion == "str":
        return "x"  # type: ignore[return-value]
    if completion == "big":
        return 7.0
    return float(completion == reference)


BAD = ["raise", "hang", "die", "nan", "str", "big"]


def test_each_failure_is_nan_with_its_reason_and_good_items_survive():
    comps = ["a", "b", *BAD, "a"]
    scores = score_batch(
        flaky,
        comps,
        ["a"] * len(comps),
        timeout_s=0.5,
        max_unscorable_frac=1.0,
        workers=2,
        reward_range=(0.0, 1.0),
        max_errors=10,
    )
    r = scores.rewards
    assert r[0] == 1.0 and r[1] == 0.0 and r[-1] == 1.0  # a real 0 stays a 0
    assert all(math.isnan(x) for x in r[2:-1])
    assert scores.unscorable == len(BAD)
    assert scores.unscorable_frac == pytest.approx(len(BAD) / len(comps))
    joined = "\n".join(scores.errors)
    for needle in [
        "[2] ZeroDivisionError: boom",
        "[3] verifier timed out after 0.5 s",
        "[4] verifier process died (exit code 3)",
        "[5] verifier returned NaN",
        "[6] verifier returned str",
        "[7] verifier returned 7.0, outside reward_range",
    ]:
        assert needle in joined, joined
    m = scores.metrics()
    assert m["reward/unscorable_frac"] == scores.unscorable_frac
    assert m["reward/unscorable"] == 6.0


def test_matches_a_plain_loop_and_keeps_order():
    comps = [str(i % 7) for i in range(200)]
    refs = [str(i % 3) for i in range(200)]
    scores = score_batch(lambda c, r: float(c == r) * 0.5, comps, refs, timeout_s=5.0, workers=3)
    assert scores.rewards == [float(c == r) * 0.5 for c, r in zip(comps, refs)]
    assert scores.unscorable == 0 and scores.errors == []


def test_hang_costs_one_timeout_and_the_rest_still_scored():
    # 1 hang + 40 quick items on 2 workers: the other worker keeps scoring while one waits,
    # so the batch takes about one timeout (0.5 s), far from 41 timeouts.
    comps = ["sleep"] + ["a"] * 40
    t0 = time.monotonic()
    scores = score_batch(flaky, comps, ["a"] * 41, timeout_s=0.5, workers=2)
    elapsed = time.monotonic() - t0
    assert math.isnan(scores.rewards[0]) and scores.rewards[1:] == [1.0] * 40
    assert 0.5 <= elapsed < 3.0


def test_too_many_unscorable_is_a_clear_error():
    with pytest.raises(UnscorableError, match=r"2 of 3 completions \(67%\).*ZeroDivisionError"):
        score_batch(flaky, ["raise", "raise", "a"], ["a"] * 3, max_unscorable_frac=0.5)
    # exactly at the threshold is allowed (the threshold is "more than")
    s = score_batch(flaky, ["raise", "a"], ["a"] * 2, max_unscorable_frac=0.5)
    assert s.unscorable == 1


def test_safe_verify_and_validation():
    assert safe_verify(flaky, "a", "a") == 1.0
    assert safe_verify(flaky, "b", "a") == 0.0
    assert math.isnan(safe_verify(flaky, "hang", "a", timeout_s=0.2))
    assert math.isnan(safe_verify(flaky, "raise", "a"))
    with pytest.raises(ValueError, match="2 completions but 1 references"):
        score_batch(flaky, ["a", "b"], ["a"])
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        score_batch(flaky, ["a"], ["a"], timeout_s=0)
    with pytest.raises(ValueError, match="max_unscorable_frac"):
        score_batch(flaky, ["a"], ["a"], max_unscorable_frac=1.5)
    empty = score_batch(flaky, [], [])
    assert empty == BatchScores([], 0, [], empty.seconds) and empty.unscorable_frac == 0.0


@settings(max_examples=15, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "raise", "nan", "str", "big"]), max_size=12))
def test_unscorable_count_property(comps):
    s = score_batch(
        flaky,
        comps,
        ["a"] * len(comps),
        max_unscorable_frac=1.0,
        workers=2,
        reward_range=(0.0, 1.0),
    )
    expected = [1.0 if c == "a" else 0.0 if c == "b" else math.nan for c in comps]  # plain loop
    assert len(s.rewards) == len(comps)
    for got, want in zip(s.rewards, expected):
        assert (math.isnan(got) and math.isnan(want)) or got == want
    assert s.unscorable == sum(c not in ("a", "b") for c in comps)
    assert len(s.errors) == min(5, s.unscorable)


@pytest.mark.slow  # imports torch
def test_group_baseline_excludes_the_unscorable_sample():
    import torch

    from grouprl import advantages

    # Group of 4: two right, one wrong, one whose verifier hangs. NaN must be excluded:
    # the baseline is mean(1, 0, 1) = 2/3 over the 3 scored samples, not mean(1,0,1,0) = 1/2.
    scores = score_batch(
        flaky, ["a", "b", "hang", "a"], ["a"] * 4, timeout_s=0.3, max_unscorable_frac=0.5
    )
    assert scores.unscorable == 1
    rewards = torch.tensor([scores.rewards], dtype=torch.float32)  # [1, 4]
    out = advantages.compute("grpo", rewards)
    # By hand over the 3 scored samples: deviations (1/3, -2/3, 1/3), sum of squares 2/3,
    # sample std (ddof 1) sqrt(1/3) = 0.57735; advantages ±dev/(σ + 1e-6) = 0.57735, -1.15470.
    # With the hang scored as 0 instead: mean 1/2, σ = sqrt(1/3), advantages ±0.86603.
    # The unscorable sample itself gets advantage 0 (it carries no gradient).
    want = torch.tensor([[0.57735, -1.15470, 0.0, 0.57735]])
    torch.testing.assert_close(out.values, want, atol=1e-4, rtol=0)
    assert out.scale.item() == pytest.approx(3**-0.5 + 1e-6, abs=1e-6)


def test_math_verify_runs_in_the_workers():
    # The real math verifier (trainer-A's math task) inside the forked workers; importing
    # math_verify in the parent first means each worker inherits it instead of re-importing.
    pytest.importorskip("math_verify")
    import math_verify  # noqa: F401

    from grouprl.tasks.math import math_verify_reward

    comps = ["The answer is \\boxed{2}", "\\boxed{3}", "so $x = \\frac{1}{2}$", "\\boxed{0.5}"]
    refs = ["2", "2", "1/2", "\\frac{1}{2}"]
    scores = score_batch(math_verify_reward, comps, refs, timeout_s=20.0, workers=2)
    assert scores.rewards == [1.0, 0.0, 1.0, 1.0] and scores.unscorable == 0


def _hang_and_tell(completion: str, reference: str) -> float:
    with open(reference, "a") as f:
        f.write(f"{os.getpid()}\n")
    while True:
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_workers_die_with_the_scoring_process(tmp_path):
    # A trainer killed mid-batch (SIGKILL, OOM) must not leave verifier workers running.
    import multiprocessing as mp

    pids_file = str(tmp_path / "pids")
    ctx = mp.get_context("fork")
    scorer = ctx.Process(
        target=score_batch,
        args=(_hang_and_tell, ["a", "b"], [pids_file, pids_file]),
        kwargs={"timeout_s": 60.0, "workers": 2},
    )
    scorer.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if os.path.exists(pids_file) and len(Path(pids_file).read_text().split()) == 2:
            break
        time.sleep(0.02)
    workers = [int(p) for p in Path(pids_file).read_text().split()]
    assert len(workers) == 2 and all(_alive(p) for p in workers)
    scorer.kill()
    scorer.join()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(_alive(p) for p in workers)
