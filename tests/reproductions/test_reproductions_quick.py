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
SIMULATIONS = ("categorical", "tail_miss", "low_variance", "acr", "normalization", "maxnorm")


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


def test_categorical_parts_runs_only_those_and_says_so(tmp_path, capsys):
    """``--parts main wd0``: only those parts run, the command reproduces the choice and the
    README block names the parts left out; a choice without main is refused with a message."""
    mod = _load("categorical")
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results:start -->\n<!-- results:end -->\n")
    assert (
        mod.main(["--quick", "--seeds", "2", "--parts", "main", "wd0", "--out", str(tmp_path)]) == 0
    )
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["config"]) == {"main", "wd0"}
    assert {r["part"] for r in res["table"]} == {"main", "wd0"}
    assert res["command"] == "python reproductions/categorical/run.py --quick --parts main wd0"
    text = readme.read_text()
    assert "wd0: no weight decay" in text and "parts not run: hu, logprob, plain" in text
    assert "Hu et al.'s η = 1e-3" not in text  # no header for a part that did not run
    assert (
        mod.main(["--quick", "--seeds", "2", "--parts", "main", "logprob", "--out", str(tmp_path)])
        == 0
    )
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["config"]["logprob"]["surrogate"] == "logprob"
    assert {r["surrogate"] for r in res["table"] if r["part"] == "logprob"} == {"logprob"}
    assert {r["surrogate"] for r in res["table"] if r["part"] == "main"} == {"prob"}
    with pytest.raises(SystemExit) as exc:
        mod.main(["--quick", "--parts", "wd0", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "must include main" in capsys.readouterr().err


def test_categorical_add_merges_a_part_into_the_saved_results(tmp_path):
    """``--add logprob`` runs that part alone and keeps the saved parts' rows as they were."""
    mod = _load("categorical")
    (tmp_path / "README.md").write_text("<!-- results:start -->\n<!-- results:end -->\n")
    argv = ["--quick", "--seeds", "2", "--out", str(tmp_path)]
    assert mod.main([*argv, "--parts", "main", "wd0"]) == 0
    before = json.loads((tmp_path / "results.json").read_text())
    assert mod.main([*argv, "--add", "logprob"]) == 0
    after = json.loads((tmp_path / "results.json").read_text())
    assert [r for r in after["table"] if r["part"] != "logprob"] == before["table"]
    assert {r["part"] for r in after["table"]} == {"main", "wd0", "logprob"}
    assert after["command"].endswith("--quick --parts main wd0 logprob")
    assert "parts not run: hu, plain" in (tmp_path / "README.md").read_text()
    with pytest.raises(SystemExit, match="--add must match them"):
        mod.main(["--quick", "--seeds", "3", "--out", str(tmp_path), "--add", "logprob"])


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
def test_maze_quick_runs_trains_and_resumes(tmp_path, monkeypatch):
    """Every arm and the N sweep on 2 x 2 mazes, 2 seeds: schema, the arms differ only in
    focal_gamma and lr, the lr control is calibrated on the f_grpo runs, and a rerun reuses
    every saved run."""
    monkeypatch.setenv("GROUPRL_NO_SFT_CACHE", "1")  # the quick SFT must not fill the cache
    mod = _load("maze")
    argv = ["--quick", "--seeds", "2", "--out", str(tmp_path)]
    assert mod.main(argv) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    arms = ["grpo", "f_grpo γ=0.5", "f_grpo γ=1", "grpo lr×w̄(γ=0.5)", "grpo lr×w̄(γ=1)"]
    assert [r["arm"] for r in res["table"]] == ["SFT start", *arms]
    runs = [r for r in res["runs"] if r["arm"] != "base"]
    main = [r for r in runs if r["group"] == 4]
    assert sorted((r["arm"], r["seed"]) for r in main) == sorted(
        (a, s) for a in arms for s in (0, 1)
    )
    assert sorted(r["seed"] for r in runs if r["group"] == 2) == [0, 0, 1, 1]  # the N sweep
    for r in runs:
        steps = res["config"]["steps"]
        assert sorted(r["evals"], key=int) == ["2", "4"]  # every eval_every steps
        per = r["per_step"]
        mixed, hi = ([int(x) for x in per[k].split()] for k in ("mixed", "mixed_hi"))
        assert len(mixed) == len(hi) == steps and per["groups"] == res["config"]["prompts"]
        assert all(0 <= h <= m <= per["groups"] for h, m in zip(hi, mixed))
    # the control's lr is lr × w̄, w̄ pooled from the saved f_grpo runs' per-step sums
    saved = [json.loads(f.read_text()) for f in (tmp_path / "runs_quick").glob("f_grpo_g0.5_N4_s*")]
    mixed = sum(x["mixed"] for r in saved for x in r["curve"])
    w = sum(x["w_0.5_sum"] for r in saved for x in r["curve"]) / mixed
    assert 0 < w <= 1 and res["control_scale"]["γ=0.5"] == pytest.approx(w)
    ctl = [r for r in main if r["arm"] == "grpo lr×w̄(γ=0.5)"]
    assert all(r["lr"] == pytest.approx(res["config"]["lr"] * w, rel=1e-3) for r in ctl)
    # arms differ only in focal_gamma and lr: f_grpo_baseline / f_grpo, equal in every other
    # field (presets.baseline_of), the same sampling and update schedule
    from grouprl import presets
    from grouprl.train.config import load_config

    a = mod._args(argv)
    cfgs = [
        load_config(None, [o.replace("{seed}", "0") for o in mod.overrides(a, g, 4, lr)])
        for g, lr in ((0.0, 1e-4), (0.5, 1e-4), (0.0, 5e-5))
    ]
    assert [c.algorithm.preset for c in cfgs] == ["f_grpo_baseline", "f_grpo", "f_grpo_baseline"]
    resolved = [c.algorithm.resolve() for c in cfgs]
    assert resolved[0] == presets.get("f_grpo_baseline").with_(focal_gamma=0.0)
    assert resolved[1] == presets.get("f_grpo")  # γ = 0.5: the preset itself
    assert resolved[1].with_(name=resolved[0].name, description=resolved[0].description,
                             focal_gamma=0.0, sources=resolved[0].sources) == resolved[0]  # fmt: skip
    d = [c.to_dict() for c in cfgs]
    for x in d[1:]:
        x["algorithm"] = d[0]["algorithm"]
        x["optim"]["lr"] = d[0]["optim"]["lr"]
        assert x == d[0]
    assert d[0]["optim"]["ppo_epochs"] == 1 and d[0]["optim"]["minibatches"] == 1
    # paired rows: one per comparison, n = 2 seeds
    assert [r["difference"] for r in res["tables"]["paired"]] == [
        "f_grpo γ=0.5 − grpo",
        "f_grpo γ=1 − grpo",
        "f_grpo γ=0.5 − grpo lr×w̄(γ=0.5)",
        "f_grpo γ=1 − grpo lr×w̄(γ=1)",
    ]
    assert all(r["pass@1"]["n"] == 2 for r in res["tables"]["paired"])
    names = {p.name for p in (tmp_path / "runs_quick").iterdir()}
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs_quick").iterdir()}
    assert len(names) == 1 + 5 * 2 + 2 * 2  # base, 5 arms x 2 seeds, the N = 2 sweep
    assert mod.main(argv) == 0  # everything reused: no run file is rewritten
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "runs_quick").iterdir()} == mtimes


