"""One run per folder: a second train on a folder in use refuses at once, naming the holder."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from train_toy import TINY_MAZE_ARGS, grouprl_command, subprocess_env

from grouprl.train.runlock import LOCK_NAME, RunFolderBusy, RunLock
from grouprl.train.sinks import read_jsonl


def _run(*argv: str) -> subprocess.CompletedProcess:
    """``grouprl ARGV`` in a child process, to the end."""
    return subprocess.run(
        grouprl_command(*argv), capture_output=True, text=True, env=subprocess_env(), timeout=120
    )


def _wait(predicate, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"process ended early: {proc.communicate()}")
        time.sleep(0.05)
    raise AssertionError(f"condition not met in {timeout} s")


def test_a_second_lock_in_the_same_process_is_refused_and_names_the_holder(tmp_path):
    with RunLock(tmp_path / "run"):
        with pytest.raises(RunFolderBusy) as info:
            RunLock(tmp_path / "run")
        message = str(info.value)
        assert f"is in use by pid {os.getpid()} on this host {socket.gethostname()}" in message
        assert "started 20" in message and "pass another --out" in message
        assert info.value.holder["pid"] == os.getpid()
    # released at the end of the with block: the folder can be locked again, details emptied
    assert (tmp_path / "run" / LOCK_NAME).read_text() == ""
    RunLock(tmp_path / "run").release()


def test_the_lock_is_released_when_the_body_raises_and_release_is_idempotent(tmp_path):
    with pytest.raises(KeyError), RunLock(tmp_path):
        raise KeyError("boom")
    lock = RunLock(tmp_path)
    lock.release()
    lock.release()
    RunLock(tmp_path).release()


def test_a_file_system_without_locks_is_said_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with RunLock(tmp_path):
        assert '"pid"' in (tmp_path / LOCK_NAME).read_text()
    assert "without file locks" in capsys.readouterr().err


HOLDER = """
import os, sys, time
from grouprl.train.runlock import RunLock
lock = RunLock(sys.argv[1])
child = os.fork()
if child == 0:          # a verifier-like worker that outlives its parent
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
time.sleep(60)
"""


def _holder(tmp_path, script=HOLDER, *args: str) -> tuple[subprocess.Popen, int]:
    """A process that holds the run lock of ``tmp_path`` and has forked a child; (it, child)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path), *args],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    return proc, int(proc.stdout.readline())


def test_a_killed_holder_frees_the_folder_even_while_its_forked_child_lives(tmp_path):
    """Two real processes: the holder is SIGKILLed; its forked child keeps running.

    The child drops its copy of the lock when it first runs (an at-fork hook), which under
    load can be tens of milliseconds after the kill: the new lock waits for it (module
    docstring of ``train.runlock``). Before it did, this failed one run in five beside four
    busy processes."""
    proc, child = _holder(tmp_path)
    try:
        t0 = time.monotonic()
        with pytest.raises(RunFolderBusy, match=f"pid {proc.pid} "):
            RunLock(tmp_path, stale_wait_s=60.0)
        assert time.monotonic() - t0 < 30.0  # a live holder is refused at once, not waited for
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        os.kill(child, 0)  # the child is alive (raises if not)
        RunLock(tmp_path).release()  # yet the folder is free: no stale lock
    finally:
        proc.kill()
        proc.stdout.close()  # its pipe: a ResourceWarning when collected otherwise
        os.kill(child, signal.SIGKILL)


LATE_CHILD = """
import os, sys, time
from grouprl.train.runlock import RunLock
lock = RunLock(sys.argv[1])
fd = os.dup(lock._fd)   # the lock's open file, in a descriptor the at-fork hook leaves open:
child = os.fork()       # a child that has not run its hook yet, for argv[2] seconds
if child == 0:
    time.sleep(float(sys.argv[2]))
    os.close(fd)
    time.sleep(60)
    os._exit(0)
os.close(fd)
print(child, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("holds", [2.0, 60.0])
def test_a_child_holding_a_killed_runs_lock_is_waited_for_then_named(tmp_path, holds):
    """The window made long: the killed run's child keeps the lock ``holds`` seconds. The
    new lock waits for it (up to ``stale_wait_s``), else says that the run has exited and a
    process it started has the lock file open."""
    proc, child = _holder(tmp_path, LATE_CHILD, str(holds))
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        if holds < 10:
            RunLock(tmp_path, stale_wait_s=30.0).release()
            assert time.monotonic() - t0 > 0.3  # it was held, and waited for
        else:
            with pytest.raises(RunFolderBusy) as info:
                RunLock(tmp_path, stale_wait_s=0.5)
            assert time.monotonic() - t0 >= 0.5
            message = str(info.value)
            assert f"(pid {proc.pid}) has exited: a process it started still has" in message
            assert "fuser -v" in message
    finally:
        proc.kill()
        proc.stdout.close()  # its pipe: a ResourceWarning when collected otherwise
        os.kill(child, signal.SIGKILL)


@pytest.mark.slow
def test_two_real_train_processes_on_one_folder(tmp_path):
    """``grouprl train`` twice on one --out: the second refuses (fresh and --resume) naming
    the first, and diagnose works on the live folder."""
    out = tmp_path / "run"
    first = subprocess.Popen(
        grouprl_command(
            "train", *TINY_MAZE_ARGS, "--steps", "100000", "--set", "run.every=1", "--out", str(out)
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(),
    )
    try:
        _wait(lambda: len(read_jsonl(out / "metrics.jsonl")) >= 2, first)
        for extra in ([], ["--resume"]):
            second = _run("train", *TINY_MAZE_ARGS, "--steps", "3", "--out", str(out), *extra)
            assert second.returncode == 2, second
            assert f"is in use by pid {first.pid} on this host" in second.stderr
            assert "Traceback" not in second.stderr
            assert "resume:" not in second.stdout  # refused before loading or resuming
        diagnose = _run("diagnose", str(out), "--no-report")
        assert diagnose.returncode == 0, diagnose.stderr
        assert "metrics.jsonl:" in diagnose.stdout
        steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl")]
        assert steps == list(range(1, len(steps) + 1))  # the first run's log, untouched
        assert first.poll() is None  # and it is still running
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
        first.stdout.close()  # never read to the end: close the pipe, or it leaks
    # that a SIGKILLed run leaves no stale lock: test_kill_resume.py resumes after SIGKILLs
