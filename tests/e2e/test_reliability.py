"""Faults a whole `rlhf-train` run (CPU, a real SGLang server) reports in one line or survives.

The runs use the session's shared server as an external one, but for the last, which
launches its own two servers to kill them.

- An absurd critic learning rate (1e30): the first update is finite but leaves the critic
  huge, so step 2's values are inf. Under `trainer.on_nonfinite=stop` the run exits 1 with one
  line naming the step and what was not finite, the step's samples kept; under `skip` it
  finishes, each later step skipped and said in one warning line with its step. Either way
  every checkpoint written holds only finite weights and optimizer state (every tensor of
  its Megatron checkpoints, read with torch's `dcp_to_torch_save`).
- A truncated file in the latest checkpoint: the next run says which file, falls back to the
  previous checkpoint and goes on from there.
- An SGLang server killed during a weight sync (distributed transport) and during the
  log-prob probe: restarted, re-synced, and the run completes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from rlhf.quickstart.data import write_quickstart_data
from tests.helpers import REPO, metrics_by_step, ppo_overrides, rlhf_train

pytestmark = [pytest.mark.reliability, pytest.mark.slow(reason="whole runs that meet each fault")]
CONFIG = str(REPO / "configs" / "quickstart_cpu.yaml")
FAULT_DRIVER = Path(__file__).with_name("server_fault_driver.py")
ABSURD = [
    "critic.optim.lr=1e30",
    "critic.ppo_mini_batch_size=16",
    "trainer.save_freq=1",
    "trainer.val_before_train=false",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_quickstart_data(tmp_path_factory.mktemp("data"), num_train=32, num_val=8)


def train(args: list[str], log_dir: Path) -> subprocess.CompletedProcess:
    return rlhf_train(CONFIG, args, log_dir)


def finite_checkpoints(run_dir: Path) -> list[int]:
    """The checkpoints' steps; asserts every tensor of their actor and critic is finite."""
    steps = []
    for checkpoint in sorted((run_dir / "checkpoints").glob("global_step_*")):
        for role in ("actor", "critic"):
            flat = run_dir / f"{checkpoint.name}_{role}.pt"
            dcp_to_torch_save(checkpoint / role / "model", flat)
            state = torch.load(flat, weights_only=False)
            tensors = {k: v for k, v in state.items() if torch.is_tensor(v)}
            assert len(tensors) > 10
            for name, tensor in tensors.items():
                assert torch.isfinite(tensor).all(), (checkpoint, role, name)
        steps.append(int(checkpoint.name.removeprefix("global_step_")))
    return steps


def test_nan_stops_the_run_in_one_line(tiny_qwen2_dir, data, sglang_server, tmp_path):
    run_dir = tmp_path / "stop"
    args = ppo_overrides(tiny_qwen2_dir, data, run_dir, 3, *ABSURD, server=sglang_server)
    proc = train(args, tmp_path / "logs")
    assert proc.returncode == 1, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("rlhf-train:")]
    assert line.startswith("rlhf-train: stopped: step 2: not finite before the updates: values")
    assert finite_checkpoints(run_dir) == [1]
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "1\n"
    # the stopped step's samples are kept (written at a step's end, a failed step's too)
    kept = sorted(p.name for p in (run_dir / "rollouts").iterdir())
    assert kept == [f"step_{s}.{x}" for s in (1, 2) for x in ("jsonl", "parquet")]


@pytest.fixture(scope="module")
def skipping_run(tiny_qwen2_dir, data, sglang_server, tmp_path_factory) -> tuple[Path, list[str]]:
    run_dir = tmp_path_factory.mktemp("skip") / "run"
    skip = ["trainer.on_nonfinite=skip", "trainer.save_freq=2"]  # checkpoints 2 and 3 (the end)
    args = ppo_overrides(tiny_qwen2_dir, data, run_dir, 3, *ABSURD, *skip, server=sglang_server)
    proc = train(args, run_dir.parent / "logs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, args


def test_nan_steps_are_skipped_and_said(skipping_run):
    run_dir, _ = skipping_run
    rows = metrics_by_step(run_dir)
    assert "training/skipped_step" not in rows[1]
    assert rows[2]["training/skipped_step"] == rows[3]["training/skipped_step"] == 1.0
    assert rows[2]["nonfinite/values"] == 1.0
    assert finite_checkpoints(run_dir) == [2, 3]


def test_truncated_latest_checkpoint_resumes_from_the_previous(skipping_run):
    run_dir, args = skipping_run
    shard = max(
        (run_dir / "checkpoints" / "global_step_3" / "critic").rglob("*.distcp"),
        key=lambda p: p.stat().st_size,
    )
    os.truncate(shard, shard.stat().st_size // 2)
    proc = train([*args, "trainer.total_training_steps=4"], run_dir.parent / "resumed_logs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (damaged,) = [x for x in proc.stderr.splitlines() if "is damaged" in x]
    assert str(shard) in damaged and "falling back" in damaged
    assert "resumed from" in proc.stderr and "global_step_2 (step 2)" in proc.stderr
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines][-2:] == [3, 4]  # step 3 again, then 4


def test_server_killed_during_sync_and_probe_is_restarted(tiny_qwen2_dir, data, tmp_path):
    """Two servers on the distributed transport (whose recovery was flaky: a crashed
    server's process still ran, was taken for alive and refused the next call); the driver
    SIGKILLs server 0 before step 1's weight bucket reaches it (calls 1 and 2 are the
    initial load into the servers that slept while the models were built), and again
    before step 2's log-prob probe asks it. Server 1 gets every bucket meanwhile; server 0 is
    restarted and re-synced each time, step 3's sync reaches the server restarted at the
    probe over a new group (the old one's was kept: that sync lost it once more), and the run
    finishes with the probe equal to the trainer (a server left with its initial weights
    would be far off). The tensor transport's recovery: tests/e2e/test_weight_sync.py."""
    run_dir = tmp_path / "faults"
    kills = ["--kill", "update_weights_from_distributed:3", "--kill", "prompt_logprobs:5"]
    args = ppo_overrides(
        tiny_qwen2_dir,
        data,
        run_dir,
        3,
        "trainer.val_before_train=false",
        "actor_rollout_ref.rollout.num_servers=2",
        "actor_rollout_ref.rollout.weight_sync_transport=distributed",
    )
    cmd = [sys.executable, str(FAULT_DRIVER), *kills, "--", "--config", CONFIG, *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert out.count("server_fault_driver: killed") == 2
    assert "lost during weight sync v1" in out and "lost during the log-prob probe" in out
    assert out.count("lost during weight sync") == 1, out
    assert "restarting it (1/2)" in out and "restarting it (2/2)" in out
    rows = metrics_by_step(run_dir)
    assert sorted(rows) == [1, 2, 3]
    for step in (1, 2, 3):
        assert rows[step]["rollout/logprob_diff_max"] < 1e-3, (step, rows[step])
