"""``grouprl bench``: JSON parsing of script output, table rows, subset runs and failure rows."""

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grouprl import cli
from grouprl.cli import bench


def test_last_json_takes_the_final_top_level_object_after_log_lines():
    text = 'loading...\n{"a": 1}\nmore log\n{\n  "benchmark": "x",\n  "n": {"k": 2}\n}\n'
    assert bench._last_json(text) == {"benchmark": "x", "n": {"k": 2}}
    assert bench._last_json('{"only": true}') == {"only": True}
    assert bench._last_json("no json here\n") is None
    assert bench._last_json("[1, 2]") is None  # a list is not a result object


VS_TRL = {
    "setting": {"model": "smollm2"},
    "results": {
        "grouprl": {
            "samples_per_s": 30.0,
            "tokens_per_s": 300.0,
            "peak_rss_mib": 500.0,
            "steps": 2,
            "phase_s": {"generate": 4.0, "forward": 2.0, "backward": 6.0, "optimizer": 1.0},
            "train_reward_mean": 0.4,
            "eval": {"reward": 0.2},
        },
        "trl": {
            "samples_per_s": 10.0,
            "tokens_per_s": 120.0,
            "peak_rss_mib": 800.0,
            "steps": 2,
            "phase_s": {"generate": 10.0, "forward": 8.0, "backward": 16.0, "optimizer": 1.0},
            "train_reward_mean": 0.3,
            "eval": {"reward": 0.25},
        },
    },
    "ratios": {"samples_per_s": 3.0, "tokens_per_s": 2.5, "peak_rss": 0.625},
    "targets_met": {
        "samples_per_s": True,
        "peak_rss": False,
        "eval_reward_not_worse": False,
    },
    "settings_equal": False,
    "settings": {
        "temperature": {"grouprl": 1.0, "trl": 1.0, "equal": True},
        "autocast in forward passes": {"grouprl": "off", "trl": "cpu bfloat16", "equal": False},
    },
    "observed": {"torch threads in forward": {"grouprl": [1], "trl": [1], "equal": True}},
}


def test_vs_trl_rows_carry_both_sides_ratios_phases_and_targets():
    rows = {r["metric"]: r for r in bench.rows_for("vs_trl", {"ok": True, "result": VS_TRL})}
    assert rows["smollm2: samples/s"] == {
        "metric": "smollm2: samples/s",
        "grouprl": 30.0,
        "peer": 10.0,
        "ratio": 3.0,
        "target": True,
    }
    assert rows["smollm2: peak RSS (MiB)"]["ratio"] == 0.625
    assert rows["smollm2: peak RSS (MiB)"]["target"] is False
    # phases are per step: 6 s of backward over 2 steps
    assert rows["smollm2: backward s/step"]["grouprl"] == 3.0
    assert rows["smollm2: backward s/step"]["peer"] == 8.0
    assert rows["smollm2: eval reward after training"]["target"] is False
    assert rows["smollm2: settings equal (table below)"]["target"] is False


def test_settings_table_printed_under_the_ratios_even_when_the_run_failed(tmp_path, capsys):
    assert bench.settings_rows(VS_TRL) == [
        ("temperature", 1.0, 1.0, True),
        ("autocast in forward passes", "off", "cpu bfloat16", False),
        ("observed: torch threads in forward", [1], [1], True),
    ]
    # a script that prints its JSON and then fails, as vs_trl does on differing settings
    body = f"import json, sys; print(json.dumps({VS_TRL!r})); sys.exit('settings differ')\n"
    _script(tmp_path, "vs_trl", body)
    outcome = bench.run_script(tmp_path / "vs_trl.py", [], timeout=60)
    assert outcome["ok"] is False and "settings differ" in outcome["error"]
    assert outcome["result"]["settings_equal"] is False
    bench.print_table({"vs_trl": outcome}, quick=False)
    out = capsys.readouterr().out
    assert "settings read back from each trainer (1 of 3 differ)" in out
    assert "cpu bfloat16" in out and "autocast in forward passes" in out


