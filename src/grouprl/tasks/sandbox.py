"""Run untrusted Python (model-written code) contained: limits, no network, nothing left behind.

``run_untrusted(source, timeout_s=..., memory_mb=...)`` runs ``source`` as ``main.py`` in a
fresh temporary directory and returns a :class:`SandboxResult`. The threat model, what is
and is not stopped, and the fallbacks are in ``docs/sandbox.md``. In short, at the
``"namespaces"`` isolation level (root with util-linux ``unshare``, the default here):

- ``unshare --net --pid --fork --mount-proc --ipc --uts --kill-child``: no network
  interface but a down loopback; the program's processes live in a PID namespace whose
  init is our bootstrap, so when the program ends (or is killed) every process it
  started dies with the namespace, double-forked ``setsid`` grandchildren included; SysV
  IPC objects die with the IPC namespace;
- in the mount namespace the temporary directory is bind-mounted over every
  world-writable directory (``/tmp``, ``/var/tmp``, ``/run/lock``, ``/dev/shm``), so the
  only place the program can write is the directory that is deleted afterwards;
- the program runs as a fresh unprivileged uid (random, unused, per call) with no
  supplementary groups, ``no_new_privs`` and no capabilities: it cannot write the host's
  files, read root-only files or signal our processes, and ``RLIMIT_NPROC`` (which root
  ignores) bounds its processes and threads, per call;
- rlimits on CPU time, address space, processes, open files, file size, no core dumps;
- wall-clock timeout enforced by the host (SIGKILL to the process group, which takes the
  namespace with it) and again by the namespace's init (timeout + 2 s) should the host die;
- stdout and stderr read incrementally and capped (``max_output_bytes`` each): a program
  that exceeds the cap is killed; the environment is replaced by a minimal one;
  ``python -I -S``: no user site, no ``PYTHON*`` variables, no site-packages.

Where namespaces are not allowed the level drops, with a logged warning, to ``"userns"``
(an unprivileged user namespace: same isolation, minus the uid drop) or ``"rlimits"``
(rlimits, own session, uid drop when root, and a sweep that kills the call's leftover
processes by uid or by a marker in their environment; **no network isolation**).
[OURS] throughout; the design follows the usual recipe of nsjail / bubblewrap /
firejail, in the ~2 ms the util-linux ``unshare`` costs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import random
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ISOLATION_LEVELS",
    "STATUSES",
    "SandboxError",
    "SandboxResult",
    "detect_isolation",
    "run_untrusted",
]

log = logging.getLogger(__name__)

STATUSES: tuple[str, ...] = ("ok", "error", "timeout", "memory", "killed")
"""``ok``: exit 0; ``error``: non-zero exit; ``timeout``: wall or CPU limit; ``memory``:
the address-space limit (MemoryError); ``killed``: a signal (segfault...) or the output cap."""

ISOLATION_LEVELS: tuple[str, ...] = ("namespaces", "userns", "rlimits")
"""Strongest first; :func:`detect_isolation` picks the first that works on this machine."""

_NS_FLAGS = ("--net", "--pid", "--fork", "--mount-proc", "--ipc", "--uts", "--kill-child")
_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "out of memory")

# The bootstrap runs as `python -I -S -c _BOOTSTRAP workdir mode uid cpu_s as_bytes nproc
# nofile fsize_bytes wall_s status_fd`. In a mount namespace it first makes the
# interpreter reachable and binds the temp dir over the world-writable dirs (/tmp last:
# once it is bound, the temp dir's own path under /tmp is hidden). Then it forks: the
# parent (PID 1 of the namespace) waits and reports "S <wait status> <cpu s>"; the child
# drops to the sandbox uid, sets the rlimits, reports "R" (ready) and runs main.py as
# __main__. No "R" means the sandbox itself failed.
_BOOTSTRAP = r"""
import os, sys
def fail(what):
    os.write(2, ("grouprl-sandbox: " + what + "\n").encode())
    os._exit(125)
