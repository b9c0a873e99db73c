"""write_run_report: robust to missing keys and bad lines; health warnings replayed."""

import json

import pytest

from grouprl.report import read_metrics, replay_health, write_run_report


def _write(run, rows, extra=""):
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n" + extra)


def test_full_report(tmp_path):
    rows = [
        {
            "step": s,
            "reward/mean": s / 100,
            "acr/rate": 0.5,
            "acr/all_wrong": 0.4,
            "acr/all_correct": 0.1,
            "acr/other": 0.0,
            "kl/mean": 0.01,
            "scale/inv_p95": 3.0,
            "scale/inv_p99": 2000.0 if s == 10 else 3.0,
            "loss/total": 0.2,
            "health/acr_cumulative": 0.5,
            "health/acr_100": 0.5,
            **({"eval/pass@1": 0.2, "eval/pass@8": 0.5} if s % 20 == 0 else {}),
        }
        for s in range(1, 61)
    ]
    run = tmp_path / "run"
    _write(run, rows)
    (run / "config.yaml").write_text("preset: grpo\ntask: maze\n")
    path = write_run_report(run)
    assert path == run / "report.html"
    page = path.read_text()
    assert page.count("data:image/png;base64,") == 1
    assert "[acr_stall] step 50" in page and "[inv_scale_tail] step 10" in page
    assert "eval/pass@8 (step 60)" in page and "config preset" in page
    # The ACR paper's fit at ACR_100 = 0.5: 51.4 - 14.8 = 36.6.
    assert "36.6" in page


def test_missing_keys_and_bad_lines(tmp_path):
    run = tmp_path / "run"
    _write(
        run,
        [{"step": 1, "loss": 0.5}, {"step": 2, "loss": None, "note": "text"}],
        extra='{bad\n[1]\n{"loss": 1}\n',
    )
    rows, errors = read_metrics(run / "metrics.jsonl")
    assert len(rows) == 2 and len(errors) == 3 and errors[0].startswith("line 3")
    page = write_run_report(run).read_text()
    assert "not logged" not in page or "Training curves" in page
    assert "Skipped lines" in page and "line 5" in page
    # Only step keys: still a page.
    _write(run, [])
    assert "no step yet" in write_run_report(run).read_text()


def test_missing_metrics_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="run folder"):
        write_run_report(tmp_path)


def test_replay_health_matches_live_feed():
    rows = [{"step": float(s), "acr/rate": 0.6, "acr/all_wrong": 0.6} for s in range(50)]
    warnings = replay_health(rows)
    assert len(warnings) == 1 and warnings[0].startswith("[acr_stall] step 49")