def test_model_flag_reaches_the_scripts_that_take_a_model(tmp_path):
    for name in ("vs_trl", "train_step", "advantages"):
        _script(tmp_path, name, "import json, sys; print(json.dumps({'argv': sys.argv[1:]}))\n")
    parser = cli.argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        ["vs_trl", "train_step", "advantages", "--model", "smollm2", "--dir", str(tmp_path),
         "--json", str(tmp_path / "o.json")]
    )  # fmt: skip
    assert bench.run(args) == 0
    got = json.loads((tmp_path / "o.json").read_text())
    assert got["vs_trl"]["result"]["argv"] == ["--model", "smollm2"]
    assert got["train_step"]["result"]["argv"] == ["--models", "smollm2"]
    assert got["advantages"]["result"]["argv"] == []


def test_advantages_rows_use_the_vectorised_peer_and_the_2x_target():
    res = {
        "samples": 8,
        "seconds": {"grpo": 0.001, "rloo": 0.004, "verl_grpo_vectorized": 0.003},
        "ratios": {
            "grpo": {"speedup_vs_verl_grpo_vectorized": 3.0},
            "rloo": {"speedup_vs_verl_grpo_vectorized": 0.75},
        },
    }
    rows = bench.rows_for("advantages", {"ok": True, "result": res})
    assert [r["target"] for r in rows] == [True, False]
    assert rows[0]["grouprl"] == pytest.approx(1.0) and rows[0]["peer"] == pytest.approx(3.0)


def test_generic_rows_flatten_numbers_and_booleans_and_skip_strings():
    rows = bench.rows_for(
        "other",
        {"ok": True, "result": {"a": 1, "s": "x", "d": {"b": 2.5}, "targets": {"ok": True}}},
    )
    assert [(r["metric"], r["grouprl"], r["target"]) for r in rows] == [
        ("a", 1, None),
        ("d/b", 2.5, None),
        ("targets/ok", None, True),
    ]


def test_failed_outcome_is_one_row_with_the_error():
    rows = bench.rows_for("x", {"ok": False, "error": "exit 2: boom"})
    assert rows == [
        {"metric": "exit 2: boom", "grouprl": None, "peer": None, "ratio": None, "target": False}
    ]


def _script(folder, name, body):
    (folder / f"{name}.py").write_text(textwrap.dedent(body), encoding="utf-8")


def test_run_subset_with_quick_args_extra_args_and_failures(tmp_path, capsys):
    _script(
        tmp_path,
        "echo",
        """
        import json, sys
        print("warming up")
        print(json.dumps({"argv": sys.argv[1:], "value": 7}, indent=1))
    """,
    )
    _script(tmp_path, "broken", "import sys; print('bad', file=sys.stderr); sys.exit(3)\n")
    out = tmp_path / "all.json"
    parser = cli.argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        [
            "echo",
            "broken",
            "missing",
            "--dir",
            str(tmp_path),
            "--json",
            str(out),
            "--arg",
            "echo=--steps 3 --name 'a b'",
        ]
    )
    assert bench.run(args) == 1  # one failure makes the command fail
    got = json.loads(out.read_text())
    assert got["echo"]["ok"] and got["echo"]["result"]["argv"] == ["--steps", "3", "--name", "a b"]
    assert not got["broken"]["ok"] and got["broken"]["error"].startswith("exit 3: bad")
    assert not got["missing"]["ok"] and "available: broken, echo" in got["missing"]["error"]
    table = capsys.readouterr().out
    assert "grouprl bench" in table and "value" in table


def test_quick_args_are_passed_only_with_quick(tmp_path):
    _script(tmp_path, "vs_trl", "import json, sys; print(json.dumps({'argv': sys.argv[1:]}))\n")
    parser = cli.argparse.ArgumentParser()
    bench.add_arguments(parser)
    for flags, expected in (([], []), (["--quick"], bench.QUICK_ARGS["vs_trl"])):
        args = parser.parse_args(
            ["vs_trl", "--dir", str(tmp_path), "--json", str(tmp_path / "o.json"), *flags]
        )
        assert bench.run(args) == 0
        got = json.loads((tmp_path / "o.json").read_text())
        assert got["vs_trl"]["result"]["argv"] == expected


def test_timeout_is_a_failure_row(tmp_path):
    _script(tmp_path, "slow", "import time; time.sleep(5)\n")
    outcome = bench.run_script(tmp_path / "slow.py", [], timeout=0.5)
    assert outcome["ok"] is False and "timed out" in outcome["error"]


