"""SIGTERM (a preemption, `scancel`, a pod eviction) ends the run at the next step boundary,
with a checkpoint of that step when one can be written within `trainer.preemption_grace_s`.

A scheduler sends SIGTERM and follows with SIGKILL after a grace period (SLURM's KillWait,
Kubernetes' terminationGracePeriodSeconds; 30 s by default for both). A step cannot be
checkpointed half-way, so the step in flight finishes; then every rank agrees (one small
all-reduce per step) whether a signal came, how long ago, and how long a save takes (the
last save's measured time, or the planned checkpoint size over the write rate measured at
startup). If the save fits in what is left of the grace period the checkpoint is written,
otherwise nothing is started that SIGKILL would cut off. Later SIGTERMs are only logged:
a worker under torchrun on SLURM gets one from the scheduler and one forwarded by torchrun
(`launch/torchrun.sh` gives torchrun a shutdown timeout long enough not to cut the grace
period short). SIGINT (Ctrl-C) stops at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

SAVE_MARGIN = 1.5  # a save estimate is this much of what was measured or planned


class Preempted(Exception):
    """SIGTERM ended the run after `step`; `message` says whether a checkpoint was written."""

    def __init__(self, step: int, message: str):
        super().__init__(f"stopped by SIGTERM after step {step}: {message}")
        self.step = step


class PreemptionGuard:
    """Records SIGTERM while installed (`with guard:`, main thread only); `poll` is collective."""

    def __init__(self, grace_s: float, device: torch.device):
        self.grace_s = grace_s
        self.device = device
        self.signalled_at: float | None = None
        self._previous: Any = None
        self._installed = False
        self.num_signals = 0

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous)
        self._installed = False

    @property
    def installed(self) -> bool:
        """Whether SIGTERM is this guard's now."""
        return self._installed and signal.getsignal(signal.SIGTERM) == self._on_sigterm

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.num_signals += 1
        if self.signalled_at is None:
            self.signalled_at = time.monotonic()
            log.warning(
                "SIGTERM: the run ends after this step, with a checkpoint if one fits in "
                "trainer.preemption_grace_s=%.0f s (Ctrl-C stops at once)",
                self.grace_s,
            )
        else:
            log.warning("SIGTERM again: still ending the run after this step")

    def poll(self, save_estimate_s: float) -> tuple[bool, float, float]:
        """(signalled on any rank, grace seconds left, seconds a save takes), the same on
        every rank (the worst case over ranks). All ranks call."""
        elapsed = 0.0 if self.signalled_at is None else time.monotonic() - self.signalled_at
        flags = torch.tensor(
            [float(self.signalled_at is not None), elapsed, save_estimate_s],
            dtype=torch.float64,
            device=self.device,
        )
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, elapsed, estimate = flags.tolist()
        return signalled > 0, self.grace_s - elapsed, estimate * SAVE_MARGIN
