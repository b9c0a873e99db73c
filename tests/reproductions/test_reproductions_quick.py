"""Each reproduction's ``--quick`` mode runs and writes results.json with the agreed schema.

In-process (one torch import for all), into a temporary folder; the README block is
rendered from the written results.json. Numbers are not judged here (a quick run is too
small for the claims); the schema, the seed count and the mean ± std entries are.
"""

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "reproductions"
SIMULATIONS = ("categorical", "tail_miss", "low_variance", "acr", "normalization")


def _load(name):
    spec = importlib.util.spec_from_file_location(f"repro_{name}", ROOT / name / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _stats_entries(table):
    for row in table:
        for v in row.values():
            if isinstance(v, dict) and "mean" in v:
                yield v


@pytest.mark.parametrize("name", SIMULATIONS)
def test_quick_run_writes_the_schema(name, tmp_path):
    mod = _load(name)
    readme = tmp_path / "README.md"
    readme.write_text("head\n<!-- results:start -->\nSTALE-BLOCK\n<!-- results:end -->\ntail\n")
    assert mod.main(["--quick", "--seeds", "2", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    common = _load_common()
    assert set(common.SCHEMA_KEYS) <= set(res)
    assert res["quick"] is True and res["seeds"] == [0, 1]
    assert res["command"].startswith(f"python reproductions/{name}/run.py")
    assert res["figure"] == "figure.png" and (tmp_path / "figure.png").stat().st_size > 1000
    stats = list(_stats_entries(res["table"]))
    assert stats, "the table must hold mean ± std entries"
    for s in stats:
        assert s["n"] <= 2 and len(s["values"]) == 2
        finite = [v for v in s["values"] if v is not None and math.isfinite(v)]
        if len(finite) == 2:  # mean and sample std (ddof 1) of the two seed values
            assert s["mean"] == pytest.approx(sum(finite) / 2)
            assert s["std"] == pytest.approx(abs(finite[0] - finite[1]) / math.sqrt(2))
    for c in res["checks"]:
        assert set(c) == {"name", "holds", "detail"} and isinstance(c["holds"], bool)
    text = readme.read_text()
    assert text.startswith("head\n") and text.endswith("tail\n") and "STALE-BLOCK" not in text
    assert "±" in text


def _load_common():
    spec = importlib.util.spec_from_file_location("repro_common", ROOT / "_common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ms_and_update_readme_hand_cases(tmp_path):
    c = _load_common()
    # mean of 1, 2, 4 = 7/3; sample variance = ((4/3)^2 + (1/3)^2 + (5/3)^2) / 2 = 42/18 = 7/3
    got = c.ms([1.0, 2.0, 4.0])
    assert got["mean"] == pytest.approx(7 / 3) and got["std"] == pytest.approx(math.sqrt(7 / 3))
    assert c.ms([5.0])["std"] == 0.0
    assert c.ms([1.0, float("nan")])["n"] == 1  # NaN seeds are counted out, not averaged
    assert c.fmt(c.ms([1.0, 3.0])) == "2 ± 1.4"
    (tmp_path / "README.md").write_text("x\n<!-- results:start -->\na\n<!-- results:end -->\ny")
    c.update_readme(tmp_path, "| t |")
    assert (tmp_path / "README.md").read_text() == (
        "x\n<!-- results:start -->\n| t |\n<!-- results:end -->\ny"
    )
    with pytest.raises(ValueError, match="lacks"):
        c.write_results(tmp_path, {"name": "x"})


@pytest.mark.slow
def test_maze_quick_runs_trains_and_resumes(tmp_path):
    """Two tiny presets, 2 seeds, no SFT: schema, equal budget, and a rerun reuses saved runs."""
    mod = _load("maze")
    argv = ["--quick", "--seeds", "2", "--out", str(tmp_path)]
    assert mod.main(argv) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert [r["preset"] for r in res["table"]] == ["SFT start (base)", "grpo", "dapo"]
    budget = res["config"]["budget_rollouts"]  # 2 steps x 2 mazes x 4 = 16
    assert budget == 16
    runs = [r for r in res["runs"] if r["preset"] != "base"]
    assert len(runs) == 4 and all(r["rollouts"] >= budget for r in runs)
    assert all(r["rollouts"] < budget + 2 * 4 * 4 for r in runs)  # at most one step over
    for row in res["table"][1:]:
        assert set(row) >= {"pass@1", "pass@2", "pass@4", "steps"} and row["pass@1"]["n"] == 2
    saved = sorted(p.name for p in (tmp_path / "runs_quick").iterdir())
    assert saved == sorted(
        ["base_s0.json"] + [f"{p}_s{s}.json" for p in ("grpo", "dapo") for s in (0, 1)]
    )
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs_quick").iterdir()}
    assert mod.main(argv) == 0  # everything reused: no run file is rewritten
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "runs_quick").iterdir()} == mtimes


def test_committed_results_match_their_readmes():
    """Every committed README block is exactly what its results.json renders to."""
    c = _load_common()
    for name in (*SIMULATIONS, "maze", "smollm2_arithmetic"):
        folder = ROOT / name
        if not (folder / "results.json").exists():
            continue
        block = _load(name).readme_block(json.loads((folder / "results.json").read_text()))
        text = (folder / "README.md").read_text()
        inside = text.split(c.START, 1)[1].split(c.END, 1)[0].strip()
        assert inside == block.strip(), f"{name}: README out of date; run --readme-only"
