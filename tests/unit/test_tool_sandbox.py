"""The Python code tool's sandbox (rlhf.tools.sandbox, rlhf.tools.isolation): hostile code is
contained by the kernel, what it tries comes back as output or a tool error, and the run's
process, files and network are never at risk.

Each case is a real sandbox (bubblewrap + seccomp, installed by `make setup`): a case passes
only if the call returned with the result expected and nothing of it is left outside. The
escapes tried are those that got out of the earlier, audit-hook sandbox (issue 50): the
trainer's environment through /proc, writes outside through a C library or sqlite3, a
forked and re-parented process, another network namespace, a signal to the trainer, paths
seen through os.stat.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import tempfile
import uuid

import psutil
import pytest

from rlhf.tools import isolation
from rlhf.tools.base import ERROR, TIMEOUT
from rlhf.tools.sandbox import PythonSandbox

SCHEMA = {"type": "function", "function": {"name": "python", "parameters": {}}}
LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    """A wall clock far beyond the CPU limit: on a loaded machine a CPU-bound child takes
    longer than its CPU seconds, and the limit under test must be the one that stops it."""
    return PythonSandbox(SCHEMA, {"timeout_s": 30, "cpu_s": 2, "max_output_bytes": 2048})


def run(sandbox: PythonSandbox, code: str):
    return asyncio.run(sandbox.run(code))


def printed(sandbox: PythonSandbox, code: str) -> str:
    result = run(sandbox, code)
    assert result.error is None, result.text
    return result.text


def test_plain_code_prints_its_result(sandbox):
    result = run(sandbox, "import math\nprint(sum(range(10)), math.factorial(5))")
    assert (result.text, result.error) == ("45 120\n", None)


def test_it_runs_as_nobody_in_its_own_directory_and_leaves_nothing(sandbox):
    code = "import os\nopen('out.txt', 'w').write('kept')\n"
    code += "print(open('out.txt').read(), os.getcwd(), os.getuid(), os.getgid())"
    assert printed(sandbox, code).split() == ["kept", "/sandbox", "65534", "65534"]
    assert printed(sandbox, "import os\nprint(sorted(os.listdir('.')))") == "['main.py']\n"


def test_the_trainers_environment_processes_and_files_are_out_of_sight(
    sandbox, tmp_path, monkeypatch
):
    """pyarrow's LocalFileSystem read /proc/<parent>/environ (the SGLang API key) and
    os.stat saw every path: here every /proc entry and every path of the trainer's."""
    monkeypatch.setenv("RLHF_SGLANG_API_KEY", "key-that-must-not-leak")
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    code = (
        "import os, glob\nfound = []\n"
        "for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):\n"
        "    found += ['environ'] if b'must-not-leak' in open(path, 'rb').read() else []\n"
        "found += ['env'] if 'must-not-leak' in str(os.environ) else []\n"
        f"for path in [{str(secret)!r}, {os.getcwd()!r}, {sys.prefix!r}, '/etc/passwd', '/tmp']:\n"
        "    found += [path] if os.path.exists(path) else []\n"
        "print(found, sorted(p for p in os.listdir('/proc') if p.isdigit()))"
    )
    assert printed(sandbox, code) == "[] ['1', '2']\n"  # bwrap's reaper and the code
    result = run(sandbox, f"print(open({str(secret)!r}).read())")
    assert result.error == ERROR and "FileNotFoundError" in result.text


def test_nothing_is_written_outside_its_directory(sandbox, tmp_path):
    """sqlite3 made a file outside, C code is not seen by an audit hook: the mounts are
    read-only whatever writes."""
    targets = [tmp_path / "escape.txt", tmp_path / "escape.db"]
    code = (
        "import sqlite3\nrefused = []\n"
        "for path in ['/usr/x', '/dev/shm/x', '/x', '/etc/x', '/packages/x', '/proc/x', "
        f"{str(targets[0])!r}, {str(isolation.BOOT_INSIDE)!r}]:\n"
        "    try:\n        open(path, 'w')\n    except OSError as e:\n"
        "        refused.append(type(e).__name__)\n"
        "try:\n"
        f"    sqlite3.connect({str(targets[1])!r}).execute('create table t (x)')\n"
        "except sqlite3.Error as e:\n    refused.append('sqlite3')\n"
        "print(len(refused))"
    )
    assert printed(sandbox, code) == "9\n"
    assert not any(t.exists() for t in targets)


