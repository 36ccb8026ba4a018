"""How a run ends before its last step: the early-stop rules, and a preemption (SIGTERM).

When to end a PPO run early, and when to go back to the last good checkpoint.

A run whose KL to the reference keeps growing has left the region the KL penalty is meant to
keep it in; a run whose reward stopped improving only spends GPU hours; a run whose validation
reward falls far below its training reward is reward hacking, and its latest checkpoints are
worse than an earlier one. These rules decide that from per-step numbers the trainer already
logs. They are plain Python (no torch) so each rule is unit-tested on its own, and their
counters go into the checkpoint (`state_dict`) so a resumed run continues counting exactly
where the interrupted one stopped.

SIGTERM (a preemption, `scancel`, a pod eviction) ends the run at the next step boundary,
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
import math
import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal

from rlhf.config.schema import EarlyStopConfig

if TYPE_CHECKING:  # torch comes with the guard's poll: `Preempted` is caught by rlhf-train
    import torch  # before it imports torch

# Ziegler et al.'s adaptive controller clips its proportional error at +-20% per step, so a
# KL that stays at twice the target is one the controller is not bringing back.
KL_THRESHOLD_FACTOR = 2.0

_STATE_KEYS = (
    "high_kl_streak",
    "best_score",
    "steps_since_best",
    "score_sum",
    "score_count",
    "last_good_step",
)


@dataclass(frozen=True)
class Decision:
    """What the trainer should do after `step`; `reason` is for the log and the user."""

    action: Literal["stop", "rollback"]
    reason: str
    step: int


def _number(value: float | None) -> str:
    return "none (no finite score yet)" if value is None else f"{value:.4g}"


class EarlyStopper:
    """Applies the `trainer.early_stop` rules to the numbers of each step and validation.

    Call `observe_step` once per training step and `observe_validation` after each
    validation; a returned `Decision` is the trainer's to act on. Call `mark_good(step)` once
    the checkpoint of `step` is saved and its validation passed: a rollback goes to
    `last_good_step` (None when no checkpoint has passed yet).
    """

    def __init__(self, section: EarlyStopConfig, target_kl: float) -> None:
        # A patience of 0 turns its rule off; a null kl_threshold is 2 x target_kl.
        threshold = section.kl_threshold or KL_THRESHOLD_FACTOR * target_kl
        self.kl_threshold = threshold if section.kl_patience else None
        self.kl_patience = section.kl_patience
        self.plateau_patience = section.reward_plateau_patience or None
        self.plateau_min_delta = section.reward_plateau_min_delta
        self.rollback_val_ratio = section.rollback_val_ratio
        self._high_kl_streak = 0
        self._best_score: float | None = None
        self._steps_since_best = 0
        self._score_sum = 0.0  # training scores since the last validation
        self._score_count = 0
        self._last_good_step: int | None = None

    @property
    def last_good_step(self) -> int | None:
        return self._last_good_step

    def mark_good(self, step: int) -> None:
        self._last_good_step = step

    def observe_step(self, step: int, mean_kl: float | None, mean_score: float) -> Decision | None:
        """Record one training step; a stop `Decision` when a rule fires (KL rule first).

        `mean_kl` is None when the run has no reference (the KL rule is then off: the
        config validator requires a reference for it). A non-finite KL counts as high; a
        non-finite score is never an improvement and is left out of the training mean that
        validation is compared with.
        """
        if math.isfinite(mean_score):
            self._score_sum += mean_score
            self._score_count += 1
        kl_decision = self._check_kl(step, mean_kl)
        plateau_decision = self._check_plateau(step, mean_score)
        return kl_decision or plateau_decision

    def _check_kl(self, step: int, mean_kl: float | None) -> Decision | None:
        threshold = self.kl_threshold
        if threshold is None or mean_kl is None:
            return None
        high = not math.isfinite(mean_kl) or mean_kl > threshold
        self._high_kl_streak = self._high_kl_streak + 1 if high else 0
        if self._high_kl_streak < self.kl_patience:
            return None
        reason = (
            f"mean KL {mean_kl:.4g} above {threshold:.4g} for "
            f"{self._high_kl_streak} consecutive steps (patience {self.kl_patience})"
        )
        return Decision("stop", reason, step)

    def _check_plateau(self, step: int, mean_score: float) -> Decision | None:
        patience = self.plateau_patience
        if patience is None:
            return None
        delta = self.plateau_min_delta
        best = self._best_score
        if math.isfinite(mean_score) and (best is None or mean_score > best + delta):
            self._best_score = mean_score
            self._steps_since_best = 0
            return None
        self._steps_since_best += 1
        if self._steps_since_best < patience:
            return None
        reason = (
            f"best mean score {_number(best)} not improved by more than {delta:.4g} "
            f"for {self._steps_since_best} steps (patience {patience}); last {mean_score:.4g}"
        )
        return Decision("stop", reason, step)

    def observe_validation(self, step: int, val_score: float) -> Decision | None:
        """Compare a validation score with the training scores since the previous validation.

        The limit is `ratio x train_mean` for a positive training mean and
        `train_mean - (1 - ratio) x |train_mean|` in general, so a negative mean (reward
        model scores) gets a limit below it, not above. No training step since the previous
        validation means nothing to compare: no decision.
        """
        count, total = self._score_count, self._score_sum
        self._score_sum, self._score_count = 0.0, 0
        ratio = self.rollback_val_ratio
        if ratio is None or count == 0:
            return None
        train_mean = total / count
        limit = train_mean - (1.0 - ratio) * abs(train_mean)
        if math.isfinite(val_score) and val_score >= limit:
            return None
        target = (
            f"roll back to step {self._last_good_step}"
            if self._last_good_step is not None
            else "no checkpoint has passed validation yet"
        )
        reason = (
            f"validation score {val_score:.4g} below {limit:.4g} (ratio {ratio:g} of the mean "
            f"training score {train_mean:.4g} over the last {count} steps); {target}"
        )
        return Decision("rollback", reason, step)

    def state_dict(self) -> dict[str, Any]:
        """The counters as JSON-able values, for the checkpoint."""
        return {
            "high_kl_streak": self._high_kl_streak,
            "best_score": self._best_score,
            "steps_since_best": self._steps_since_best,
            "score_sum": self._score_sum,
            "score_count": self._score_count,
            "last_good_step": self._last_good_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"early-stop state is missing {missing}; expected {list(_STATE_KEYS)}")
        self._high_kl_streak = int(state["high_kl_streak"])
        best = state["best_score"]
        self._best_score = None if best is None else float(best)
        self._steps_since_best = int(state["steps_since_best"])
        self._score_sum = float(state["score_sum"])
        self._score_count = int(state["score_count"])
        good = state["last_good_step"]
        self._last_good_step = None if good is None else int(good)


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
        import torch
        import torch.distributed as dist

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
