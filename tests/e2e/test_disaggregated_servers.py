"""Disaggregated servers, as a user runs them: `launch/sglang_servers.sh` starts a real SGLang
CPU server behind an sglang-router with the run's API key (from the environment, on no
command line), announces them on stdout once healthy, refuses requests without the key
(server and router, generation and weight updates), serves the project's clients, which
send it, and a whole `rlhf-train` run given the announced `rollout.server_urls` syncs its
weights into the server through the distributed transport with the probe in tolerance;
SIGTERM then stops everything the script started. (A server that cannot start:
tests/e2e/test_launch_servers.py.)"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

from rlhf import sglang_api
from rlhf.quickstart.data import write_quickstart_data
from rlhf.rollout.client import GenerateClient, generate_payload
from rlhf.utils import free_port, free_ports
from tests.e2e.test_ppo_training import launch_node, wait_all
from tests.helpers import REPO, metrics_by_step, ppo_overrides, processes_on

STARTUP_S = 300  # a CPU server takes ~30 s here; bounded so a hang fails instead of waiting
KEY = "e2e-api-key-4f1c"
SAMPLING = {"n": 2, "temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}


def stdout_lines(stream) -> queue.Queue:
    """Lines of `stream` as they come (a thread, so that waiting on them is bounded)."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def announced(lines: queue.Queue, deadline: float) -> list[str]:
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


def refused_without_key(url: str) -> list[int]:
    """Status codes of /generate and a weight update sent with no key and a wrong key."""
    generate = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
    calls = [("generate", generate), ("update_weights_from_disk", {"model_path": "/nowhere"})]
    codes = []
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for route, body in calls:
            codes.append(
                requests.post(f"{url}/{route}", json=body, headers=headers, timeout=30).status_code
            )
    return codes


def check_keyed_servers(url: str, router: str) -> None:
    """Strangers are refused; the project's clients (which send the key) are served."""
    assert sglang_api.healthy(url) and sglang_api.healthy(router)  # /health needs no key
    assert refused_without_key(url) == [401] * 4
    assert requests.post(f"{router}/generate", json={}, timeout=30).status_code == 401
    via_router = GenerateClient([router]).generate([generate_payload([4, 5], SAMPLING)])
    assert [len(g.output_ids) for g in via_router[0].generations] == [4, 4]
    assert sglang_api.router_healthy_workers(router) == {url}


@pytest.mark.reliability
@pytest.mark.slow(reason="servers from the launch script, then a whole run on them")
def test_keyed_servers_from_the_launch_script_serve_a_run(tiny_qwen2_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(sglang_api.API_KEY_ENV, KEY)
    port, router_port = free_ports(2)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PYTHON": sys.executable,
        "MODEL": str(tiny_qwen2_dir),
        "DEVICE": "cpu",
        "NUM_SERVERS": "1",
        "BASE_PORT": str(port),
        "LOG_DIR": str(tmp_path / "logs"),
        "STARTUP_TIMEOUT": str(STARTUP_S),
        "ROUTER": "1",
        "ROUTER_PORT": str(router_port),
    }
    stderr = (tmp_path / "launcher.log").open("w")
    before = processes_on(tiny_qwen2_dir)
    script = subprocess.Popen(
        ["bash", str(REPO / "launch" / "sglang_servers.sh")],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    url, router = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{router_port}"
    try:
        lines = stdout_lines(script.stdout)
        override = f"actor_rollout_ref.rollout.server_urls=[{url}]"
        assert announced(lines, time.monotonic() + STARTUP_S) == [url, override]
        assert lines.get(timeout=5) == f"router_url={router}"
        assert (tmp_path / "logs" / "sglang_server_0.log").is_file()
        tree = [psutil.Process(script.pid), *psutil.Process(script.pid).children(recursive=True)]
        assert any("sglang.launch_server" in " ".join(p.cmdline()) for p in tree)
        # the key reaches them by environment (rlhf.rollout.keyed_launch), not on a command
        # line any local user reads; their logs, where SGLang writes it, are private
        assert [p.cmdline() for p in tree if KEY in " ".join(p.cmdline())] == []
        assert (tmp_path / "logs" / "sglang_server_0.log").stat().st_mode & 0o777 == 0o600
        check_keyed_servers(url, router)
        run_dir = train_on(override, tiny_qwen2_dir, tmp_path)

        script.send_signal(signal.SIGTERM)
        assert script.wait(timeout=60) == 0
    finally:
        if script.poll() is None:
            script.kill()
            script.wait()
        stderr.close()
    assert not sglang_api.healthy(url, timeout_s=1.0)
    assert not sglang_api.healthy(router, timeout_s=1.0)
    assert processes_on(tiny_qwen2_dir) - before == set()  # nothing the script started
    rows = metrics_by_step(run_dir)
    assert sorted(rows) == [0, 1, 2]
    for step in (1, 2):
        assert rows[step]["rollout/logprob_diff_max"] < 1e-3
    assert not (run_dir / "logs").exists()  # the run launched no server of its own


def train_on(override: str, model_dir: Path, tmp_path: Path) -> Path:
    """A 2-step `launch/torchrun.sh` run on the announced servers (the distributed
    transport); its run directory."""
    data = write_quickstart_data(tmp_path / "data", num_train=32, num_val=8)
    run_dir = tmp_path / "run"
    args = ppo_overrides(
        model_dir,
        data,
        run_dir,
        2,
        override,
        "actor_rollout_ref.rollout.weight_sync_transport=distributed",
        "actor_rollout_ref.rollout.logprob_diff_threshold=1e-3",
    )
    log = tmp_path / "run.log"
    wait_all([launch_node(args, log, GPUS_PER_NODE="1", MASTER_PORT=str(free_port()))], [log])
    return run_dir
