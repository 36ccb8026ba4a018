"""rlhf-doctor: each check on a situation made for it (busy port, unwritable directory, URL
with nothing behind it, ...), and the CLI's exit codes on the quickstart config."""

from __future__ import annotations

import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from rlhf.cli.doctor_checks import (
    FAIL,
    PASS,
    SKIP,
    WARN,
    check_cuda,
    check_inputs,
    check_master_addr,
    check_master_port,
    check_packages,
    check_run_dir,
    check_sglang_urls,
    check_weight_sync_address,
)
from rlhf.config import load_config
from rlhf.utils import free_port
from tests.helpers import REPO

LOCK = REPO / "requirements" / "cpu.lock"
QUICKSTART = REPO / "configs" / "quickstart_cpu.yaml"


@pytest.fixture
def listening_socket():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        yield sock


def test_occupied_master_port_fails_naming_the_port(listening_socket):
    port = listening_socket.getsockname()[1]
    result = check_master_port(port, node_rank=0)
    assert result.status == FAIL
    assert f"MASTER_PORT {port} is in use" in result.detail
    assert "MASTER_PORT" in result.fix


def test_free_master_port_passes_and_other_nodes_skip(listening_socket):
    assert check_master_port(free_port(), node_rank=0).status == PASS
    assert check_master_port(listening_socket.getsockname()[1], node_rank=1).status == SKIP


def test_master_addr(listening_socket):
    port = listening_socket.getsockname()[1]
    assert check_master_addr("127.0.0.1", port, node_rank=0, nnodes=1).status == PASS
    assert check_master_addr("localhost", port, node_rank=0, nnodes=2).status == FAIL
    assert check_master_addr("no-such-host.invalid", port, 0, 1).status == FAIL
    assert check_master_addr("127.0.0.1", port, node_rank=1, nnodes=2).status == PASS
    refused = check_master_addr("127.0.0.1", free_port(), node_rank=1, nnodes=2)
    assert refused.status == WARN and "nothing listens" in refused.detail


def test_run_dir_under_a_regular_file_fails(tmp_path):
    (tmp_path / "a_file").write_text("x")
    result = check_run_dir(tmp_path / "a_file" / "run")
    assert result.status == FAIL
    assert "is a file" in result.detail


def test_run_dir_that_cannot_be_written_fails(tmp_path):
    if os.geteuid() == 0:  # root writes through chmod 0o500; /proc refuses new files to all
        target = Path("/proc/rlhf-doctor-test/run")
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        target = locked / "run"
    try:
        result = check_run_dir(target)
    finally:
        if os.geteuid() != 0:
            (tmp_path / "locked").chmod(0o700)
    assert result.status == FAIL
    assert "cannot write" in result.detail


def test_run_dir_writable_passes_and_needs_room_for_checkpoints(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.safetensors").write_bytes(b"0" * 1000)
    assert check_run_dir(tmp_path / "new" / "run", tmp_path / "model").status == PASS
    assert not list(tmp_path.glob(".rlhf-doctor-*"))  # the probe file is removed

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10, 10, 100 << 20))
    result = check_run_dir(tmp_path / "run", tmp_path / "model")
    assert result.status == FAIL and "0.1 GiB free" in result.detail


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_sglang_urls():
    dead = f"http://127.0.0.1:{free_port()}"
    result = check_sglang_urls([dead], num_servers=1)
    assert result.status == FAIL and dead in result.detail
    assert check_sglang_urls(None, num_servers=2).status == SKIP

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        alive = f"http://127.0.0.1:{server.server_address[1]}/"
        assert check_sglang_urls([alive], num_servers=1).status == PASS
        assert check_sglang_urls([alive, dead], num_servers=1).status == FAIL
    finally:
        server.shutdown()
        server.server_close()


def test_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check_cuda("cpu", 1).status == SKIP
    assert check_cuda("auto", 1).status == WARN
    assert check_cuda("cuda", 1).status == FAIL
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    result = check_cuda("cuda", 8)
    assert result.status == FAIL and "2 GPU(s) visible" in result.detail


def test_packages(tmp_path):
    assert check_packages(LOCK).status == PASS
    assert check_packages(tmp_path / "missing.lock").status == SKIP
    lock = tmp_path / "other.lock"
    lock.write_text("no-such-package-xyz==1.0\n")
    assert check_packages(lock).status == WARN
    lock.write_text("torch==0.0.1\n")
    assert check_packages(lock).status == FAIL
    gpu = tmp_path / "gpu.txt"
    gpu.write_text("transformer-engine[pytorch]==2.11.0\n")
    result = check_packages(LOCK, gpu)
    assert result.status == FAIL and "transformer-engine: pinned 2.11.0" in result.detail


def config_check(cfg, world_size: int | None, tmp_path: Path):
    """The config row of `run_checks` (which binds the config's validation for it)."""
    from rlhf.cli.doctor import run_checks

    checks = run_checks(cfg, world_size, {"MASTER_PORT": "0"}, requirements=tmp_path / "none")
    return next(c for c in checks if c.name == "config")


