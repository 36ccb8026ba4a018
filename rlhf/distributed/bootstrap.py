"""Process bootstrap: torchrun environment -> torch.distributed -> Megatron's parallel groups.

The only code that initialises, reads and tears down Megatron's global `parallel_state`;
`init_parallel` returns a `ParallelContext` that the rest of the package receives.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rlhf.config.validate import sequence_parallel_on
from rlhf.distributed.context import ParallelContext, backend_for
from rlhf.distributed.cpu_compat import apply_cpu_compat
from rlhf.distributed.stores import bound_store

log = logging.getLogger(__name__)


def pick_device(requested: str = "auto") -> torch.device:
    """'auto' -> cuda when available, else cpu. Asking for cuda without one is an error."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA device is visible; use auto or cpu")
    if requested == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def init_layout(device: str, layout: Any) -> ParallelContext:
    """`init_parallel` with the sizes of a checked `rlhf.config.validate.ParallelLayout`."""
    return init_parallel(
        device,
        tp_size=layout.tp_size,
        pp_size=layout.pp_size,
        sp_size=layout.sp_size,
        ep_size=layout.ep_size,
        etp_size=layout.etp_size,
        sequence_parallel=layout.sequence_parallel,
    )


def _init_process_group(device: torch.device, timeout_minutes: int) -> None:
    """torch.distributed from torchrun's variables, or as a private 1-process world.

    nccl is used with CUDA, gloo without; on CPU the Megatron compatibility layer is
    installed before anything else touches Megatron.
    """
    if device.type == "cpu":
        apply_cpu_compat()
    else:
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return
    backend = backend_for(device)
    timeout = timedelta(minutes=timeout_minutes)
    if "RANK" in os.environ:  # torchrun's MASTER_ADDR/PORT
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
            timeout=timeout,
        )
    else:
        dist.init_process_group(
            backend=backend,
            store=bound_store("127.0.0.1", 1, timeout),
            rank=0,
            world_size=1,
            timeout=timeout,
        )


def init_parallel(
    device: str = "auto",
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    sp_size: int = 1,
    ep_size: int = 1,
    etp_size: int | None = None,
    sequence_parallel: bool | None = None,
    timeout_minutes: int = 30,
) -> ParallelContext:
    """Start torch.distributed and Megatron's TP x SP x DP x PP groups; this rank's context.

    Ulysses sequence parallelism (`sp_size`) is Megatron's context-parallel group;
    `sequence_parallel` is Megatron's own over the TP group (on only when TP > 1; None: on
    then, as `megatron.sequence_parallel: null` has it). Mixture-of-experts layers have
    their own grid over the same ranks: expert-TP (`etp_size`, None: TP) x EP x expert-DP x PP.
    """
    from megatron.core import parallel_state

    _init_process_group(pick_device(device), timeout_minutes)
    world = dist.get_world_size()
    if world % (tp_size * pp_size * sp_size):
        raise ValueError(
            f"TP {tp_size} x PP {pp_size} x SP {sp_size} does not divide the {world} ranks running"
        )
    etp_size = etp_size or tp_size
    if world % (etp_size * ep_size * pp_size):
        raise ValueError(
            f"expert-TP {etp_size} x EP {ep_size} x PP {pp_size} does not divide the {world} "
            "ranks running"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        context_parallel_size=sp_size,
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=etp_size,
    )
    found = _context(pick_device(device))
    split = sequence_parallel_on(sequence_parallel, tp_size)
    return dataclasses.replace(found, sequence_parallel=split)


def _context(device: torch.device) -> ParallelContext:
    """This rank's `ParallelContext` from Megatron's parallel state."""
    from megatron.core import parallel_state as ps

    tp_size = ps.get_tensor_model_parallel_world_size()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    sp_size = ps.get_context_parallel_world_size()
    pp_group = ps.get_pipeline_model_parallel_group() if pp_size > 1 else None
    ep_size = ps.get_expert_model_parallel_world_size()
    etp_size = ps.get_expert_tensor_parallel_world_size()
    world = dist.get_world_size()
    return ParallelContext(
        rank=dist.get_rank(),
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        backend=dist.get_backend(),
        device=device,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=tp_size,
        tp_group=ps.get_tensor_model_parallel_group() if tp_size > 1 else None,
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=pp_size,
        pp_group=pp_group,
        pp_stage_ranks=tuple(
            dist.get_process_group_ranks(pp_group) if pp_group else [dist.get_rank()]
        ),
        sp_rank=ps.get_context_parallel_rank(),
        sp_size=sp_size,
        sp_group=ps.get_context_parallel_group() if sp_size > 1 else None,
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_group=ps.get_data_parallel_group(),
        dp_sp_size=ps.get_data_parallel_world_size(with_context_parallel=True),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ep_size,
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_size=etp_size,
        ep_group=ps.get_expert_model_parallel_group() if ep_size > 1 else None,
        etp_group=ps.get_expert_tensor_parallel_group() if etp_size > 1 else None,
        edp_rank=ps.get_expert_data_parallel_rank(),
        edp_size=ps.get_expert_data_parallel_world_size(),
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