try:
    import ctypes, resource, signal
    workdir, mode = sys.argv[1], sys.argv[2]
    uid, cpu, mem, nproc, nofile, fsize = (int(x) for x in sys.argv[3:9])
    wall, sfd = float(sys.argv[9]), int(sys.argv[10])
    libc = ctypes.CDLL(None, use_errno=True)
    if mode == "ns":
        # The interpreter may live under a directory the sandbox uid cannot enter (pyenv
        # in /root, mode 700): cover that directory with an empty tmpfs in this mount
        # namespace (hiding the rest of it) and bind the interpreter's prefix back in place.
        prefix = os.path.realpath(sys.base_prefix)
        parts = prefix.split("/")
        closed = [d for d in ("/".join(parts[:i]) for i in range(2, len(parts) + 1))
                  if not os.stat(d).st_mode & 1]
        if closed:
            keep = os.open(prefix, os.O_PATH)
            if libc.mount(b"tmpfs", closed[0].encode(), b"tmpfs", 6, b"mode=755,size=1m"):
                fail("tmpfs over %s: %s" % (closed[0], os.strerror(ctypes.get_errno())))
            os.makedirs(prefix, exist_ok=True)
            if libc.mount(("/proc/self/fd/%d" % keep).encode(), prefix.encode(), None, 4096 | 16384, None):
                fail("bind %s: %s" % (prefix, os.strerror(ctypes.get_errno())))
            os.close(keep)
        for target in ("/var/tmp", "/run/lock", "/dev/shm", "/tmp"):
            if os.path.isdir(target) and libc.mount(workdir.encode(), target.encode(), None, 4096, None):
                fail("bind mount over %s: %s" % (target, os.strerror(ctypes.get_errno())))
        workdir = "/tmp"
    pid = os.fork()
except BaseException as e:
    fail("bootstrap: %r" % (e,))
if pid:
    def on_alarm(signum, frame):
        os.kill(pid, 9)
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, wall + 2.0)
    _, status, ru = os.wait4(pid, 0)
    os.write(sfd, ("S %d %.3f\n" % (status, ru.ru_utime + ru.ru_stime)).encode())
    os._exit(0)
try:
    os.chdir(workdir)
    os.umask(0o077)
    if uid >= 0:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    if libc.prctl(38, 1, 0, 0, 0):
        fail("no_new_privs: " + os.strerror(ctypes.get_errno()))
    R = resource
    for res, soft, hard in ((R.RLIMIT_CPU, cpu, cpu + 1), (R.RLIMIT_AS, mem, mem),
                            (R.RLIMIT_NPROC, nproc, nproc), (R.RLIMIT_NOFILE, nofile, nofile),
                            (R.RLIMIT_FSIZE, fsize, fsize), (R.RLIMIT_CORE, 0, 0)):
        R.setrlimit(res, (soft, hard))
    with open("main.py", encoding="utf-8") as f:
        code = compile(f.read(), "main.py", "exec")
    os.write(sfd, b"R\n")
    os.close(sfd)
except SyntaxError:
    os.write(sfd, b"R\n")
    os.close(sfd)
    raise
except BaseException as e:
    fail("setup: %r" % (e,))
import types
main = types.ModuleType("__main__")
main.__file__ = "main.py"
sys.modules["__main__"] = main
sys.argv = ["main.py"]
exec(code, main.__dict__)
"""


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start or set up): the code was not judged."""


@dataclass(frozen=True)
class SandboxResult:
    """What happened to one untrusted program.

    ``status`` is one of :data:`STATUSES`; ``returncode`` is the exit code, ``-signal``
    when a signal ended it, ``None`` when we killed it (timeout, output cap).
    ``stdout``/``stderr`` are decoded with replacement and hold at most
    ``max_output_bytes`` each (``truncated`` says the cap was hit). ``seconds`` is wall
    time from launch to collection; ``cpu_seconds`` the program's CPU time when known.
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    truncated: bool = False
    cpu_seconds: float | None = None
    isolation: str = "namespaces"


# --------------------------------------------------------------------------- isolation level


def _base_command(level: str) -> list[str]:
    unshare = shutil.which("unshare") or "unshare"
    if level == "namespaces":
        return [unshare, *_NS_FLAGS]
    if level == "userns":
        return [unshare, "--user", "--map-root-user", *_NS_FLAGS]
    return []


def _python() -> str:
    """The real interpreter behind a venv's symlink: the sandbox uid must be able to exec it."""
    return os.path.realpath(sys.executable)


_PROBE = "import json\nprint(json.dumps(6 * 7))\n"  # json: a stdlib import after the uid drop


