"""Checkpoints written while training goes on (`trainer.async_save`).

A synchronous save holds the step for the whole write: a 7B actor with its Adam state is about
112 GB over the ranks, minutes at the few GB/s of a shared file system, far more than the 30 s
SLURM and Kubernetes give a preempted job. An asynchronous save holds the step only while it
takes a consistent snapshot in host memory: every tensor of the model and optimizer is copied
off the GPU (Megatron's preload for the model, `owned_state`'s copy for the optimizer shards),
then each rank forks a writer process. The writer holds the snapshot (copy-on-write: on the
CPU the fork itself is the snapshot), writes and fsyncs the files and exits, while training
goes on in the trainer process.

At every step boundary the ranks ask, in one all-reduce, whether all writers are done; once
they are, each rank joins its writer, the ranks agree that none failed, Megatron's collective
finalize steps run (its `.metadata`, `metadata.json`), and only then is the checkpoint
published (marker, rename, pointer; `CheckpointManager.publish`). A run killed before that
resumes from the previous checkpoint, and its writers die with it (they ask the kernel for
SIGKILL when their parent dies). One save at most is in flight: a new one, a rollback, a
preemption and the end of the run wait for it first. Host memory: one snapshot of this
node's share of the trained models and their optimizer state (the memory plan's row).
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import multiprocessing as mp
import os
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf.errors import UserError
from rlhf.utils import die_with_parent

log = logging.getLogger(__name__)

ERROR_FILE = ".write_error_rank{rank}.json"


@dataclass
class PendingWrite:
    """One piece of a checkpoint: `write()` runs in the writer process on data already in
    host memory; then `finalize` runs in the trainer on every rank (collective)."""

    write: Callable[[], None] | None
    finalize: list[Callable[[], None]] = field(default_factory=list)


class CheckpointWriterError(RuntimeError, UserError):
    """A writer process failed; the checkpoint was not published."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _run_writes(writes: list[PendingWrite], error_file: Path, parent: int) -> None:
    """The writer process: every `write`, or the first failure recorded in `error_file`."""
    die_with_parent(parent)  # not on Linux: the writer outlives a killed trainer
    # the trainer's handlers are not the writer's: a SIGTERM for the job lets it finish
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    gc.disable()  # collecting the trainer's objects here could touch its GPU memory
    try:
        for piece in writes:
            if piece.write is not None:
                piece.write()
    except BaseException as e:
        record = {
            "errno": getattr(e, "errno", None),
            "message": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(),
        }
        error_file.write_text(json.dumps(record))
        os._exit(1)


def _gathered(value: object) -> list:
    if not dist.is_initialized():
        return [value]
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


class BackgroundSave:
    """The checkpoint of `step` being written into `tmp` by a writer process on each rank.
    Starts the writer; `done_everywhere` and `finish` are collective."""

    def __init__(self, step: int, tmp: Path, writes: list[PendingWrite]):
        self.step, self.tmp, self.writes = step, tmp, writes
        self.error_file = tmp / ERROR_FILE.format(rank=_rank())
        context = mp.get_context("fork")  # the snapshot is this process's memory
        self.process = context.Process(
            target=_run_writes,
            args=(writes, self.error_file, os.getpid()),
            name=f"rlhf-checkpoint-writer-{step}",
        )
        self.process.start()

    def done_everywhere(self) -> bool:
        """Whether every rank's writer has exited (one all-reduce; all ranks call)."""
        alive = torch.tensor([int(self.process.is_alive())], dtype=torch.int64)
        if dist.is_initialized():
            if dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only
                alive = alive.cuda()
            dist.all_reduce(alive)
        return int(alive.item()) == 0

    def finish(self) -> None:
        """Wait for this rank's writer, then, if no rank's failed, run the finalize steps
        (all ranks call). A failure on any rank raises on every rank, naming that rank."""
        self.process.join()
        failures = [f for f in _gathered(self._failure()) if f is not None]
        if failures:
            rank, code, message = failures[0]
            error = CheckpointWriterError(
                f"checkpoint of step {self.step} not written: rank {rank}'s writer {message}"
            )
            # an errno travels as the cause: a full or read-only disk is said as such
            raise error from (OSError(code, message) if code is not None else None)
        for piece in self.writes:
            for finalize in piece.finalize:
                finalize()

    def _failure(self) -> tuple[int, int | None, str] | None:
        """(rank, errno, what happened) when this rank's writer failed."""
        rank = _rank()
        if self.error_file.is_file():
            record = json.loads(self.error_file.read_text())
            log.error("checkpoint writer of rank %d failed:\n%s", rank, record["traceback"])
            code = record["errno"] if record["errno"] in errno.errorcode else None
            return rank, code, f"failed: {record['message']}"
        if self.process.exitcode != 0:
            return (
                rank,
                None,
                f"died (exit code {self.process.exitcode}; -9 is SIGKILL, e.g. the kernel's "
                "out-of-memory killer: a snapshot needs host memory, see the memory plan)",
            )
        return None
