"""Readers of TRL's and verl's rollout logs (grouprl.diagnostics.external) on hand-made files.

The files follow the formats the trainers write (TRL 1.16 ``GRPOTrainer.log`` with
``log_completions=True``; verl 0.9.1 ``RayPPOTrainer._write_generations``); the tests in
``tests/integrations/test_diagnose_peer_logs.py`` read files the real trainers wrote.
"""

import json
import math

import pytest
import torch

from grouprl.cli import main
from grouprl.diagnostics import external
from grouprl.diagnostics.diagnose import diagnose_groups, load_groups

NAN = math.nan

# Two steps of 2 prompts x 3 completions. Columns as TRL writes them: step, prompt, completion,
# the reward functions (correct, fmt), a log_extra column (note), advantage.
TRL_STEPS = {
    1: [
        ("p", "c1", 1.0, 1.0),  # 1 + 0.5 * 1 = 1.5
        ("p", "c2", 0.0, None),  # one function None: nansum -> 0
        ("p", "c3", None, None),  # every function None: NaN (unscorable)
        ("q", "c4", 0.0, 0.0),  # 0
        ("q", "c5", 0.0, 1.0),  # 0.5
        ("q", "c6", 1.0, 0.0),  # 1
    ],
    2: [
        ("q", "c7", 1.0, 1.0),  # 1.5 (prompt q first this step)
        ("q", "c8", 1.0, 1.0),
        ("q", "c9", 1.0, 1.0),
        ("p", "c10", 0.0, 0.0),
        ("p", "c11", 0.0, 0.0),
        ("p", "c12", 0.0, 0.0),
    ],
}
# the same groups, combined by hand with weights (1, 0.5)
TRL_GROUPS = {
    1: {"p": [1.5, 0.0, NAN], "q": [0.0, 0.5, 1.0]},
    2: {"q": [1.5, 1.5, 1.5], "p": [0.0, 0.0, 0.0]},
}


def write_trl(folder, step, rows, extra=True):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = {
        "step": [step] * len(rows),
        "prompt": [r[0] for r in rows],
        "completion": [r[1] for r in rows],
        "correct": [NAN if r[2] is None else r[2] for r in rows],
        "fmt": [NAN if r[3] is None else r[3] for r in rows],
    }
    if extra:
        table["note"] = ["x"] * len(rows)
    table["advantage"] = [0.0] * len(rows)
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(table), folder / f"completions_{step:05d}.parquet")


@pytest.fixture
def trl_dir(tmp_path):
    out = tmp_path / "trl-run"
    for step, rows in TRL_STEPS.items():
        write_trl(out / "completions", step, rows)
    return out


def assert_groups(gf, want):
    assert sorted(gf.batches) == sorted(want)
    for step, groups in want.items():
        ids, rewards = gf.batches[step]
        assert ids == list(groups)  # first-seen order within the step
        expected = torch.tensor(list(groups.values()), dtype=torch.float64)
        torch.testing.assert_close(rewards, expected, equal_nan=True)


def test_trl_groups_are_rebuilt_and_combined_as_trl_combines_them(trl_dir):
    gf = external.load_trl(trl_dir, reward_weights=[1.0, 0.5])
    assert_groups(gf, TRL_GROUPS)
    assert gf.source == "trl" and gf.n_lines == 12 and gf.n_errors == 0
    assert "TRL reward = 1·correct + 0.5·fmt (nansum; NaN where every function returned None)" in (
        gf.notes
    )


def test_trl_reward_columns_and_weights_can_be_named(trl_dir):
    gf = external.load_trl(trl_dir / "completions", reward_columns=["fmt"])
    # fmt alone: step 1 p = (1, NaN, NaN), q = (0, 1, 0)
    torch.testing.assert_close(
        gf.batches[1][1],
        torch.tensor([[1.0, NAN, NAN], [0.0, 1.0, 0.0]], dtype=torch.float64),
        equal_nan=True,
    )
    with pytest.raises(ValueError, match="2 reward weight"):
        external.load_trl(trl_dir, reward_columns=["fmt"], reward_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="no reward column nope"):
        external.load_trl(trl_dir, reward_columns=["nope"])


def test_trl_a_repeated_generation_batch_is_counted_once(trl_dir):
    # TRL logs its latest generation batch at every logging step: with num_iterations = 2 the
    # file of step 3 repeats step 2's rows (with step = 3)
    write_trl(trl_dir / "completions", 3, TRL_STEPS[2])
    gf = external.load_trl(trl_dir, reward_weights=[1.0, 0.5])
    assert sorted(gf.batches) == [1, 2]
    assert any("completions_00003.parquet repeats" in n for n in gf.notes)


