"""The PPO run: build everything once, then the loop of steps, validation and checkpoints.

SPMD: every rank runs this loop. One step (generate -> score -> log-probs/values ->
advantages -> updates -> weights to the servers) is `rlhf.trainer.step.PPOStep`;
`PolicyServers` generates on the ranks that own SGLang engines and hands every rank the
same batch. Every decision (early stop, rollback, checkpoint) is computed from the step's
typed result, identical on all ranks, so all take it together.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from rlhf.algo import build_kl_controller
from rlhf.config.loader import config_to_dict, dump_yaml
from rlhf.config.schema import RLHFConfig
from rlhf.config.validate import trained_megatron
from rlhf.data.sampler import PromptSampler
from rlhf.distributed.context import ParallelContext
from rlhf.engine.build import build_engine
from rlhf.engine.nonfinite import NonFiniteError, check_scores
from rlhf.engine.reward_model import (
    RewardModelScorer,
    score_model_rows,
)
from rlhf.logging import StepProfiler
from rlhf.memory.checkpoint_size import checkpoint_bytes, save_hold_text
from rlhf.memory.ledger import ledger
from rlhf.reward.validation import val_samples, validation_metrics
from rlhf.rollout.policy_servers import PolicyServers, val_sampling_params
from rlhf.trainer.checkpoints import CheckpointKeeper
from rlhf.trainer.metrics import (
    StepMeter,
    build_tracker,
    measure_matmul_flops,
    model_passes,
    tracker_state,
)
from rlhf.trainer.preflight import CHECKPOINT_CONFIG, Preflight, check_resume
from rlhf.trainer.rollouts import (
    AheadRollout,
    BatchShaping,
    MixedRollout,
    RolloutStrategy,
    SynchronousRollout,
)
from rlhf.trainer.step import Learning, PPOStep, StepResult
from rlhf.trainer.stopping import Decision, EarlyStopper, PreemptionGuard
from rlhf.utils import torch_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Validation:
    """One validation pass: the mean score over every response (what the early stop reads)
    and the metrics to log."""

    score: float
    metrics: dict[str, float]


class PPOTrainer:
    """Holds the run: data, models, policy servers, controllers, checkpoints; runs the loop."""

    def __init__(self, cfg: RLHFConfig, ctx: ParallelContext, run_dir: Path, checked: Preflight):
        """`checked`: what `rlhf.trainer.preflight.preflight` checked and loaded."""
        self.cfg, self.ctx, self.run_dir, self.arch = cfg, ctx, run_dir, checked.arch
        self.plan, self.tokenizer, self.tools = checked.plan, checked.tokenizer, checked.tools
        self.train_data, self.val_data = checked.train_data, checked.val_data
        self.stored = checked.stored
        rollout = cfg.actor_rollout_ref.rollout
        self.sampler = PromptSampler(
            len(self.train_data), self.plan.prompts_per_step, rollout.n, cfg.data.seed
        )
        self.total_steps = cfg.trainer.total_training_steps or (
            cfg.trainer.total_epochs * self.steps_per_epoch()
        )
        # before any server starts: a read-only or too small checkpoint directory fails now
        aro = cfg.actor_rollout_ref
        trained = trained_megatron(aro, cfg.critic, cfg.algorithm)
        size = checkpoint_bytes(trained.values(), checked.arch, cfg.trainer.save_hf, ctx.dp_sp_size)
        sources = {
            "actor": (aro.model.path, aro.actor.megatron.dtype),
            "critic": (cfg.critic.model.path, cfg.critic.megatron.dtype),
        }
        self.keeper = CheckpointKeeper(
            cfg.trainer, size, run_dir, ctx, self.total_steps, dump_yaml(cfg), sources
        )
        if ctx.is_main:
            self.log_save_plan()
        self.checkpoints = self.keeper.manager
        # before any server starts: a missing or damaged checkpoint fails (or falls back) now,
        # and one written under settings that would mix two runs is refused
        self.resume_path = self.checkpoints.resolve_resume(cfg.trainer.resume_mode)
        if self.resume_path is not None:
            data = len(self.train_data)
            check_resume(cfg, self.resume_path, data, ctx.world_size, ctx.dp_sp_size)
        if ctx.is_main:
            (run_dir / CHECKPOINT_CONFIG).write_text(dump_yaml(cfg))
        num_val = len(self.val_data) if self.val_data is not None else 0
        max_prompts = max(cfg.data.train_batch_size, num_val)
        # SGLang starts loading now; the models are built meanwhile, then wait_ready()
        self.servers = PolicyServers.launch(
            cfg,
            ctx,
            run_dir,
            self.tokenizer,
            max_prompts,
            checked.arch,
            self.tools,
            checked.processor,
        )
        try:
            with ledger().phase("build"):
                self.build_training_side()
            self.servers.wait_ready()
        except BaseException:
            self.servers.shutdown()
            raise
        self.batches = self.rollout_strategy()
        meter = StepMeter(checked.arch, ctx.world_size, self.peak_flops, model_passes(self.plan))
        rollouts_dir = run_dir / "rollouts" if ctx.is_main else None
        learning = Learning.of(cfg.algorithm, cfg.actor_rollout_ref.actor, cfg.trainer)
        self.ppo_step = PPOStep(
            learning,
            cfg.data.max_response_length,
            self.engine,
            self.servers,
            self.batches,
            self.kl_ctrl,
            meter,
            rollouts_dir,
        )

    def steps_per_epoch(self) -> int:
        """Steps in one pass over the prompts (over the stored groups when every group of a
        step is stored)."""
        stored = self.plan.stored_groups_per_step
        if self.stored is not None and stored == self.cfg.data.train_batch_size:
            return len(self.stored) // stored
        return self.sampler.steps_per_epoch

    def rollout_strategy(self) -> RolloutStrategy:
        """Where each step's batch comes from (`trainer.rollout_mode`, `data.rollout_files`)."""
        cfg = self.cfg
        shaping = BatchShaping.of(cfg.actor_rollout_ref, cfg.data, cfg.algorithm, cfg.reward)
        source = (self.servers, self.sampler, self.train_data, shaping, self.reward_model)
        if self.stored is not None:
            return MixedRollout(*source, self.stored, self.tokenizer, self.ctx.is_main)
        if cfg.trainer.rollout_mode == "sync":
            return SynchronousRollout(*source)
        return AheadRollout(*source, cfg.trainer, last_step=self.total_steps)

    def build_training_side(self) -> None:
        """Models, controllers, profiler, the MFU yardstick and the tracker."""
        cfg, ctx = self.cfg, self.ctx
        self.engine = build_engine(cfg, self.arch, ctx, self.total_steps)
        budget = self.engine.budgets.ref  # the reward model's passes: the reference's
        dtype = cfg.actor_rollout_ref.actor.megatron.dtype
        self.reward_model = RewardModelScorer.from_config(
            cfg.reward, dtype, ctx, self.engine.planner, budget
        )
        self.kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl)
        self.stopper = EarlyStopper(cfg.trainer.early_stop, cfg.algorithm.kl_ctrl.target_kl)
        self.profiler = StepProfiler.from_config(cfg.global_profiler, cfg.trainer.default_local_dir)
        self.peak_flops = measure_matmul_flops(
            ctx.device, torch_dtype(cfg.actor_rollout_ref.actor.megatron.dtype)
        )
        # on resume it continues the tracker runs of the checkpoint (and drops the rows of
        # later steps from metrics.jsonl: they are redone)
        root = self.checkpoints.root
        self.tracker = (
            build_tracker(cfg.trainer, config_to_dict(cfg), self.resume_path, root)
            if ctx.is_main
            else None
        )

    def close(self) -> None:
        try:
            self.batches.close()
            self.servers.shutdown()
            self.ppo_step.close()  # the last step's rollout files, if still being written
        finally:
            if self.tracker is not None:
                self.tracker.close()

    def load_weights(self, version: int) -> None:
        """The servers serve the actor's current weights as `version` (through the rollout
        strategy: generating servers are waited for or paused)."""
        self.batches.publish(self.engine, version)

    def validate(self) -> Validation:
        """Generate and score the validation prompts; its time is `timing_s/testing`."""
        assert self.val_data is not None
        start = time.perf_counter()
        prompts = list(self.val_data.prompts)
        result = self.servers.validate(
            prompts,
            val_sampling_params(
                self.cfg.actor_rollout_ref.rollout, self.cfg.data.max_response_length
            ),
        )
        batch = score_model_rows(result, self.reward_model).batch
        check_scores(batch)
        texts = self.tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
        scores = batch.scores_b.tolist()
        samples = val_samples(batch.data_sources, batch.uids, scores, texts, self.cfg.reward)
        metrics = validation_metrics(samples)
        if result.tool_stats is not None:
            metrics |= {f"val/{k}": v for k, v in result.tool_stats.metrics().items()}
        metrics["timing_s/testing"] = time.perf_counter() - start
        return Validation(sum(scores) / len(scores), metrics)

    # ---- checkpoints ------------------------------------------------------------------

    def log_save_plan(self) -> None:
        """How long a save holds its step, with and without `trainer.async_save`."""
        trainer, keeper = self.cfg.trainer, self.keeper
        device, world_size = self.ctx.device.type, self.ctx.world_size
        args = (keeper.size, world_size, keeper.write_rate, device, trainer.async_save)
        log.info("%s", save_hold_text(*args, trainer.preemption_grace_s))

    def state_dict(self, step: int) -> dict:
        return {
            "step": step,
            "sampler": self.batches.sampler_state(),
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "early_stop": self.stopper.state_dict(),
            **tracker_state(self.tracker),
            **self.engine.state_dict(),
        }

    def save_checkpoint(self, step: int) -> None:
        """The models, optimizer and trainer state at `step` (`CheckpointKeeper.save_step`),
        once the rollout files of the steps it holds are on disk."""
        self.ppo_step.files_written()
        self.keeper.save_step(step, self.engine, lambda: self.state_dict(step))

    def load_models(self, path: Path) -> dict:
        """Actor, critic (model + optimizer + LR schedule) and the trainer state at `path`."""
        state = self.keeper.load_step(path, self.engine)
        self.engine.load_state_dict(state)
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        return state

    def resume(self) -> int:
        """Load the checkpoint `trainer.resume_mode` names; the step to continue after."""
        path = self.resume_path
        if path is None:
            if self.cfg.actor_rollout_ref.rollout.server_urls:
                # servers this run did not launch may hold any weights (another run's, an
                # older step's); launched ones loaded model.path, which the actor starts from
                self.load_weights(0)
                log.info("loaded the actor's weights into the external SGLang servers")
            elif self.servers.weights_released:  # they slept while the models were built
                self.load_weights(0)
            return 0
        state = self.load_models(path)
        self.batches.load_sampler_state(state["sampler"])
        self.stopper.load_state_dict(state["early_stop"])
        step = int(state["step"])
        self.load_weights(step)  # the servers started from the HF weights
        log.info("resumed from %s (step %d)", path, step)
        return step

    def rollback(self, decision: Decision, step: int) -> dict[str, float]:
        """Back to the last good checkpoint's models; data order and step count go on."""
        good = self.stopper.last_good_step
        self.keeper.wait()  # a background save of `good` is published first
        if good is None or good not in self.checkpoints.complete_steps():
            log.warning("rollback requested (%s) but no good checkpoint is kept", decision.reason)
            return {"early_stop/rollback_skipped": 1.0}
        self.load_models(self.checkpoints.path_for(good))
        self.load_weights(step)
        log.warning("rolled back to the checkpoint of step %d: %s", good, decision.reason)
        if step == self.total_steps:
            log.warning(
                "the rollback was at the last step: the run's final checkpoint (step %d) holds "
                "the models of step %d, not those step %d trained",
                step,
                good,
                step,
            )
        return {"early_stop/rollback_to_step": float(good)}

    # ---- the loop ---------------------------------------------------------------------

    def fit(self) -> int:
        """Train to `total_steps` (or an early stop); returns the last step run."""
        cfg = self.cfg.trainer
        step = self.resume()
        if self.val_data is not None and cfg.val_before_train and step == 0:
            self.log(self.validate().metrics, 0)
        bar = tqdm(
            total=self.total_steps,
            initial=step,
            desc="ppo",
            unit="step",
            disable=not (self.ctx.is_main and "console" in cfg.logger),
        )
        guard = PreemptionGuard(cfg.preemption_grace_s, self.ctx.device)
        try:
            with guard:
                step = self._run_steps(step, bar, guard)
                self.ppo_step.files_written()
                self.keeper.wait()  # the last checkpoint, if written in the background
        finally:
            bar.close()  # a failure's message then starts on its own line
        return step

    def _run_steps(self, step: int, bar: tqdm, guard: PreemptionGuard) -> int:
        """Steps after `step` to the end (or an early stop); the last step run."""
        cfg = self.cfg.trainer
        first = step + 1
        after_record: dict[str, float] = {}  # timed after a record went out: in the next one
        while step < self.total_steps:
            step += 1
            with self.profiler.step(step):
                try:
                    result = self.ppo_step.run(step)
                except NonFiniteError as e:
                    raise NonFiniteError(f"step {step}: {e}") from None
            warn_nonfinite(result)
            if self.ctx.is_main and step == first:
                log.info(
                    "device residency by phase at step %d (rlhf.memory.ledger; on the CPU the "
                    "residency a GPU run would have):\n%s",
                    step,
                    ledger().table(),
                )
            metrics = result.metrics | after_record
            decision = self.stopper.observe_step(step, result.reward_kl, result.mean_score)
            last = step == self.total_steps or decision is not None
            save = (cfg.save_freq > 0 and step % cfg.save_freq == 0) or last
            if self.val_data is not None and (
                (cfg.test_freq > 0 and step % cfg.test_freq == 0) or last
            ):
                val = self.validate()
                metrics |= val.metrics
                decision = self.after_validation(step, val, metrics, save) or decision
            if decision is not None:
                metrics[f"early_stop/{decision.action}"] = 1.0
                log.warning("early stop at step %d: %s", step, decision.reason)
            start = time.perf_counter()
            self.log(metrics, step)  # before the checkpoint: a kill in between redoes the step
            logged = time.perf_counter()
            after_record = {"timing_s/log": logged - start}
            if save or decision is not None:
                self.save_checkpoint(step)
                after_record["timing_s/save_checkpoint"] = time.perf_counter() - logged
            else:
                self.keeper.poll()  # a background save done by now is published
            bar.update(1)
            if not last:  # the run ends here anyway, with its final checkpoint
                self.keeper.end_if_preempted(step, guard, self.save_checkpoint)
            if decision is not None and decision.action == "stop":
                break
        return step

    def after_validation(self, step: int, val: Validation, metrics: dict, saving: bool):
        """Rollback when validation falls behind training; else mark a good checkpoint."""
        decision = self.stopper.observe_validation(step, val.score)
        if decision is not None and decision.action == "rollback":
            metrics |= self.rollback(decision, step)
            return None  # rolled back (or could not): training goes on
        if decision is None:
            kept = [s for s in self.keeper.steps_kept() if s <= step]
            if saving:
                self.stopper.mark_good(step)  # the checkpoint written at this step
            elif kept:
                self.stopper.mark_good(kept[-1])
        return decision

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracker is not None:
            self.tracker.log(metrics, step=step)


def warn_nonfinite(result: StepResult) -> None:
    """Say what a step skipped (`trainer.on_nonfinite=skip`): the whole step, or updates."""
    if result.nonfinite:
        log.warning(
            "step %d: skipped %s, not finite: %s (trainer.on_nonfinite=skip)",
            result.step,
            "the step" if result.skipped else "updates",
            ", ".join(result.nonfinite),
        )