def inputs_check(cfg):
    aro = cfg.actor_rollout_ref
    return check_inputs(aro.model.path, cfg.critic.model.path, cfg.reward.model_path, cfg.data)


def test_config_for_the_world_size_and_inputs(tmp_path, tiny_qwen2_dir):
    cfg = load_config(QUICKSTART, [f"actor_rollout_ref.model.path={tmp_path / 'none'}"])
    assert config_check(cfg, 1, tmp_path).status == PASS
    wrong = config_check(cfg, 2, tmp_path)
    assert wrong.status == FAIL and "WORLD_SIZE" in wrong.detail
    inputs = inputs_check(cfg)
    assert inputs.status == FAIL and "no config.json" in inputs.detail

    cfg = load_config(QUICKSTART, _overrides(tmp_path, tiny_qwen2_dir))
    assert inputs_check(cfg).status == PASS


def test_a_mixture_of_experts_policy_with_dense_layers_is_refused(tmp_path, tiny_qwen2_dir):
    """SGLang builds every qwen3_moe layer with experts: a policy with dense layers among
    them is refused up front; an all-MoE one passes."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    vocab = json.loads((tiny_qwen2_dir / "config.json").read_text())["vocab_size"]
    experts = dict(num_experts=3, moe_intermediate_size=8)
    for name, dense, status in (("mixed", [1], FAIL), ("sparse", [], PASS)):
        moe_dir = tmp_path / name
        shutil.copytree(tiny_qwen2_dir, moe_dir)
        config = AutoConfig.for_model(
            "qwen3_moe", vocab_size=vocab, mlp_only_layers=dense, **shape, **experts
        )
        AutoModelForCausalLM.from_config(config).save_pretrained(moe_dir)
        inputs = inputs_check(load_config(QUICKSTART, _overrides(tmp_path, moe_dir)))
        assert inputs.status == status, inputs.detail
        if status == FAIL:
            assert "dense layers [1] among its mixture-of-experts layers" in inputs.detail


def _overrides(tmp_path: Path, model_dir: Path) -> list[str]:
    for name in ("train.parquet", "val.parquet"):
        (tmp_path / name).write_bytes(b"")  # only their existence is checked
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={tmp_path / 'train.parquet'}",
        f"data.val_files={tmp_path / 'val.parquet'}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]


def _doctor(args: list[str], as_script: bool = False) -> subprocess.CompletedProcess:
    """`python -m rlhf.cli.doctor`, or the installed `rlhf-doctor` console script."""
    script = Path(sys.executable).parent / "rlhf-doctor"
    entry = [str(script)] if as_script else ["-m", "rlhf.cli.doctor"]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for key in ("NODE_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    return subprocess.run(
        [sys.executable, *entry, "--config", str(QUICKSTART), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def test_cli_exit_codes(tmp_path, tiny_qwen2_dir):
    overrides = _overrides(tmp_path, tiny_qwen2_dir)
    ok = _doctor(overrides)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "FAIL" not in ok.stdout and "rlhf-doctor: no check failed" in ok.stdout

    dead = f"http://127.0.0.1:{free_port()}"
    failing = _doctor([*overrides, f"actor_rollout_ref.rollout.server_urls=[{dead}]"], True)
    assert failing.returncode == 1, failing.stdout + failing.stderr
    assert "FAIL" in failing.stdout and dead in failing.stdout

    bad = _doctor(["actor_rollout_ref.rollout.temprature=1"])
    assert bad.returncode == 2
    assert bad.stdout == ""
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlhf-doctor: config error: unknown config key")


def test_run_checks_reads_the_launch_environment(tmp_path, tiny_qwen2_dir, listening_socket):
    from rlhf.cli.doctor import run_checks

    cfg = load_config(QUICKSTART, _overrides(tmp_path, tiny_qwen2_dir))
    port = str(listening_socket.getsockname()[1])
    checks = {c.name: c for c in run_checks(cfg, None, {"MASTER_PORT": port})}
    assert checks["master port"].status == FAIL and port in checks["master port"].detail
    assert checks["config"].status == PASS
    assert checks["sglang servers"].status == SKIP


def test_a_loopback_weight_sync_address_fails_with_servers_on_other_hosts():
    remote = ["http://10.1.2.3:30000", "http://127.0.0.1:30001"]
    failed = check_weight_sync_address(remote, "distributed", "127.0.0.1")
    assert failed.status == FAIL and "unreachable from the servers at http://10.1.2.3:30000" in (
        failed.detail
    )
    assert check_weight_sync_address(remote, "distributed", "10.1.2.9").status == PASS
    local = ["http://localhost:30000", "http://127.0.0.1:30001"]
    assert check_weight_sync_address(local, "distributed", "127.0.0.1").status == PASS
    assert check_weight_sync_address(None, "distributed", "127.0.0.1").status == PASS
    assert check_weight_sync_address(remote, "tensor", "127.0.0.1").status == SKIP
