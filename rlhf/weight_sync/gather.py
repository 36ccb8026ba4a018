"""Turn this job's Megatron shards into HF-named full tensors, in size-bounded buckets, on rank 0.

Every rank of one data-parallel replica takes part: TP ranks all-gather each parameter's
shards, the TP-rank-0 "stage leader" of every pipeline stage converts them to HF names and
layout (`rlhf.models.mapping.shards_to_hf`), packs them into buckets of at most
`bucket_bytes`, and stage leaders of later stages send their buckets to global rank 0 over
the pipeline group. Only global rank 0 talks to SGLang.

Routed experts (mixture-of-experts layers) are not split like the rest: each expert-parallel
(EP) rank holds E / EP of them, each split over the expert-TP group, and the EP ranks are
carved out of the DP x TP ranks, so the sync replica alone does not hold them all. The
ranks of one expert-data-parallel replica (the expert-TP x EP group of the stage leader)
gather each local expert weight to the leader instead: `dist.gather` over expert-TP to
each expert-TP rank 0, then over EP to the leader, one local expert index at a time
(expert i of every EP rank in one call), and the leader emits them under their global HF
names (`model.layers.L.mlp.experts.E.gate_proj.weight`, ...): SGLang's MoE models load
per-expert names into their fused expert parameters. Only the leader receives; nothing is
all-gathered.

Peak extra memory on a stage leader: one dense parameter's TP shards, or for a routed
expert weight at most (2 x EP + 1) x that weight of one expert (its expert-TP slices, every
EP rank's copy, and their HF tensors where the layout copies), plus about one bucket (two on
rank 0 while receiving another stage's); another expert-TP rank 0 holds one expert's weight.
For Qwen3-235B-A22B at EP 8, one expert's gate/up weight is 25 MB (bf16): 200 MB a gather.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from rlhf.distributed.context import ParallelContext
from rlhf.models.chunks import ModelChunks
from rlhf.models.families import ModelArch
from rlhf.models.mapping import (
    Layout,
    ParamRule,
    Placement,
    resolve,
    shards_to_hf,
    skip_on_export,
)

Bucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class SyncTopology:
    """Who does what in a sync: the groups and this rank's role.

    `in_sync_replica`: this rank belongs to the data-parallel replica that gathers the
    weights for its servers: replica 0 of the job, or, when every node syncs its own
    colocated servers (`per_node`), the replica holding the node's local rank 0 (which needs
    whole replicas per node: PP = 1, TP x SP dividing the node's processes).
    `in_sync_experts`: this rank belongs to the expert-data-parallel replica (expert-TP x EP
    ranks of a stage) whose routed experts go to that replica's stage leader. The defaults
    (no expert groups, experts local) describe a single rank.
    """

    placement: Placement
    tp_group: ProcessGroup | None  # None when TP = 1
    pp_group: ProcessGroup | None  # None when PP = 1
    pp_stage_ranks: tuple[int, ...]  # global ranks of my pipeline's stages, stage order
    in_sync_replica: bool
    etp_group: ProcessGroup | None = None  # None when expert-TP = 1
    ep_group: ProcessGroup | None = None  # None when EP = 1
    in_sync_experts: bool = True

    @classmethod
    def of(cls, ctx: ParallelContext, per_node: bool = False) -> SyncTopology:
        num_syncs = ctx.num_nodes if per_node else 1
        if per_node and ctx.local_world_size % (ctx.etp_size * ctx.ep_size):
            raise ValueError(
                f"every node syncs its own servers, so each node must hold whole expert-TP x EP "
                f"groups: expert-TP {ctx.etp_size} x EP {ctx.ep_size} does not divide the "
                f"{ctx.local_world_size} processes per node"
            )
        replicas_per_sync = ctx.dp_size // num_syncs
        in_replica = ctx.dp_rank % replicas_per_sync == 0 and ctx.sp_rank == 0
        in_experts = ctx.edp_rank % (ctx.edp_size // num_syncs) == 0
        if in_replica and ctx.tp_rank == 0:  # a stage leader receives the experts
            assert in_experts and ctx.ep_rank == 0 and ctx.etp_rank == 0, ctx
        return cls(
            Placement.of(ctx),
            ctx.tp_group,
            ctx.pp_group,
            ctx.pp_stage_ranks,
            in_replica,
            ctx.etp_group,
            ctx.ep_group,
            in_experts,
        )

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


def _gather_to_first(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor | None:
    """`tensor` of every rank of `group` stacked in group-rank order ([group size, *shape])
    on the group's first rank, None on the others (no group: [1, *shape] at once)."""
    if group is None:
        return tensor.unsqueeze(0)
    size = dist.get_world_size(group)
    first = dist.get_rank(group) == 0
    received = tensor.new_empty((size, *tensor.shape)) if first else None
    parts = list(received.unbind(0)) if received is not None else None
    dist.gather(tensor.contiguous(), parts, group=group, group_dst=0)
    return received


def _gather_expert(param: torch.Tensor, topo: SyncTopology) -> torch.Tensor | None:
    """One local expert's weight of every EP rank, [EP, expert-TP, *shard shape] on the
    stage leader (None elsewhere): expert-TP slices first, then EP ranks."""
    slices = _gather_to_first(param.detach(), topo.etp_group)
    if slices is None:
        return None
    return _gather_to_first(slices, topo.ep_group)


def _expert_tensors(
    gathered: torch.Tensor, name: str, placement: Placement, arch: ModelArch
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of one local expert weight gathered from every EP rank: EP rank r's
    local expert i is global expert r x E / EP + i (`resolve` at r's placement)."""
    for ep_rank, slices in enumerate(gathered.unbind(0)):
        rule, layer = resolve(arch, name, dataclasses.replace(placement, ep_rank=ep_rank))
        yield from shards_to_hf(rule, layer, list(slices.unbind(0)), arch)


def _stage_tensors_of(
    rule: ParamRule,
    layer: int | None,
    name: str,
    param: torch.Tensor,
    placement: Placement,
    arch: ModelArch,
    topo: SyncTopology,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of one parameter, on the stage leader; the gathers it needs elsewhere."""
    if rule.expert:
        if topo.in_sync_experts and (gathered := _gather_expert(param, topo)) is not None:
            assert topo.is_stage_leader
            yield from _expert_tensors(gathered, name, placement, arch)
    elif topo.in_sync_replica:
        shards = _gather_tp(param, rule.layout, topo)
        if topo.is_stage_leader:
            yield from shards_to_hf(rule, layer, shards, arch)


def iter_stage_tensors(
    model, arch: ModelArch, topo: SyncTopology
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of this pipeline stage, chunk by chunk (`ModelChunks`, or one model at the
    topology's placement); yielded on the stage leader, others only gather."""
    for placement, name, param in ModelChunks.of(model, topo.placement).placed_parameters():
        rule, layer = resolve(arch, name, placement)
        if not skip_on_export(arch, rule):
            yield from _stage_tensors_of(rule, layer, name, param, placement, arch, topo)


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

    Every rank must exhaust this iterator: it drives the TP and expert gathers and the sends
    of later pipeline stages, one stage after the other.
    """
    if not (topo.in_sync_replica or topo.in_sync_experts):
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
