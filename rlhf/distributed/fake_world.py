"""A world of many ranks in one process, for the memory simulation: every collective is
answered by torch's fake process group and moves nothing.

`rlhf.trainer.memory_simulation` runs one rank of a shipped GPU config (rank 0 of 8 or 16)
with no other process: `fake_world(world_size, rank)` starts torch.distributed with the
"fake" backend (`torch.testing._internal.distributed.fake_pg`) for the CPU, CUDA and meta
devices (the simulation's stand-in for the GPU is the meta device), so that Megatron's
`initialize_model_parallel` builds every TP, PP, DP, EP group for that rank and each
collective returns at once, its output tensors left as they were. Inside:

- every group asked for is fake, also the gloo ones Megatron builds next to its NCCL
  groups (a gloo group would wait for the other ranks' processes);
- object collectives (`all_gather_object`, `gather_object`, `broadcast_object_list`) are
  answered as in SPMD: every rank gathered holds this rank's object; a broadcast from
  another rank leaves the list as it was (the fake group would hand back unpicklable
  bytes). A value that only another rank knows cannot be had here: see the simulation.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

BACKEND = "cpu:fake,cuda:fake,meta:fake"


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """torch.distributed as rank `rank` of `world_size` fake ranks inside; torn down after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world() needs a process without a process group")
    saved = {name: getattr(dist, name) for name in _ANSWERS}
    new_group = dist.new_group

    def fake_group(*args: Any, **kwargs: Any):
        kwargs["backend"] = BACKEND
        return new_group(*args, **kwargs)

    dist.init_process_group(BACKEND, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        dist.new_group = fake_group
        for name, answer in _ANSWERS.items():
            setattr(dist, name, answer)
        yield
    finally:
        dist.new_group = new_group
        for name, original in saved.items():
            setattr(dist, name, original)
        if dist.is_initialized():
            dist.destroy_process_group()


def _all_gather_object(object_list: list, obj: Any, group=None) -> None:
    for i in range(len(object_list)):
        object_list[i] = copy.deepcopy(obj)


def _gather_object(obj: Any, object_gather_list: list | None = None, dst=None, **kwargs) -> None:
    if object_gather_list is not None:
        _all_gather_object(object_gather_list, obj)


def _broadcast_object_list(object_list: list, src=None, group=None, **kwargs) -> None:
    """This rank's list stays as it is: the source's copy when it is the source."""


_ANSWERS = {
    "all_gather_object": _all_gather_object,
    "gather_object": _gather_object,
    "broadcast_object_list": _broadcast_object_list,
}