def test_third_party_packages_are_not_importable_unless_allowed(sandbox):
    """The bare interpreter: cffi (which forked out of the old sandbox), pyarrow (which read
    the trainer's environment) and numpy are absent; `packages` lets numpy in, alone."""
    code = (
        "import importlib.util as u, site, sys, sysconfig\n"  # put them back on the path
        "sys.path += site.getsitepackages() + list(sysconfig.get_paths().values())\n"
        "print([u.find_spec(m) is None for m in %r])"
    )
    names = ["cffi", "pyarrow", "numpy", "torch", "rlhf"]
    assert printed(sandbox, code % names) == str([True] * 5) + "\n"
    allowed = PythonSandbox(SCHEMA, {"packages": ["numpy"]})
    text = printed(allowed, "import numpy as np\nprint(int(np.arange(5).sum()))\n" + code % names)
    assert text == "10\n" + str([True, True, False, True, True]) + "\n"


def test_no_process_can_be_started(sandbox):
    """A fork bomb, C-level fork / vfork / clone (cffi's fork + setsid + execv got out) and
    subprocess all fail; threads work."""
    code = LIBC + (
        "print([libc.fork(), libc.syscall(57), libc.syscall(58), libc.syscall(56, 17, 0, 0, 0),"
        " ctypes.get_errno()])\n"
        "import subprocess, threading\n"
        "for start in (os.fork, lambda: subprocess.run(['true'])):\n"
        "    try:\n        start()\n    except PermissionError:\n        print('refused')\n"
        "t = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()"
    )
    assert printed(sandbox, code) == "[-1, -1, -1, -1, 1]\nrefused\nrefused\nthread\n"
    result = run(sandbox, "import os\nwhile True:\n    os.fork()")
    assert result.error == ERROR and "PermissionError" in result.text


def test_a_process_that_gets_started_anyway_does_not_outlive_the_call(monkeypatch):
    """The second line: with the seccomp filter replaced by one that allows everything, a
    child that leaves its session and sleeps on is gone once the call returns (bwrap's
    PID namespace ends with the call)."""
    import pyseccomp

    with tempfile.TemporaryFile() as out:
        pyseccomp.SyscallFilter(pyseccomp.ALLOW).export_bpf(out)
        out.seek(0)
        allow_all = out.read()
    monkeypatch.setattr(isolation, "seccomp_filter", lambda: allow_all)
    marker = f"rlhf-orphan-{uuid.uuid4().hex}"
    code = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
        f"    os.execv('/bin/sh', ['sh', '-c', 'sleep 600; : {marker}'])\nprint('parent done')"
    )
    assert printed(PythonSandbox(SCHEMA, {}), code) == "parent done\n"
    found = [
        p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or ())
    ]
    # killed with the namespace when the call ended; under load the kernel may still be
    # taking it down when we look (it was seen "running" once), so give it a moment
    _, alive = psutil.wait_procs(found, timeout=10)
    assert alive == []


