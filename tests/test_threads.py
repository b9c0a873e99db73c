"""run.threads = 0 (auto): one thread per physical core, never the load; told to OpenMP before
torch loads; and a run's numbers are the same beside a busy process as on its own."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grouprl import _threads as T
from grouprl.train.sinks import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def _sysfs(root: Path, cpus: dict[int, tuple[int, int]]) -> Path:
    """A fake ``/sys/devices/system/cpu``: cpu -> (package, core)."""
    for cpu, (package, core) in cpus.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
    return root


def test_physical_cores_counts_hyperthread_siblings_once(tmp_path, monkeypatch):
    # 4 logical CPUs: two cores with two hyperthreads each, on one package
    sysfs = _sysfs(tmp_path / "a", {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)})
    monkeypatch.setattr(T.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert T.physical_cores(sysfs) == 2
    monkeypatch.setattr(T.os, "sched_getaffinity", lambda pid: {0, 2}, raising=False)
    assert T.physical_cores(sysfs) == 1  # only the CPUs this process may run on
    # the same core_id on two packages is two cores
    sysfs = _sysfs(tmp_path / "b", {0: (0, 0), 1: (1, 0)})
    monkeypatch.setattr(T.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert T.physical_cores(sysfs) == 2
    # no topology to read: the affinity mask
    assert T.physical_cores(tmp_path / "missing") == 2


@pytest.fixture
def machine(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(T, "physical_cores", lambda: 2)

    def set_load(x):
        monkeypatch.setattr(T.os, "getloadavg", lambda: (x, x, x), raising=False)

    return set_load


def test_choose_threads_does_not_follow_the_load(machine, monkeypatch):
    for load in (0.0, 0.9, 5.3, 30.0):
        machine(load)
        assert T.choose_threads(0) == (2, "auto: 2 physical cores")
    assert T.choose_threads(0, cap=1) == (1, "auto: 2 physical cores, torch's count 1")
    assert T.choose_threads(0, cap=4) == (2, "auto: 2 physical cores")
    assert T.choose_threads(3) == (3, "run.threads")  # an explicit count is kept
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert T.choose_threads(0) == (4, "auto: OMP_NUM_THREADS")  # the user's setting wins
    monkeypatch.setattr(T, "physical_cores", lambda: 1)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert T.choose_threads(0) == (1, "auto: 1 physical core")


def test_tell_openmp_sets_the_choice_but_keeps_the_users(machine, monkeypatch):
    machine(3.0)
    assert T.tell_openmp(0) == (2, "auto: 2 physical cores")
    assert os.environ["OMP_NUM_THREADS"] == "2" and os.environ["MKL_NUM_THREADS"] == "2"
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"  # waiting threads sleep, not spin
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delenv("MKL_NUM_THREADS")
    assert T.tell_openmp(0)[0] == 1 and os.environ["MKL_NUM_THREADS"] == "1"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"  # the user's choice is kept


BUSY = "import time\nt = time.time() + 600\nwhile time.time() < t: pass\n"


def _run(out: Path, env: dict[str, str]) -> list[dict]:
    cmd = [sys.executable, "-m", "grouprl", "train", "--out", str(out), "--steps", "6",
           "--prompts-per-step", "4", "--group-size", "4", "--no-progress",
           "--set", "model.sft_steps=30", "--set", "eval.every=3", "--set", "eval.prompts=8",
           "--set", "eval.samples=4", "--set", "eval.ks=[1,4]", "--set", "run.save_final=false",
           "--set", "run.report=false",
           "--set", "run.tensorboard=false"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "threads: 2 (auto: OMP_NUM_THREADS" in proc.stdout
    return read_jsonl(out / "metrics.jsonl")


def test_a_run_gives_the_same_numbers_beside_busy_processes(tmp_path):
    """Two threads, the same command twice: once alone, once beside two busy-looping
    processes (every core taken). Every metric but the clocks is bit for bit equal."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "2",
           "GROUPRL_CACHE": str(tmp_path / "cache")}  # fmt: skip
    env.pop("MKL_NUM_THREADS", None)
    alone = _run(tmp_path / "alone", env)
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2)]
    try:
        loaded = _run(tmp_path / "loaded", {**env, "GROUPRL_CACHE": str(tmp_path / "cache2")})
    finally:
        for p in busy:
            p.kill()
            p.wait()

    def numbers(rows):
        return [{k: v for k, v in r.items() if "time" not in k and not k.endswith("_s")}
                for r in rows]  # fmt: skip

    assert len(alone) == 7 and numbers(alone) == numbers(loaded)