@pytest.mark.slow
def test_maze_finished_only_summarises_the_saved_runs_and_names_the_missing(tmp_path, monkeypatch):
    """--finished-only starts no run: after a 1-seed sweep, asking for 2 seeds summarises
    seed 0 alone and lists exactly the seed-1 runs as missing (README included); on an empty
    folder it stops with a message instead of a traceback."""
    monkeypatch.setenv("GROUPRL_NO_SFT_CACHE", "1")
    mod = _load("maze")
    flags = ["--quick", "--out", str(tmp_path), "--gammas", "0.5", "--controls", "closed"]
    with pytest.raises(SystemExit, match="no finished SFT-start evaluation"):
        mod.main([*flags, "--finished-only"])
    (tmp_path / "README.md").write_text("<!-- results:start -->\n<!-- results:end -->\n")
    assert mod.main([*flags, "--seeds", "1"]) == 0
    files = {f: f.stat().st_mtime_ns for f in (tmp_path / "runs_quick").iterdir()}
    assert mod.main([*flags, "--seeds", "2", "--finished-only"]) == 0
    assert {f: f.stat().st_mtime_ns for f in (tmp_path / "runs_quick").iterdir()} == files
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["missing"] == [
        "grpo N=4 seed 1",
        "f_grpo γ=0.5 N=4 seed 1",
        "grpo N=2 seed 1",
        "f_grpo γ=0.5 N=2 seed 1",
        "grpo lr×m_γ(γ=0.5) N=4 seed 1",
    ]
    assert {r["seed"] for r in res["runs"] if r["arm"] != "base"} == {0}
    assert all(r["pass@1"]["n"] == 1 for r in res["tables"]["paired"])
    assert "--finished-only" not in res["command"] and "--seeds 2" in res["command"]
    text = (tmp_path / "README.md").read_text()
    assert "5 planned runs missing" in text and "grpo lr×m_γ(γ=0.5) N=4 seed 1" in text


