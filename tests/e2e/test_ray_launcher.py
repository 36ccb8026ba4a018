"""`rlhf-ray-train` on a local Ray cluster of two simulated nodes (`ray.cluster_utils.Cluster`:
two raylets on this machine, 2 CPUs and 2 declared GPUs each) with 2 CPU ranks:

- a 2-step DP2 run on one node (trainer.nnodes=1, n_gpus_per_node=2) with a checkpoint every
  step, then a second launch on both nodes (trainer.nnodes=2, n_gpus_per_node=1) that resumes
  from it and runs step 3 (the ranks' torchrun variables, the rendezvous on rank 0's node,
  per-rank logs, the trainer's own resume);
- a rank that fails (a model directory that does not exist: the config loads, the ranks
  fail at startup) makes the launcher exit with its code and one line naming it;
- GPU ranks of two nodes (the declared GPUs; nothing runs on them): one bundle per node on
  distinct nodes, one GPU per rank, each node's CUDA_VISIBLE_DEVICES from Ray's ids.

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
ONE_NODE = ["trainer.nnodes=1", "trainer.n_gpus_per_node=2", "trainer.device=cpu"]
TWO_NODES = ["trainer.nnodes=2", "trainer.n_gpus_per_node=1", "trainer.device=cpu"]


@pytest.fixture(scope="module")
def ray_address():
    """Two simulated Ray nodes for this module's launches (the GCS address); shut down after.
    This process is a driver on it too."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 2, "num_gpus": 2, "object_store_memory": 80 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster.address
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_quickstart_data(tmp_path_factory.mktemp("data"), num_train=16, num_val=4)


def ray_train(address: str, args: list[str], log: Path, sizes=ONE_NODE) -> tuple[int, str]:
    """`rlhf-ray-train --address ADDRESS --config CONFIG ARGS`: its exit code and stderr
    (all of its output is in `log`)."""
    command = [sys.executable, "-m", "rlhf.cli.ray_train", "--address", address, "--grace-s", "20"]
    proc = subprocess.run(
        [*command, "--config", CONFIG, *args, *sizes],
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
    code, _ = ray_train(ray_address, second, tmp_path / "second.log", sizes=TWO_NODES)
    assert code == 0, (tmp_path / "second.log").read_text()[-6000:]
    rank0 = (run_dir / "logs" / "rank_0.log").read_text()
    assert "resumed from" in rank0 and "(step 2)" in rank0
    assert sorted(metrics_by_step(run_dir))[-3:] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "global_step_3" / "COMPLETE").is_file()


@pytest.mark.slow(reason="uses this module's two-node Ray cluster (~8 s to start)")
def test_gpu_ranks_of_two_nodes_get_a_node_each_and_one_gpu_each(ray_address):
    import ray
    from ray.util.placement_group import (
        placement_group,
        placement_group_table,
        remove_placement_group,
    )

    from rlhf.cli.ray_plan import node_visible_devices, plan_launch
    from rlhf.cli.ray_train import start_actors

    plan = plan_launch(2, 2, "auto", ray.cluster_resources()["GPU"])
    assert plan.use_gpus and plan.bundles() == [{"CPU": 2.0, "GPU": 2.0}] * 2
    group = placement_group(plan.bundles(), strategy=plan.strategy)
    actors = []
    try:
        assert group.wait(timeout_seconds=60)
        nodes = placement_group_table(group)["bundles_to_node_id"]
        assert len({nodes[0], nodes[1]}) == 2  # the two node ranks on distinct Ray nodes
        actors = start_actors(plan, group)
        gpus = [ids for _, ids in ray.get([actor.node.remote() for actor in actors])]
        assert all(len(ids) == 1 for ids in gpus)
        assert gpus[0] != gpus[1] and gpus[2] != gpus[3]  # a node's ranks: distinct GPUs
        devices = node_visible_devices(plan, gpus)
        assert devices[0] == devices[1] == f"{gpus[0][0]},{gpus[1][0]}"
        assert devices[2] == devices[3] == f"{gpus[2][0]},{gpus[3][0]}"
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)
