"""rlhf.cli.launch_servers with stand-in servers (tests/unit/test_rollout_server_group.py's
small HTTP script): fixed ports and GPUs per server, the announcement on stdout, a clean stop
on SIGTERM, exit 1 naming the URL when a server dies. Real SGLang: tests/e2e."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from rlhf.cli import launch_servers
from rlhf.config.schema import RolloutConfig
from rlhf.rollout import server_group
from rlhf.rollout.server_group import ServerGroup
from rlhf.rollout.sglang_server import build_server_args
from rlhf.sglang_api import healthy as http_healthy
from rlhf.utils import free_port
from tests.unit.test_rollout_server_group import STAND_IN, assert_gone, group_pids


@pytest.fixture
def launched(tmp_path, monkeypatch) -> list[dict]:
    """Servers become stand-ins; returns the keyword arguments each was built with."""
    script = tmp_path / "stand_in_server.py"
    script.write_text(STAND_IN)
    calls: list[dict] = []

    def build(rollout, model_path, *, port, device, host="127.0.0.1", **kwargs):
        calls.append({"port": port, "device": device, **kwargs})
        launch = build_server_args(rollout, model_path, port=port, device=device, host=host)
        argv = [launch.argv[0], str(script), str(port), str(tmp_path / "posts"), "0"]
        return type(launch)(argv=argv, env={}, url=launch.url)

    monkeypatch.setattr(server_group, "build_server_args", build)
    return calls


def _two_free_ports() -> int:
    """A port p with p and p + 1 free a moment ago."""
    for _ in range(50):
        base = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise RuntimeError("no two consecutive free ports")


def test_fixed_ports_and_one_gpu_range_per_server(launched, tmp_path):
    base = _two_free_ports()
    rollout = RolloutConfig(num_servers=2, tensor_model_parallel_size=2)
    with ServerGroup(rollout, "m", log_dir=tmp_path, base_port=base) as group:
        group.start()
        assert group.server_urls == [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
    assert [(c["port"], c["base_gpu_id"]) for c in launched] == [(base, 0), (base + 1, 2)]


def test_base_gpu_id_flag():
    argv = build_server_args(RolloutConfig(), "m", port=1, device="cuda", base_gpu_id=4).argv
    assert argv[argv.index("--base-gpu-id") + 1] == "4"
    assert (
        "--base-gpu-id" not in build_server_args(RolloutConfig(), "m", port=1, device="cuda").argv
    )


def test_wildcard_host_is_announced_by_name():
    assert launch_servers.advertised("http://0.0.0.0:30000", "0.0.0.0") == (
        f"http://{socket.getfqdn()}:30000"
    )
    assert launch_servers.advertised("http://10.0.0.5:1", "10.0.0.5") == "http://10.0.0.5:1"


def test_bad_sizes_exit_2_naming_the_key(capsys):
    assert launch_servers.main(["--model", "m", "--tp", "0"]) == 2
    assert "tensor_model_parallel_size: must be > 0" in capsys.readouterr().err


def _when_healthy(url: str, then, timeout_s: float = 30.0) -> threading.Thread:
    def wait() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not http_healthy(url, timeout_s=1.0):
            time.sleep(0.2)
        time.sleep(0.5)  # past the announcement
        then()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def test_announces_then_stops_cleanly_on_sigterm(launched, tmp_path, capsys):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    before = signal.getsignal(signal.SIGTERM)
    _when_healthy(url, lambda: os.kill(os.getpid(), signal.SIGTERM))
    argv = ["--model", "m", "--device", "cpu", "--base-port", str(port), "--log-dir", str(tmp_path)]
    assert launch_servers.main(argv) == 0
    assert capsys.readouterr().out.splitlines() == [
        url,
        f"actor_rollout_ref.rollout.server_urls=[{url}]",
    ]
    assert launched[0]["max_total_tokens"] == launch_servers.CPU_MAX_TOTAL_TOKENS
    assert not http_healthy(url, timeout_s=1.0)
    assert signal.getsignal(signal.SIGTERM) == before


def test_dead_server_exits_1_naming_it(launched, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launch_servers, "POLL_S", 0.2)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    pids: list[int] = []
    original_start = ServerGroup.start

    def start(group: ServerGroup) -> ServerGroup:
        original_start(group)
        pids.extend(group_pids(group))
        return group

    monkeypatch.setattr(ServerGroup, "start", start)
    _when_healthy(url, lambda: os.killpg(pids[0], signal.SIGKILL))
    argv = ["--model", "m", "--device", "cpu", "--base-port", str(port), "--log-dir", str(tmp_path)]
    assert launch_servers.main(argv) == 1
    err = capsys.readouterr().err
    assert url in err and "sglang_server_0.log" in err
    assert_gone(pids)
