"""`rlhf-ray-train` on a local Ray cluster (started by this module, 4 CPUs) with 2 CPU ranks:

- a 2-step DP2 run with a checkpoint every step, then a second launch that resumes from it
  and runs step 3 (the ranks' torchrun variables, the rendezvous on rank 0's node, per-rank
  logs, the trainer's own resume);
- a rank that fails (a model directory that does not exist: the config loads, the ranks
  fail at startup) makes the launcher exit with its code and one line naming it.

The pure decisions (bundles, ranks, environments, the supervisor) are tested in
tests/unit/test_ray_launch_plan.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.quickstart.data import write_quickstart_data
from tests.helpers import REPO, metrics_by_step, ppo_overrides

CONFIG = str(REPO / "configs" / "quickstart_cpu.yaml")
TWO_CPU_RANKS = ["trainer.nnodes=1", "trainer.n_gpus_per_node=2", "trainer.device=cpu"]


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray cluster for this module's launches (its GCS address); shut down after."""
    ray = pytest.importorskip("ray")
    ctx = ray.init(num_cpus=4, include_dashboard=False, object_store_memory=80 * 2**20)
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_quickstart_data(tmp_path_factory.mktemp("data"), num_train=16, num_val=4)


def ray_train(address: str, args: list[str], log: Path) -> tuple[int, str]:
    """`rlhf-ray-train --address ADDRESS --config CONFIG ARGS`: its exit code and stderr
    (all of its output is in `log`)."""
    command = [sys.executable, "-m", "rlhf.cli.ray_train", "--address", address, "--grace-s", "20"]
    proc = subprocess.run(
        [*command, "--config", CONFIG, *TWO_CPU_RANKS, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    return proc.returncode, proc.stderr


def launcher_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("rlhf-ray-train:")]


@pytest.mark.slow(reason="a Ray cluster and two trainer processes that import torch and Megatron")
def test_a_failing_rank_is_named_in_one_line(ray_address, tiny_qwen2_dir, data, tmp_path):
    run_dir = tmp_path / "run"
    args = ppo_overrides(tiny_qwen2_dir, data, run_dir, 2)
    args.append(f"actor_rollout_ref.model.path={tmp_path / 'no_model'}")
    code, stderr = ray_train(ray_address, args, tmp_path / "failed.log")
    assert code == 2, stderr[-4000:]
    lines = launcher_lines(stderr)
    assert len(lines) == 1, stderr[-4000:]
    assert lines[0].startswith("rlhf-ray-train: rank ") and "exited with 2" in lines[0]
    assert "no_model" in lines[0]  # the rank's own last line: what was missing
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank_0.log", "rank_1.log"]


@pytest.mark.slow(reason="two whole 2-rank runs under Ray: 2 steps with checkpoints, a resume")
def test_two_ranks_train_checkpoint_and_resume(
    ray_address, tiny_qwen2_dir, data, sglang_server, tmp_path
):
    run_dir = tmp_path / "run"
    fast = [
        "trainer.save_freq=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "critic.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4",
    ]
    first = ppo_overrides(tiny_qwen2_dir, data, run_dir, 2, *fast, server=sglang_server)
    code, _ = ray_train(ray_address, first, tmp_path / "first.log")
    assert code == 0, (tmp_path / "first.log").read_text()[-6000:]
    assert sorted(metrics_by_step(run_dir))[-2:] == [1, 2]
    assert (run_dir / "checkpoints" / "global_step_2" / "COMPLETE").is_file()
    rank0 = (run_dir / "logs" / "rank_0.log").read_text()
    assert "world 2:" in rank0  # one torch.distributed world of the two actors' processes
    assert "rlhf-train: finished at step 2" in rank0

    second = ppo_overrides(tiny_qwen2_dir, data, run_dir, 3, *fast, server=sglang_server)
    code, _ = ray_train(ray_address, second, tmp_path / "second.log")
    assert code == 0, (tmp_path / "second.log").read_text()[-6000:]
    rank0 = (run_dir / "logs" / "rank_0.log").read_text()
    assert "resumed from" in rank0 and "(step 2)" in rank0
    assert sorted(metrics_by_step(run_dir))[-3:] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "global_step_3" / "COMPLETE").is_file()