def _probe(level: str, python: str, drop_uid: bool) -> str | None:
    """None when a real sandboxed run works at ``level``, else why it does not."""
    try:
        res = _run(_PROBE, "", 10.0, 256, None, 32, 64, 16, 1 << 16, level, python, drop_uid)
    except SandboxError as exc:
        return str(exc)
    if res.status == "ok" and res.stdout.strip() == "42":
        return None
    return f"probe ended {res.status}: {res.stderr.strip()[-300:]!r}"


@functools.cache
def _rlimits_drop_uid(python: str) -> bool:
    """Whether the rlimits fallback can run ``python`` as an unprivileged uid (root only)."""
    if os.geteuid() != 0:
        return False
    why = _probe("rlimits", python, True)
    if why:
        log.warning(
            "grouprl sandbox: cannot run %s as an unprivileged uid (%s); the 'rlimits' "
            "fallback runs untrusted code AS ROOT: it can write any file and fork without "
            "bound until the CPU/wall limit. Install Python where all users can read it.",
            python,
            why,
        )
    return why is None


@functools.cache
def detect_isolation() -> str:
    """The strongest isolation level that works here (probed once, by a real sandboxed run).

    ``GROUPRL_SANDBOX_ISOLATION`` forces a level. Falling below ``"namespaces"`` logs a
    warning that says what is lost; ``"rlimits"`` has no network isolation.
    """
    forced = os.environ.get("GROUPRL_SANDBOX_ISOLATION")
    if forced:
        if forced not in ISOLATION_LEVELS:
            raise ValueError(
                f"GROUPRL_SANDBOX_ISOLATION={forced!r}; choose one of {', '.join(ISOLATION_LEVELS)}"
            )
        return forced
    level = "namespaces" if os.geteuid() == 0 else "userns"
    if shutil.which("unshare") is None:
        why = "util-linux `unshare` is not installed"
    else:
        why = _probe(level, _python(), level == "namespaces")
        if why is None:
            return level
    log.warning(
        "grouprl sandbox: namespaces are not available (%s). Falling back to 'rlimits': "
        "rlimits, own session, uid drop when root, and a sweep of leftover processes; "
        "untrusted code CAN reach the network and write world-writable dirs "
        "(/tmp). Run as root with util-linux unshare, or allow unprivileged user "
        "namespaces, for full isolation (docs/sandbox.md).",
        f"{level}: {why}",
    )
    return "rlimits"


# --------------------------------------------------------------------------- the run


def _sandbox_uid() -> int:
    """A fresh uid for this call (root only): unused, so RLIMIT_NPROC counts this call alone."""
    return random.SystemRandom().randrange(1_000_000, 2_000_000_000)


def _tasks_of(uid: int) -> int:
    """Processes + threads the user already runs (RLIMIT_NPROC counts them all)."""
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if entry.stat().st_uid == uid:
                    n += len(os.listdir(f"/proc/{entry.name}/task"))
    return n


def _clean_env(marker: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": "/tmp",
        "TMPDIR": "/tmp",
        "PYTHONIOENCODING": "utf-8",
        "GROUPRL_SANDBOX_CALL": marker,  # lets the rlimits fallback find leftovers
    }


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _terminate(proc: subprocess.Popen, level: str) -> None:
    """Kill a running sandbox and return only once every process in it is gone.

    With a PID namespace we SIGKILL its init (``unshare``'s only child): the kernel kills
    every other process of the namespace and init is reaped only after all of them are,
    so ``unshare`` exiting means the namespace is empty. Killing ``unshare`` itself would
    return at once while the namespace is still being torn down. Without a namespace (or
    before init exists) the whole process group is killed.
    """
    if level != "rlimits":
        try:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        except OSError:
            children = []
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        if children:
            try:
                proc.wait(timeout=5.0)
                return
            except subprocess.TimeoutExpired:
                pass
    _kill_group(proc.pid)
    proc.wait()


