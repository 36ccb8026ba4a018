"""Checkpoints written in the background (`trainer.async_save`, rlhf.checkpoint.background):
the writer writes the state of the moment the save started while the trainer changes it,
nothing is published before every write and finalize step is done, and a writer that fails
(a full disk, a crash) is one clear error that names what is lost, with no checkpoint
published. The whole path with Megatron's model and optimizer files: the bf16 runs of
tests/distributed/test_distributed_optimizer.py and the killed run of
tests/e2e/test_ppo_training.py."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch

from rlhf.checkpoint import CheckpointStorageError
from rlhf.checkpoint.background import BackgroundSave, CheckpointWriterError, PendingWrite
from rlhf.config import load_config
from rlhf.memory.checkpoint_size import save_hold_text
from rlhf.models.families import load_arch
from rlhf.trainer.checkpoints import CheckpointKeeper
from rlhf.trainer.stopping import Preempted, PreemptionGuard
from tests.helpers import REPO, small_filesystem
from tests.unit.test_checkpoint_storage import planned_bytes

# where a 1-rank run's only rank sits (the keeper reads these of a ParallelContext)
ONE_RANK = SimpleNamespace(is_main=True, rank=0, dp_sp_size=1, world_size=1, tp_size=1, pp_size=1)

pytestmark = pytest.mark.reliability


def keeper_for(model_dir, run_dir) -> CheckpointKeeper:
    cfg = load_config(
        str(REPO / "configs" / "quickstart_cpu.yaml"), [f"actor_rollout_ref.model.path={model_dir}"]
    )
    return CheckpointKeeper(
        cfg.trainer, planned_bytes(cfg, load_arch(model_dir)), run_dir, ONE_RANK, total_steps=10
    )


def test_the_writer_writes_the_state_of_the_save_not_the_changed_one(tmp_path):
    weights = torch.zeros(1000)
    order = []
    writes = [
        PendingWrite(lambda: time.sleep(0.5)),  # the trainer changes the weights meanwhile
        PendingWrite(
            lambda: torch.save(weights, tmp_path / "weights.pt"),
            [lambda: order.append(("finalize", (tmp_path / "weights.pt").is_file()))],
        ),
    ]
    pending = BackgroundSave(1, tmp_path, writes)
    weights.add_(1.0)  # in place, as an optimizer step
    assert not (tmp_path / "weights.pt").exists() and order == []
    pending.finish()
    assert order == [("finalize", True)]  # after the writes, in the trainer
    assert torch.equal(torch.load(tmp_path / "weights.pt"), torch.zeros(1000))


def test_nothing_is_published_before_the_writer_is_done(tiny_qwen2_dir, tmp_path):
    keeper = keeper_for(tiny_qwen2_dir, tmp_path)
    manager = keeper.manager

    def snapshot(tmp):
        return [PendingWrite(lambda: (time.sleep(1.0), (tmp / "state").write_text("1")))]

    keeper.save_in_background(1, snapshot)
    assert keeper.pending is not None and keeper.steps_kept() == [1]
    keeper.poll()  # the writer still sleeps: nothing published
    assert manager.complete_steps() == [] and manager.latest() is None
    deadline = time.monotonic() + 30
    while keeper.pending is not None and time.monotonic() < deadline:
        time.sleep(0.1)
        keeper.poll()
    assert manager.complete_steps() == [1]
    assert (manager.latest() / "state").read_text() == "1"
    assert keeper.last_saved_step == 1 and keeper.last_save_s >= 1.0 > keeper.last_blocking_s


def test_a_full_disk_in_the_writer_says_so_and_what_is_lost(tiny_qwen2_dir, tmp_path):
    with small_filesystem(tmp_path / "disk", 4096) as disk:
        keeper = keeper_for(tiny_qwen2_dir, disk)
        keeper.save(1, lambda tmp: (tmp / "state").write_text("1"))

        def too_big(tmp):  # fills the 4 MiB file system
            return [PendingWrite(lambda: (tmp / "state").write_bytes(os.urandom(8 * 1024**2)))]

        keeper.save_in_background(2, too_big)
        with pytest.raises(CheckpointStorageError) as err:
            keeper.wait()
        assert keeper.manager.complete_steps() == [1]
    message = str(err.value)
    assert message.startswith("step 2: checkpoint not written: no space left on device")
    assert message.endswith(
        f"step 2 is lost (the latest checkpoint is {disk / 'checkpoints' / 'global_step_1'})"
    )


@pytest.mark.parametrize(
    ("write", "said"),
    [
        (lambda: os._exit(3), "died (exit code 3"),
        (lambda: [][1], "failed: IndexError: list index out of range"),
    ],
)
def test_a_failed_writer_publishes_nothing_and_names_the_rank(tmp_path, write, said):
    pending = BackgroundSave(5, tmp_path, [PendingWrite(write, [lambda: pytest.fail("ran")])])
    with pytest.raises(CheckpointWriterError) as err:
        pending.finish()
    assert str(err.value).startswith("checkpoint of step 5 not written: rank 0's writer ")
    assert said in str(err.value) and "\n" not in str(err.value)


def test_a_failed_writer_says_which_steps_are_lost(tiny_qwen2_dir, tmp_path):
    keeper = keeper_for(tiny_qwen2_dir, tmp_path)
    keeper.save(1, lambda tmp: (tmp / "state").write_text("1"))
    keeper.save_in_background(2, lambda tmp: [PendingWrite(lambda: os._exit(9))])
    with pytest.raises(CheckpointWriterError, match=r"died \(exit code 9.*; step 2 is lost \("):
        keeper.wait()
    assert keeper.manager.complete_steps() == [1]


def test_sigterm_publishes_the_background_save_before_ending(tiny_qwen2_dir, tmp_path):
    keeper = keeper_for(tiny_qwen2_dir, tmp_path)

    def snapshot(tmp):
        return [PendingWrite(lambda: (time.sleep(0.5), (tmp / "state").write_text("3")))]

    keeper.save_in_background(3, snapshot)
    guard = PreemptionGuard(30.0, torch.device("cpu"))
    guard.signalled_at = time.monotonic()
    with pytest.raises(Preempted, match=r"after step 3: checkpoint .*global_step_3 holds step 3"):
        keeper.end_if_preempted(3, guard, lambda step: pytest.fail("saved again"))
    assert keeper.manager.complete_steps() == [3]
    # step 4's preemption save is itself a background save: published before the run ends
    keeper.save_in_background(4, snapshot)  # still in flight at step 5's SIGTERM

    def save_in_background(step):
        keeper.save_in_background(step, snapshot)

    with pytest.raises(Preempted, match=r"after step 5: checkpoint .*global_step_5 holds step 5"):
        keeper.end_if_preempted(5, guard, save_in_background)
    assert keeper.manager.complete_steps() == [4, 5] and keeper.pending is None  # keeps 2


def test_the_save_plan_by_hand():
    gib = 1024**3
    # 7B with Adam in bf16 + fp32 master: 16 bytes a parameter = 112 GiB over 8 ranks,
    # written at 500 MB/s; a snapshot copies 14 GiB per rank at 8 GB/s
    text = save_hold_text(112 * gib, 8, 500e6, "cuda", False, 30.0)
    sync_s, snapshot_s = 112 * gib / 500e6, 14 * gib / 8e9
    assert f"holds its step about {sync_s:.1f} s (at the 500 MB/s measured)" in text
    assert f"holds it about {snapshot_s:.1f} s, for a snapshot of 14.00 GiB per rank" in text
    assert "does not fit in trainer.preemption_grace_s=30 s" in text
    assert text.index("synchronous") < text.index("async_save")
    on = save_hold_text(112 * gib, 8, 500e6, "cuda", True, 30.0)
    assert on.index("async_save") < on.index("synchronous")
    assert "does not fit" not in save_hold_text(gib, 8, 500e6, "cuda", False, 30.0)