@pytest.mark.slow
def test_maze_run_killed_inside_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    """--ckpt-every: a run stopped after step 5 of 6 continues from its step-4 checkpoint and
    ends with the curve and evaluations of a run never stopped; the folder is then removed."""
    monkeypatch.setenv("GROUPRL_NO_SFT_CACHE", "1")
    mod = _load("maze")
    a = mod._args(["--quick", "--ckpt-every", "2"])
    a.steps, a.prompts, a.sft_steps = 6, 8, 40  # enough correct answers for mixed groups
    full = mod.job(a, "f_grpo γ=0.5", 0.5, 8, 1e-3, 0)  # no folder: never checkpointed
    assert (
        sum(r["mixed"] for r in full["curve"]) > 0
        and max(r["grad_norm"] for r in full["curve"]) > 0
    )
    from grouprl.train import loop

    real = loop.train_step

    def stop_at_5(run):
        if run.step == 5:
            raise KeyboardInterrupt
        return real(run)

    folder = tmp_path / "run.partial"
    monkeypatch.setattr(loop, "train_step", stop_at_5)
    with pytest.raises(KeyboardInterrupt):
        mod.job(a, "f_grpo γ=0.5", 0.5, 8, 1e-3, 0, folder=folder)
    assert json.loads((folder / "job.json").read_text())["step"] == 4
    monkeypatch.setattr(loop, "train_step", real)
    again = mod.job(a, "f_grpo γ=0.5", 0.5, 8, 1e-3, 0, folder=folder)
    # json: NaN (no mixed group at a step) compares equal to NaN
    assert json.dumps(again["curve"]) == json.dumps(full["curve"])
    assert json.dumps(again["evals"]) == json.dumps(full["evals"])
    assert [r["step"] for r in again["curve"]] == [1, 2, 3, 4, 5, 6]
    assert not folder.exists()


