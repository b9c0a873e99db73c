"""A full disk is a message, not a traceback: ENOSPC injected at each writer of a run folder
(checkpoint, metrics, rewards, config.yaml, report.html), then on a real 6 MB file system."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from train_toy import TINY_MAZE_ARGS, grouprl_command, make, subprocess_env

from grouprl import cli
from grouprl.train import checkpoint as ckpt
from grouprl.train import sinks
from grouprl.train.api import write_report
from grouprl.train.diskfull import DiskFullError, is_disk_full
from grouprl.train.loop import train
from grouprl.train.sinks import JsonlAppender, Sinks, read_jsonl

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _no_torn_line(path):
    """Every line of a JSONL file is whole (parses) and the file ends with a newline."""
    text = Path(path).read_text()
    assert text == "" or text.endswith("\n"), repr(text[-80:])
    return [json.loads(line) for line in text.splitlines()]


def _steps(path):
    return sorted({r["step"] for r in _no_torn_line(path)})


def _full_disk_message(run: Path, *overrides: str) -> str:
    """Train in ``run`` until the injected ENOSPC stops it; the DiskFullError's message."""
    cfg, inj = make(run, *overrides)
    with pytest.raises(DiskFullError) as info:
        train(cfg, **inj)
    return str(info.value)


def _partial_write(target: Path, nbytes: int = 7):
    """A stand-in for ``sinks._write_all`` that writes ``nbytes`` of a line to ``target``
    (a torn line on disk, as a full disk leaves it) and raises ENOSPC."""
    real = sinks._write_all

    def write_all(fd, data):
        if target.exists() and os.path.samestat(os.fstat(fd), os.stat(target)):
            os.write(fd, data[:nbytes])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    return write_all


def test_is_disk_full_follows_the_cause_chain():
    try:
        try:
            raise ENOSPC
        except OSError as err:
            raise RuntimeError("PytorchStreamWriter failed writing file") from err
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(ValueError("x"))


def test_appender_cuts_a_torn_line_back_and_keeps_appending(tmp_path, monkeypatch):
    path = tmp_path / "x.jsonl"
    out = JsonlAppender(path)
    out.write('{"step": 1}\n')
    monkeypatch.setattr(sinks, "_write_all", _partial_write(path))
    with pytest.raises(OSError):
        out.write('{"step": 2, "long": "line"}\n')
    monkeypatch.undo()
    assert path.read_text() == '{"step": 1}\n'  # the 7 bytes written were cut back
    out.write('{"step": 2}\n')
    out.close()
    assert _steps(path) == [1, 2]


def test_checkpoint_full_disk_removes_the_partial_folder_and_names_the_last_good(
    tmp_path, monkeypatch
):
    common = ["optim.steps=3", "run.every=1", "run.keep_last=3"]
    cfg, inj = make(tmp_path / "full", *common)
    train(cfg, **inj)
    real = ckpt._fsync_write

    def full_at_step_2_optimizer(path, obj):
        if path.name == "optimizer.pt" and "step_00000002" in path.parent.name:
            with open(path, "wb") as f:
                f.write(b"partial")  # the space it took must be given back
            raise ENOSPC
        real(path, obj)

    run = tmp_path / "run"
    monkeypatch.setattr(ckpt, "_fsync_write", full_at_step_2_optimizer)
    message = _full_disk_message(run, *common)
    assert "disk full (No space left on device) while writing" in message
    assert f".tmp-step_00000002-{os.getpid()}/optimizer.pt at step 2" in message
    assert "The partial checkpoint" in message and "was removed" in message
    assert f"Last good checkpoint: {run / 'checkpoints/step_00000001'} (step 1)" in message
    assert "then rerun the same command with --resume" in message
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000001"]  # no .tmp-*
    assert ckpt.verify(run / "checkpoints/step_00000001") == 1
    assert _steps(run / "metrics.jsonl") == [1, 2]  # flushed up to the step that failed
    assert _steps(run / "rewards.jsonl") == [1, 2]
    monkeypatch.undo()  # space freed: --resume finishes the run as if nothing happened
    cfg, inj = make(run, *common, "run.resume=true")
    assert train(cfg, **inj).step == 3

    def rows(d):
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read_jsonl(d)]

    assert rows(run / "metrics.jsonl") == rows(tmp_path / "full/metrics.jsonl")


