"""grouprl diagnose: a generated file with known answers, bad lines, bad files, run folders."""

import json
import math

import pytest

from grouprl.cli import main
from grouprl.diagnostics.diagnose import diagnose_groups, load_groups

GOOD = [
    # step 0: all-correct, all-wrong, mixed, constant 0.5 -> ACR 3/4, split 1/4 each
    {"prompt_id": "a", "step": 0, "rewards": [1, 1, 1, 1]},
    {"prompt_id": "b", "step": 0, "rewards": [0, 0, 0, 0]},
    {"prompt_id": "c", "step": 0, "rewards": [1, 0, 1, 0]},
    {"prompt_id": "d", "step": 0, "rewards": [0.5, 0.5, 0.5, 0.5]},
    # step 1: mixed with one null (NaN), and a ragged all-correct pair (padded with 2 NaN)
    {"prompt_id": "c", "step": 1, "rewards": [1, 0, None, 0]},
    {"prompt_id": "a", "step": 1, "rewards": [1, 1]},
]
BAD = [
    "garbage",
    '{"rewards": []}',
    '{"rewards": [1, "x"]}',
    "[1, 2]",
    '{"step": "a", "rewards": [1]}',
    '{"rewards": [1e999, 0]}',
    '{"prompt_id": 1}',
]


@pytest.fixture
def groups_file(tmp_path):
    path = tmp_path / "groups.jsonl"
    lines = (
        [json.dumps(g) for g in GOOD[:3]]
        + BAD[:4]
        + [""]
        + [json.dumps(g) for g in GOOD[3:]]
        + BAD[4:]
    )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_groups_known_answers(groups_file):
    gf = load_groups(groups_file)
    assert gf.n_groups == 6 and gf.n_errors == 7 and gf.n_lines == 13
    # Lines: 1-3 good, 4-7 bad, 8 blank, 9-11 good, 12-14 bad.
    assert [no for no, _ in gf.errors] == [4, 5, 6, 7, 12, 13, 14]
    assert "non-empty list" in gf.errors[1][1] and "not a number" in gf.errors[2][1]
    assert "infinite" in gf.errors[5][1] and "integer" in gf.errors[4][1]
    ids, r1 = gf.batches[1]
    assert ids == ["c", "a"] and r1.shape == (2, 4)
    assert math.isnan(r1[0, 2]) and r1[1, 2:].isnan().all()


def test_diagnose_known_answers(groups_file):
    d = diagnose_groups(load_groups(groups_file))
    s0, s1 = d.steps
    assert (s0["acr/rate"], s0["acr/all_correct"], s0["acr/all_wrong"], s0["acr/other"]) == (
        0.75,
        0.25,
        0.25,
        0.25,
    )
    assert s1["acr/rate"] == 0.5 and s1["acr/all_correct"] == 0.5 and s1["reward/nan_count"] == 3
    assert d.totals["ACR (all groups)"] == pytest.approx(4 / 6)
    assert d.totals["malformed lines"] == 7
    by = {r["estimator"]: r for r in d.scale}
    # Updated groups: [1,0,1,0] and [1,0,NaN,0], both σ(ddof 1) = sqrt(1/3): 1/σ = sqrt(3).
    assert by["grpo"]["inv P99"] == pytest.approx(math.sqrt(3), rel=1e-5)
    assert by["rloo"]["inv max"] == 1.0 and by["grpo"]["updated groups"] == pytest.approx(2 / 6)
    # Per-prompt success pooled by prompt_id: a 1.0, b 0.0, c (2+1)/(4+3) = 3/7, d 0.5.
    assert sorted(d.mu) == pytest.approx([0.0, 3 / 7, 0.5, 1.0])
    assert d.group_size == 4 and d.advice is not None


def test_diagnose_stall_warning_and_range_warning(tmp_path):
    path = tmp_path / "stall.jsonl"
    rows = [
        {"prompt_id": p, "step": s, "rewards": [0, 0, 0, 0] if p < 3 else [0, 1, 0, 1]}
        for s in range(55)
        for p in range(4)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    d = diagnose_groups(load_groups(path))
    assert any(w.startswith("[acr_stall] step 49") for w in d.warnings)
    d2 = diagnose_groups(load_groups(path), reward_range=(-1.0, 0.5))
    assert any("reward_range" in w for w in d2.warnings)


def test_cli_file_report_and_bad_lines(groups_file, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["diagnose", str(groups_file), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "7 malformed line(s) skipped" in captured.err and "line 12:" in captured.err
    assert "Per-step collapse" in captured.out
    page = out.read_text()
    assert "data:image/png;base64," in page and "Malformed lines (7, skipped)" in page


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty"),
        (b"\n\n", "is empty"),
        (b"nope\n{}\n", "no valid group"),
        (b"\xff\xfe\x00bin", "UTF-8"),
    ],
)
def test_cli_bad_files_fail_clearly(tmp_path, capsys, content, message):
    path = tmp_path / "x.jsonl"
    path.write_bytes(content)
    assert main(["diagnose", str(path), "--no-report"]) == 2
    assert message in capsys.readouterr().err


def test_cli_missing_path_and_non_run_folder(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["diagnose", str(tmp_path)]) == 2
    assert "not a grouprl run folder" in capsys.readouterr().err


def test_cli_run_folder(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "rewards.jsonl").write_text("\n".join(json.dumps(g) for g in GOOD) + "\n")
    metrics = [
        {
            "step": s,
            "reward/mean": 0.1 * s,
            "acr/rate": 0.5,
            "kl/mean": None,
            "loss/total": 1.0 / (s + 1),
        }
        for s in range(1, 6)
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics) + "\nnot json\n")
    (run / "config.yaml").write_text("preset: grpo\n")
    assert main(["diagnose", str(run)]) == 0
    out = capsys.readouterr().out
    assert "metrics.jsonl: 5 steps (1 bad lines)" in out
    page = (run / "report.html").read_text()
    assert "Logged run metrics" in page and "Per step" in page
    # A run folder with metrics only (no rewards.jsonl) still gets a report.
    (run / "rewards.jsonl").unlink()
    assert main(["diagnose", str(run), "--out", str(tmp_path / "m.html")]) == 0
    assert "Training curves" in (tmp_path / "m.html").read_text()
