"""Runs that get killed lose nothing: SIGKILL at several points, SIGTERM, then --resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_toy import make

from grouprl.train.loop import train
from grouprl.train.sinks import read_jsonl

STEPS = 10
COMMON = [
    f"optim.steps={STEPS}",
    "run.every=1",
    "run.keep_last=2",
    "eval.every=5",
    "eval.prompts=2",
    "eval.samples=4",
    "eval.ks=[1,4]",
    "algorithm.preset=avspo",
    "run.threads=1",  # the uninterrupted reference runs in this process, on one thread
]

DRIVER = """
import sys
from pathlib import Path
sys.path.insert(0, {here!r})
from train_toy import make
from grouprl.train.loop import train
extra = ["run.resume=true"] if sys.argv[2] == "1" else []
cfg, inj = make(Path(sys.argv[1]), *{common!r}, *extra)
result = train(cfg, **inj)
sys.exit(128 + result.stopped_by if result.stopped_by else 0)
"""


def _rows(run_dir):
    return [
        {k: v for k, v in r.items() if not k.startswith("time/")}
        for r in read_jsonl(Path(run_dir) / "metrics.jsonl")
    ]


def _diff(a, b):
    """The first differing step's differing keys, for a readable failure message."""
    for ra, rb in zip(a, b):
        d = {k: (ra.get(k), rb.get(k)) for k in set(ra) | set(rb) if ra.get(k) != rb.get(k)}
        if d:
            return ra["step"], d
    return len(a), len(b)


def _start(tmp_path, out, resume):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(here=str(Path(__file__).parent), common=COMMON))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        [sys.executable, str(script), str(out), "1" if resume else "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _last_step(out) -> int:
    """The last logged step (metrics.jsonl starts with the step-0 evaluation row)."""
    rows = read_jsonl(Path(out) / "metrics.jsonl") if (Path(out) / "metrics.jsonl").exists() else []
    return rows[-1]["step"] if rows else -1


def _wait_for_steps(proc, out, k, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _last_step(out) >= k or proc.poll() is not None:
            return
        time.sleep(0.02)
    raise AssertionError(f"run did not reach step {k} in {timeout} s")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    cfg, inj = make(out, *COMMON)
    train(cfg, **inj)
    return _rows(out)


@pytest.mark.slow
def test_sigkill_at_several_points_then_resume_gives_the_same_metrics(tmp_path, uninterrupted):
    out = tmp_path / "run"
    kills = []
    for k in (2, 6):  # kill while step k+1 runs (mid-generation, mid-update or mid-save)
        proc = _start(tmp_path, out, resume=bool(kills))
        _wait_for_steps(proc, out, k)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills.append(_last_step(out))
    proc = _start(tmp_path, out, resume=True)
    log, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, log
    assert "resume: continuing after step" in log
    assert all(k < STEPS for k in kills), kills  # the kills did interrupt the run
    rows = _rows(out)
    assert rows == uninterrupted, _diff(rows, uninterrupted)  # every step once, same numbers


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_cleanly(tmp_path, uninterrupted):
    out = tmp_path / "run"
    proc = _start(tmp_path, out, resume=False)
    _wait_for_steps(proc, out, 3)
    proc.send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, log
    assert "stopped by signal 15 after step" in log
    stopped = _last_step(out)
    assert (out / f"checkpoints/step_{stopped:08d}/manifest.json").exists()
    proc = _start(tmp_path, out, resume=True)
    log, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, log
    assert f"continuing after step {stopped}" in log
    rows = _rows(out)
    assert rows == uninterrupted, _diff(rows, uninterrupted)
