"""Checkpoint layout, pointer, pruning, resume modes, crash safety and trainer-state round trips."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rlhf.checkpoint import (
    COMPLETE_MARKER,
    POINTER_FILE,
    CheckpointManager,
    capture_rng_state,
    load_trainer_state,
    restore_rng_state,
    rng_file,
    save_trainer_state,
)
from tests.helpers import REPO

CRASH_WRITER = Path(__file__).with_name("checkpoint_crash_writer.py")


def save(manager: CheckpointManager, step: int, payload: str | None = None) -> Path:
    with manager.writing(step) as d:
        (d / "model.txt").write_text(payload or f"weights {step}")
    return manager.path_for(step)


def test_writing_publishes_dir_marker_and_pointer(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", keep_last=None)
    path = save(manager, 3)
    assert path == tmp_path / "ckpt" / "global_step_3"
    assert (path / "model.txt").read_text() == "weights 3"
    marker = json.loads((path / COMPLETE_MARKER).read_text())
    assert marker["step"] == 3 and marker["world_size"] == 1
    assert (tmp_path / "ckpt" / POINTER_FILE).read_text().strip() == "3"
    assert manager.latest() == path and manager.step_of(path) == 3
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]


def test_keep_last_prunes_oldest_and_keeps_newest(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        save(manager, step)
    assert manager.complete_steps() == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step_3",
        "global_step_4",
        POINTER_FILE,
    ]


def test_keep_last_never_prunes_the_checkpoint_just_written(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=1)
    for step in (5, 6, 7):
        save(manager, step)
    save(manager, 3)  # after a rollback: step 3 is older than 5..7 but was just written
    assert 3 in manager.complete_steps()
    assert manager.latest() == manager.path_for(3)


def test_same_step_written_again_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=None)
    save(manager, 2, "first")
    save(manager, 2, "second")
    assert (manager.path_for(2) / "model.txt").read_text() == "second"
    assert manager.complete_steps() == [2]


def test_failure_inside_writing_keeps_previous_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=1)
    save(manager, 1)
    with pytest.raises(RuntimeError, match="disk full"), manager.writing(2) as d:
        (d / "model.txt").write_text("half")
        raise RuntimeError("disk full")
    assert manager.latest() == manager.path_for(1)
    assert (manager.path_for(1) / "model.txt").read_text() == "weights 1"
    assert (tmp_path / POINTER_FILE).read_text().strip() == "1"
    assert not manager.path_for(2).exists()


@pytest.mark.parametrize("content", ["", "garbage", "12abc"])
def test_corrupt_pointer_falls_back_to_highest_complete(tmp_path, content):
    manager = CheckpointManager(tmp_path, keep_last=None)
    for step in (1, 2):
        save(manager, step)
    (tmp_path / POINTER_FILE).write_text(content)
    assert manager.latest() == manager.path_for(2)


def test_missing_pointer_or_pointer_to_deleted_dir_falls_back(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=None)
    for step in (1, 2):
        save(manager, step)
    (tmp_path / POINTER_FILE).write_text("9")
    assert manager.latest() == manager.path_for(2)
    (tmp_path / POINTER_FILE).unlink()
    assert manager.latest() == manager.path_for(2)


def test_latest_ignores_temp_and_incomplete_dirs(tmp_path, caplog):
    manager = CheckpointManager(tmp_path, keep_last=None)
    assert manager.latest() is None
    save(manager, 1)
    (tmp_path / ".tmp_global_step_5").mkdir()
    (tmp_path / "global_step_4").mkdir()  # no marker
    (tmp_path / POINTER_FILE).unlink()
    assert manager.latest() == manager.path_for(1)
    assert manager.complete_steps() == [1]
    assert "global_step_4" in caplog.text and ".tmp_global_step_5" in caplog.text


def test_new_manager_removes_stale_temp_dirs(tmp_path):
    CheckpointManager(tmp_path)
    stale = tmp_path / ".tmp_global_step_3"
    (stale / "sub").mkdir(parents=True)
    CheckpointManager(tmp_path)
    assert not stale.exists()


def test_new_manager_restores_a_checkpoint_caught_mid_replacement(tmp_path):
    manager = CheckpointManager(tmp_path)
    save(manager, 2)
    os.rename(manager.path_for(2), tmp_path / ".old_global_step_2")  # killed right here
    assert CheckpointManager(tmp_path).latest() == manager.path_for(2)


def test_resolve_resume_modes(tmp_path):
    manager = CheckpointManager(tmp_path / "run", keep_last=None)
    assert manager.resolve_resume("auto") is None
    for step in (1, 2):
        save(manager, step)
    assert manager.resolve_resume("disable") is None
    assert manager.resolve_resume("auto") == manager.path_for(2)
    assert manager.resolve_resume(str(manager.path_for(1))) == manager.path_for(1)
    assert manager.resolve_resume(str(tmp_path / "run")) == manager.path_for(2)


def test_resolve_resume_errors_say_what_was_looked_for_and_what_exists(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=None)
    save(manager, 1)
    save(manager, 2)
    missing = tmp_path / "global_step_7"
    with pytest.raises(FileNotFoundError, match=r"global_step_7 does not exist.*steps \[1, 2\]"):
        manager.resolve_resume(str(missing))
    (tmp_path / "global_step_3").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no COMPLETE marker.*steps \[1, 2\]"):
        manager.resolve_resume(str(tmp_path / "global_step_3"))
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"holds no complete global_step_<N>"):
        manager.resolve_resume(str(empty))


@pytest.mark.reliability
@pytest.mark.parametrize("harm", ["truncate", "delete", "grow"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog, harm):
    manager = CheckpointManager(tmp_path, keep_last=None)
    for step in (1, 2):
        with manager.writing(step) as d:
            (d / "model.txt").write_text("x" * 100)
            (d / "sub").mkdir()
            (d / "sub" / "shard.distcp").write_bytes(b"\0" * 64)
    shard = manager.path_for(2) / "sub" / "shard.distcp"
    if harm == "truncate":
        os.truncate(shard, 10)
    elif harm == "delete":
        shard.unlink()
    else:
        shard.write_bytes(b"\0" * 65)
    assert manager.latest() == manager.path_for(1)
    (line,) = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert str(shard) in line and "falling back" in line
    assert manager.resolve_resume("auto") == manager.path_for(1)
    with pytest.raises(FileNotFoundError, match=r"global_step_2.*is damaged: .*shard.distcp"):
        manager.resolve_resume(str(manager.path_for(2)))


def test_checkpoints_without_recorded_sizes_are_trusted(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=None)
    path = save(manager, 1)
    marker = json.loads((path / COMPLETE_MARKER).read_text())
    assert marker["files"] == {"model.txt": len("weights 1")}
    del marker["files"]  # as written before sizes were recorded
    (path / COMPLETE_MARKER).write_text(json.dumps(marker))
    (path / "model.txt").write_text("w")
    assert manager.latest() == path


def test_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


def draw() -> tuple:
    return (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3).tolist())


def test_rng_capture_restore_round_trip():
    draw()
    state = capture_rng_state()
    expected = draw()
    draw()
    restore_rng_state(state)
    assert draw() == expected


@pytest.fixture
def tracker():
    """Megatron's RNG tracker on the CPU generator, reset afterwards."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from rlhf.distributed.cpu_compat import apply_cpu_compat

    if torch.cuda.is_available():
        pytest.skip("the CPU compatibility layer would patch this GPU process")
    apply_cpu_compat()
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 1234)
    yield tracker
    tracker.reset()


