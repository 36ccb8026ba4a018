"""`rlhf.cli.launch_servers` (behind launch/sglang_servers.sh): a real SGLang server that
cannot start (no model) fails naming its URL and log, and leaves no process behind.
(Servers that start, behind a router, serving a run, then stopped by SIGTERM:
tests/e2e/test_disaggregated_servers.py.)"""

from __future__ import annotations

import subprocess
import sys

from rlhf.utils import free_port
from tests.helpers import REPO, processes_on

STARTUP_S = 300  # bounded so a hang fails instead of waiting


def test_server_that_cannot_start_fails_naming_url_and_log(tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "rlhf.cli.launch_servers", "--device", "cpu"]
    argv += ["--model", str(tmp_path / "no_model"), "--base-port", str(port)]
    argv += ["--log-dir", str(tmp_path / "logs"), "--startup-timeout", str(STARTUP_S)]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=STARTUP_S)
    assert processes_on(tmp_path / "no_model") == set()
    assert result.returncode == 1
    assert result.stdout == ""
    (error,) = [x for x in result.stderr.splitlines() if x.startswith("launch_servers: error:")]
    assert f"SGLang server for http://127.0.0.1:{port} exited with code" in error
    assert str(tmp_path / "logs" / "sglang_server_0.log") in error
