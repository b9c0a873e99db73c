"""``grouprl bench``: JSON parsing of script output, table rows, subset runs and failure rows."""

import json
import textwrap

import pytest

from grouprl import cli
from grouprl.cli import bench


def test_last_json_takes_the_final_top_level_object_after_log_lines():
    text = 'loading...\n{"a": 1}\nmore log\n{\n  "benchmark": "x",\n  "n": {"k": 2}\n}\n'
    assert bench._last_json(text) == {"benchmark": "x", "n": {"k": 2}}
    assert bench._last_json('{"only": true}') == {"only": True}
    assert bench._last_json("no json here\n") is None
    assert bench._last_json("[1, 2]") is None  # a list is not a result object


def test_vs_trl_rows_carry_both_sides_ratios_and_targets():
    res = {
        "results": {
            "grouprl": {
                "samples_per_s": 30.0,
                "tokens_per_s": 300.0,
                "peak_rss_mib": 500.0,
                "eval": {"reward": 0.2},
            },
            "trl": {
                "samples_per_s": 10.0,
                "tokens_per_s": 120.0,
                "peak_rss_mib": 800.0,
                "eval": {"reward": 0.25},
            },
        },
        "ratios": {"samples_per_s": 3.0, "tokens_per_s": 2.5, "peak_rss": 0.625},
        "targets_met": {"samples_per_s_ge_1.5x": True, "eval_reward_not_worse": False},
    }
    rows = {r["metric"]: r for r in bench.rows_for("vs_trl", {"ok": True, "result": res})}
    assert rows["samples/s"] == {
        "metric": "samples/s",
        "grouprl": 30.0,
        "peer": 10.0,
        "ratio": 3.0,
        "target": True,
    }
    assert rows["peak RSS (MiB)"]["ratio"] == 0.625
    assert rows["eval reward after training"]["peer"] == 0.25
    assert rows["eval reward after training"]["target"] is False


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