def _sweep(uid: int, marker: str) -> int:
    """Kill leftover processes of one call (rlimits fallback): by its uid, else its env marker."""
    me, killed = os.getpid(), 0
    needle = f"GROUPRL_SANDBOX_CALL={marker}".encode()
    for _ in range(50):  # a fork bomb refills as we kill: repeat until a pass finds none
        found = 0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            try:
                if uid >= 0:
                    mine = entry.stat().st_uid == uid
                else:
                    mine = needle in (entry / "environ").read_bytes()
                if mine:
                    os.kill(int(entry.name), signal.SIGKILL)
                    found += 1
            except (OSError, ValueError):
                continue
        killed += found
        if not found:
            break
        time.sleep(0.01)
    return killed


@dataclass
class _Streams:
    """Incremental, capped reading of stdout, stderr and the status pipe."""

    cap: int
    out: bytearray
    err: bytearray
    status: bytearray
    truncated: bool = False

    def read(self, sel: selectors.BaseSelector, timeout: float) -> None:
        for key, _ in sel.select(timeout=timeout):
            data = os.read(key.fd, 65536)
            if not data:
                sel.unregister(key.fileobj)
                continue
            buf = key.data
            room = max((self.cap if buf is not self.status else 4096) - len(buf), 0)
            buf += data[:room]
            if len(data) > room and buf is not self.status:
                self.truncated = True


def _status_of(
    streams: _Streams, timed_out: bool, level: str, cpu_limit: int
) -> tuple[str, int | None, float | None]:
    """(status, returncode, cpu seconds) from what the bootstrap reported."""
    report = streams.status.decode(errors="replace").split()
    ready = "R" in report
    if "S" in report and len(report) >= report.index("S") + 3:
        i = report.index("S")
        wait_status, cpu = int(report[i + 1]), float(report[i + 2])
    else:
        wait_status, cpu = None, None
    if streams.truncated:
        return "killed", None, cpu
    if timed_out:
        return "timeout", None, cpu
    if not ready:
        tail = streams.err.decode(errors="replace").strip()[-500:]
        raise SandboxError(f"the sandbox ({level}) failed before running the code: {tail!r}")
    if wait_status is None:  # the namespace's init died without reporting: killed from outside
        return "killed", None, cpu
    if os.WIFSIGNALED(wait_status):
        sig = os.WTERMSIG(wait_status)
        if sig == signal.SIGXCPU or (
            sig == signal.SIGKILL and cpu is not None and cpu >= cpu_limit
        ):
            return "timeout", -sig, cpu
        return "killed", -sig, cpu
    code = os.WEXITSTATUS(wait_status)
    if code == 0:
        return "ok", 0, cpu
    tail = streams.err[-2000:].decode(errors="replace")
    if any(m in tail for m in _MEMORY_MARKERS):
        return "memory", code, cpu
    return "error", code, cpu


def _validate(timeout_s: float, memory_mb: int, isolation_level: str | None) -> None:
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"run_untrusted: timeout_s must be a positive number, got {timeout_s!r}")
    if memory_mb < 64:
        raise ValueError(
            f"run_untrusted: memory_mb={memory_mb} is below what the Python interpreter "
            "itself needs; use at least 64 (256 is a good default)."
        )
    if isolation_level is not None and isolation_level not in ISOLATION_LEVELS:
        raise ValueError(
            f"run_untrusted: unknown isolation {isolation_level!r}; "
            f"choose one of {', '.join(ISOLATION_LEVELS)}"
        )


def run_untrusted(
    source: str,
    *,
    stdin: str = "",
    timeout_s: float,
    memory_mb: int,
    cpu_s: int | None = None,
    max_processes: int = 32,
    max_open_files: int = 64,
    max_file_mb: int = 16,
    max_output_bytes: int = 1 << 20,
    isolation: str | None = None,
    python: str | None = None,
) -> SandboxResult:
    """Run Python ``source`` contained (see the module docstring) and report what happened.

    Limits: ``timeout_s`` wall seconds (from launch; the interpreter's ~10 ms start is
    included), ``cpu_s`` CPU seconds (default ``ceil(timeout_s) + 1``), ``memory_mb`` of
    address space per process, ``max_processes`` processes+threads for the call,
    ``max_open_files`` descriptors, ``max_file_mb`` per written file,
    ``max_output_bytes`` per output stream (exceeding it kills the program: ``killed``,
    ``truncated=True``). ``isolation`` defaults to :func:`detect_isolation`'s probe;
    ``python`` to the real interpreter behind ``sys.executable``, run as ``python -I -S``
    (standard library only: no site-packages, no ``exit()``/``quit()`` builtins).

    Raises SandboxError when the sandbox itself could not run the code (a reward built on
    it should be NaN, not 0); every outcome of the code itself is a status.
    """
    _validate(timeout_s, memory_mb, isolation)
    level = isolation or detect_isolation()
    python = python or _python()
    if level == "namespaces":
        drop_uid = True
    elif level == "rlimits":
        drop_uid = _rlimits_drop_uid(python)
    else:
        drop_uid = False  # in a user namespace only our own uid is mapped
    return _run(
        source,
        stdin,
        timeout_s,
        memory_mb,
        cpu_s,
        max_processes,
        max_open_files,
        max_file_mb,
        max_output_bytes,
        level,
        python,
        drop_uid,
    )


