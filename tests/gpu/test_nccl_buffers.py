"""Buffers of NCCL collectives are allocated where the one device rule puts them
(`rlhf.distributed.context.rank_device`): a weight-sync bucket received on the CPU over
NCCL failed with "No backend type associated with device type cpu" (issue 51, item 6).
One GPU: a one-rank NCCL group, the receive side of a broadcast. Skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from rlhf.distributed.context import rank_device
from rlhf.utils import free_port


@pytest.fixture
def nccl_world():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield dist.new_group([0], backend="nccl")
    dist.destroy_process_group()


def test_a_bucket_travels_over_nccl_in_a_buffer_on_the_ranks_gpu(nccl_world):
    where = rank_device("nccl", 0)
    assert where == torch.device("cuda", 0)
    buffer = torch.arange(1024, dtype=torch.uint8, device=where)
    dist.broadcast(buffer, src=0, group=nccl_world)
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.broadcast(torch.zeros(4, dtype=torch.uint8), src=0, group=nccl_world)
