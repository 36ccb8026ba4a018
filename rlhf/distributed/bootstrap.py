"""Process bootstrap: torchrun environment -> torch.distributed -> Megatron parallel state.

The only code that initialises (and tears down) Megatron's global `parallel_state`; the
rest of the package receives process groups or `ParallelDims` explicitly.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from rlhf.config.validate import ParallelDims
from rlhf.distributed.cpu_compat import apply_cpu_compat
from rlhf.utils import free_port

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: global rank, rank on its node, world size, backend, device."""

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_world_size() -> int | None:
    """WORLD_SIZE when started by torchrun (or an equivalent launcher), else None."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


def pick_device(requested: str = "auto") -> torch.device:
    """'auto' -> cuda when available, else cpu. Asking for cuda without one is an error."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA device is visible; use auto or cpu")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def init_distributed(device: str = "auto", timeout_minutes: int = 30) -> DistEnv:
    """Initialise torch.distributed from torchrun's variables (or as a 1-process world).

    nccl is used with CUDA, gloo without; on CPU the Megatron compatibility layer is
    installed before anything else touches Megatron.
    """
    dev = pick_device(device)
    if dev.type == "cpu":
        apply_cpu_compat()
    launched = "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            # torchrun's MASTER_ADDR/PORT when launched by it, else a private 1-rank store
            init_method="env://" if launched else f"tcp://127.0.0.1:{free_port()}",
            rank=rank,
            world_size=world,
            timeout=timedelta(minutes=timeout_minutes),
        )
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world, backend=backend, device=dev)


def init_model_parallel(dims: ParallelDims) -> None:
    """Create Megatron's TP x CP x DP x PP groups (CP carries Ulysses sequence parallelism)."""
    from megatron.core import parallel_state

    if dims.world_size != dist.get_world_size():
        raise ValueError(
            f"parallel layout is for {dims.world_size} ranks, "
            f"but {dist.get_world_size()} are running"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        context_parallel_size=dims.cp,
    )


def seed_everything(seed: int, model_parallel: bool = True) -> None:
    """Seed Python, NumPy and torch; with model parallel state, also Megatron's RNG tracker.

    Megatron gives every TP rank its own stream for weight init/dropout in sharded regions
    and the same stream for replicated regions (`model_parallel_cuda_manual_seed`).
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if model_parallel:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def teardown() -> None:
    """Destroy Megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def current_placement():
    """This rank's TP/PP coordinates from Megatron's parallel state (after init_model_parallel)."""
    from megatron.core import parallel_state as ps

    from rlhf.models.mapping import Placement

    return Placement(
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
    )


def nodes() -> tuple[int, int]:
    """(this node's index, number of nodes): torchrun gives each node contiguous ranks."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return dist.get_rank() // local, dist.get_world_size() // local


def sync_topology(per_node: bool = False):
    """Groups and roles for weight sync (see `rlhf.weight_sync.gather.SyncTopology`).

    `per_node`: every node syncs its own colocated servers from the data-parallel replica
    that holds its local rank 0 (needs whole replicas per node: PP = 1, TP x CP dividing the
    node's processes); otherwise global rank 0's replica syncs every server.
    """
    from megatron.core import parallel_state as ps

    from rlhf.parallel.ulysses import SequenceShard
    from rlhf.weight_sync.gather import SyncTopology

    placement = current_placement()
    cp_size = ps.get_context_parallel_world_size()
    dp_rank, cp_rank = ps.get_data_parallel_rank(), ps.get_context_parallel_rank()
    dp_size = ps.get_data_parallel_world_size()
    replicas_per_sync = dp_size // nodes()[1] if per_node else dp_size
    pp_group = ps.get_pipeline_model_parallel_group() if placement.pp_size > 1 else None
    leaders = tuple(dist.get_process_group_ranks(pp_group)) if pp_group is not None else ()
    return SyncTopology(
        placement=placement,
        tp_group=ps.get_tensor_model_parallel_group() if placement.tp_size > 1 else None,
        pp_group=pp_group,
        pp_leader_ranks=leaders,
        in_sync_replica=dp_rank % replicas_per_sync == 0 and cp_rank == 0,
        in_probe_replica=dp_rank == 0 and cp_rank == 0,
        sp=SequenceShard(
            ps.get_context_parallel_group() if cp_size > 1 else None,
            ps.get_context_parallel_rank(),
            cp_size,
        ),
    )


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups and coordinates the trainer passes around explicitly.

    dp_group: ranks holding different samples (same TP/PP/CP coordinates); dp_cp_size: the
    ranks Megatron's DDP averages gradients over (DP x CP); pp_group is None without PP.
    """

    tp_group: object | None
    tp_rank: int
    tp_size: int
    pp_group: object | None
    is_last_stage: bool
    dp_group: object
    dp_rank: int
    dp_size: int
    dp_cp_size: int
    cp_group: object | None  # Ulysses sequence parallelism (None without it)
    cp_rank: int
    cp_size: int
    device: torch.device  # where tensors for collectives live (cuda with nccl, cpu with gloo)


def parallel_groups() -> ParallelGroups:
    """This rank's groups from Megatron's parallel state (after init_model_parallel)."""
    from megatron.core import parallel_state as ps

    tp_size = ps.get_tensor_model_parallel_world_size()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    cp_size = ps.get_context_parallel_world_size()
    return ParallelGroups(
        tp_group=ps.get_tensor_model_parallel_group() if tp_size > 1 else None,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=tp_size,
        pp_group=ps.get_pipeline_model_parallel_group() if pp_size > 1 else None,
        is_last_stage=ps.is_pipeline_last_stage(),
        dp_group=ps.get_data_parallel_group(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_cp_size=ps.get_data_parallel_world_size(with_context_parallel=True),
        cp_group=ps.get_context_parallel_group() if cp_size > 1 else None,
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=cp_size,
        device=torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu"),
    )