def _run(
    source: str,
    stdin: str,
    timeout_s: float,
    memory_mb: int,
    cpu_s: int | None,
    max_processes: int,
    max_open_files: int,
    max_file_mb: int,
    max_output_bytes: int,
    level: str,
    python: str,
    drop_uid: bool,
) -> SandboxResult:
    """run_untrusted with every choice made."""
    start = time.monotonic()
    marker = secrets.token_hex(8)
    uid = _sandbox_uid() if drop_uid else -1
    if level == "rlimits" and uid < 0:  # RLIMIT_NPROC counts all of our uid's processes
        max_processes += _tasks_of(os.geteuid())
    workdir = Path(tempfile.mkdtemp(prefix="grouprl-sb-"))
    proc = None
    try:
        (workdir / "main.py").write_text(source, encoding="utf-8")
        (workdir / ".stdin").write_text(stdin, encoding="utf-8")
        if uid >= 0:
            os.chown(workdir, uid, uid)
        args = [
            str(workdir),
            "ns" if level != "rlimits" else "plain",
            str(uid),
            str(cpu_s or math.ceil(timeout_s) + 1),
            str(memory_mb << 20),
            str(max_processes),
            str(max_open_files),
            str(max_file_mb << 20),
            f"{timeout_s:.3f}",
        ]
        cmd = [*_base_command(level), python, "-I", "-S", "-c", _BOOTSTRAP, *args]
        status_r, status_w = os.pipe()
        try:
            with open(workdir / ".stdin", "rb") as stdin_file:
                proc = subprocess.Popen(
                    [*cmd, str(status_w)],
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(status_w,),
                    start_new_session=True,
                    env=_clean_env(marker),
                    cwd=str(workdir),
                )
        except OSError as exc:
            os.close(status_r)
            raise SandboxError(f"could not start the sandbox ({level}): {exc}") from exc
        finally:
            os.close(status_w)
        streams, timed_out = _collect(proc, status_r, start + timeout_s, max_output_bytes, level)
        if level == "rlimits":
            _sweep(uid, marker)
        status, returncode, cpu = _status_of(streams, timed_out, level, int(args[3]))
        return SandboxResult(
            status=status,
            returncode=returncode,
            stdout=streams.out.decode(errors="replace"),
            stderr=streams.err.decode(errors="replace"),
            seconds=time.monotonic() - start,
            truncated=streams.truncated,
            cpu_seconds=cpu,
            isolation=level,
        )
    finally:
        if proc is not None and proc.poll() is None:
            _terminate(proc, level)
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(
    proc: subprocess.Popen, status_r: int, deadline: float, cap: int, level: str
) -> tuple[_Streams, bool]:
    """Read the three pipes until they close, the deadline passes or the cap is hit."""
    streams = _Streams(cap, bytearray(), bytearray(), bytearray())
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None and proc.stderr is not None
    sel.register(proc.stdout, selectors.EVENT_READ, streams.out)
    sel.register(proc.stderr, selectors.EVENT_READ, streams.err)
    sel.register(status_r, selectors.EVENT_READ, streams.status)
    timed_out, exited_at = False, None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.2:
                break  # pipes held open by escaped processes (rlimits fallback): stop waiting
            streams.read(sel, min(deadline - now, 0.05 if exited_at else 0.5))
            if streams.truncated:
                break
    finally:
        sel.close()
        os.close(status_r)
        if proc.poll() is None:
            _terminate(proc, level)
        proc.stdout.close()
        proc.stderr.close()
    return streams, timed_out