def test_namespaces_other_processes_and_the_network_are_out_of_reach(sandbox):
    """setns into the trainer's network namespace reached a loopback listener, pidfd_open +
    pidfd_send_signal killed the caller; here each call fails and the listener is alone."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    code = LIBC + (
        "net = os.open('/proc/1/ns/net', os.O_RDONLY)\n"
        "calls = [libc.setns(net, 0), libc.unshare(0x40000000), libc.syscall(101, 16, 1, 0, 0),"
        " libc.syscall(434, os.getppid(), 0), libc.mount(b'none', b'/sandbox', b'tmpfs', 0, 0)]\n"
        "print(calls, ctypes.get_errno())\nimport signal, socket\n"
        "try:\n    os.kill(-1, signal.SIGKILL)\nexcept ProcessLookupError:\n    pass\n"
        "for family, kind in ((socket.AF_INET, socket.SOCK_RAW), (17, socket.SOCK_RAW)):\n"
        "    try:\n        socket.socket(family, kind)\n    except PermissionError:\n"
        "        print('raw refused')\n"
        f"socket.create_connection(('127.0.0.1', {port}), timeout=1)"
    )
    try:
        result = run(sandbox, code)
        listener.settimeout(0.1)
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    assert result.error == ERROR and "ConnectionRefusedError" in result.text
    assert result.text.count("raw refused") == 2 and "[-1, -1, -1, -1, -1] 1\n" in result.text


def test_x32_system_calls_kill_the_code(sandbox):
    """The x86-64 kernel's x32 numbering would bypass a filter of x86-64 numbers."""
    if os.uname().machine != "x86_64":
        pytest.skip("x32 exists on x86-64 only")
    result = run(sandbox, LIBC + "libc.syscall(0x40000000 | 57)")
    assert result.error == ERROR and "SIGSYS" in result.text


def test_an_infinite_loop_times_out(sandbox):
    result = run(sandbox, "while True:\n    pass")
    assert result.error == TIMEOUT and "used its 2 s of CPU time" in result.text
    sleepy = PythonSandbox(SCHEMA, {"timeout_s": 3, "cpu_s": 2})
    result = run(sleepy, "import time\ntime.sleep(60)")
    assert result.error == TIMEOUT and "did not finish within 3 s" in result.text


def test_output_and_disk_are_bounded(sandbox):
    result = run(sandbox, "import sys\nfor _ in range(10_000):\n    sys.stdout.write('x' * 10**6)")
    assert result.error == ERROR and "exceeded 2048 bytes" in result.text
    assert len(result.text) < 2048 + 200
    result = run(sandbox, "with open('big', 'w') as f:\n    f.write('x' * 10**8)")
    assert result.error == ERROR and "File too large" in result.text  # file_mb
    code = "for i in range(100):\n    open(f'f{i}', 'w').write('x' * 1000_000)"
    result = run(sandbox, code)  # 100 files of 1 MB into the 16 MB directory
    assert result.error == ERROR and "No space left on device" in result.text


def test_a_crash_is_an_error_with_its_status(sandbox):
    result = run(sandbox, "import os\nos.abort()")
    assert result.error == ERROR and "SIGABRT" in result.text
    result = run(sandbox, "raise ValueError('boom')")
    assert result.error == ERROR and "ValueError: boom" in result.text
    assert 'File "main.py", line 1' in result.text and "sandbox_boot" not in result.text
    result = run(sandbox, "x = bytearray(8 * 1024**3)")
    assert result.error == ERROR and "MemoryError" in result.text


def test_without_the_boundary_the_tool_refuses_to_start(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    missing = isolation.check_machine.__wrapped__()
    assert missing is not None and "apt-get install bubblewrap" in missing
    monkeypatch.setattr(isolation, "check_machine", lambda: missing)
    with pytest.raises(ValueError, match="sandbox cannot start: bubblewrap is not installed"):
        PythonSandbox(SCHEMA, {})
    insecure = PythonSandbox(SCHEMA, {"insecure_local": True})
    assert printed(insecure, "print(6 * 7)") == "42\n"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_files": 4}, "'max_files' was replaced by disk_mb"),
        ({"cpu": 4}, "unknown setting(s) ['cpu']"),
        ({"packages": "numpy"}, "packages must be a list"),
        ({"packages": ["no-such-distribution"]}, "'no-such-distribution' is not installed"),
        ({"python": "/no/python"}, "is not a Python interpreter"),
    ],
)
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError) as error:
        PythonSandbox(SCHEMA, settings)
    assert message in str(error.value)
