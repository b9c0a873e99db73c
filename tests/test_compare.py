"""``grouprl compare``: paired statistics by hand on small hand-written run folders."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from grouprl.cli import main
from grouprl.diagnostics.compare import (
    CompareError,
    bootstrap_ci,
    compare,
    curves,
    load_arms,
    load_sweep,
    paired_stats,
)


def make_run(root, name, seed, rows, **config):
    """A run folder: config.yaml (run.seed + ``config`` as section.field) and metrics.jsonl."""
    d = root / name
    d.mkdir(parents=True)
    cfg = {"run": {"seed": seed, "out": str(d)}, "algorithm": {"preset": "grpo"}, "optim": {}}
    for key, value in config.items():
        section, field = key.split("__")
        cfg.setdefault(section, {})[field] = value
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    with open(d / "metrics.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return d


def two_arms(tmp_path, a_end=(0.1, 0.2, 0.3), b_end=(0.3, 0.3, 0.6)):
    """Arm a (baseline) and b, seeds 0-2, eval/pass@1 at steps 0, 5 and 10 (the end)."""
    for arm, ends in (("a", a_end), ("b", b_end)):
        for seed, v in enumerate(ends):
            rows = [
                {"step": 0, "eval/pass@1": 0.0, "eval/pass@8": 0.5},
                {"step": 1, "reward/mean": 0.1},
                {"step": 5, "eval/pass@1": v / 2, "eval/pass@8": 0.5 + v / 4},
                {"step": 10, "eval/pass@1": v, "eval/pass@8": 0.5 + v / 2, "reward/mean": v},
            ]
            make_run(tmp_path, f"{arm}/seed{seed}", seed, rows)
    return {"a": [str(tmp_path / "a" / "*")], "b": [str(tmp_path / "b" / "*")]}


def test_paired_mean_se_and_signs_by_hand(tmp_path):
    res = compare(load_arms(two_arms(tmp_path)), metrics=["eval/pass@1"], at=[5])
    (c,) = res["comparisons"]
    end = c["end"]
    # d = (0.2, 0.1, 0.3): mean 0.2, sd = sqrt((0 + 0.01 + 0.01) / 2) = 0.1, SE = 0.1 / sqrt(3)
    assert end["mean"] == pytest.approx(0.2)
    assert end["se"] == pytest.approx(0.1 / math.sqrt(3))
    assert (end["positive"], end["negative"], end["zero"], end["n"]) == (3, 0, 0, 3)
    assert end["steps"] == [10]
    # at step 5 every value is halved: d/2
    assert c["steps"]["5"]["mean"] == pytest.approx(0.1)
    assert c["steps"]["5"]["se"] == pytest.approx(0.05 / math.sqrt(3))
    assert c["seeds"] == [0, 1, 2] and c["baseline"] == "a"


def test_sign_counts_and_one_seed():
    st = paired_stats([0.2, -0.1, 0.0])
    assert (st["positive"], st["negative"], st["zero"]) == (1, 1, 1)
    assert math.isnan(paired_stats([0.3])["se"])  # no spread from one seed


def test_bootstrap_known_answers():
    assert bootstrap_ci([0.4, 0.4, 0.4]) == (pytest.approx(0.4), pytest.approx(0.4))
    # n = 2, d = (0, 1): resampled means are 0, 0.5, 1 with probability 1/4, 1/2, 1/4, so the
    # 2.5 % and 97.5 % quantiles are 0 and 1, and the 30 % and 70 % quantiles are both 0.5
    assert bootstrap_ci([0.0, 1.0], resamples=20_000) == (0.0, 1.0)
    assert bootstrap_ci([0.0, 1.0], resamples=20_000, level=0.4) == (0.5, 0.5)
    # seeded: the same seed gives the same interval, another seed may not
    d = [0.3, -0.2, 0.5, 0.1, 0.0]
    assert bootstrap_ci(d, seed=3) == bootstrap_ci(d, seed=3)


def test_bootstrap_interval_within_the_range_and_around_the_mean():
    rng = np.random.default_rng(1)
    for _ in range(20):
        d = rng.normal(size=int(rng.integers(2, 9)))
        lo, hi = bootstrap_ci(d, resamples=2000, seed=int(rng.integers(100)))
        assert d.min() - 1e-12 <= lo <= hi <= d.max() + 1e-12
    # a large sample: the percentile interval approaches mean ± 1.96 SE (normal theory)
    d = rng.normal(size=400)
    lo, hi = bootstrap_ci(d, resamples=4000)
    se = d.std(ddof=1) / math.sqrt(d.size)
    assert lo == pytest.approx(d.mean() - 1.96 * se, abs=0.3 * se)
    assert hi == pytest.approx(d.mean() + 1.96 * se, abs=0.3 * se)


def test_default_metrics_are_the_pass_at_k_keys_by_k(tmp_path):
    rows = [{"step": 1, "eval/pass@16": 0.5, "eval/pass@2": 0.2, "eval/pass@1": 0.1, "x": 1}]
    for arm in ("a", "b"):
        make_run(tmp_path, arm, 0, rows)
    res = compare(load_arms({"a": [str(tmp_path / "a")], "b": [str(tmp_path / "b")]}))
    assert res["metrics"] == ["eval/pass@1", "eval/pass@2", "eval/pass@16"]
    assert res["comparisons"][0]["end"]["mean"] == 0.0


def test_curves_mean_and_se_by_hand(tmp_path):
    arms = load_arms(two_arms(tmp_path))
    c = curves(arms["b"], "eval/pass@1")
    assert c["step"] == [0, 5, 10]
    assert c["mean"] == pytest.approx([0.0, 0.2, 0.4])
    # b's ends (0.3, 0.3, 0.6): sd = sqrt((0.01 + 0.01 + 0.04) / 2) = sqrt(0.03)
    assert c["se"][2] == pytest.approx(math.sqrt(0.03) / math.sqrt(3))


def test_unpaired_seeds_name_the_arm_and_the_seed(tmp_path):
    spec = two_arms(tmp_path)
    make_run(tmp_path, "b/seed7", 7, [{"step": 10, "eval/pass@1": 0.5, "eval/pass@8": 0.7}])
    with pytest.raises(CompareError, match=r"arm 'a' lacks seed\(s\) 7"):
        compare(load_arms(spec))


def test_missing_metric_lists_the_ones_present(tmp_path):
    with pytest.raises(CompareError, match=r"'eval/pass@4' is not logged; it logs: .*eval/pass@1"):
        compare(load_arms(two_arms(tmp_path)), metrics=["eval/pass@4"])


def test_different_configs_within_an_arm_name_field_and_values(tmp_path):
    spec = two_arms(tmp_path)
    make_run(tmp_path, "b/seed3", 3, [{"step": 10, "eval/pass@1": 0.5}], optim__lr=0.002)
    make_run(tmp_path, "a/seed3", 3, [{"step": 10, "eval/pass@1": 0.5}])
    with pytest.raises(
        CompareError, match=r"arm 'b': its runs differ in optim\.lr: '<absent>'.*0\.002"
    ):
        compare(load_arms(spec), metrics=["eval/pass@1"])
    # declared as varied, the same arms compare
    res = compare(load_arms(spec), metrics=["eval/pass@1"], vary=["optim.lr"])
    assert res["comparisons"][0]["end"]["n"] == 4


def test_empty_glob_and_absent_step(tmp_path):
    spec = two_arms(tmp_path)
    with pytest.raises(CompareError, match=r"arm 'c': .*nothing.* matches no run folder"):
        load_arms({**spec, "c": [str(tmp_path / "nothing" / "*")]})
    with pytest.raises(
        CompareError, match=r"no eval/pass@1 at step 7; it is logged at steps 0, 5, 10"
    ):
        compare(load_arms(spec), metrics=["eval/pass@1"], at=[7])


def test_baseline_choice_and_errors(tmp_path):
    arms = load_arms(two_arms(tmp_path))
    res = compare(arms, metrics=["eval/pass@1"], baseline="b")
    assert res["comparisons"][0]["end"]["mean"] == pytest.approx(-0.2)
    with pytest.raises(CompareError, match="baseline 'z' is not an arm; the arms: a, b"):
        compare(arms, baseline="z")
    with pytest.raises(CompareError, match="only one arm"):
        compare({"a": arms["a"]})


def test_sweep_file_fills_seeds(tmp_path):
    two_arms(tmp_path)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        yaml.safe_dump(
            {
                "arms": {
                    "a": str(tmp_path / "a" / "seed{seed}"),
                    "b": str(tmp_path / "b" / "seed{seed}"),
                },
                "seeds": [0, 2],
                "baseline": "a",
            }
        )
    )
    spec, rest = load_sweep(sweep)
    assert rest["baseline"] == "a" and len(spec["a"]) == 2
    res = compare(load_arms(spec), metrics=["eval/pass@1"])
    # seeds 0 and 2: d = (0.2, 0.3)
    assert res["comparisons"][0]["end"]["mean"] == pytest.approx(0.25)
    assert res["comparisons"][0]["seeds"] == [0, 2]


def test_cli_writes_json_and_report(tmp_path, capsys):
    spec = two_arms(tmp_path)
    out, js = tmp_path / "r.html", tmp_path / "r.json"
    argv = ["compare", "--arm", f"a={spec['a'][0]}", "--arm", f"b={spec['b'][0]}",
            "--metric", "eval/pass@1,eval/pass@8", "--at", "5", "--out", str(out), "--json", str(js)]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(js.read_text())
    assert [c["metric"] for c in res["comparisons"]] == ["eval/pass@1", "eval/pass@8"]
    # pass@8 = 0.5 + v/2 at the end: d/2 = (0.1, 0.05, 0.15), mean 0.1
    assert res["comparisons"][1]["end"]["mean"] == pytest.approx(0.1)
    html = out.read_text()
    assert "data:image/png;base64" in html and "b − a" in html
    assert "+0.2000 ± 0.0577" in capsys.readouterr().out


def test_cli_errors_are_one_line_without_traceback(tmp_path, capsys):
    spec = two_arms(tmp_path)
    argv = ["compare", "--arm", f"a={spec['a'][0]}", "--arm", f"b={tmp_path}/none/*", "--no-report"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: arm 'b'") and "Traceback" not in err
    assert main(["compare", "--arm", "nonsense", "--no-report"]) == 2
    assert "expected NAME=GLOB" in capsys.readouterr().err


# ---- grouprl sweep ------------------------------------------------------------------------------


def test_sweep_plan_is_seed_major_with_every_override(tmp_path):
    from grouprl.cli.sweep import plan

    data = {
        "arms": {
            "grpo": {
                "runs": str(tmp_path / "g" / "s{seed}"),
                "overrides": ["algorithm.preset=grpo"],
            },
            "dapo": {
                "runs": str(tmp_path / "d" / "s{seed}"),
                "overrides": ["algorithm.preset=dapo"],
            },
        },
        "seeds": [0, 3],
        "common": ["optim.steps=5"],
    }
    jobs = plan(data, threads=1)
    assert [(j.arm, j.seed) for j in jobs] == [("grpo", 0), ("dapo", 0), ("grpo", 3), ("dapo", 3)]
    j = jobs[3]
    assert j.out == tmp_path / "d" / "s3"
    sets = [j.argv[i + 1] for i, a in enumerate(j.argv) if a == "--set"]
    assert sets == ["run.seed=3", "run.threads=1", "optim.steps=5", "algorithm.preset=dapo"]
    assert j.argv[1:5] == ("-m", "grouprl", "train", "--out")
    # the same file is a compare sweep file: {seed} filled from seeds
    sweep = tmp_path / "s.yaml"
    sweep.write_text(yaml.safe_dump(data))
    spec, _ = load_sweep(sweep)
    assert spec["dapo"] == [str(tmp_path / "d" / "s0"), str(tmp_path / "d" / "s3")]


def test_sweep_plan_errors():
    from grouprl.cli.sweep import SweepError, plan

    with pytest.raises(SweepError, match="'seeds': a list of integers"):
        plan({"arms": {"a": {"runs": "r/{seed}"}}})
    with pytest.raises(SweepError, match=r"has no \{seed\}"):
        plan({"arms": {"a": {"runs": "r/x"}}, "seeds": [0]})
    with pytest.raises(SweepError, match="not key=value"):
        plan({"arms": {"a": {"runs": "r/{seed}", "overrides": ["oops"]}}, "seeds": [0]})


def test_sweep_launch_caps_concurrency_skips_finished_and_reports_failures(tmp_path):
    import sys

    from grouprl.cli.sweep import Job, launch

    # each job records its start and end time; one fails; one folder already holds a run
    code = (
        "import sys, time, pathlib; p = pathlib.Path(sys.argv[1]); p.mkdir(parents=True);"
        "t = time.time(); time.sleep(0.6); (p / 't').write_text(f'{t} {time.time()}');"
        "sys.exit(int(sys.argv[2]))"
    )
    jobs = [Job("a", s, tmp_path / f"r{s}", (sys.executable, "-c", code, str(tmp_path / f"r{s}"), str(int(s == 2)))) for s in range(4)]  # fmt: skip
    (tmp_path / "r3").mkdir()
    (tmp_path / "r3" / "metrics.jsonl").write_text("")
    said: list[str] = []
    failed = launch(jobs, n=2, niceness=0, say=said.append)
    assert [j.seed for j in failed] == [2]
    assert any(s.startswith("skip a seed 3") for s in said)
    spans = [tuple(map(float, (tmp_path / f"r{s}" / "t").read_text().split())) for s in range(3)]
    # never more than two at once: at every start, fewer than two others are running
    for start, _ in spans:
        assert sum(1 for a, b in spans if a < start < b) <= 1


def test_sweep_cli_dry_run_and_bad_file(tmp_path, capsys):
    sweep = tmp_path / "s.yaml"
    sweep.write_text(
        yaml.safe_dump({"arms": {"a": {"runs": "r/a{seed}", "overrides": []}}, "seeds": [1]})
    )
    assert main(["sweep", str(sweep), "--dry-run"]) == 0
    assert (
        "grouprl train --out r/a1 --set run.seed=1 --set run.threads=1" in capsys.readouterr().out
    )
    sweep.write_text(yaml.safe_dump({"arms": {"a": "r/a{seed}"}, "seeds": [1]}))
    assert main(["sweep", str(sweep)]) == 2
    assert "to run it, give a mapping with 'runs'" in capsys.readouterr().err
