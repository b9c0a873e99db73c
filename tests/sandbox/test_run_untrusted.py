"""run_untrusted: the result fields, the limits, the clean-up, and the fallbacks without namespaces."""

from __future__ import annotations

import ast
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grouprl.tasks import sandbox
from grouprl.tasks.sandbox import SandboxError, detect_isolation, run_untrusted

NS = detect_isolation() == "namespaces"
needs_ns = pytest.mark.skipif(not NS, reason="needs namespace isolation (root + unshare)")
# The rlimits fallback can drop to an unprivileged uid only with an interpreter that uid can
# read; this machine's pyenv lives in /root (mode 700), Debian's python3 does not.
SYSTEM_PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else None
needs_system_py = pytest.mark.skipif(
    SYSTEM_PY is None or os.geteuid() != 0, reason="needs root and /usr/bin/python3"
)


def _record_workdirs(monkeypatch) -> list[str]:
    """The folders ``tempfile.mkdtemp`` makes from now on (the sandbox's work dirs), recorded
    by name: a second test run on the machine makes its own in the same temp folder, so a
    listing of ``grouprl-sb-*`` there would see them (it failed beside a second copy of the
    suite)."""
    made: list[str] = []
    real = tempfile.mkdtemp

    def recording(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", recording)
    return made


def test_result_fields_stdin_and_exit_codes(monkeypatch):
    made = _record_workdirs(monkeypatch)
    res = run_untrusted(
        "import sys\ndata = sys.stdin.read()\nprint(data.upper())\n"
        "print('ünïcode', file=sys.stderr)\nsys.exit(3)\n",
        stdin="hello\nworld",
        timeout_s=5,
        memory_mb=256,
    )
    assert (res.status, res.returncode) == ("error", 3)
    assert res.stdout == "HELLO\nWORLD\n" and res.stderr == "ünïcode\n"
    assert 0 < res.seconds < 5 and not res.truncated and res.cpu_seconds is not None
    ok = run_untrusted("print(sum(range(10)))", timeout_s=5, memory_mb=256)
    assert (ok.status, ok.returncode, ok.stdout) == ("ok", 0, "45\n")
    syntax = run_untrusted("def f(:\n", timeout_s=5, memory_mb=256)
    assert syntax.status == "error" and "SyntaxError" in syntax.stderr
    raised = run_untrusted("raise KeyError('k')", timeout_s=5, memory_mb=256)
    assert raised.status == "error" and raised.stderr.rstrip().endswith("KeyError: 'k'")
    assert len(made) == 4 and all(os.path.basename(d).startswith("grouprl-sb-") for d in made)
    assert not any(os.path.exists(d) for d in made)  # every work dir removed


def test_environment_is_stripped(monkeypatch):
    secret = secrets.token_hex(8)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    res = run_untrusted(
        "import json, os\nprint(json.dumps(dict(os.environ)))", timeout_s=5, memory_mb=256
    )
    env = json.loads(res.stdout)
    assert set(env) == {
        "PATH",
        "LANG",
        "HOME",
        "TMPDIR",
        "PYTHONIOENCODING",
        "GROUPRL_SANDBOX_CALL",
    }
    assert secret not in res.stdout


def test_memory_limit_is_per_call_setting():
    # 100 MB fits under 512 MB of address space but not under 96 MB
    prog = "x = bytearray(100 * 2**20)\nprint(len(x))"
    assert run_untrusted(prog, timeout_s=5, memory_mb=512).status == "ok"
    assert run_untrusted(prog, timeout_s=5, memory_mb=96).status == "memory"


def test_process_limit_allows_normal_use_and_stops_more():
    prog = textwrap.dedent(
        """
        import subprocess, sys
        procs = [subprocess.Popen([sys.executable, '-S', '-c', 'import time; time.sleep(0.5)'])
                 for _ in range({n})]
        print(sum(p.wait() == 0 for p in procs))
        """
    )
    ok = run_untrusted(prog.format(n=4), timeout_s=10, memory_mb=256, max_processes=8)
    assert (ok.status, ok.stdout) == ("ok", "4\n"), ok.stderr
    over = run_untrusted(prog.format(n=12), timeout_s=10, memory_mb=256, max_processes=8)
    assert over.status == "error" and "BlockingIOError" in over.stderr


def test_cpu_limit_is_a_timeout():
    # wall limit far away (a loaded machine gives a spinning program a fraction of a core)
    res = run_untrusted("while True:\n    pass", timeout_s=60, memory_mb=256, cpu_s=1)
    assert res.status == "timeout" and res.returncode == -24  # SIGXCPU at 1 CPU second
    assert res.cpu_seconds is not None and 0.5 <= res.cpu_seconds < 2.5  # tick-sampled


def test_output_cap_kills_and_truncates():
    res = run_untrusted(
        "import sys\nsys.stderr.write('e' * 5000)\nsys.stderr.flush()\nprint('x' * 10**7)",
        timeout_s=5,
        memory_mb=256,
        max_output_bytes=1000,
    )
    assert res.status == "killed" and res.truncated
    assert len(res.stderr) == 1000 and len(res.stdout) <= 1000


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        run_untrusted("pass", timeout_s=0, memory_mb=256)
    with pytest.raises(ValueError, match="memory_mb=10 is below"):
        run_untrusted("pass", timeout_s=1, memory_mb=10)
    with pytest.raises(ValueError, match="unknown isolation 'docker'"):
        run_untrusted("pass", timeout_s=1, memory_mb=256, isolation="docker")


def test_sandbox_failure_raises_sandbox_error(tmp_path):
    not_python = tmp_path / "python"
    not_python.write_text("#!/bin/sh\nexit 0\n")
    not_python.chmod(0o755)
    with pytest.raises(SandboxError, match="failed before running the code"):
        run_untrusted("print(1)", timeout_s=5, memory_mb=256, python=str(not_python))
    with pytest.raises(SandboxError):
        run_untrusted("print(1)", timeout_s=5, memory_mb=256, python="/nonexistent/python")


@needs_ns
def test_namespace_view():
    res = run_untrusted(
        textwrap.dedent(
            """
            import os, socket
            print(os.getpid(), os.getppid(), os.getuid() != 0, os.getcwd())
            print(sorted(p for p in os.listdir('/proc') if p.isdigit()))
            print(socket.if_nameindex())
            print(sorted(os.listdir('/tmp')))
            try:
                print(sorted(os.listdir('/root')))
            except PermissionError:
                print([])
            """
        ),
        timeout_s=5,
        memory_mb=256,
    )
    lines = res.stdout.splitlines()
    assert lines[0] == "2 1 True /tmp"  # PID 2 under our init, unprivileged, in its temp dir
    assert lines[1] == "['1', '2']"  # sees only its own namespace's processes
    assert lines[2] == "[(1, 'lo')]"  # no interface but a (down) loopback
    assert lines[3] == "['.stdin', 'main.py']"  # /tmp is its own temp dir
    # root's home is hidden: at most the path to the interpreter shows (pyenv under /root)
    visible = ast.literal_eval(lines[4])
    assert all(os.path.realpath(sys.base_prefix).startswith(f"/root/{v}") for v in visible)


def test_detect_isolation_warns_when_it_falls_back(monkeypatch, caplog):
    monkeypatch.delenv("GROUPRL_SANDBOX_ISOLATION", raising=False)
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="grouprl.tasks.sandbox"):
        assert sandbox.detect_isolation.__wrapped__() == "rlimits"
    assert "CAN reach the network" in caplog.text and "unshare` is not installed" in caplog.text
    monkeypatch.setenv("GROUPRL_SANDBOX_ISOLATION", "bogus")
    with pytest.raises(ValueError, match="choose one of namespaces, userns, rlimits"):
        sandbox.detect_isolation.__wrapped__()