def test_maze_table4_rows_and_verdicts_by_hand():
    """F-GRPO Table 4 beside ours: per N the paper's pass@1, ours in %, the paired differences
    and the verdict (beyond 2 paired SE: agrees / opposite; else within noise)."""
    mod = _load("maze")

    def run(arm, n, seed, p1):
        return {"arm": arm, "group": n, "seed": seed, "evals": {"10": {"pass@1": p1}}}

    runs = [run("grpo", 8, s, v) for s, v in enumerate((0.50, 0.52, 0.54))]
    runs += [run("f_grpo γ=0.5", 8, s, v) for s, v in enumerate((0.60, 0.61, 0.65))]
    runs += [run("f_grpo γ=1", 8, s, v) for s, v in enumerate((0.49, 0.53, 0.52))]
    by = {(r["arm"], r["group"], r["seed"]): r for r in runs}

    def of(arm, n=8):
        return [by[(arm, n, s)] for s in range(3) if (arm, n, s) in by]

    cfg = {"group": 8, "sweep_groups": [7]}  # N = 7 is not in Table 4: no row
    (row,) = mod.table4_rows(of, cfg)
    assert (row["N"], row["GRPO (paper)"], row["γ=0.5 (paper)"], row["γ=1 (paper)"]) == (
        8, 72.2, 83.4, 76.3,
    )  # fmt: skip
    assert row["GRPO (ours)"]["mean"] == pytest.approx(52.0)
    # γ = 0.5: d = (10, 9, 11) points, mean 10, sd 1, SE 1/√3: beyond 2 SE, as the paper (+11.2)
    d = row["γ=0.5 − GRPO, ours"]
    assert d["mean"] == pytest.approx(10.0) and d["se"] == pytest.approx(1 / math.sqrt(3))
    assert row["γ=0.5 − GRPO, paper"] == 11.2 and row["γ=0.5 verdict"] == "agrees"
    # γ = 1: d = (−1, 1, −2), mean −2/3, SE 0.882: within noise, opposite to the paper's +4.1
    assert row["γ=1 − GRPO, paper"] == 4.1
    assert row["γ=1 verdict"] == "opposite sign, within 2 SE"


def test_maze_endpoint_checks_by_hand():
    """The endpoint rule: pass@1's rise over the second half (last − half-way evaluation,
    paired by seed) or the pass@k_max − pass@1 gap at the end below 0.03."""
    mod = _load("maze")

    def curve(arm, metric, by_step):
        row = {"arm": arm, "metric": metric}
        for step, vals in by_step.items():
            row[str(step)] = {"mean": sum(vals) / len(vals), "n": len(vals), "values": vals}
        return row

    p1 = {0: [0.4], 500: [0.5, 0.5], 1000: [0.52, 0.50], 1500: [0.54, 0.56]}
    late = {0: [0.4], 500: [0.5, 0.5], 1000: [0.50, 0.50], 1500: [0.55, 0.57]}
    tables = {
        "curves": [
            curve("a", "pass@1", p1),  # rise 1500 − 1000: (0.02, 0.06), mean 0.04; gap 0.30
            curve("a", "pass@8", {s: [v + 0.3 for v in vs] for s, vs in p1.items()}),
            curve("b", "pass@1", late),  # rise 0.06, but the gap is 0.01: it met pass@8
            curve("b", "pass@8", {s: [v + 0.01 for v in vs] for s, vs in late.items()}),
            curve("c", "pass@1", {0: [0.4], 500: [0.5, 0.5], 1000: [0.51, 0.5], 1500: [0.52, 0.5]}),
            curve("c", "pass@8", {0: [0.9], 500: [0.8, 0.8], 1000: [0.8, 0.8], 1500: [0.8, 0.8]}),
        ]
    }
    got = {c["name"]: c for c in mod._endpoint_checks(tables, "pass@8")}
    assert set(got) == {"a_converged", "b_converged", "c_converged"}
    assert not got["a_converged"]["holds"] and "+0.0400" in got["a_converged"]["detail"]
    assert got["b_converged"]["holds"]  # the gap rule
    assert got["c_converged"]["holds"]  # rise (0.01, 0.0): mean 0.005 < 0.03
    assert "step 1500 − step 1000" in got["c_converged"]["detail"]


