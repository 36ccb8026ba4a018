"""Object collectives over the whole job that also work in a process without torch.distributed,
and the sum of per-sample outputs over the ranks that computed different samples."""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

from rlhf.distributed.context import ParallelContext

T = TypeVar("T")


def _single() -> bool:
    return not dist.is_initialized() or dist.get_world_size() == 1


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank `src`'s picklable object on every rank."""
    if _single():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather_objects(obj: T) -> list[T]:
    """Every rank's object, in rank order, on every rank."""
    if _single():
        return [obj]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def gather_objects(obj: T, dst: int = 0) -> list[T] | None:
    """Every rank's object, in rank order, on rank `dst` (None elsewhere)."""
    if _single():
        return [obj]
    gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    dist.gather_object(obj, gathered, dst=dst)
    return gathered


def sum_over_dp_and_pp(tensor: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum in place over DP ranks (different samples) and PP stages (only the last one holds
    outputs; the others contribute zeros)."""
    if ctx.dp_size > 1:
        dist.all_reduce(tensor, group=ctx.dp_group)
    if ctx.pp_group is not None:
        dist.all_reduce(tensor, group=ctx.pp_group)
    return tensor