@needs_system_py
def test_rlimits_fallback_as_root_contains_what_it_can(tmp_path):
    """Without namespaces: uid drop, rlimits and the sweep still hold; the network does not."""
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    marker = "grouprl-rl-" + secrets.token_hex(4)
    kw = {"timeout_s": 1.0, "memory_mb": 256, "isolation": "rlimits", "python": SYSTEM_PY}
    double_fork = textwrap.dedent(
        f"""
        import os, sys
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)',
                                          {marker!r}])
            os._exit(0)
        print('parent done')
        """
    )
    assert run_untrusted(double_fork, **kw).status == "ok"
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    assert run_untrusted(bomb, **kw).status == "timeout"
    write = run_untrusted(f"open({str(sentinel)!r} + '/x', 'w')", **kw)
    assert write.status == "error" and "PermissionError" in write.stderr
    assert list(sentinel.iterdir()) == []
    alive = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline_has(p, marker)]
    assert alive == []  # the setsid grandchild was swept
    # the documented gap: no network isolation in this fallback
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    res = run_untrusted(f"import socket\nsocket.create_connection(('127.0.0.1', {port}))", **kw)
    server.close()
    assert res.status == "ok"


def _cmdline_has(proc: Path, marker: str) -> bool:
    try:
        return marker.encode() in (proc / "cmdline").read_bytes()
    except OSError:
        return False


