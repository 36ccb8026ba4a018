"""The Ray launcher's decisions without Ray (`rlhf.cli.ray_plan`, `rlhf.cli.ray_train`'s
supervisor): what it reserves, which rank runs where with which torchrun variables, and how
a failed rank ends the launch. The launch itself: tests/e2e/test_ray_launcher.py."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from rlhf.cli.ray_plan import (
    LaunchError,
    LaunchPlan,
    exit_code,
    failure_line,
    node_visible_devices,
    plan_launch,
    rank_env,
    trainer_command,
)
from rlhf.cli.ray_train import Supervisor, parse_args, supervise
from tests.helpers import REPO


def test_one_bundle_per_node_holds_its_ranks_and_nodes_are_distinct():
    gpu = plan_launch(2, 8, "auto", cluster_gpus=16, cpus_per_rank=4)
    assert gpu.bundles() == [{"CPU": 32.0, "GPU": 8.0}] * 2
    assert gpu.strategy == "STRICT_SPREAD"
    assert gpu.rank_resources() == {"num_cpus": 4, "num_gpus": 1.0}
    cpu = plan_launch(1, 2, "cpu", cluster_gpus=16)
    assert cpu.bundles() == [{"CPU": 2.0}] and cpu.strategy == "STRICT_PACK"
    assert cpu.rank_resources() == {"num_cpus": 1.0, "num_gpus": 0.0}


def test_the_device_decides_whether_ranks_reserve_gpus():
    assert plan_launch(1, 1, "auto", cluster_gpus=0).use_gpus is False
    assert plan_launch(1, 1, "auto", cluster_gpus=1).use_gpus is True
    assert plan_launch(1, 1, "cuda", cluster_gpus=1).use_gpus is True
    with pytest.raises(LaunchError, match=r"trainer\.device=cuda, but the Ray cluster has no GPUs"):
        plan_launch(1, 1, "cuda", cluster_gpus=0)
    with pytest.raises(LaunchError, match="--cpus-per-rank"):
        plan_launch(1, 1, "cpu", cluster_gpus=0, cpus_per_rank=0)


def expected_torchrun_env(rank: int, nnodes: int, per_node: int) -> dict[str, str]:
    """What `torchrun --nnodes N --nproc-per-node P` gives rank `rank` (written by hand)."""
    node, local = divmod(rank, per_node)
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(nnodes * per_node),
        "LOCAL_WORLD_SIZE": str(per_node),
        "GROUP_RANK": str(node),
        "NODE_RANK": str(node),
        "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(nnodes * per_node),
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "29511",
    }


@pytest.mark.parametrize("nnodes,per_node", [(1, 1), (1, 2), (2, 4), (3, 2)])
def test_every_rank_gets_torchruns_variables(nnodes, per_node):
    plan = LaunchPlan(nnodes, per_node, use_gpus=False)
    slots = plan.slots()
    assert [s.rank for s in slots] == list(range(nnodes * per_node))
    for slot in slots:
        env = rank_env(plan, slot, "10.0.0.7", 29511, None)
        assert env == expected_torchrun_env(slot.rank, nnodes, per_node)


def test_the_trainer_accepts_the_launch_it_is_given(monkeypatch):
    """Every rank's variables pass the trainer's own startup check of trainer.nnodes x
    trainer.n_gpus_per_node (`check_launch`, from what bootstrap reads)."""
    from rlhf.config.validate import check_launch
    from rlhf.distributed.launch_env import launched_local_world_size, launched_world_size

    plan = LaunchPlan(2, 3, use_gpus=False)
    trainer = SimpleNamespace(nnodes=2, n_gpus_per_node=3)
    for slot in plan.slots():
        for key, value in rank_env(plan, slot, "h", 1, None).items():
            monkeypatch.setenv(key, value)
        check_launch(trainer, launched_world_size(), launched_local_world_size())


def test_a_node_sees_its_ranks_gpus_with_each_rank_at_its_local_rank():
    plan = LaunchPlan(2, 2, use_gpus=True)
    given = [["3"], ["1"], ["0"], ["2"]]  # Ray's ids: any order, per rank
    devices = node_visible_devices(plan, given)
    assert devices == ["3,1", "3,1", "0,2", "0,2"]
    for slot in plan.slots():
        env = rank_env(plan, slot, "h", 1, devices[slot.rank])
        own = env["CUDA_VISIBLE_DEVICES"].split(",")[int(env["LOCAL_RANK"])]
        assert own == given[slot.rank][0]  # cuda:LOCAL_RANK is the rank's own GPU
    assert node_visible_devices(LaunchPlan(1, 2, use_gpus=False), [[], []]) == [None, None]
    with pytest.raises(LaunchError, match="rank 1"):
        node_visible_devices(LaunchPlan(1, 2, use_gpus=True), [["0"], ["1", "2"]])


def test_a_failed_rank_is_one_line_with_a_shells_exit_code():
    slot = LaunchPlan(2, 2, use_gpus=False).slots()[3]
    assert exit_code(0) == 0 and exit_code(2) == 2 and exit_code(-9) == 137
    line = failure_line(slot, "10.0.0.8", 2, "rlhf-train: error: no model\n")
    assert line == "rank 3 (node 1, 10.0.0.8) exited with 2: rlhf-train: error: no model"
    assert failure_line(slot, "h", -9, "") == "rank 3 (node 1, h) was killed by SIGKILL (137)"
    command = trainer_command("py", ["--config", "c"])
    assert command == ["py", "-m", "rlhf.cli.train", "--config", "c"]


class FakeRank:
    """A rank that ends with `code` at poll number `ends_at` (or on a signal, with 128 + it)."""

    def __init__(self, rank: int, code: int = 0, ends_at: int | None = 1) -> None:
        self.slot = LaunchPlan(1, 4, use_gpus=False).slots()[rank]
        self.node_ip, self.code, self.ends_at = "h", code, ends_at
        self.polls, self.signals = 0, []

    def poll(self):
        self.polls += 1
        if self.signals and self.signals[-1] == signal.SIGKILL:
            return -signal.SIGKILL, ""
        if self.ends_at is not None and self.polls >= self.ends_at:
            return self.code, f"rank {self.slot.rank} said bye"
        return None

    def stop(self, sig: int) -> None:
        self.signals.append(sig)


def run(ranks, grace_s=10.0, signals=()):
    now = [0.0]

    def sleep(s):
        now[0] += s

    supervisor = Supervisor(ranks, grace_s, clock=lambda: now[0])
    supervisor.signals.extend(signals)
    for _ in range(1000):
        if not supervisor.step():
            return supervisor
        sleep(1.0)
    raise AssertionError(f"ranks {sorted(supervisor.pending)} never ended")


def test_the_first_failure_stops_the_others_and_is_the_exit_code():
    hung = FakeRank(0, ends_at=None)  # waits on its failed peer: ends only when killed
    ranks = [hung, FakeRank(1, code=2, ends_at=3), FakeRank(2, ends_at=1), FakeRank(3, 1, 5)]
    result = run(ranks, grace_s=10.0)
    assert result.code == 2
    assert result.failure == "rank 1 (node 0, h) exited with 2: rank 1 said bye"
    assert hung.signals == [signal.SIGTERM, signal.SIGKILL]  # SIGKILL after the grace
    assert ranks[2].signals == []  # it had finished before
    assert ranks[3].signals == [signal.SIGTERM]  # ended (failing too) within the grace
    assert hung.polls >= 12  # the grace was waited out


def test_ranks_that_all_succeed_are_left_alone():
    ranks = [FakeRank(r, ends_at=r + 1) for r in range(4)]
    result = run(ranks)
    assert (result.code, result.failure) == (0, "")
    assert all(not r.signals for r in ranks)


def test_a_signal_to_the_driver_reaches_every_rank():
    ranks = [FakeRank(r, code=143, ends_at=2) for r in range(2)]
    result = run(ranks, signals=[signal.SIGTERM])
    assert result.code == 128 + signal.SIGTERM and result.failure == ""
    assert all(r.signals == [signal.SIGTERM] for r in ranks)


def test_supervise_restores_the_drivers_signal_handlers():
    before = signal.getsignal(signal.SIGTERM)
    result = supervise([FakeRank(0)], grace_s=1.0, poll_s=0.0)
    assert result.code == 0 and signal.getsignal(signal.SIGTERM) is before


def test_launcher_options_and_trainer_arguments_are_separated():
    opts, rest = parse_args(
        ["--address", "auto", "--config", "c.yaml", "trainer.nnodes=2", "--cpus-per-rank", "4"]
    )
    assert opts.address == "auto" and opts.cpus_per_rank == 4
    assert rest == ["--config", "c.yaml", "trainer.nnodes=2"]


def test_a_config_error_stops_the_launch_before_ray_in_one_line(capsys):
    from rlhf.cli.ray_train import main

    config = str(REPO / "configs" / "quickstart_cpu.yaml")
    assert main(["--config", config, "trainer.n_gpus_per_node=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlhf-ray-train: config error: trainer.n_gpus")
