"""scripts/gpu_check.py on a CPU with a tiny shape: both trainers run and the report adds up."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_full_shape_is_smollm2_135m_without_building_it():
    gc = _module()
    vocab = gc.char_vocabulary(49152 - 5)
    assert len(set(vocab)) == len(vocab) == 49147 and not any(c.isspace() for c in vocab[100:])
    # SmolLM2-135M: 30 layers x (4 attention projections 576x576, 576x192 x2 for 3 KV heads of
    # 64, MLP 3 x 576x1536, two RMSNorms) + tied embedding 49152x576 + final norm
    s = gc.SMOLLM2_135M
    d, f, kv = s["hidden_size"], s["intermediate_size"], 3 * 64
    layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d
    assert s["num_hidden_layers"] * layer + s["vocab_size"] * d + d == 134_515_008


@pytest.mark.slow
def test_gpu_check_runs_on_cpu_with_a_tiny_shape(tmp_path):
    out = tmp_path / "report.json"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--threads", "1",
           "--prompts", "4", "--group", "4", "--tokens", "8", "--steps", "3",
           "--tests", "tests/test_presets.py -q", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads(out.read_text())
    g = report["summary"]["grouprl"]
    assert len(report["results"]["grouprl"]["steps"]) == 3 and g["tokens_per_s"] > 0
    # the split's parts are measured inside the step: they cannot add up to more than it
    assert 0 < sum(g["split_s"].values()) <= g["step_s"] * 1.05
    assert report["tests"]["rc"] == 0  # the --tests command ran and passed
    if importlib.util.find_spec("trl") is not None:
        assert "grouprl / TRL" in proc.stdout
        t = report["summary"]["trl"]
        assert len(report["results"]["trl"]["steps"]) == 3 and t["tokens_per_s"] > 0
        assert report["ratio"]["step_s"] == pytest.approx(g["step_s"] / t["step_s"])
        assert 0 < sum(t["split_s"].values()) <= t["step_s"] * 1.05