def test_maze_appk_plan_every_n_and_gamma_seed_major_with_the_closed_form_control():
    """--setting appk: N ∈ {4, 8, 16} × γ ∈ {0, 0.5, 1} for every seed, seed by seed, and the
    §5.6 control at lr × m_0.5 = 1e-4 × 32/(15π) (F-GRPO App. N) without calibration."""
    mod = _load("maze")
    a = mod._args(["--setting", "appk", "--seeds", "2"])
    assert (a.size, a.group, a.sweep_groups, a.sft_batch, a.lr) == (9, 8, [4, 16], 32, 1e-4)
    # the appk warm start: 1-3-move answers, 300 steps on ≤ 2 moves then 900 on ≤ 3, a
    # constant lr after each stage's warm-up, the plain cell tokens
    assert (a.min_path, a.max_path, a.max_new, a.sft_schedule, a.coords) == (
        1, 3, 6, "constant", False,
    )  # fmt: skip
    assert mod.sft_stages(a) == [(2, 300), (3, 300), (3, 300), (3, 300)]
    specs = mod.plan(a)
    assert specs[0][0] == "base"
    per_seed = [sp for sp in specs[1:] if sp[4] == 0]
    assert specs[1 : 1 + len(per_seed)] == per_seed  # seed 0 entirely before seed 1
    runs = {(arm, n) for arm, _g, n, _lr, _s in per_seed}
    arms = {"grpo": 0.0, "f_grpo γ=0.5": 0.5, "f_grpo γ=1": 1.0}
    assert {(arm, n) for arm in arms for n in (4, 8, 16)} <= runs
    (ctl,) = [sp for sp in per_seed if sp[0] == "grpo lr×m_γ(γ=0.5)"]
    assert (
        ctl[1] == 0.0
        and ctl[2] == 8
        and ctl[3] == pytest.approx(1e-4 * 32 / (15 * math.pi), rel=1e-3)
    )
    assert all(g == arms[arm] for arm, g, *_ in per_seed if arm in arms)
    assert len(specs) == 1 + 2 * (9 + 1)
    # the small setting keeps its committed defaults: measured controls only, γ 0.5 swept
    small = mod._args([])
    assert (small.controls, small.sweep_gammas, small.model) == (["measured"], [0.5], "tiny")


def test_maze_sft_curriculum_runs_each_stage_on_its_own_range_then_the_task(monkeypatch):
    """--sft-curriculum 2:30 3:20 with --sft-steps 10 on 1..4-move mazes: three warm_start
    calls in that order, on answers of ≤ 2, ≤ 3, ≤ 4 moves, each with the schedule asked for."""
    import grouprl.train.sft as sft

    mod = _load("maze")
    calls = []

    def fake(model, tok, task, *, steps, batch_size, lr, schedule, seed, progress):
        calls.append((task.size, task.min_path, task.max_path, steps, batch_size, schedule, seed))
        return model

    monkeypatch.setattr(sft, "warm_start", fake)
    argv = ["--size", "5", "--max-path", "4", "--sft-steps", "10", "--sft-batch", "8"]
    a = mod._args([*argv, "--sft-curriculum", "2:30", "3:20", "--sft-schedule", "constant"])
    assert mod.sft_stages(a) == [(2, 30), (3, 20), (4, 10)]
    mod._policy(a)
    assert calls == [
        (5, 1, 2, 30, 8, "constant", 0),
        (5, 1, 3, 20, 8, "constant", 0),
        (5, 1, 4, 10, 8, "constant", 0),
    ]
    # no curriculum: the one stage on the task, as before the option existed
    calls.clear()
    mod._policy(mod._args(argv))
    assert calls == [(5, 1, 4, 10, 8, "cosine", 0)]


