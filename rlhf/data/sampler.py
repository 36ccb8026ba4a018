"""Which prompts each PPO step uses: a seeded global shuffle per epoch, resumable exactly.

A resumed run must see exactly the batches the uninterrupted run would have seen, or its
curves are not comparable. The order of epoch e is a pure function of (seed, e), so the
whole state is (epoch, position, seed): no generator state needs saving. Each step takes
`batch_size` prompts in that order and never crosses an epoch (the remainder of an epoch is
dropped, as with a drop-last data loader); every prompt becomes `n` consecutive samples
that share a uid, which group-based advantages (GRPO, RLOO) group by.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

STATE_KEYS = ("epoch", "position", "seed", "num_prompts", "batch_size")


@dataclass(frozen=True)
class SampledBatch:
    """One step's prompts. `prompt_indices`/`uids`: [batch_size]; samples: [batch_size x n]."""

    step: int
    epoch: int
    prompt_indices: list[int]
    uids: list[str]
    n: int

    @property
    def sample_prompt_indices(self) -> list[int]:
        """Dataset index of every sample: each prompt repeated n times, consecutively."""
        return [i for i in self.prompt_indices for _ in range(self.n)]

    @property
    def sample_uids(self) -> list[str]:
        return [u for u in self.uids for _ in range(self.n)]


class PromptSampler:
    """Endless iterator of `SampledBatch`; `state_dict`/`load_state_dict` for checkpoints."""

    def __init__(self, num_prompts: int, batch_size: int, n: int = 1, seed: int = 1):
        if num_prompts <= 0:
            raise ValueError("the prompt dataset is empty: check data.train_files")
        if batch_size <= 0 or n <= 0:
            raise ValueError(f"batch size ({batch_size}) and rollout.n ({n}) must be >= 1")
        if batch_size > num_prompts:
            raise ValueError(
                f"data.train_batch_size={batch_size} is larger than the dataset "
                f"({num_prompts} prompts); lower it or add prompts"
            )
        self.num_prompts, self.batch_size, self.n, self.seed = num_prompts, batch_size, n, seed
        self.epoch, self.position, self.step = 0, 0, 0
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.num_prompts // self.batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of dataset indices used in `epoch` (a function of seed and epoch)."""
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order = (epoch, rng.permutation(self.num_prompts))
        return self._order[1]

    def next_batch(self) -> SampledBatch:
        if self.position + self.batch_size > self.num_prompts:
            self.epoch, self.position = self.epoch + 1, 0
        order = self.epoch_order(self.epoch)
        indices = [int(i) for i in order[self.position : self.position + self.batch_size]]
        batch = SampledBatch(
            step=self.step,
            epoch=self.epoch,
            prompt_indices=indices,
            uids=[f"{self.epoch}:{i}" for i in indices],
            n=self.n,
        )
        self.position += self.batch_size
        self.step += 1
        return batch

    def __iter__(self) -> Iterator[SampledBatch]:
        return self

    def __next__(self) -> SampledBatch:
        return self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Everything needed to continue exactly (plain ints; JSON-serialisable)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_prompts": self.num_prompts,
            "batch_size": self.batch_size,
            "step": self.step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; a different dataset size or batch size is an error."""
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"sampler state lacks {', '.join(missing)}")
        for key, mine in (("num_prompts", self.num_prompts), ("batch_size", self.batch_size)):
            if state[key] != mine:
                raise ValueError(
                    f"cannot resume the prompt order: the checkpoint was saved with {key}="
                    f"{state[key]} but this run has {mine} (the batches would differ)"
                )
        if not 0 <= state["position"] <= self.num_prompts or state["epoch"] < 0:
            raise ValueError(f"sampler state out of range: {state}")
        if state["seed"] != self.seed:
            log.warning(
                "resuming with the checkpoint's prompt seed %d (config has %d)",
                state["seed"],
                self.seed,
            )
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self.step = state.get("step", 0)
        self._order = None
