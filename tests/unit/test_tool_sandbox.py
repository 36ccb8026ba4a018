"""The Python code tool's sandbox (rlhf.tools.sandbox): what the policy's code may not do is
contained and comes back as a tool error, and the run's process is never at risk.

Each case is a real subprocess under the real limits; a case passes only if the call
returned (no hang, no exception into the caller) with the error kind and message expected.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.tools.base import ERROR, TIMEOUT
from rlhf.tools.sandbox import PythonSandbox, network_namespace_prefix

SCHEMA = {"type": "function", "function": {"name": "python", "parameters": {}}}


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    """A wall clock far beyond the CPU limit: on a loaded machine a CPU-bound child takes
    longer than its CPU seconds, and the limit under test must be the one that stops it."""
    return PythonSandbox(SCHEMA, {"timeout_s": 30, "cpu_s": 2, "max_output_bytes": 2048})


def run(sandbox: PythonSandbox, code: str):
    return asyncio.run(sandbox.run(code))


def test_plain_code_prints_its_result(sandbox):
    result = run(sandbox, "import math\nprint(sum(range(10)), math.factorial(5))")
    assert (result.text, result.error) == ("45 120\n", None)


def test_reading_a_file_outside_its_directory_is_refused(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    result = run(sandbox, f"print(open({str(secret)!r}).read())")
    assert result.error == ERROR
    assert f"opening {secret} is not allowed" in result.text and "do not read" not in result.text
    result = run(sandbox, "import os\nprint(os.listdir('/'))")
    assert result.error == ERROR and "os.listdir outside the working directory" in result.text


def test_its_own_directory_is_writable_and_gone_afterwards(sandbox):
    code = (
        "import os\nopen('out.txt', 'w').write('kept')\nprint(open('out.txt').read(), os.getcwd())"
    )
    result = run(sandbox, code)
    text, workdir = result.text.split()
    assert text == "kept" and result.error is None
    assert not os.path.exists(workdir)


def test_opening_a_socket_is_refused(sandbox):
    listener = socket.create_server(("127.0.0.1", 0))  # a port the code could reach
    port = listener.getsockname()[1]
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"
        result = run(sandbox, code)
    finally:
        listener.close()
    assert result.error == ERROR and "sandbox: socket." in result.text


@pytest.mark.skipif(not network_namespace_prefix(), reason="unshare cannot make a namespace")
def test_the_process_has_no_network_even_below_python(sandbox):
    """With the audit hook out of the way (a C library's socket would bypass it), the
    namespace has no interface to reach: a connection to this machine's listener fails."""
    prefix = network_namespace_prefix()
    assert PythonSandbox(SCHEMA, {}).argv(Path("/w"))[: len(prefix)] == list(prefix)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)"
        done = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True)
    finally:
        listener.close()
    assert done.returncode != 0, done.stdout
    assert b"Network is unreachable" in done.stderr or b"ConnectionRefusedError" in done.stderr


def test_a_fork_bomb_is_refused(sandbox):
    result = run(sandbox, "import os\nwhile True:\n    os.fork()")
    assert result.error == ERROR and "sandbox: os.fork is not allowed" in result.text
    result = run(sandbox, "import subprocess\nsubprocess.run(['ls', '/'])")
    assert result.error == ERROR and "is not allowed" in result.text


def test_an_infinite_loop_times_out(sandbox):
    result = run(sandbox, "while True:\n    pass")
    assert result.error == TIMEOUT and "used its 2 s of CPU time" in result.text
    sleepy = PythonSandbox(SCHEMA, {"timeout_s": 3, "cpu_s": 2})
    result = run(sleepy, "import time\ntime.sleep(60)")
    assert result.error == TIMEOUT and "did not finish within 3 s" in result.text


def test_ten_gigabytes_of_output_are_cut(sandbox):
    result = run(sandbox, "import sys\nfor _ in range(10_000):\n    sys.stdout.write('x' * 10**6)")
    assert result.error == ERROR and "exceeded 2048 bytes" in result.text
    assert len(result.text) < 2048 + 200
    result = run(sandbox, "with open('big', 'w') as f:\n    f.write('x' * 10**9)")
    assert result.error == ERROR  # 1 GB into a file: the file size or memory limit


def test_a_crash_is_an_error_with_its_status(sandbox):
    result = run(sandbox, "import os\nos.abort()")
    assert result.error == ERROR and "SIGABRT" in result.text
    result = run(sandbox, "raise ValueError('boom')")
    assert result.error == ERROR and "ValueError: boom" in result.text
    assert 'File "main.py", line 1' in result.text and "sandbox_boot" not in result.text
    result = run(sandbox, "x = bytearray(8 * 1024**3)")
    assert result.error == ERROR and "MemoryError" in result.text


def test_ctypes_cannot_reach_c_functions_but_numpy_imports(sandbox):
    result = run(sandbox, "import ctypes\nctypes.CDLL(None).system(b'true')")
    assert result.error == ERROR and "ctypes.dlsym is not allowed" in result.text
    result = run(sandbox, "import numpy as np\nprint(int(np.arange(5).sum()))")
    assert (result.text, result.error) == ("10\n", None)
