"""Checkpoint storage faults on real (tmpfs) file systems: read-only, too small, filling up
during a save; the checkpoint size plan against a real model; SIGTERM bookkeeping."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM

from rlhf.checkpoint import CheckpointManager, CheckpointStorageError, probe_storage
from rlhf.checkpoint.storage import available_bytes
from rlhf.config import load_config
from rlhf.config.validate import trained_megatron
from rlhf.memory.checkpoint_size import checkpoint_bytes
from rlhf.models.families import load_arch
from rlhf.trainer.checkpoints import CheckpointKeeper
from rlhf.trainer.stopping import SAVE_MARGIN, Preempted, PreemptionGuard
from tests.helpers import REPO, small_filesystem

# where a 1-rank run's only rank sits (the keeper reads these of a ParallelContext)
ONE_RANK = SimpleNamespace(is_main=True, rank=0, dp_sp_size=1, world_size=1, tp_size=1, pp_size=1)

pytestmark = pytest.mark.reliability
MIB = 1024 * 1024


def test_read_only_directory_is_refused_at_startup(tmp_path):
    with (
        small_filesystem(tmp_path / "ro", 1024, read_only=True) as ro,
        pytest.raises(CheckpointStorageError, match="read-only") as e,
    ):
        probe_storage(ro / "checkpoints", 10 * MIB)
    assert str(ro / "checkpoints") in str(e.value)


def test_too_little_space_is_refused_with_both_sizes(tmp_path):
    with small_filesystem(tmp_path / "small", 4096) as small:
        rate = probe_storage(small, 1 * MIB)  # fits: the measured write rate comes back
        assert rate > 0 and not any(small.iterdir())  # the probe file is gone
        with pytest.raises(CheckpointStorageError) as e:
            probe_storage(small, 6 * MIB)
    message = str(e.value)
    assert "has 4.0 MiB free" in message and "takes about 6.0 MiB" in message
    assert "trainer.default_local_dir" in message


def test_a_save_that_fills_the_disk_says_enospc_and_keeps_the_previous(tmp_path):
    """torch's own checkpoint writer on a full disk (it reports an unclear error of its own):
    the manager names ENOSPC, publishes nothing and leaves step 1 the latest."""
    with small_filesystem(tmp_path / "disk", 4096) as disk:
        manager = CheckpointManager(disk / "checkpoints")
        with manager.writing(1) as tmp:
            dcp.save({"w": torch.zeros(1000)}, checkpoint_id=tmp / "model")
        free_before = available_bytes(disk)
        with (
            pytest.raises(CheckpointStorageError, match=r"step 2: .*\(ENOSPC\)") as e,
            manager.writing(2) as tmp,
        ):
            dcp.save({"w": torch.zeros(2 * 1024 * 1024)}, checkpoint_id=tmp / "model")
        assert str(disk / "checkpoints") in str(e.value)
        assert manager.complete_steps() == [1]
        assert (disk / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "1\n"
        assert available_bytes(disk) >= free_before - 64 * 1024  # the partial save is gone


def test_other_failures_are_not_called_storage_errors(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    with pytest.raises(ValueError, match="not storage"), manager.writing(1):
        raise ValueError("not storage")


def test_planned_checkpoint_size_counts_weights_and_adam(tiny_qwen2_dir):
    """Against transformers' own parameter count: fp32 weights + 2 fp32 Adam moments, for the
    actor and (GAE) the critic; bf16 adds fp32 master weights; save_hf an HF copy."""
    params = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir).num_parameters()
    arch = load_arch(tiny_qwen2_dir)
    config = str(REPO / "configs" / "quickstart_cpu.yaml")
    cfg = load_config(config, [f"actor_rollout_ref.model.path={tiny_qwen2_dir}"])
    assert planned_bytes(cfg, arch) == 2 * params * (4 + 8)
    # the distributed optimizer (on by default over 2 data-parallel ranks) keeps fp32 master
    # weights in its shards even when training in fp32
    assert planned_bytes(cfg, arch, optimizer_group=2) == 2 * params * (4 + 4 + 8)
    grpo = load_config(
        config,
        [
            "algorithm.adv_estimator=grpo",
            "trainer.save_hf=true",
            "actor_rollout_ref.actor.megatron.dtype=bfloat16",
        ],
    )
    assert planned_bytes(grpo, arch) == params * (2 * 2 + 4 + 8)


def planned_bytes(cfg, arch, optimizer_group: int = 1) -> int:
    """`checkpoint_bytes` of the models `cfg` trains, as `CheckpointKeeper` asks it."""
    trained = trained_megatron(cfg.actor_rollout_ref, cfg.critic, cfg.algorithm).values()
    return checkpoint_bytes(trained, arch, cfg.trainer.save_hf, optimizer_group)


def test_sigterm_is_recorded_and_later_ones_do_not_kill():
    """A worker under torchrun on SLURM gets two SIGTERMs (the scheduler's and torchrun's):
    neither may kill it before the step's checkpoint; the previous handler is back after."""
    seen = []

    def previous(signum, frame):
        seen.append(signum)

    before = signal.signal(signal.SIGTERM, previous)
    try:
        guard = PreemptionGuard(grace_s=30.0, device=torch.device("cpu"))
        with guard:
            assert guard.installed
            assert guard.poll(2.0) == (False, 30.0, 2.0 * SAVE_MARGIN)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            signalled, left, needed = guard.poll(2.0)
            assert signalled and 29.0 < left < 30.0 and needed == 2.0 * SAVE_MARGIN
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            assert guard.num_signals == 2 and seen == []
        assert not guard.installed and signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, before)