@pytest.mark.parametrize("name", ["metrics.jsonl", "rewards.jsonl"])
def test_jsonl_full_disk_leaves_no_torn_line(tmp_path, monkeypatch, name):
    run = tmp_path / "run"
    monkeypatch.setattr(sinks, "_write_all", _partial_write(run / name))
    message = _full_disk_message(run, "optim.steps=3", "run.every=1")
    assert f"while writing {run / name} at step 1" in message
    assert f"{name} was cut back to its last whole line" in message
    assert "Last good checkpoint: none yet" in message
    assert _steps(run / name) == []  # the torn first line is gone
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())


def test_report_full_disk_removes_the_partial_report(tmp_path, monkeypatch):
    from grouprl.report import html

    def partial_page(path, *args, **kwargs):
        Path(path).write_text("<!doctype html><html>")
        raise ENOSPC

    monkeypatch.setattr(html, "write_page", partial_page)
    run = tmp_path / "run"
    cfg, inj = make(run, "optim.steps=2", "run.report=true")
    result = train(cfg, **inj)
    assert not (run / "report.html").exists()  # the trainer writes no report ...
    with pytest.raises(DiskFullError) as info:
        write_report(cfg, result)  # ... the entry points do, after train()
    message = str(info.value)
    assert f"while writing {run / 'report.html'} at step 2" in message
    assert "The partial report.html was removed" in message
    assert f"Last good checkpoint: {run / 'checkpoints/step_00000002'} (step 2)" in message
    assert not (run / "report.html").exists()
    assert _steps(run / "metrics.jsonl") == [1, 2]


def test_export_full_disk_removes_the_partial_export_and_resume_writes_it(tmp_path, monkeypatch):
    import transformers

    real = transformers.PreTrainedModel.save_pretrained

    def partial(self, folder, *args, **kwargs):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise ENOSPC

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", partial)
    run = tmp_path / "run"
    message = _full_disk_message(run, "optim.steps=2", "run.save_final=true")
    assert f"while writing {run / 'final'} at step 2" in message
    assert "The partial export was removed" in message
    assert f"Last good checkpoint: {run / 'checkpoints/step_00000002'} (step 2)" in message
    assert not any(p.name.startswith((".tmp-final", "final")) for p in run.iterdir())
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", real)
    cfg, inj = make(run, "optim.steps=2", "run.save_final=true", "run.resume=true")
    assert train(cfg, **inj).step == 2
    assert (run / "final/config.json").is_file()
    assert _steps(run / "metrics.jsonl") == [1, 2]