@pytest.mark.parametrize(
    ("stage", "says"), [("2-30", "not MAX_PATH:STEPS"), ("2:0", "not MAX_PATH:STEPS"),
                        ("1:30", "below --min-path 2")],
)  # fmt: skip
def test_maze_bad_sft_curriculum_is_a_usage_error(stage, says, capsys):
    mod = _load("maze")
    with pytest.raises(SystemExit) as e:
        mod._args(["--min-path", "2", "--sft-curriculum", stage])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_maze_pass_at_1_by_answer_length_hand_case():
    """Four mazes of 8 draws: lengths (1, 3, 1, 2), correct (8, 2, 4, 0): one move 12/16,
    two moves 0, three moves 2/8."""
    mod = _load("maze")
    got = mod.by_length([8, 2, 4, 0], [1, 3, 1, 2], samples=8)
    assert list(got) == [1, 2, 3]
    assert got[1] == {"mazes": 2, "pass@1": 0.75}
    assert got[2] == {"mazes": 1, "pass@1": 0.0} and got[3] == {"mazes": 1, "pass@1": 0.25}
    with pytest.raises(ValueError):  # one length per maze
        mod.by_length([8, 2], [1], samples=8)


def test_maze_paired_statistics_hand_case():
    """Paired differences per seed: mean, SE = sd/√n (ddof 1), sign counts, the bootstrap
    interval; the legacy row."""
    mod = _load("maze")
    # d = (0.1, 0.3, -0.1): mean 0.1, sd = sqrt((0 + 0.04 + 0.04) / 2) = 0.2, SE = 0.2/√3
    p = mod.paired([0.6, 0.8, 0.4], [0.5, 0.5, 0.5])
    assert p["mean"] == pytest.approx(0.1) and p["se"] == pytest.approx(0.2 / math.sqrt(3))
    assert (p["positive"], p["negative"], p["n"]) == (2, 1, 3)
    # n = 3: each extreme resample (all three draws the same seed) has probability 1/27 > 2.5 %,
    # so the 95 % percentile interval is [min d, max d]
    assert (p["ci_low"], p["ci_high"]) == pytest.approx((-0.1, 0.3))
    assert mod.fmt_paired(p) == "+0.1000 ± 0.1155 (2/3 +; 95 % [-0.1000, +0.3000])"
    # a dict saved before the interval was stored: recomputed from its per-seed values
    old_style = {k: p[k] for k in ("mean", "se", "n", "positive", "negative", "values")}
    assert mod.fmt_paired(old_style) == mod.fmt_paired(p)
    one = mod.paired([0.7], [0.5])  # one seed: no SE, no interval
    assert mod.fmt_paired(one) == "+0.2000 ± – (1/1 +)"
    # the earlier sweep, paired by seed (-0.034, SE 0.0075, 5 of 5 negative)
    old = mod.legacy()
    assert old["pass@64"]["mean"] == pytest.approx(-0.034, abs=5e-4)
    assert old["pass@64"]["se"] == pytest.approx(0.0075, abs=5e-4)
    assert old["pass@64"]["negative"] == 5 and old["pass@64"]["n"] == 5


def test_maze_predicted_regime_hand_case():
    """N = 2, one maze with p = 0.5: P(mixed) = 1/2, μ̂ = 1/2 when mixed, w = 0.5^γ."""
    mod = _load("maze")
    got = mod.predicted_regime([4], samples=8, group=2, gammas=[0.5, 1.0])
    assert got["mixed_share"] == pytest.approx(0.5) and got["hi_of_mixed"] == 1.0
    assert got["w_0.5"] == pytest.approx(math.sqrt(0.5)) and got["w_1"] == pytest.approx(0.5)


def test_committed_results_match_their_readmes():
    """Every committed README block is exactly what its results.json renders to."""
    c = _load_common()
    names = (*SIMULATIONS, "maze", "smollm2_arithmetic", "rollout_correction", "agpo")
    # the maze's other settings render with the maze script's block (--setting ... --out)
    folders = [(n, n) for n in names] + [("maze", f"maze/{s}") for s in ("appk", "converge")]
    for name, where in folders:
        folder = ROOT / where
        if not (folder / "results.json").exists():
            continue
        block = _load(name).readme_block(json.loads((folder / "results.json").read_text()))
        text = (folder / "README.md").read_text()
        inside = text.split(c.START, 1)[1].split(c.END, 1)[0].strip()
        assert inside == block.strip(), f"{where}: README out of date; run --readme-only"


