"""Which trainer rank hands each SGLang TP rank its bucket (the tensor transport).

`update_weights_from_tensor` takes one serialized handle per server TP rank, and TP rank r
opens entry r only (SGLang 0.5.23, `TpModelWorker.deserialize_own_rank`). On GPU a handle
is a CUDA IPC handle: a process that opens one to another GPU's memory makes a CUDA context
there (0.3-0.5 GiB) and copies the bucket peer to peer. So entry r of server s is packed on
that TP rank's own GPU by the trainer rank that computes there: colocated servers share
the trainer's GPUs, server s taking GPUs s x TP onwards of its node
(`rlhf.config.placement.server_gpus`), and local rank g computes on GPU g
(`rlhf.distributed.context.rank_device`). Every rank then needs every bucket
(`SyncTopology.everywhere`), and the handles are gathered to the sender, which posts the
requests. On the CPU every process of a node shares one device, the host memory: the
sender, which holds the buckets, packs every entry, as it does for servers whose GPUs are
not known (external ones).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from rlhf.distributed.context import rank_device
from rlhf.weight_sync.gather import SyncTopology


@dataclass(frozen=True)
class HandleSource:
    """The trainer rank (global) that packs a bucket for one server TP rank, and where."""

    rank: int
    device: torch.device


def handle_sources(
    server_gpus: list[tuple[int, ...]],
    backend: str,
    sender_rank: int,
    local_world_size: int,
    colocated: bool = True,
) -> list[list[HandleSource]]:
    """[server][TP rank] -> its `HandleSource`, for the servers of the node whose first
    rank, the sender, is `sender_rank`; `server_gpus[s][r]`: the GPU of server s's TP rank
    r on that node (`server_gpus`); `backend`: the trainer's. A TP rank on the sender's
    device (every one on the CPU), or any when the servers are not `colocated` (their GPUs
    unknown), is served by the sender; any other by the rank computing on its GPU."""
    sender_device = rank_device(backend, 0)  # a sender is its node's local rank 0
    sources = []
    for gpus in server_gpus:
        row = []
        for gpu in gpus:
            device = rank_device(backend, gpu)
            if device == sender_device or not colocated:
                row.append(HandleSource(sender_rank, sender_device))
                continue
            if gpu >= local_world_size:
                raise ValueError(
                    f"a server TP rank on GPU {gpu} has no trainer process on its GPU (the node "
                    f"runs {local_world_size}): the tensor transport needs colocated servers"
                )
            row.append(HandleSource(sender_rank + gpu, device))
        sources.append(row)
    return sources


@dataclass(frozen=True)
class HandlePlan:
    """One sync's handle sources ([server][TP rank]), seen from rank `rank`; `sender`
    gathers the handles; `group`: a gloo group of the sender and the sources, when more
    than one rank packs (None otherwise)."""

    sources: list[list[HandleSource]]
    rank: int
    sender: int
    group: ProcessGroup | None = None

    @classmethod
    def from_sender(cls, num_servers: int, server_tp_size: int, device: torch.device):
        """Every handle packed by this process on `device` (one process, or the CPU)."""
        return cls([[HandleSource(0, device)] * server_tp_size] * num_servers, 0, 0)

    @property
    def ranks(self) -> list[int]:
        """The sender and the ranks that pack, in rank order."""
        return sorted({self.sender} | {h.rank for row in self.sources for h in row})

    @property
    def spread(self) -> bool:
        """More than one rank packs: every rank needs every bucket."""
        return len(self.ranks) > 1

    def mine(self) -> list[tuple[int, int]]:
        """(server, TP rank) of the handles this rank packs."""
        return [
            (s, r)
            for s, row in enumerate(self.sources)
            for r, h in enumerate(row)
            if h.rank == self.rank
        ]

    @property
    def device(self) -> torch.device | None:
        """Where this rank packs (None: it packs nothing)."""
        devices = {h.device for row in self.sources for h in row if h.rank == self.rank}
        assert len(devices) <= 1, devices
        return next(iter(devices), None)


def plan_handles(
    sources_by_sender: dict[int, list[list[HandleSource]]], topology: SyncTopology
) -> tuple[HandlePlan, SyncTopology]:
    """This rank's plan among every sync's (`sources_by_sender`: a sync's sources by its
    sender), and the topology to gather with (`everywhere` when handles are spread). Every
    rank calls it alike: the gloo group of each spread sync is made here, in sender order."""
    mine = None
    for sender, sources in sorted(sources_by_sender.items()):
        plan = HandlePlan(sources, topology.rank, sender)
        if plan.spread:
            group = dist.new_group(plan.ranks, backend="gloo")  # every rank makes each group
            member = topology.rank in plan.ranks
            plan = dataclasses.replace(plan, group=cast(ProcessGroup, group) if member else None)
        if sender == topology.sender_rank:
            mine = plan
    assert mine is not None, (topology.sender_rank, sorted(sources_by_sender))
    return mine, dataclasses.replace(topology, everywhere=topology.everywhere or mine.spread)


def tensor_handle_plan(
    server_gpus: list[tuple[int, ...]], colocated: bool, topology: SyncTopology
) -> tuple[HandlePlan, SyncTopology]:
    """`plan_handles` for this job: `server_gpus` on every node that syncs (each sender's)."""
    return plan_handles(
        {
            sender: handle_sources(
                server_gpus, topology.backend, sender, topology.local_world_size, colocated
            )
            for sender in topology.sender_ranks
        },
        topology,
    )
