"""Where this rank sits: one frozen record of its process, device and parallel groups.

`rlhf.distributed.bootstrap.init_parallel` builds it once, after Megatron's groups exist;
everything else receives it explicitly instead of reading Megatron's global state. Views
that only one package needs are derived from it inside that package: `Placement`
(rlhf.models.mapping), `VocabShard` (rlhf.models.logprobs), `SequenceShard`
(rlhf.parallel.ulysses), `SyncTopology` (rlhf.weight_sync.gather).

Dimension names: `tp` tensor, `pp` pipeline, `sp` Ulysses sequence parallelism (which runs
on Megatron's context-parallel group), `dp` data parallelism, `ep` expert parallelism and
`etp` expert tensor parallelism (mixture-of-experts layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class ParallelContext:
    """This rank's process, device and Megatron groups. A group is None when its size is 1,
    except `dp_group` (always set: sums over DP ranks are written without a special case).

    `device` is where this rank computes and where tensors for collectives live (CUDA with
    nccl, the CPU with gloo: `rank_device`). `pp_stage_ranks` are the global ranks of this
    rank's pipeline, stage by stage; `dp_sp_size` is the number of ranks Megatron's DDP
    averages gradients over (DP x SP). `sequence_parallel`: the models split their
    activations outside the TP-split layers along the sequence over the TP group
    (Megatron's sequence parallelism).
    `ep_*` / `etp_*`: where the rank sits among the expert-parallel ranks and, within those,
    the expert tensor-parallel ranks (mixture-of-experts layers; both 1 for dense models
    except that expert-TP follows TP by Megatron's default). `edp_*`: the expert
    data-parallel replicas, expert-TP x EP groups that each hold every routed expert once
    (per pipeline stage).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    tp_rank: int
    tp_size: int
    tp_group: ProcessGroup | None
    pp_rank: int
    pp_size: int
    pp_group: ProcessGroup | None
    pp_stage_ranks: tuple[int, ...]
    sp_rank: int
    sp_size: int
    sp_group: ProcessGroup | None
    dp_rank: int
    dp_size: int
    dp_group: ProcessGroup
    dp_sp_size: int
    sequence_parallel: bool = False
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    ep_group: ProcessGroup | None = None
    etp_group: ProcessGroup | None = None
    edp_rank: int = 0
    edp_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def node_rank(self) -> int:
        """This node's index: torchrun gives each node contiguous ranks."""
        return self.rank // self.local_world_size

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    def describe(self) -> str:
        return (
            f"TP {self.tp_size} x PP {self.pp_size} x SP {self.sp_size} x DP {self.dp_size} "
            f"({self.backend})"
        )


def backend_for(device: torch.device) -> str:
    """The process-group backend for collectives of tensors on `device`: nccl for CUDA,
    gloo for the CPU (the inverse of `rank_device`)."""
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(backend: str, local_rank: int) -> torch.device:
    """Where the rank at `local_rank` of its node computes and where the buffers of its
    collectives over a `backend` group must be: its own GPU for nccl (torchrun's local rank
    k computes on cuda:k, `bootstrap.pick_device`), the CPU for gloo. The one rule for
    every buffer sent or received over a group, and for which GPU a node's rank sits on."""
    if "nccl" in backend:  # "nccl", or a "cpu:gloo,cuda:nccl" pair: tensors go to the GPU
        return torch.device("cuda", local_rank)
    return torch.device("cpu")
