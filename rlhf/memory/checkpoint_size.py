"""How many bytes one `global_step_N` checkpoint of a run takes on disk (planned, before any
is written), so that a too-small checkpoint directory is refused at startup and a
preemption checkpoint can be timed."""

from __future__ import annotations

from rlhf.config.schema import RLHFConfig
from rlhf.config.validate import distributed_optimizer_on, trained_megatron
from rlhf.memory.planner import DTYPE_BYTES, hf_param_count
from rlhf.models.families import ModelArch

ADAM_BYTES = 2 * 4  # exp_avg and exp_avg_sq in fp32


def checkpoint_bytes(cfg: RLHFConfig, arch: ModelArch, optimizer_group: int = 1) -> int:
    """Per trained model (actor; critic under GAE): its weights in the training dtype, Adam's
    two fp32 moments, fp32 master weights when training in 16 bits or under the distributed
    optimizer (its shards keep them even in fp32; `optimizer_group`: DP x SP ranks), and with
    `trainer.save_hf` an HF copy of the weights. The critic is counted at the actor's size
    (its value head is smaller than the LM head it replaces: a slight overestimate)."""
    params = hf_param_count(arch)
    total = 0
    for megatron in trained_megatron(cfg).values():
        weight = DTYPE_BYTES[megatron.dtype]
        distributed = distributed_optimizer_on(megatron, optimizer_group)
        master = 4 if weight < 4 or distributed else 0
        copies = 2 if cfg.trainer.save_hf else 1
        total += params * (weight * copies + master + ADAM_BYTES)
    return total