NON_ROOT_SCRIPT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("sb", sys.argv[1])
sb = importlib.util.module_from_spec(spec)
sys.modules["sb"] = sb
spec.loader.exec_module(sb)
out = {"detected": sb.detect_isolation()}
bomb = "import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass\\n"
for level in ("userns", "rlimits"):
    ok = sb.run_untrusted("import os; print(os.getpid())", timeout_s=5, memory_mb=256,
                          isolation=level)
    fb = sb.run_untrusted(bomb, timeout_s=1, memory_mb=256, isolation=level)
    out[level] = [ok.status, ok.stdout.strip(), fb.status]
print(json.dumps(out))
"""


@pytest.mark.slow
@needs_system_py
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
def test_non_root_levels():
    """As an ordinary user (nobody): user namespaces are detected; both lower levels run."""
    folder = Path(tempfile.mkdtemp(prefix="grouprl-nonroot-"))
    folder.chmod(0o755)
    script = folder / "nonroot.py"
    script.write_text(NON_ROOT_SCRIPT)
    script.chmod(0o644)
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PY, str(script),
         sandbox.__file__],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )  # fmt: skip
    shutil.rmtree(folder)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["detected"] in ("userns", "rlimits")
    if out["detected"] == "userns":
        assert out["userns"] == ["ok", "2", "timeout"]  # PID 2 in its own PID namespace
    assert out["rlimits"][0] == "ok" and out["rlimits"][2] == "timeout"


def test_overhead_is_small_enough_to_score_many():
    # Not a benchmark (benchmarks/sandbox_overhead.py is): a guard against a regression by
    # an order of magnitude on a loaded 2-core machine.
    res = [run_untrusted("pass", timeout_s=5, memory_mb=256) for _ in range(5)]
    assert all(r.status == "ok" for r in res)
    assert min(r.seconds for r in res) < 0.5


@settings(max_examples=8, deadline=None)
@given(st.text(max_size=3000))
def test_stdin_round_trips_exactly(text):
    # bytes in, bytes out (the buffer, so that no newline translation can hide a bug)
    prog = "import sys\nsys.stdout.buffer.write(sys.stdin.buffer.read())"
    res = run_untrusted(prog, stdin=text, timeout_s=5, memory_mb=256)
    assert res.status == "ok" and res.stdout == text and not res.truncated


def test_output_cap_boundary():
    prog = "import sys\nsys.stdout.write('x' * {n})\nsys.stdout.flush()\nimport time\n"
    exact = run_untrusted(prog.format(n=4096), timeout_s=5, memory_mb=256, max_output_bytes=4096)
    assert (exact.status, exact.truncated, len(exact.stdout)) == ("ok", False, 4096)
    over = run_untrusted(prog.format(n=4097), timeout_s=5, memory_mb=256, max_output_bytes=4096)
    assert (over.status, over.truncated, len(over.stdout)) == ("killed", True, 4096)


def test_unread_large_stdin_does_not_block():
    res = run_untrusted("print('ignored')", stdin="y" * (4 << 20), timeout_s=5, memory_mb=256)
    assert (res.status, res.stdout) == ("ok", "ignored\n")


def test_concurrent_calls_from_threads_keep_their_own_output():
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> str:
        return run_untrusted(f"print({i} * {i})", timeout_s=10, memory_mb=256).stdout

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(one, range(8)))
    assert outs == [f"{i * i}\n" for i in range(8)]
