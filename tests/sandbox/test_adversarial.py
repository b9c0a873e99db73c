"""The adversarial corpus: each hostile program is contained, gets its status, and the host is unchanged.

Host checks after every program:
- a sentinel directory (with a file in it) outside the sandbox is byte-for-byte unchanged,
  and no file the program tried to drop in the host's /tmp exists;
- no process is left whose command line carries this test's marker (every program first
  re-execs itself with the marker in argv, so its forks, threads' process and exec'd
  grandchildren all carry it);
- a real TCP listener on 127.0.0.1 received no connection;
- a secret planted in this process's environment never appears in the program's output.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from pathlib import Path

import pytest

from grouprl.tasks.sandbox import detect_isolation, run_untrusted

MARKER = "grouprl-adv-" + secrets.token_hex(6)
SECRET = "s3cr3t-" + secrets.token_hex(8)
TIMEOUT = 1.0  # wall seconds for the programs that must time out
SLACK = 10.0  # for the others, which end by themselves (slow only on a loaded machine)
MEMORY_MB = 256

# name -> (program body, expected status). The body runs after a re-exec that puts MARKER
# in argv. {sentinel}, {port}, {host_pid}, {escape} are filled in per test.
CORPUS: dict[str, tuple[str, str]] = {
    "infinite_loop": ("while True:\n    pass\n", "timeout"),
    "sleep_past_timeout": ("import time\ntime.sleep(60)\n", "timeout"),
    "fork_bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "timeout",
    ),
    "thread_bomb": (
        "import threading, time\n"
        "while True:\n    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n",
        "error",  # RuntimeError: can't start new thread (RLIMIT_NPROC / address space)
    ),
    "memory_bomb": ("x = []\nwhile True:\n    x.append(bytearray(1 << 24))\n", "memory"),
    "recursion_bomb": (
        "import json, sys\nsys.setrecursionlimit(10**9)\njson.loads('[' * 10**6)\n",
        "killed",  # the C decoder recurses with no limit left: the C stack overflows (SIGSEGV)
    ),
    "write_outside_tempdir": (
        "open({escape!r}, 'w').write('x')\n"  # host /tmp: lands in the sandbox's own dir
        "open({sentinel!r} + '/pwned', 'w').write('x')\n",
        "error",
    ),
    "delete_files": (
        "import os, shutil\n"
        "for path in [{sentinel!r} + '/keep.txt', '/etc/hostname']:\n"
        "    try:\n        os.remove(path)\n    except OSError as e:\n        print(e)\n"
        "shutil.rmtree({sentinel!r})\n",
        "error",
    ),
    "read_parent_env": (
        "import os\nprint(dict(os.environ))\n"
        "for pid in ['1', str(os.getppid()), str({host_pid})]:\n"
        "    try:\n        print(open('/proc/' + pid + '/environ', 'rb').read())\n"
        "    except OSError as e:\n        print(e)\n",
        "ok",
    ),
    "socket_to_localhost": (
        "import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n"
        "s.sendall(b'hello')\n",
        "error",
    ),
    "huge_stdout": (
        "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
        "killed",  # the output cap
    ),
    "kill_parent": (
        "import os, signal\nfor pid in [os.getppid(), {host_pid}]:\n"
        "    os.kill(pid, signal.SIGKILL)\n",
        "error",  # PermissionError / ProcessLookupError: the parent is not ours to kill
    ),
    "ctypes_segfault": ("import ctypes\nctypes.string_at(0)\n", "killed"),
    "close_stdout_and_spin": (
        "import os\nos.close(1)\nos.close(2)\nwhile True:\n    pass\n",
        "timeout",
    ),
    "double_fork_outlives_parent": (
        "import os, sys, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', "
        "{marker!r}])\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\nprint('parent done')\n",
        "ok",
    ),
    "ignore_signals_and_spin": (
        "import signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):\n"
        "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass\n",
        "timeout",
    ),
    "kill_everything": (
        "import os, signal\nos.kill(-1, signal.SIGKILL)\n",
        "error",  # ESRCH: in its PID namespace, as its own uid, there is nobody else to kill
    ),
    "fill_disk": (
        "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * (1 << 20))\n",
        "error",  # EFBIG at max_file_mb (Python ignores SIGXFSZ)
    ),
    "exhaust_file_descriptors": (
        "fs = []\nwhile True:\n    fs.append(open('/dev/null'))\n",
        "error",
    ),
    "read_root_only_file": ("print(open('/etc/shadow').read())\n", "error"),
}


def _wrapped(body: str, **fmt: object) -> str:
    """Re-exec with MARKER in argv (so every descendant carries it), then run the body."""
    code = body.format(marker=MARKER, **fmt)
    return (
        "import os, sys\n"
        f"if {MARKER!r} not in sys.argv:\n"
        f"    os.execv(sys.executable, [sys.executable, '-c', {code!r}, {MARKER!r}])\n"
    )


def _marked_processes() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if MARKER.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


class _Listener:
    """A real TCP server on 127.0.0.1 that records every connection it accepts."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture(scope="module")
def listener():
    lst = _Listener()
    # the listener works: a connection from this (unsandboxed) process is counted
    socket.create_connection(("127.0.0.1", lst.port), timeout=1).close()
    deadline = time.monotonic() + 2
    while lst.connections < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lst.connections == 1
    lst.connections = 0
    yield lst
    lst.close()


@pytest.fixture
def sentinel(tmp_path: Path) -> Path:
    d = tmp_path / "sentinel"
    d.mkdir()
    (d / "keep.txt").write_text("precious")
    return d


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.skipif(
    detect_isolation() != "namespaces", reason="the full corpus needs namespace isolation"
)
@pytest.mark.parametrize("name", sorted(CORPUS))
def test_hostile_program_is_contained(name, listener, sentinel, monkeypatch, tmp_path):
    monkeypatch.setenv("GROUPRL_TEST_SECRET", SECRET)
    body, expected = CORPUS[name]
    escape = f"/tmp/grouprl-escape-{MARKER}"
    before = _snapshot(sentinel)
    source = _wrapped(
        body, sentinel=str(sentinel), port=listener.port, host_pid=os.getpid(), escape=escape
    )
    timeout = TIMEOUT if expected == "timeout" else SLACK
    t0 = time.monotonic()
    res = run_untrusted(source, timeout_s=timeout, memory_mb=MEMORY_MB, max_file_mb=4)
    wall = time.monotonic() - t0

    assert res.status == expected, (res.status, res.returncode, res.stderr[-800:])
    assert wall < timeout + 2.0  # the timeout is enforced promptly
    assert _snapshot(sentinel) == before  # nothing written or deleted outside
    assert not Path(escape).exists()
    assert _marked_processes() == []  # nothing left behind
    assert listener.connections == 0  # the network was not reached
    assert SECRET not in res.stdout and SECRET not in res.stderr
    if name == "huge_stdout":
        assert res.truncated and len(res.stdout) == 1 << 20
    if name == "socket_to_localhost":
        assert "Network is unreachable" in res.stderr or "refused" in res.stderr
    if name == "double_fork_outlives_parent":
        assert res.stdout == "parent done\n"
    if name in ("infinite_loop", "sleep_past_timeout", "close_stdout_and_spin"):
        assert wall >= TIMEOUT and res.returncode is None


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 15


def test_this_python_runs_in_the_sandbox():
    # Guard against a corpus that "passes" because nothing runs at all.
    res = run_untrusted(_wrapped("print(6 * 7)"), timeout_s=5, memory_mb=MEMORY_MB)
    assert (res.status, res.stdout) == ("ok", "42\n"), res.stderr
