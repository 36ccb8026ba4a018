"""Launch modes on one machine, with real SGLang CPU servers.

- Simulated 2 nodes: two `launch/torchrun.sh` launches (NNODES=2, NODE_RANK 0 and 1,
  rendezvous on localhost), one colocated SGLang server per node, prompts split across the
  nodes and each node's server synced by its own local rank 0. With greedy rollouts it logs
  exactly the metrics of a single-node 2-process run (one server) with the same seed.
- Disaggregated: servers started by `launch/sglang_servers.sh`, given to the run as
  `rollout.server_urls`, weights synced through the distributed transport; the parity probe
  stays within tolerance.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf.quickstart.data import write_quickstart_data
from rlhf.utils import free_port
from tests.helpers import REPO, metrics_by_step, ppo_overrides

CONFIG = "configs/quickstart_cpu.yaml"
VOLATILE = ("timing_s/", "perf/throughput", "perf/mfu")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_quickstart_data(tmp_path_factory.mktemp("data"), num_train=32, num_val=8)


def launch(args: list[str], log: Path, **env: str) -> subprocess.Popen:
    full_env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PYTHON": sys.executable,
        **env,
    }
    with open(log, "w") as out:
        return subprocess.Popen(
            ["bash", "launch/torchrun.sh", "--config", CONFIG, *args], cwd=REPO,
            stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
        )  # fmt: skip


def wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    for proc, log in zip(procs, logs):
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            raise
        assert code == 0, log.read_text()[-6000:]


@pytest.mark.slow
def test_two_simulated_nodes_match_one_node(tiny_qwen2_dir, data, tmp_path):
    single = tmp_path / "single"
    log = tmp_path / "single.log"
    wait_all(
        [launch(ppo_overrides(tiny_qwen2_dir, data, single, 2), log, NNODES="1", GPUS_PER_NODE="2",
                MASTER_PORT=str(free_port()))],
        [log],
    )  # fmt: skip
    two = tmp_path / "two_nodes"
    port = str(free_port())
    logs = [tmp_path / f"node{k}.log" for k in (0, 1)]
    procs = [
        launch(ppo_overrides(tiny_qwen2_dir, data, two, 2), logs[k], NNODES="2", NODE_RANK=str(k),
               GPUS_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        for k in (0, 1)
    ]  # fmt: skip
    wait_all(procs, logs)
    # one colocated server per node, each with its own log
    assert (two / "node0" / "logs" / "sglang_server_0.log").is_file()
    assert (two / "node1" / "logs" / "sglang_server_0.log").is_file()
    reference, got = metrics_by_step(single), metrics_by_step(two)
    assert sorted(got) == sorted(reference) == [0, 1, 2]
    for step, row in reference.items():
        assert set(got[step]) == set(row)
        for key, value in row.items():
            if not key.startswith(VOLATILE):
                assert got[step][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, key)


@pytest.mark.slow
def test_disaggregated_servers_from_the_launch_script(tiny_qwen2_dir, data, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHON": sys.executable,
           "MODEL": str(tiny_qwen2_dir), "NUM_SERVERS": "1", "DEVICE": "cpu",
           "BASE_PORT": str(free_port()), "LOG_DIR": str(tmp_path / "server_logs")}  # fmt: skip
    servers_log = tmp_path / "servers.out"
    with open(servers_log, "w") as out:
        servers = subprocess.Popen(
            ["bash", "launch/sglang_servers.sh"], cwd=REPO, stdout=out,
            stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        override = None
        deadline = time.monotonic() + 300
        while override is None and time.monotonic() < deadline and servers.poll() is None:
            found = re.search(
                r"actor_rollout_ref\.rollout\.server_urls=\S+", servers_log.read_text()
            )
            override = found.group(0) if found else None
            time.sleep(0.5)
        assert override, servers_log.read_text()[-3000:]
        run_dir = tmp_path / "run"
        args = ppo_overrides(
            tiny_qwen2_dir, data, run_dir, 2, override,
            "actor_rollout_ref.rollout.weight_sync_transport=distributed",
            "actor_rollout_ref.rollout.logprob_diff_threshold=1e-3",
        )  # fmt: skip
        log = tmp_path / "run.log"
        wait_all([launch(args, log, GPUS_PER_NODE="1", MASTER_PORT=str(free_port()))], [log])
    finally:
        servers.send_signal(signal.SIGTERM)
        servers.wait(timeout=120)
    rows = metrics_by_step(run_dir)
    assert sorted(rows) == [0, 1, 2]
    for step in (1, 2):
        assert rows[step]["rollout/logprob_diff_max"] < 1e-3
    assert not (run_dir / "logs").exists()  # the run launched no server of its own
