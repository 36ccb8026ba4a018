"""How many bytes one `global_step_N` checkpoint of a run takes on disk (planned, before any
is written), so that a too-small checkpoint directory is refused at startup and a
preemption checkpoint can be timed."""

from __future__ import annotations

from collections.abc import Iterable

from rlhf.config.schema import MegatronParallelConfig
from rlhf.config.validate import distributed_optimizer_on
from rlhf.memory.planner import DTYPE_BYTES, hf_param_count
from rlhf.models.families import ModelArch

ADAM_BYTES = 2 * 4  # exp_avg and exp_avg_sq in fp32


def checkpoint_bytes(
    trained: Iterable[MegatronParallelConfig],
    arch: ModelArch,
    save_hf: bool,
    optimizer_group: int = 1,
) -> int:
    """Per trained model (`trained`: the Megatron settings of the actor, and of the critic
    under GAE, as `rlhf.config.validate.trained_megatron` gives them): its weights in the
    training dtype, Adam's two fp32 moments, fp32 master weights when training in 16 bits or
    under the distributed optimizer (its shards keep them even in fp32; `optimizer_group`:
    DP x SP ranks), and with `save_hf` (`trainer.save_hf`) an HF copy of the weights. The
    critic is counted at the actor's size (its value head is smaller than the LM head it
    replaces: a slight overestimate)."""
    params = hf_param_count(arch)
    total = 0
    for megatron in trained:
        weight = DTYPE_BYTES[megatron.dtype]
        distributed = distributed_optimizer_on(megatron, optimizer_group)
        master = 4 if weight < 4 or distributed else 0
        copies = 2 if save_hf else 1
        total += params * (weight * copies + master + ADAM_BYTES)
    return total


# Copying a rank's snapshot to host memory: pageable device-to-host copies on a GPU node
# (an assumption to be measured by tools/run_gpu_checks.sh), a memcpy on the CPU.
SNAPSHOT_BYTES_PER_S = {"cuda": 8e9, "cpu": 4e9}


def save_hold_text(
    size: int, world_size: int, write_rate: float, device: str, async_save: bool, grace_s: float
) -> str:
    """In words: how long a save holds its step, synchronously (`size` at the measured
    `write_rate`, bytes/s) and under `trainer.async_save` (this rank's share copied to host
    memory), against the preemption grace period."""
    per_rank = size / max(world_size, 1)
    sync_s = size / write_rate if write_rate > 0 else float("inf")
    snapshot_s = per_rank / SNAPSHOT_BYTES_PER_S["cpu" if device == "cpu" else "cuda"]
    measured = f"at the {write_rate / 1e6:.0f} MB/s measured"
    sync = f"a synchronous save holds its step about {sync_s:.1f} s ({measured})"
    background = (
        f"trainer.async_save holds it about {snapshot_s:.1f} s, for a snapshot of "
        f"{per_rank / 1024**3:.2f} GiB per rank in host memory, and writes the files in the "
        "background"
    )
    text = f"checkpoint plan: {size / 1024**3:.2f} GiB a save; "
    text += f"{background} ({sync} without it)" if async_save else f"{sync}; {background}"
    if grace_s > 0 and sync_s > grace_s:
        text += (
            f"; a checkpoint of the step SIGTERM interrupts does not fit in "
            f"trainer.preemption_grace_s={grace_s:.0f} s, so the run keeps the last saved one"
        )
    return text
