"""Host RAM a node needs for its trainer ranks (estimated: the GPU plan's rows moved to the host).

Per rank, at its peak:

    process      HOST_PROCESS_BYTES: Python, torch and the CUDA libraries, the CUDA context's
                 host side (an estimate, not measured here)
    offloaded    the pinned copies of every offloaded kind of every model (all at once in the
                 rollout phase); gradient buffers are freed, not copied (DDP zeroes them
                 before every use), so they take none
    the larger of
      sync       colocated servers that sleep: the actor's master weights and Adam state
                 while only its weights are on the GPU (`weights_on_device`), unless they
                 are offloaded already
      checkpoint a save's CPU copies of one trained model: its weights, and under the
                 distributed optimizer this rank's master weights and Adam state
                 (`rlhf.engine.optimizer_shards.owned_state`); under `trainer.async_save`
                 those of every trained model at once, the snapshot its writer process
                 holds until the files are written (`rlhf.checkpoint.background`)

The node's need is that times the trainer ranks on it (`trainer.n_gpus_per_node`); SGLang's
own host memory (colocated servers keep none of their released GPU memory on the host) and
the page cache are not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

GIB = 1024**3
HOST_PROCESS_BYTES = 4 * GIB
HOST_COPIED = ("weights", "master_weights", "optimizer_state")  # gradients are not copied


class Row(Protocol):
    """What the host plan needs of a role's row (`rlhf.memory.planner.RoleMemory`)."""

    @property
    def role(self) -> str: ...

    @property
    def weights(self) -> int: ...

    @property
    def master_weights(self) -> int: ...

    @property
    def optimizer_state(self) -> int: ...

    @property
    def offloaded(self) -> frozenset[str]: ...


def host_bytes_per_rank(rows: Sequence[Row], colocated_sleep: bool, async_save: bool) -> int:
    """One trainer rank's host memory at its peak (see the module docstring)."""
    trainer = [r for r in rows if r.role != "rollout"]
    offloaded = sum(getattr(r, k) for r in trainer for k in HOST_COPIED if k in r.offloaded)
    actor = next(r for r in trainer if r.role == "actor")
    state_resident = not {"master_weights", "optimizer_state"} <= actor.offloaded
    sync = actor.master_weights + actor.optimizer_state if colocated_sleep and state_resident else 0
    copies = [
        r.weights + r.master_weights + r.optimizer_state
        for r in trainer
        if r.role in ("actor", "critic")
    ]
    checkpoint = sum(copies) if async_save else max(copies)
    return HOST_PROCESS_BYTES + offloaded + max(sync, checkpoint)