def test_keeper_says_what_is_lost_and_decides_the_preemption_save(tiny_qwen2_dir, tmp_path):
    cfg = load_config(
        str(REPO / "configs" / "quickstart_cpu.yaml"),
        [f"actor_rollout_ref.model.path={tiny_qwen2_dir}"],
    )
    keeper = CheckpointKeeper(
        cfg.trainer,
        planned_bytes(cfg, load_arch(tiny_qwen2_dir)),
        tmp_path,
        ONE_RANK,
        total_steps=10,
    )
    root = tmp_path / "checkpoints"
    assert keeper.write_rate > 0 and keeper.last_save_s is None
    assert keeper.work_lost(3) == "no checkpoint holds steps 1-3"
    keeper.save(1, lambda tmp: (tmp / "state").write_text("1"))
    assert keeper.last_saved_step == 1 and keeper.last_save_s > 0
    assert keeper.work_lost(1) == f"checkpoint {root / 'global_step_1'} holds step 1"
    latest = f"(the latest checkpoint is {root / 'global_step_1'})"
    assert keeper.work_lost(2) == f"step 2 is lost {latest}"
    assert keeper.work_lost(4) == f"steps 2-4 are lost {latest}"

    saved = []

    def save(step):
        saved.append(step)
        keeper.save(step, lambda tmp: (tmp / "state").write_text(str(step)))

    cpu = torch.device("cpu")
    keeper.end_if_preempted(2, PreemptionGuard(30.0, cpu), save)  # no signal: nothing
    assert saved == []
    signalled = PreemptionGuard(30.0, cpu)
    signalled.signalled_at = time.monotonic()
    with pytest.raises(Preempted, match=r"after step 3: checkpoint .*global_step_3 holds step 3"):
        keeper.end_if_preempted(3, signalled, save)
    no_time = PreemptionGuard(0.0, cpu)
    no_time.signalled_at = time.monotonic()
    with pytest.raises(Preempted, match=r"after step 4: no checkpoint written .* step 4 is lost"):
        keeper.end_if_preempted(4, no_time, save)
    assert saved == [3]


def test_a_directory_turned_read_only_mid_run_says_read_only_and_what_is_lost(
    tiny_qwen2_dir, tmp_path
):
    """Writable at startup (the probe passed), read-only at the second save: the keeper's
    documented line (read-only, the steps lost), not the bare OSError of a mkdir."""
    cfg = load_config(
        str(REPO / "configs" / "quickstart_cpu.yaml"),
        [f"actor_rollout_ref.model.path={tiny_qwen2_dir}"],
    )
    with small_filesystem(tmp_path / "disk", 4096) as disk:
        keeper = CheckpointKeeper(
            cfg.trainer,
            planned_bytes(cfg, load_arch(tiny_qwen2_dir)),
            disk,
            ONE_RANK,
            total_steps=10,
        )
        keeper.save(1, lambda tmp: (tmp / "state").write_text("1"))
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        with pytest.raises(CheckpointStorageError) as err:
            keeper.save(2, lambda tmp: (tmp / "state").write_text("2"))
    message = str(err.value)
    assert message.startswith("step 2: checkpoint not written: ")
    assert "is read-only or not writable" in message
    assert message.endswith(
        f"step 2 is lost (the latest checkpoint is {disk / 'checkpoints' / 'global_step_1'})"
    )
