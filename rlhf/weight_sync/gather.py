"""Turn this job's Megatron shards into HF-named full tensors, in size-bounded buckets, on rank 0.

Every rank of one data-parallel replica takes part: TP ranks all-gather each parameter's
shards, the TP-rank-0 "stage leader" of every pipeline stage converts them to HF names and
layout (`rlhf.models.mapping.shards_to_hf`), packs them into buckets of at most
`bucket_bytes`, and stage leaders of later stages send their buckets to global rank 0 over
the pipeline group. Only global rank 0 talks to SGLang. Peak extra memory is one
parameter's gathered shards plus about one bucket (two on rank 0 while receiving).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from rlhf.distributed.context import ParallelContext
from rlhf.models.chunks import ModelChunks
from rlhf.models.families import ModelArch
from rlhf.models.mapping import Layout, Placement, resolve, shards_to_hf, skip_on_export

Bucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class SyncTopology:
    """Who does what in a sync: the groups and this rank's role.

    `in_sync_replica`: this rank belongs to the data-parallel replica that gathers the
    weights for its servers: replica 0 of the job, or, when every node syncs its own
    colocated servers (`per_node`), the replica holding the node's local rank 0 (which needs
    whole replicas per node: PP = 1, TP x SP dividing the node's processes).
    """

    placement: Placement
    tp_group: ProcessGroup | None  # None when TP = 1
    pp_group: ProcessGroup | None  # None when PP = 1
    pp_stage_ranks: tuple[int, ...]  # global ranks of my pipeline's stages, stage order
    in_sync_replica: bool

    @classmethod
    def of(cls, ctx: ParallelContext, per_node: bool = False) -> SyncTopology:
        replicas_per_sync = ctx.dp_size // ctx.num_nodes if per_node else ctx.dp_size
        in_replica = ctx.dp_rank % replicas_per_sync == 0 and ctx.sp_rank == 0
        return cls(Placement.of(ctx), ctx.tp_group, ctx.pp_group, ctx.pp_stage_ranks, in_replica)

    @property
    def is_stage_leader(self) -> bool:
        return self.in_sync_replica and self.placement.tp_rank == 0

    @property
    def is_sender(self) -> bool:
        """A rank that talks to SGLang: stage 0's leader (global rank 0, or each node's
        local rank 0 when every node syncs its own servers)."""
        return self.is_stage_leader and self.placement.pp_rank == 0


def _gather_tp(param: torch.Tensor, layout: Layout, topo: SyncTopology) -> list[torch.Tensor]:
    if layout is Layout.REPLICATED or topo.tp_group is None:
        return [param.detach()]
    parts = [torch.empty_like(param) for _ in range(topo.placement.tp_size)]
    dist.all_gather(parts, param.detach().contiguous(), group=topo.tp_group)
    return parts


def iter_stage_tensors(
    model, arch: ModelArch, topo: SyncTopology
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of this pipeline stage, chunk by chunk (`ModelChunks`, or one model at the
    topology's placement); yielded on the stage leader, others only gather."""
    for placement, name, param in ModelChunks.of(model, topo.placement).placed_parameters():
        rule, layer = resolve(arch, name, placement)
        if skip_on_export(arch, rule):
            continue
        shards = _gather_tp(param, rule.layout, topo)
        if topo.is_stage_leader:
            yield from shards_to_hf(rule, layer, shards, arch)


def bucketize(tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group tensors into buckets of at most `bucket_bytes` (a larger tensor goes alone)."""
    bucket: Bucket = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.contiguous()))
        size += nbytes
    if bucket:
        yield bucket


def _send_bucket(bucket: Bucket | None, dst: int, group) -> None:
    meta = None if bucket is None else [(n, t.dtype, tuple(t.shape)) for n, t in bucket]
    dist.send_object_list([meta], dst=dst, group=group)
    if bucket is not None:
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])
        dist.send(flat, dst=dst, group=group)


def _recv_bucket(src: int, group) -> Bucket | None:
    meta = [None]
    dist.recv_object_list(meta, src=src, group=group)
    if meta[0] is None:
        return None
    sizes = [
        torch.Size(shape).numel() * torch.empty(0, dtype=dt).element_size()
        for _, dt, shape in meta[0]
    ]
    flat = torch.empty(sum(sizes), dtype=torch.uint8)
    dist.recv(flat, src=src, group=group)
    bucket, offset = [], 0
    for (name, dtype, shape), nbytes in zip(meta[0], sizes):
        bucket.append((name, flat[offset : offset + nbytes].view(dtype).reshape(shape)))
        offset += nbytes
    return bucket


def iter_buckets(model, arch: ModelArch, topo: SyncTopology, bucket_bytes: int) -> Iterator[Bucket]:
    """All HF buckets of the model, yielded on the sender (global rank 0) only.

    Every rank must exhaust this iterator: it drives the TP gathers and the sends of later
    pipeline stages, one stage after the other.
    """
    if not topo.in_sync_replica:
        return
    for stage, leader in enumerate(topo.pp_stage_ranks):
        if stage == topo.placement.pp_rank:
            for bucket in bucketize(iter_stage_tensors(model, arch, topo), bucket_bytes):
                if topo.is_sender:
                    yield bucket
                elif topo.is_stage_leader:
                    _send_bucket(bucket, topo.pp_stage_ranks[0], topo.pp_group)
            if topo.is_stage_leader and not topo.is_sender:
                _send_bucket(None, topo.pp_stage_ranks[0], topo.pp_group)
        elif topo.is_sender:
            while (received := _recv_bucket(leader, topo.pp_group)) is not None:
                yield received