def test_tensorboard_full_disk_is_the_same_message(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")  # an optional extra, not our module
    from torch.utils.tensorboard import SummaryWriter

    def full(self, *args, **kwargs):
        raise ENOSPC

    monkeypatch.setattr(SummaryWriter, "add_scalar", full)
    run = tmp_path / "run"
    message = _full_disk_message(run, "optim.steps=2", "run.tensorboard=true")
    assert f"while writing {run / 'tb'} at step 1" in message  # eval.every=0: no step-0 row
    assert "metrics.jsonl holds every step up to this one" in message
    assert _steps(run / "metrics.jsonl") == [1]  # written before TensorBoard, and whole


def test_config_yaml_full_disk_keeps_the_old_file(tmp_path, monkeypatch):
    Sinks(tmp_path, {"a": 1}, total_steps=1, tensorboard=False, progress=False).close()
    real = Path.write_text

    def full(self, *args, **kwargs):
        if self.name == "config.yaml.tmp":
            real(self, "a: ")
            raise ENOSPC
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(DiskFullError, match=r"config\.yaml at step 0\. config\.yaml was left"):
        Sinks(tmp_path, {"a": 2}, total_steps=1, tensorboard=False, progress=False)
    assert (tmp_path / "config.yaml").read_text() == "a: 1\n"
    assert not (tmp_path / "config.yaml.tmp").exists()


def test_cli_prints_the_message_and_exits_1_without_a_traceback(tmp_path, monkeypatch, capsys):
    real = ckpt._fsync_write

    def full(path, obj):
        if path.name == "model.pt":
            raise ENOSPC
        real(path, obj)

    monkeypatch.setattr(ckpt, "_fsync_write", full)
    argv = ["train", *TINY_MAZE_ARGS, "--steps", "1", "--out", str(tmp_path / "run")]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("grouprl train: stopped: disk full (No space left on device) while")
    assert "model.pt at step 1" in err and "Traceback" not in err
    assert "Last good checkpoint: none yet" in err


DRIVER = r"""
import os, shutil, subprocess, sys
mnt, out, leave, cmd = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
os.makedirs(mnt, exist_ok=True)
mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", mnt],
                         capture_output=True, text=True)
if mounted.returncode:
    print("cannot mount a tmpfs:", mounted.stderr.strip(), file=sys.stderr)
    sys.exit(77)
st = os.statvfs(mnt)
with open(os.path.join(mnt, "ballast"), "wb") as f:   # leave `leave` bytes free
    f.write(b"\0" * (st.f_bavail * st.f_frsize - leave))
run = os.path.join(mnt, "run")
for name, extra in (("first", []), ("second", ["--resume"])):
    p = subprocess.run([*cmd, "--out", run, *extra], capture_output=True, text=True)
    os.makedirs(os.path.join(out, name))
    for stream, text in (("rc", str(p.returncode)), ("stdout", p.stdout), ("stderr", p.stderr)):
        with open(os.path.join(out, name, stream), "w") as f:
            f.write(text)
    with open(os.path.join(out, name, "listing"), "w") as f:
        for d, _, files in os.walk(run):
            for x in [d, *(os.path.join(d, y) for y in files)]:
                f.write(os.path.relpath(x, run) + "\n")
    shutil.copytree(run, os.path.join(out, name, "run"))
    os.remove(os.path.join(mnt, "ballast")) if name == "first" else None  # free the space
"""


@pytest.mark.slow
def test_a_real_six_megabyte_file_system_fills_up_then_resume_finishes(tmp_path):
    """The issue's case on a real tmpfs of 6 MB (in a private mount namespace): the run fills
    it, says so without a traceback, leaves no partial checkpoint and no torn line; after
    the space is freed, --resume ends with the metrics of a run that never failed."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("needs unshare and mount (util-linux) to make a size-limited file system")
    env = subprocess_env()
    cmd = grouprl_command("train", *TINY_MAZE_ARGS, "--steps", "8", "--set", "run.every=1")
    full = subprocess.run(
        [*cmd, "--out", str(tmp_path / "full")], capture_output=True, text=True, env=env
    )
    assert full.returncode == 0, full.stderr
    (tmp_path / "driver.py").write_text(DRIVER)
    out = tmp_path / "out"
    ns = (
        ["unshare", "--user", "--map-root-user", "--mount"]
        if os.geteuid()
        else ["unshare", "--mount"]
    )
    leave = 250_000  # room for about two checkpoints of this model (~100 kB each) and the logs
    proc = subprocess.run(
        [
            *ns,
            sys.executable,
            str(tmp_path / "driver.py"),
            str(tmp_path / "mnt"),
            str(out),
            str(leave),
            *cmd,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if proc.returncode == 77 or proc.stderr.startswith("unshare:"):
        pytest.skip(f"cannot make a size-limited file system here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    first = out / "first"
    err = (first / "stderr").read_text()
    assert (first / "rc").read_text() == "1", err
    assert err.startswith("grouprl train: stopped: disk full (No space left on device) while")
    assert "Traceback" not in err and "--resume" in err
    assert ".tmp-" not in (first / "listing").read_text()  # no partial checkpoint left
    steps = _steps(first / "run/metrics.jsonl")  # no torn line
    assert 0 < len(steps) < 8, steps  # it did stop early
    _no_torn_line(first / "run/rewards.jsonl")
    last = err.split("Last good checkpoint: ")[1].split(" (step")[0]
    assert last.startswith(str(tmp_path / "mnt/run/checkpoints/step_"))
    assert ckpt.verify(first / "run/checkpoints" / Path(last).name) == int(Path(last).name[5:])
    second = out / "second"
    assert (second / "rc").read_text() == "0", (second / "stderr").read_text()
    assert "resume: continuing after step" in (second / "stdout").read_text()

    def rows(path):
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in read_jsonl(path)]

    assert rows(second / "run/metrics.jsonl") == rows(tmp_path / "full/metrics.jsonl")