def test_trl_bad_tables_fail_clearly(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder = tmp_path / "completions"
    folder.mkdir()
    pq.write_table(pa.table({"step": [1], "prompt": ["p"]}), folder / "completions_00001.parquet")
    with pytest.raises(ValueError, match="missing TRL column"):
        external.load_trl(tmp_path)
    (folder / "completions_00001.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="not a readable parquet file"):
        external.load_trl(tmp_path)
    with pytest.raises(ValueError, match=r"no completions_<step>\.parquet"):
        external.load_trl(tmp_path / "empty-nothing")


# --------------------------------------------------------------------------- verl
def verl_line(step, prompt, score, **extra):
    return json.dumps(
        {"input": prompt, "output": "o", "gts": "a", "score": score, "step": step, **extra}
    )


@pytest.fixture
def verl_dir(tmp_path):
    out = tmp_path / "rollouts"
    out.mkdir()
    # balance_batch reorders the samples: groups are interleaved; one malformed line
    (out / "1.jsonl").write_text(
        "\n".join(
            [
                verl_line(1, "a b", 1.0, acc=1.0),
                verl_line(1, "c d", 0.0, acc=0.0),
                verl_line(1, "a b", 0.0, acc=0.0),
                "{not json",
                verl_line(1, "c d", 0.0, acc=0.0),
            ]
        )
        + "\n"
    )
    (out / "2.jsonl").write_text(
        "\n".join([verl_line(2, "c d", 0.5, acc=1.0), verl_line(2, "c d", 0.25, acc=0.0)]) + "\n"
    )
    (out / "notes.txt").write_text("not a step file")
    return out


def test_verl_groups_are_rebuilt_by_step_and_prompt(verl_dir):
    gf = external.load_verl(verl_dir)
    assert_groups(gf, {1: {"a b": [1.0, 0.0], "c d": [0.0, 0.0]}, 2: {"c d": [0.5, 0.25]}})
    assert gf.n_errors == 1 and gf.errors[0][0] == 4 and "1.jsonl line 4" in gf.errors[0][1]
    assert gf.n_lines == 7
    acc = external.load_verl(verl_dir, score_key="acc")
    torch.testing.assert_close(acc.batches[2][1], torch.tensor([[1.0, 0.0]], dtype=torch.float64))
    one = external.load_verl(verl_dir / "2.jsonl")
    assert sorted(one.batches) == [2]


def test_detect_tells_the_layouts_apart(trl_dir, verl_dir, tmp_path):
    assert external.detect(trl_dir) == "trl"
    assert external.detect(trl_dir / "completions") == "trl"
    assert external.detect(trl_dir / "completions" / "completions_00001.parquet") == "trl"
    assert external.detect(verl_dir) == "verl"
    assert external.detect(verl_dir / "1.jsonl") == "verl"
    ours = tmp_path / "3.jsonl"  # grouprl's own groups format, numbered like verl's
    ours.write_text(json.dumps({"prompt_id": 1, "rewards": [0, 1], "input": "x"}) + "\n")
    assert external.detect(ours) is None
    assert external.detect(tmp_path / "missing") is None
    with pytest.raises(ValueError, match="not a TRL completions log"):
        external.load(ours)
    with pytest.raises(ValueError, match="apply to TRL logs"):
        external.load(verl_dir, reward_weights=[1.0])


def test_a_log_gets_the_same_diagnosis_as_our_own_groups_file(trl_dir, tmp_path):
    # the same groups written in grouprl's JSONL format: every number of the diagnosis agrees
    ours = tmp_path / "groups.jsonl"
    ours.write_text(
        "\n".join(
            json.dumps(
                {"step": s, "prompt_id": p, "rewards": [None if math.isnan(r) else r for r in v]}
            )
            for s, groups in TRL_GROUPS.items()
            for p, v in groups.items()
        )
    )
    kw = {"reward_range": (0.0, 1.5)}
    a = diagnose_groups(external.load_trl(trl_dir, reward_weights=[1.0, 0.5]), **kw)
    b = diagnose_groups(load_groups(ours), **kw)
    assert a.steps == b.steps and a.warnings == b.warnings and a.current == b.current
    assert json.dumps(a.scale) == json.dumps(b.scale)  # NaN-safe equality
    assert a.advice.recommended == b.advice.recommended and a.mu == b.mu
    # and the hand-derived ACR: step 2 has both groups collapsed (all 1.5, all 0)
    assert [r["acr/rate"] for r in a.steps] == [0.0, 1.0]
    assert a.steps[1]["acr/all_correct"] == 0.5 and a.steps[1]["acr/all_wrong"] == 0.5


def test_cli_diagnoses_trl_and_verl_logs(trl_dir, verl_dir, tmp_path, capsys):
    out = tmp_path / "trl.html"
    args = ["diagnose", str(trl_dir), "--reward-weights", "1", "0.5", "--out", str(out)]
    assert main([*args, "--reward-range", "0", "1.5"]) == 0
    printed = capsys.readouterr().out
    assert "Per-step collapse (2 steps, 4 groups)" in printed
    assert "TRL reward = 1·correct + 0.5·fmt" in printed
    assert "data:image/png;base64," in out.read_text()
    assert main(["diagnose", str(verl_dir), "--no-report"]) == 0
    captured = capsys.readouterr()
    assert "Per-step collapse (2 steps, 3 groups)" in captured.out
    assert "1 malformed line(s) skipped" in captured.err
    assert main(["diagnose", str(verl_dir), "--reward-weights", "2", "--no-report"]) == 2
    assert "apply to TRL logs" in capsys.readouterr().err
    assert main(["diagnose", str(trl_dir), "--reward-weights", "1", "--no-report"]) == 2
    assert "1 reward weight(s) for 2 reward column(s)" in capsys.readouterr().err