def test_maze_group_regime_hand_case():
    """Five groups of 4 by hand: mixed = rows 0, 1, 4; μ̂ ≥ 0.5 among them = rows 0, 1."""
    import torch

    mod = _load("maze")
    r = torch.tensor(
        [[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float
    )
    got = mod.group_regime(r, [1.0])
    assert (got["groups"], got["mixed"], got["mixed_hi"], got["all_correct"]) == (5, 3, 2, 1)
    assert got["hi_of_mixed"] == pytest.approx(2 / 3)
    assert got["w_1_sum"] == pytest.approx(0.5 + 0.25 + 0.75)  # (1 − μ̂) over mixed groups
    assert got["reward"] == pytest.approx(10 / 20)  # 2 + 3 + 0 + 4 + 1 correct of 20


def test_maze_config_is_the_scripts_f_grpo_arm():
    """configs/maze_focal.yaml = run.py's f_grpo γ=0.5 arm at the script's defaults."""
    from grouprl.train.config import load_config

    mod = _load("maze")
    a = mod._args([])
    ours = load_config(ROOT.parent / "configs" / "maze_focal.yaml").to_dict()
    script = load_config(
        None, [o.replace("{seed}", "0") for o in mod.overrides(a, 0.5, a.group, a.lr)]
    ).to_dict()
    assert ours["task"]["params"] == {
        "size": a.size,
        "min_path": a.min_path,
        "max_path": a.max_path,
    }
    assert ours["model"]["sft_steps"] == a.sft_steps
    for section in ("sampling", "algorithm", "optim"):
        assert ours[section] == script[section], section


@pytest.mark.slow
def test_rollout_correction_quick_runs_logs_the_mismatch_and_resumes(tmp_path, monkeypatch):
    """Every arm on 2 x 2 mazes, 2 seeds: the arms differ only in the rollout precision and the
    correction; the bf16 arms log their mismatch every step and the fp32 arm none; a rerun
    reuses every saved run."""
    monkeypatch.setenv("GROUPRL_NO_SFT_CACHE", "1")
    mod = _load("rollout_correction")
    argv = ["--quick", "--seeds", "2", "--out", str(tmp_path)]
    assert mod.main(argv) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert [r["arm"] for r in res["table"]] == ["SFT start", *mod.ARMS]
    for r in res["runs"]:
        if r["arm"] == "base":
            continue
        per = r["per_step"]
        assert len(per["reward/mean"].split()) == res["config"]["steps"]
        logged = "mismatch/kl_k3" in per and "nan" not in per["mismatch/kl_k3"].split()
        assert logged == (r["arm"] != "fp32"), r["arm"]
    from grouprl.train.config import load_config

    a = mod._args(argv)
    d = [load_config(None, mod.overrides(a, arm, 0)).to_dict() for arm in mod.ARMS]
    for arm, x in zip(mod.ARMS, d):
        precision, spec = mod.ARMS[arm]
        assert x["model"]["rollout_precision"] == precision
        assert x["algorithm"]["overrides"]["rollout_correction"] == spec
        x["model"]["rollout_precision"] = d[0]["model"]["rollout_precision"]
        x["algorithm"]["overrides"]["rollout_correction"] = "none"
        assert x == d[0]  # nothing else differs
    diffs = [r["difference"] for r in res["tables"]["paired"]]
    assert diffs[-1] == "bf16 − fp32" and all(d.endswith("− bf16") for d in diffs[:-1])
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "runs_quick").iterdir()}
    assert len(mtimes) == 1 + len(mod.ARMS) * 2
    assert mod.main(argv) == 0  # everything reused
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "runs_quick").iterdir()} == mtimes
