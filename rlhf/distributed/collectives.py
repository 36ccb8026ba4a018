"""Object collectives over the whole job that also work in a process without torch.distributed."""

from __future__ import annotations

from typing import TypeVar

import torch.distributed as dist

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
