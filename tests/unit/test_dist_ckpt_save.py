"""Writing a Megatron distributed checkpoint starts no spawned interpreter (rlhf.models.dist_ckpt).

Megatron-Core's writer would start its results queue's manager with the spawn method at a
process's first save (a new interpreter importing the main module again, ~2 s a rank and
run); `save_distributed` hands it one started by fork. Both the synchronous save and the
background one (the writes in a forked process, as `rlhf.checkpoint.background` runs them)
must still give back what was saved.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys

import psutil
import pytest
import torch

from rlhf.checkpoint.run_lock import RunDirBusy, RunDirLock
from rlhf.models.dist_ckpt import (
    load_distributed,
    save_distributed,
    save_distributed_in_background,
)
from rlhf.utils import free_port


@pytest.fixture(scope="module")
def one_rank():
    from rlhf.distributed.bootstrap import init_parallel, teardown

    init_parallel("cpu")
    yield
    teardown()


def spawned_children() -> set[int]:
    """This process's children that the spawn method started."""
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if any("spawn_main" in arg for arg in child.cmdline()):
                found.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def state(values: torch.Tensor) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    return {"weight": ShardedTensor.from_rank_offsets("weight", values.clone())}


@pytest.fixture
def fresh_queue(monkeypatch):
    """As in a new process: Megatron has no results queue yet."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.setattr(filesystem_async, "_results_queue", None)


def test_a_save_starts_no_spawned_process_and_loads_back(one_rank, fresh_queue, tmp_path):
    before = spawned_children()
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    save_distributed(state(values), tmp_path)
    assert spawned_children() - before == set()
    loaded = load_distributed(state(torch.zeros(3, 4)), tmp_path)
    torch.testing.assert_close(loaded["weight"], values, rtol=0, atol=0)


def test_a_background_save_written_by_a_forked_process_loads_back(one_rank, fresh_queue, tmp_path):
    before = spawned_children()
    values = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    write, finalize = save_distributed_in_background(state(values), tmp_path)
    assert write is not None
    writer = multiprocessing.get_context("fork").Process(target=write)
    writer.start()
    writer.join(60)
    assert writer.exitcode == 0
    for step in finalize:
        step()
    assert spawned_children() - before == set()
    loaded = load_distributed(state(torch.zeros(5, 7)), tmp_path)
    torch.testing.assert_close(loaded["weight"], values, rtol=0, atol=0)


KILLED_SAVER = """
import sys, time
from pathlib import Path
import torch
from megatron.core.dist_checkpointing import ShardedTensor
from rlhf.checkpoint.run_lock import RunDirLock
from rlhf.distributed.bootstrap import init_parallel
from rlhf.models.dist_ckpt import save_distributed

run_dir = Path(sys.argv[1])
RunDirLock(run_dir).acquire()
init_parallel("cpu")
(run_dir / "ckpt").mkdir()
save_distributed({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, run_dir / "ckpt")
print("saved", flush=True)
time.sleep(600)
"""


def test_a_killed_saver_leaves_no_process_holding_its_run_directory(tmp_path):
    """The forked manager holds the saver's open files (the run directory's lock among
    them): killed with the saver, it lets a resumed run take the directory at once."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "saved"
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children  # the manager
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    psutil.wait_procs(children, timeout=30)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    try:
        RunDirLock(tmp_path).acquire().release()
    except RunDirBusy as e:
        pytest.fail(f"the run directory is still locked after the saver was killed: {e}")
