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

`SyncTopology.everywhere` (the tensor transport on GPU, whose every server TP rank reads
its bucket from the trainer rank on its own GPU: `rlhf.weight_sync.handle_plan`): every
rank yields every bucket instead. Each TP group gathers and converts its own replica's
shards (DP and SP replicas hold the same weights), routed experts are all-gathered over
expert-TP and EP, and each stage's buckets are broadcast over the pipeline group; the peak
above is then every rank's.

Buffers live where the group they travel on needs them (`SyncTopology.device`: this rank's
GPU for nccl, the CPU for gloo; `rlhf.distributed.context.rank_device`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from rlhf.distributed.context import ParallelContext, rank_device
from rlhf.models.chunks import ModelChunks
from rlhf.models.families import ModelArch
from rlhf.models.lora import LoraAdapter, peft_factors
from rlhf.models.mapping import (
    Layout,
    ParamRule,
    Placement,
    resolve,
    shards_to_hf,
    skip_on_export,
)

Bucket = list[tuple[str, torch.Tensor]]
CPU = torch.device("cpu")


@dataclass(frozen=True)
class SyncTopology:
    """Who does what in a sync: the groups and this rank's role.

    `in_sync_replica`: this rank belongs to the data-parallel replica that gathers the
    weights for its servers: replica 0 of the job, or, when every node syncs its own
    colocated servers (`per_node`), the replica holding the node's local rank 0 when nodes
    hold whole replicas (PP = 1, TP x SP dividing the node's processes); otherwise every
    rank takes part (`everywhere`).
    `in_sync_experts`: this rank belongs to the expert-data-parallel replica (expert-TP x EP
    ranks of a stage) whose routed experts go to that replica's stage leader. The defaults
    (no expert groups, experts local) describe a single rank.
    `device`: where this rank's buffers for the sync's groups live (`rank_device` of the
    job's backend: Megatron's groups use it); `sender_ranks`: the global rank of each
    sync's sender (one per node when every node syncs its own servers); `everywhere`:
    every rank yields every bucket (module docstring), set by the tensor transport's plan.
    """

    placement: Placement
    tp_group: ProcessGroup | None  # None when TP = 1
    pp_group: ProcessGroup | None  # None when PP = 1
    pp_stage_ranks: tuple[int, ...]  # global ranks of my pipeline's stages, stage order
    in_sync_replica: bool
    etp_group: ProcessGroup | None = None  # None when expert-TP = 1
    ep_group: ProcessGroup | None = None  # None when EP = 1
    in_sync_experts: bool = True
    rank: int = 0
    local_world_size: int = 1
    backend: str = "gloo"
    device: torch.device = CPU
    sender_ranks: tuple[int, ...] = (0,)
    everywhere: bool = False

    @classmethod
    def of(cls, ctx: ParallelContext, per_node: bool = False) -> SyncTopology:
        num_syncs = ctx.num_nodes if per_node else 1
        everywhere = per_node and not whole_replicas_per_node(ctx)
        if everywhere:  # every rank yields every bucket; each node's first rank sends
            in_replica = in_experts = True
        else:
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
            ctx.rank,
            ctx.local_world_size,
            ctx.backend,
            rank_device(ctx.backend, ctx.local_rank),
            tuple(n * ctx.world_size // num_syncs for n in range(num_syncs)),
            everywhere,
        )

    @property
    def is_stage_leader(self) -> bool:
        return self.in_sync_replica and self.placement.tp_rank == 0

    @property
    def is_sender(self) -> bool:
        """A rank that talks to SGLang: stage 0's leader (global rank 0, or each node's
        local rank 0 when every node syncs its own servers); with `everywhere`, the first
        rank of each sync (its node's, when every node syncs its own)."""
        if self.everywhere:
            return self.rank in self.sender_ranks
        return self.is_stage_leader and self.placement.pp_rank == 0

    @property
    def sender_rank(self) -> int:
        """The global rank of the sender of this rank's sync."""
        return max(s for s in self.sender_ranks if s <= self.rank)

    @property
    def converts(self) -> bool:
        """This rank turns its stage's gathered shards into HF tensors."""
        return self.everywhere or self.is_stage_leader


def whole_replicas_per_node(ctx: ParallelContext) -> bool:
    """Whether every node holds whole model replicas, experts included (Megatron numbers
    TP, then SP, EP and DP inside PP): one replica per node can then gather the node's
    sync alone; otherwise every rank takes part (`everywhere`: the pipeline stages on other
    nodes broadcast their buckets)."""
    dense = ctx.pp_size == 1 and ctx.local_world_size % (ctx.tp_size * ctx.sp_size) == 0
    return dense and ctx.local_world_size % (ctx.etp_size * ctx.ep_size) == 0


def _gather_tp(param: torch.Tensor, layout: Layout, topo: SyncTopology) -> list[torch.Tensor]:
    if layout is Layout.REPLICATED or topo.tp_group is None:
        return [param.detach()]
    parts = [torch.empty_like(param) for _ in range(topo.placement.tp_size)]
    dist.all_gather(parts, param.detach().contiguous(), group=topo.tp_group)
    return parts


def _gather_to_first(
    tensor: torch.Tensor, group: ProcessGroup | None, to_all: bool = False
) -> torch.Tensor | None:
    """`tensor` of every rank of `group` stacked in group-rank order ([group size, *shape])
    on the group's first rank, None on the others (every rank with `to_all`; no group:
    [1, *shape] at once)."""
    if group is None:
        return tensor.unsqueeze(0)
    size = dist.get_world_size(group)
    if to_all:
        everyone = tensor.new_empty((size, *tensor.shape))
        dist.all_gather(list(everyone.unbind(0)), tensor.contiguous(), group=group)
        return everyone
    first = dist.get_rank(group) == 0
    received = tensor.new_empty((size, *tensor.shape)) if first else None
    parts = list(received.unbind(0)) if received is not None else None
    dist.gather(tensor.contiguous(), parts, group=group, group_dst=0)
    return received


def _gather_expert(param: torch.Tensor, topo: SyncTopology) -> torch.Tensor | None:
    """One local expert's weight of every EP rank, [EP, expert-TP, *shard shape] on the
    stage leader (None elsewhere; on every rank when `everywhere`): expert-TP slices
    first, then EP ranks."""
    slices = _gather_to_first(param.detach(), topo.etp_group, topo.everywhere)
    if slices is None:
        return None
    return _gather_to_first(slices, topo.ep_group, topo.everywhere)


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
    """The HF tensors of one parameter, on the ranks that convert; the gathers it needs
    elsewhere."""
    if rule.expert:
        takes_part = topo.in_sync_experts or topo.everywhere
        if takes_part and (gathered := _gather_expert(param, topo)) is not None:
            assert topo.converts
            yield from _expert_tensors(gathered, name, placement, arch)
    elif topo.in_sync_replica or topo.everywhere:
        shards = _gather_tp(param, rule.layout, topo)
        if topo.converts:
            yield from shards_to_hf(rule, layer, shards, arch)


def iter_stage_tensors(
    model, arch: ModelArch, topo: SyncTopology
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of this pipeline stage, chunk by chunk (`ModelChunks`, or one model at the
    topology's placement); yielded on the stage leader, others only gather."""
    for placement, name, param in ModelChunks.of(model, topo.placement).served_weights():
        rule, layer = resolve(arch, name, placement)
        if not skip_on_export(arch, rule):
            yield from _stage_tensors_of(rule, layer, name, param, placement, arch, topo)


def iter_stage_adapters(
    model, arch: ModelArch, topo: SyncTopology
) -> Iterator[tuple[str, torch.Tensor]]:
    """PEFT-named factors of this pipeline stage's LoRA adapters (`rlhf.models.lora`), whole:
    the factor split over TP (column-parallel layers' B, row-parallel layers' A) gathered as
    its layer's weight is; yielded on the stage leader. Routed experts have none."""
    if not (topo.in_sync_replica or topo.everywhere):
        return
    chunks = ModelChunks.of(model, topo.placement)
    for placement, chunk in zip(chunks.placements, chunks):
        for name, layer in chunk.named_modules():
            adapter = getattr(layer, "lora", None)
            if not isinstance(adapter, LoraAdapter):
                continue
            rule, index = resolve(arch, f"{name}.weight", placement)
            a, b = adapter.factors()
            split = _gather_tp(b if adapter.column else a, rule.layout, topo)
            if topo.converts:
                yield from peft_factors(adapter, rule, index, split, arch)


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


def _meta(bucket: Bucket | None) -> list | None:
    return None if bucket is None else [(n, t.dtype, tuple(t.shape)) for n, t in bucket]


def _flat(bucket: Bucket, device: torch.device) -> torch.Tensor:
    """The bucket's bytes, one after the other, on `device`."""
    return torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket]).to(device)


def _unflatten(meta: list, device: torch.device, fill) -> Bucket:
    """A bucket of `meta`'s tensors, views of one uint8 buffer on `device` that
    `fill(buffer)` receives."""
    sizes = [
        torch.Size(shape).numel() * torch.empty(0, dtype=dt).element_size() for _, dt, shape in meta
    ]
    flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    fill(flat)
    bucket, offset = [], 0
    for (name, dtype, shape), nbytes in zip(meta, sizes):
        bucket.append((name, flat[offset : offset + nbytes].view(dtype).reshape(shape)))
        offset += nbytes
    return bucket


def _send_bucket(bucket: Bucket | None, dst: int, group, device: torch.device) -> None:
    """`bucket` (None: the end) to `dst` over `group`, whose buffers live on `device`."""
    dist.send_object_list([_meta(bucket)], dst=dst, group=group, device=device)
    if bucket is not None:
        dist.send(_flat(bucket, device), dst=dst, group=group)


def _recv_bucket(src: int, group, device: torch.device) -> Bucket | None:
    """What `_send_bucket` sent from `src` (None at the end), received on `device`."""
    meta = [None]
    dist.recv_object_list(meta, src=src, group=group, device=device)
    if meta[0] is None:
        return None
    return _unflatten(meta[0], device, lambda flat: dist.recv(flat, src=src, group=group))


def _broadcast_bucket(bucket: Bucket | None, src: int, topo: SyncTopology) -> Bucket | None:
    """On every stage of the pipeline, the `bucket` that rank `src` passes (None there:
    the end, returned as None everywhere); the other ranks pass None."""
    group, device = topo.pp_group, topo.device
    meta = [_meta(bucket)]
    dist.broadcast_object_list(meta, src=src, group=group, device=device)
    if bucket is not None:
        dist.broadcast(_flat(bucket, device), src=src, group=group)
        return bucket
    if meta[0] is None:
        return None
    return _unflatten(meta[0], device, lambda flat: dist.broadcast(flat, src=src, group=group))


def _own_stage_buckets(
    model, arch: ModelArch, topo: SyncTopology, bucket_bytes: int, adapters: bool
) -> Iterator[Bucket]:
    """This stage's buckets, yielded where they are held; sent (`everywhere`: broadcast)
    to the other stages."""
    first_stage, stages = topo.pp_stage_ranks[0], topo.pp_group is not None
    stage_tensors = iter_stage_adapters if adapters else iter_stage_tensors
    for bucket in bucketize(stage_tensors(model, arch, topo), bucket_bytes):
        if topo.everywhere:
            if stages:
                _broadcast_bucket(bucket, topo.rank, topo)
            yield bucket
        elif topo.is_sender:
            yield bucket
        elif topo.is_stage_leader:
            _send_bucket(bucket, first_stage, topo.pp_group, topo.device)
    if topo.everywhere and stages:
        _broadcast_bucket(None, topo.rank, topo)
    elif topo.is_stage_leader and not topo.is_sender:
        _send_bucket(None, first_stage, topo.pp_group, topo.device)


def iter_buckets(
    model, arch: ModelArch, topo: SyncTopology, bucket_bytes: int, adapters: bool = False
) -> Iterator[Bucket]:
    """All HF buckets of the model, in the same order wherever they are yielded: on the
    sender only (every rank with `topo.everywhere`); `adapters`: the LoRA adapters' PEFT
    tensors instead (`iter_stage_adapters`).

    Every rank must exhaust this iterator: it drives the TP and expert gathers and the sends
    of later pipeline stages, one stage after the other.
    """
    if not (topo.in_sync_replica or topo.in_sync_experts or topo.everywhere):
        return
    for stage, leader in enumerate(topo.pp_stage_ranks):
        if stage == topo.placement.pp_rank:
            yield from _own_stage_buckets(model, arch, topo, bucket_bytes, adapters)
        elif topo.everywhere:
            while (received := _broadcast_bucket(None, leader, topo)) is not None:
                yield received
        elif topo.is_sender:
            while (received := _recv_bucket(leader, topo.pp_group, topo.device)) is not None:
                yield received
