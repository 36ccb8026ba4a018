"""launch/sglang_servers.sh: one real SGLang CPU server on the tiny model behind an
sglang-router, announced on stdout once healthy, stopped by SIGTERM with no process left
behind; a server that cannot start fails naming its URL and log."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import psutil

from rlhf.rollout.sglang_api import healthy as http_healthy
from rlhf.utils import free_port
from tests.helpers import REPO

STARTUP_S = 300  # a CPU server takes ~30 s here; bounded so a hang fails instead of waiting


def _lines(stream) -> queue.Queue:
    """Lines of `stream` as they come (a thread, so that waiting on them is bounded)."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _announced(lines: queue.Queue, deadline: float) -> list[str]:
    """stdout lines up to and including the server_urls override."""
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        if line.startswith("actor_rollout_ref.rollout.server_urls="):
            return seen
    raise AssertionError(f"no server_urls line within {STARTUP_S} s; stdout so far: {seen}")


def _processes_of(model_dir: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if model_dir in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def test_script_serves_until_sigterm_and_leaves_nothing(tiny_qwen2_dir, tmp_path):
    port, router_port = free_port(), free_port()
    env = {
        **os.environ,
        "MODEL": str(tiny_qwen2_dir),
        "DEVICE": "cpu",
        "NUM_SERVERS": "1",
        "BASE_PORT": str(port),
        "LOG_DIR": str(tmp_path / "logs"),
        "STARTUP_TIMEOUT": str(STARTUP_S),
        "PYTHON": sys.executable,
        "ROUTER": "1",
        "ROUTER_PORT": str(router_port),
    }
    stderr = (tmp_path / "launcher.log").open("w")
    proc = subprocess.Popen(
        ["bash", str(REPO / "launch" / "sglang_servers.sh")],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True,
    )  # fmt: skip
    try:
        url, router = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{router_port}"
        lines = _lines(proc.stdout)
        announced = _announced(lines, time.monotonic() + STARTUP_S)
        assert announced == [url, f"actor_rollout_ref.rollout.server_urls=[{url}]"]
        assert lines.get(timeout=5) == f"router_url={router}"
        assert http_healthy(url) and http_healthy(router)
        assert (tmp_path / "logs" / "sglang_server_0.log").is_file()
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        assert any("sglang.launch_server" in " ".join(p.cmdline()) for p in tree)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stderr.close()
    assert not http_healthy(url, timeout_s=1.0) and not http_healthy(router, timeout_s=1.0)
    assert _processes_of(str(tiny_qwen2_dir)) == []


def test_server_that_cannot_start_fails_naming_url_and_log(tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "rlhf.cli.launch_servers", "--device", "cpu"]
    argv += ["--model", str(tmp_path / "no_model"), "--base-port", str(port)]
    argv += ["--log-dir", str(tmp_path / "logs"), "--startup-timeout", str(STARTUP_S)]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=STARTUP_S)
    assert result.returncode == 1
    assert result.stdout == ""
    assert f"http://127.0.0.1:{port}" in result.stderr
    assert str(tmp_path / "logs" / "sglang_server_0.log") in result.stderr
