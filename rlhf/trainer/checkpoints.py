"""The run's checkpoints as the trainer keeps them: the directory checked before training
(writable, room for the planned checkpoints), every save timed and a failed one explained
with the steps it loses, saves written in the background (`trainer.async_save`,
`rlhf.checkpoint.background`) published when done, and the SIGTERM decision
(`rlhf.trainer.stopping`) taken with the measured save time."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from rlhf.checkpoint import (
    CheckpointManager,
    CheckpointStorageError,
    load_trainer_state,
    probe_storage,
    save_trainer_state,
)
from rlhf.checkpoint.background import BackgroundSave, CheckpointWriterError, PendingWrite
from rlhf.checkpoint.storage import available_bytes, size_text
from rlhf.config.schema import TrainerConfig
from rlhf.distributed.context import ParallelContext
from rlhf.engine.engine import PPOEngine
from rlhf.engine.nonfinite import NonFiniteError
from rlhf.models.mapping import Placement
from rlhf.trainer.export import write_model_exports
from rlhf.trainer.preflight import CHECKPOINT_CONFIG
from rlhf.trainer.stopping import Preempted, PreemptionGuard

log = logging.getLogger(__name__)


class CheckpointKeeper:
    """`manager` writes and finds checkpoints; this adds the run's bookkeeping around it."""

    def __init__(
        self,
        trainer: TrainerConfig,
        size: int,
        run_dir: Path,
        ctx: ParallelContext,
        total_steps: int,
        config_yaml: str = "",
        sources: Mapping[str, tuple[str, str]] | None = None,
    ):
        """`trainer`: the checkpoint keys; `size`: a checkpoint's planned bytes on disk
        (`rlhf.memory.checkpoint_size`); `ctx`: where this rank sits (`is_main`, `rank`);
        `config_yaml`: the run's config, written into each checkpoint; `sources`: each
        trained model's HF directory and dtype (its exports, `rlhf.trainer.export`)."""
        self.trainer, self.ctx = trainer, ctx
        self.config_yaml, self.sources = config_yaml, dict(sources or {})
        # the manager first: it removes what a failed save left before space is counted
        self.manager = CheckpointManager(run_dir / "checkpoints", trainer.max_actor_ckpt_to_keep)
        self.size = size
        saves = total_steps // trainer.save_freq + 1 if trainer.save_freq > 0 else 1
        self.write_rate = self._probe(saves, trainer.max_actor_ckpt_to_keep) if ctx.is_main else 0.0
        self.last_save_s: float | None = None  # the last save, until it was published
        self.last_saved_step: int | None = None
        self.pending: BackgroundSave | None = None  # a save being written in the background
        self.pending_since = 0.0
        self.last_blocking_s = 0.0  # how long the last background save held its step

    def _probe(self, saves: int, keep: int | None) -> float:
        """Fail unless one checkpoint fits; warn when all the run's may not (a new one is
        written before the oldest kept one is pruned). The write rate in bytes/s."""
        root = self.manager.root
        rate = probe_storage(root, self.size)
        peak = saves if keep is None else min(saves, keep + 1)  # on disk at once, at most
        needed = self.size * (peak - len(self.manager.complete_steps()))
        if available_bytes(root) < needed:
            log.warning(
                "checkpoint directory %s has %s free; this run's checkpoints may need %s more "
                "(up to %d at about %s each; trainer.max_actor_ckpt_to_keep bounds how many are "
                "kept)",
                root,
                size_text(available_bytes(root)),
                size_text(needed),
                peak,
                size_text(self.size),
            )
        return rate

    def save_step(self, step: int, engine: PPOEngine, state: Callable[[], dict]) -> None:
        """The models, optimizer and trainer state (`state()`) at `step`, in the background
        under `trainer.async_save`; never from non-finite weights (the previous checkpoint
        stays the latest); a failed write says what is lost."""
        for name in engine.nonfinite_weights():
            raise NonFiniteError(
                f"step {step}: the {name}'s weights are not finite; checkpoint not written"
            )
        if self.trainer.async_save:
            self.save_in_background(step, lambda tmp: self._snapshot(tmp, engine, state))
        else:
            self.save(step, lambda tmp: self._write(tmp, engine, state))

    def load_step(self, path: Path, engine: PPOEngine) -> dict:
        """The models (+ optimizer + LR schedules) at `path` into `engine`; the trainer state."""
        engine.load(path)
        state = load_trainer_state(path, self.ctx.rank)
        engine.load_state_dict(state)
        return state

    def _write(self, tmp: Path, engine: PPOEngine, state: Callable[[], dict]) -> None:
        self._make_model_dirs(tmp, engine)
        engine.save(tmp)
        self._write_state(tmp, state())
        self._write_exports(tmp, engine)

    def _snapshot(
        self, tmp: Path, engine: PPOEngine, state: Callable[[], dict]
    ) -> list[PendingWrite]:
        """The checkpoint in host memory and the writes of a background save; the exports
        (an HF copy under `trainer.save_hf` reads the written model) come last."""
        self._make_model_dirs(tmp, engine)
        writes = engine.save_in_background(tmp)
        self._write_state(tmp, state())
        return [*writes, PendingWrite(None, [lambda: self._write_exports(tmp, engine)])]

    def _make_model_dirs(self, tmp: Path, engine: PPOEngine) -> None:
        if self.ctx.is_main:
            for name in engine.trained():
                (tmp / name).mkdir()
        if dist.is_initialized():
            dist.barrier()

    def _write_state(self, tmp: Path, state: dict) -> None:
        save_trainer_state(tmp, state, self.ctx.rank)
        if self.ctx.is_main:
            (tmp / CHECKPOINT_CONFIG).write_text(self.config_yaml)

    def _write_exports(self, tmp: Path, engine: PPOEngine) -> None:
        if self.ctx.is_main:
            placement = Placement.of(self.ctx)
            trained = engine.trained()
            write_model_exports(tmp, trained, self.sources, self.trainer.save_hf, placement)

    def save(self, step: int, write: Callable[[Path], None]) -> None:
        """`write(tmp_dir)` as the checkpoint of `step` (all ranks), timed; a full or
        read-only disk is raised naming the steps that are lost."""
        self.wait()
        start = time.perf_counter()
        with self._explained(step), self.manager.writing(step) as tmp:
            write(tmp)
        self.last_save_s, self.last_saved_step = time.perf_counter() - start, step
        log.info("checkpoint of step %d written to %s", step, self.manager.path_for(step))

    def save_in_background(self, step: int, snapshot: Callable[[Path], list[PendingWrite]]):
        """`snapshot(tmp_dir)` copies the checkpoint of `step` to host memory and returns its
        writes, which a writer process runs while training goes on; published by the `poll`
        or `wait` that finds them done (all ranks call)."""
        self.wait()
        start = time.perf_counter()
        tmp = self.manager.begin(step)
        with self._explained(step):
            try:
                self.pending = BackgroundSave(step, tmp, snapshot(tmp))
            except BaseException as e:
                self.manager.abandon(step, tmp, e)
                raise
        self.pending_since = start
        self.last_blocking_s = time.perf_counter() - start
        log.info(
            "checkpoint of step %d: the step was held %.2f s for its snapshot; writing it in "
            "the background",
            step,
            self.last_blocking_s,
        )

    def poll(self) -> None:
        """Publish the background save if every rank's writer is done (all ranks call)."""
        if self.pending is not None and self.pending.done_everywhere():
            self.wait()

    def wait(self) -> None:
        """Finish and publish the background save in flight, if any (all ranks call)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        with self._explained(pending.step):
            try:
                pending.finish()
            except BaseException as e:
                self.manager.abandon(pending.step, pending.tmp, e)
                raise
            self.manager.publish(pending.step, pending.tmp)
        self.last_save_s = time.perf_counter() - self.pending_since
        self.last_saved_step = pending.step
        log.info(
            "checkpoint of step %d written to %s in %.1f s (the step was held %.2f s)",
            pending.step,
            self.manager.path_for(pending.step),
            self.last_save_s,
            self.last_blocking_s,
        )

    def steps_kept(self) -> list[int]:
        """Steps with a checkpoint, published or being written in the background."""
        steps = self.manager.complete_steps()
        return sorted({*steps, self.pending.step}) if self.pending is not None else steps

    @contextmanager
    def _explained(self, step: int) -> Iterator[None]:
        """A full or read-only disk said with the steps it loses."""
        try:
            yield
        except CheckpointStorageError as e:
            raise CheckpointStorageError(f"{e}; {self.work_lost(step)}") from e.__cause__
        except CheckpointWriterError as e:
            raise CheckpointWriterError(f"{e}; {self.work_lost(step)}") from e.__cause__

    def work_lost(self, step: int) -> str:
        """In words: which steps up to `step` no checkpoint holds."""
        kept = [s for s in self.manager.complete_steps() if s <= step]
        if not kept:
            return f"no checkpoint holds steps 1-{step}"
        if kept[-1] == step:
            return f"checkpoint {self.manager.path_for(step)} holds step {step}"
        latest = self.manager.path_for(kept[-1])
        lost = f"step {step} is" if kept[-1] + 1 == step else f"steps {kept[-1] + 1}-{step} are"
        return f"{lost} lost (the latest checkpoint is {latest})"

    def end_if_preempted(
        self, step: int, guard: PreemptionGuard, save: Callable[[int], None]
    ) -> None:
        """After SIGTERM on any rank: `save(step)` if that fits in the grace period left,
        then raise `Preempted` (all ranks, together)."""
        estimate = self.last_save_s
        if estimate is None:  # no save yet: the planned size at the rate measured at startup
            estimate = self.size / self.write_rate if self.write_rate else 0.0
        signalled, left_s, needed_s = guard.poll(estimate)
        if not signalled:
            return
        if self.pending is not None:  # published first; then a save of `step` if not that
            self.wait()
            signalled, left_s, needed_s = guard.poll(self.last_save_s or estimate)
        saved = self.last_saved_step == step
        if not saved and needed_s <= left_s:
            save(step)
            self.wait()  # a save in the background is published before the run ends
            saved = True
        if saved:
            raise Preempted(step, f"{self.work_lost(step)}; the same command resumes from it")
        raise Preempted(
            step,
            f"no checkpoint written (one takes about {needed_s:.0f} s, {max(left_s, 0):.0f} s "
            f"of trainer.preemption_grace_s were left); {self.work_lost(step)}",
        )