def test_cli_registers_bench(capsys):
    assert cli.COMMANDS["bench"] == "grouprl.cli.bench"
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage: grouprl bench" in out
    assert cli.HELP["bench"] in " ".join(out.split())  # the one help text, shown under usage


def test_installed_package_without_benchmarks_says_where_they_are(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./benchmarks here
    monkeypatch.setattr(bench, "__file__", str(tmp_path / "site-packages/grouprl/cli/bench.py"))
    with pytest.raises(SystemExit) as exc:
        bench.find_dir()
    assert "not part of the installed package" in str(exc.value)
    assert "--dir" in str(exc.value)


# ---- benchmarks/vs_trl.py: the settings comparison ----------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def _bench_module(name: str):
    """A script of benchmarks/ as a module (its sibling imports resolved)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))  # roofline imports vs_trl's machine block
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _vs_trl_module():
    return _bench_module("vs_trl")


def test_vs_trl_compare_lists_every_differing_row_and_missing_rows():
    vs = _vs_trl_module()
    a = {"dtype": "float32", "opt": {"lr": 1e-6, "betas": [0.9, 0.999]}, "only_a": 1}
    b = {"dtype": "float32", "opt": {"betas": [0.9, 0.999], "lr": 2e-6}, "only_b": 2}
    table = vs.compare(a, b)
    assert [k for k, r in table.items() if r["equal"]] == ["dtype"]
    rows = vs.differing(table)
    assert rows == [
        'opt: grouprl {"betas": [0.9, 0.999], "lr": 1e-06} vs TRL {"betas": [0.9, 0.999], '
        '"lr": 2e-06}',
        'only_a: grouprl 1 vs TRL "<missing>"',
        'only_b: grouprl "<missing>" vs TRL 2',
    ]
    err = vs.SettingsDiffer("before training", rows)
    assert "3 row(s)" in str(err.code) and "only_b" in str(err.code)


@pytest.mark.slow
def test_vs_trl_settings_are_equal_and_a_changed_trl_default_fails_the_run():
    """Both trainers built on the tiny model, settings read back: all equal; TRL's own
    defaults (bf16 autocast, gradient checkpointing) make the run fail, naming the rows."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "--quick", "--settings-only"]
    ok = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr[-2000:]
    res = json.loads(ok.stdout)
    assert res["settings_equal"] is True
    table = res["settings"]
    assert table["autocast in forward passes"] == {"grouprl": "off", "trl": "off", "equal": True}
    assert table["gradient checkpointing"]["trl"] is False
    assert table["initial weights (float64 sum)"]["equal"]
    bad = subprocess.run(
        [*cmd, "--trl-set", "bf16=true", "--trl-set", "gradient_checkpointing=true"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode != 0
    message = bad.stderr.strip().splitlines()[-1]
    assert "settings differ before training" in message and "(2 row(s))" in message
    assert 'autocast in forward passes: grouprl "off" vs TRL "cpu bfloat16"' in message
    assert "gradient checkpointing: grouprl false vs TRL true" in message


ROLLOUT_CORRECTION = {
    "functions": {"batch": [256, 32], "seconds": {"icepop": 0.0004, "mismatch_metrics": 0.002}},
    "step": [
        {"spec": "none", "precision": "same", "seconds": {"step": 2.0, "correction": 0.0}},
        {"spec": "icepop", "precision": "bfloat16", "seconds": {"step": 2.5, "correction": 0.05},
         "correction_frac": 0.02, "recompute_frac": 0.1},
        {"spec": "seq_mis", "precision": "bfloat16", "seconds": {"step": 2.5, "correction": 0.2},
         "correction_frac": 0.08, "recompute_frac": 0.1},
        {"spec": "x", "precision": "bfloat16", "error": ["boom"]},
    ],
    "target": {"correction_frac": 0.05},
}  # fmt: skip


def test_rollout_correction_rows_judge_the_share_of_a_step():
    rows = bench.rows_for("rollout_correction", {"ok": True, "result": ROLLOUT_CORRECTION})
    by = {r["metric"]: r for r in rows}
    assert by["icepop (ms, 256×32 tokens)"]["grouprl"] == pytest.approx(0.4)
    share = "step, bfloat16 rollouts, {}: correction share (target <= 0.05)"
    assert by[share.format("icepop")]["target"] is True
    assert by[share.format("seq_mis")]["target"] is False  # 0.08 of a step: over the target
    assert by["step, bfloat16 rollouts, x: failed"]["target"] is False
    assert "rollout_correction" in bench.BENCHMARKS and "rollout_correction" in bench.QUICK_ARGS


# ---- benchmarks/roofline.py: the decode step's own GEMM limit ---------------------------


def test_shape_bound_is_the_flop_weighted_harmonic_mean_of_the_shape_rates():
    roof = _bench_module("roofline")
    names = [f"linear_{k}" for k in roof.SMOLLM2_DECODE_SHAPES]
    # every shape at one rate: the step runs at that rate, whatever the layer count
    assert roof.shape_bound(dict.fromkeys(names, 37.0), 30) == pytest.approx(37.0)
    # by hand, one layer at batch 64: q,o 2 x 2*64*576*576, k,v 2 x 2*64*576*192, gate,up
    # 2 x 2*64*576*1536, down 2*64*1536*576 = 452,984,832 FLOPs; the head 2*64*576*49,152 =
    # 3,623,878,656 = 8 x the layer. Layers at 10 GFLOP/s, head at 20: 9 / (1/10 + 8/20) = 18
    rates = {**dict.fromkeys(names, 10.0), "linear_lm_head_576x49152": 20.0}
    assert roof.shape_bound(rates, 1) == pytest.approx(18.0)


def test_vs_trl_ratios_include_the_cpu_second_ratio():
    vs = _vs_trl_module()
    g = {
        "samples_per_s": 3.0,
        "tokens_per_s": 30.0,
        "peak_rss_mib": 100.0,
        "samples_per_cpu_s": 2.0,
    }
    t = {
        "samples_per_s": 1.0,
        "tokens_per_s": 20.0,
        "peak_rss_mib": 400.0,
        "samples_per_cpu_s": 0.5,
    }
    r = vs._ratios(g, t)
    assert (r["samples_per_s"], r["tokens_per_s"], r["peak_rss"], r["samples_per_cpu_s"]) == (
        3.0,
        1.5,
        0.25,
        4.0,
    )


# ---- benchmarks/static_decode.py and bf16_rollouts.py -----------------------------------------


def test_static_decode_amortisation_weighs_the_saving_of_a_run_against_the_first_call():
    sd = _bench_module("static_decode")
    # 0.40 -> 0.39 s a decode step: 0.01 x 64 tokens = 0.64 s a training step, 192 s over 300
    a = sd.amortisation(0.40, 0.39, 60.0, 300)
    assert a["decode_cpu_s_saved_per_train_step_at_most"] == pytest.approx(0.64)
    assert a["saved_over_run_cpu_s"] == pytest.approx(192.0)
    assert a["pays"] is True
    assert sd.amortisation(0.40, 0.399, 60.0, 300)["pays"] is False  # 19.2 s < 60 s
    assert sd.amortisation(0.40, 0.45, 60.0, 300)["pays"] is False  # compiled is slower


def test_bf16_rollouts_summary_is_relative_to_the_fp32_setting():
    b = _bench_module("bf16_rollouts")
    fp32 = {
        "setting": "fp32",
        "train_cpu_s": 100.0,
        "samples_per_cpu_s": 1.28,
        "seconds_per_step": {"generate": 40.0},
        "reward_mean": [0.1, 0.2],
        "mismatch": {},
    }
    bf16 = {
        "setting": "bf16_token_tis",
        "train_cpu_s": 80.0,
        "samples_per_cpu_s": 1.6,
        "seconds_per_step": {"generate": 30.0},
        "reward_mean": [0.1, 0.15],
        "mismatch": {"mismatch/kl_k3": 2e-4},
    }
    failed = {"setting": "bf16_none", "error": ["boom"]}
    s = b.summary([fp32, bf16, failed])
    assert list(s) == ["bf16_token_tis"]  # fp32 is the reference, a failed child is left out
    row = s["bf16_token_tis"]
    assert row["samples_per_cpu_s_vs_fp32"] == pytest.approx(1.25)
    assert row["generate_s_vs_fp32"] == pytest.approx(0.75)
    assert row["final_reward_minus_fp32"] == pytest.approx(-0.05)
    assert row["mismatch_kl_k3"] == 2e-4
    assert b.summary([bf16]) == {}  # no fp32 reference: nothing to compare with
    assert set(b.SETTINGS["bf16_token_tis"]) == {"bfloat16", "token_tis"}