def test_rng_round_trip_includes_megatron_tracker(tracker):
    state = capture_rng_state()
    assert set(state["megatron_tracker"]) == {"model-parallel-rng"}
    with tracker.fork():
        expected = torch.rand(4)
    restore_rng_state(state)
    with tracker.fork():
        torch.testing.assert_close(torch.rand(4), expected)


def test_trainer_state_round_trip(tmp_path):
    state = {"global_step": 7, "sampler": {"epoch": 1, "offset": 3}, "kl_ctrl": {"value": 0.02}}
    torch.manual_seed(3)
    save_trainer_state(tmp_path, state, rank=0)
    expected = draw()
    draw()
    assert load_trainer_state(tmp_path, rank=0) == state
    assert draw() == expected
    assert load_trainer_state(tmp_path, rank=0, restore_rng=False) == state


def test_missing_rank_file_names_it_and_the_world_size(tmp_path):
    save_trainer_state(tmp_path, {"global_step": 1}, rank=0)
    save_trainer_state(tmp_path, {"global_step": 1}, rank=1)
    with pytest.raises(FileNotFoundError, match=r"rank_2\.pt.*ranks \[0, 1\].*world size"):
        load_trainer_state(tmp_path, rank=2)
    assert rng_file(tmp_path, 1).is_file()


def wait_for(path: Path, proc: subprocess.Popen, limit_s: float = 120) -> None:
    """Poll until `path` is a non-empty file; fail if the writer exits or the bound passes."""
    deadline = time.monotonic() + limit_s
    while not (path.is_file() and path.stat().st_size > 0):
        if proc.poll() is not None:
            raise AssertionError(f"writer exited early with {proc.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {limit_s} s")
        time.sleep(0.05)


def test_sigkill_during_writing_leaves_previous_checkpoint_loadable(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(CRASH_WRITER), str(tmp_path)], env=env)
    try:
        wait_for(tmp_path / ".tmp_global_step_2" / "big.bin", proc)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert (tmp_path / ".tmp_global_step_2").is_dir()
    manager = CheckpointManager(tmp_path)
    assert not (tmp_path / ".tmp_global_step_2").exists()
    latest = manager.latest()
    assert latest == tmp_path / "global_step_1"
    weights = torch.load(latest / "model.pt", weights_only=True)["w"]
    torch.testing.assert_close(weights, torch.arange(1000, dtype=torch.float32))
    assert load_trainer_state(latest, rank=0, restore_rng=False) == {"global_step": 1}
