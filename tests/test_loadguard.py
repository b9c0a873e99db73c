"""benchmarks/loadguard.py: a headline results file is written only from a run at load <= 2;
a loaded run goes to FILE_loaded.json unless --allow-loaded."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("loadguard", ROOT / "benchmarks" / "loadguard.py")
G = importlib.util.module_from_spec(spec)
spec.loader.exec_module(G)


def test_cpu_names_the_processor_and_its_vector_units():
    got = G.cpu()
    assert set(got) == {"model", "cores", "avx512", "amx"}
    assert isinstance(got["model"], str) and got["model"]
    assert got["cores"] == __import__("os").cpu_count()
    flags = ""
    if Path("/proc/cpuinfo").exists():
        flags = next(
            (ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")),
            "",
        )
    words = set(flags.partition(":")[2].split())  # avx512f, not avx512fp16 alone
    assert got["avx512"] == ("avx512f" in words)
    assert got["amx"] == ("amx_tile" in words)


def test_loaded_name():
    assert G.loaded_name("results/vs_trl_smollm2.json") == Path(
        "results/vs_trl_smollm2_loaded.json"
    )


@pytest.mark.parametrize(
    ("before", "after", "allow", "written", "loaded"),
    [
        ([0.4, 0.3, 0.2], [1.9, 0.8, 0.4], False, "x.json", False),
        ([2.0, 1.0, 1.0], [2.0, 1.0, 1.0], False, "x.json", False),  # the limit itself is idle
        ([3.1, 2.0, 1.0], [1.2, 1.0, 1.0], False, "x_loaded.json", True),  # busy before
        ([0.5, 0.5, 0.5], [2.3, 1.0, 1.0], False, "x_loaded.json", True),  # busy after
        ([9.0, 9.0, 9.0], [9.0, 9.0, 9.0], True, "x.json", True),  # told to overwrite
    ],
)
def test_write_keeps_the_headline_file_from_a_loaded_run(
    tmp_path, before, after, allow, written, loaded
):
    head = tmp_path / "x.json"
    head.write_text('{"idle": true}\n')
    path = G.write({"n": 1}, before, out=head, allow_loaded=allow, load_after=after)
    assert path == tmp_path / written
    got = json.loads(path.read_text())
    assert got == {
        "n": 1,
        "load_average_before": before,
        "load_average_after": after,
        "loaded": loaded,
        "cpu": G.cpu(),
    }
    if written != "x.json":
        assert json.loads(head.read_text()) == {"idle": True}  # untouched


def test_without_out_the_json_goes_to_stdout(capsys):
    assert G.write({"n": 2}, [0.1], out=None, load_after=[5.0]) is None
    assert json.loads(capsys.readouterr().out) == {
        "n": 2, "load_average_before": [0.1], "load_average_after": [5.0], "loaded": True,
        "cpu": G.cpu()}  # fmt: skip


FAKE_LOAD = """
import os, runpy, sys
os.getloadavg = lambda: ({load}, {load}, {load})
sys.path.insert(0, {bench!r})
sys.argv = [{script!r}, *{argv!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def test_the_advantages_benchmark_refuses_a_loaded_headline(tmp_path):
    """The benchmark itself, at a load average of 4 (os.getloadavg replaced): the headline
    file is left, the run is kept as adv_loaded.json (the cases: the tests above)."""
    load, allow, name = 4.0, False, "adv_loaded.json"
    head = tmp_path / "adv.json"
    head.write_text("{}\n")
    argv = ["--prompts", "64", "--group", "4", "--repeat", "1", "--threads", "1",
            "--no-verl-loop", "--no-methods", "--clock", "cpu", "--out", str(head)]  # fmt: skip
    if allow:
        argv.append("--allow-loaded")
    script = str(ROOT / "benchmarks" / "advantages.py")
    code = FAKE_LOAD.format(load=load, bench=str(ROOT / "benchmarks"), script=script, argv=argv)
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads((tmp_path / name).read_text())
    assert got["benchmark"] == "advantages" and got["loaded"] is (load > 2)
    assert got["load_average_before"] == [load] * 3
    if name != "adv.json":
        assert head.read_text() == "{}\n" and "left as it is" in proc.stderr
