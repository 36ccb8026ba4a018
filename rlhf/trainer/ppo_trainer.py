"""The PPO loop: rollout -> reward -> log-probs/values -> advantages -> updates -> sync.

SPMD: every rank runs this loop. Rank 0 (per node, when colocated on several nodes: see
`rlhf.trainer.fleet`) also owns the SGLang engine (generation and
validation) and the metric tracker, and broadcasts what it alone computes, so every
decision (early stop, rollback, checkpoint) is taken identically on all ranks.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

from rlhf.algo import build_kl_controller, masked_mean
from rlhf.checkpoint import CheckpointManager, load_trainer_state, save_trainer_state
from rlhf.config.schema import RLHFConfig
from rlhf.data.prompts import load_tokenizer, prompt_dataset_from_config
from rlhf.data.sampler import PromptSampler
from rlhf.distributed.bootstrap import DistEnv, parallel_groups
from rlhf.logging import MetricTracker, StepProfiler, Timer
from rlhf.reward import build_reward_fn
from rlhf.trainer import stages
from rlhf.trainer.early_stop import Decision, EarlyStopper, EarlyStopSettings
from rlhf.trainer.fleet import RolloutFleet
from rlhf.trainer.perf import measure_matmul_flops, ppo_step_flops
from rlhf.trainer.rollout_stage import (
    broadcast_batch,
    broadcast_object,
    rollout_metrics,
    sampling_params,
    score_by_source,
    val_sampling_params,
    write_records,
)
from rlhf.trainer.setup import build_models, load_arch_of, token_budgets, use_thd, vocab_shard
from rlhf.utils import DTYPES

log = logging.getLogger(__name__)


class PPOTrainer:
    """Holds the run: models, data, rollout fleet, controllers, checkpoints."""

    def __init__(self, cfg: RLHFConfig, env: DistEnv, run_dir: Path):
        self.cfg, self.env, self.run_dir = cfg, env, run_dir
        self.groups = parallel_groups()
        self.arch = load_arch_of(cfg)
        model_path = cfg.actor_rollout_ref.model.path
        self.tokenizer = load_tokenizer(model_path)
        self.train_data = prompt_dataset_from_config(cfg.data, self.tokenizer, "train")
        self.val_data = (
            prompt_dataset_from_config(cfg.data, self.tokenizer, "val")
            if cfg.data.val_files
            else None
        )
        rollout = cfg.actor_rollout_ref.rollout
        self.sampler = PromptSampler(
            len(self.train_data), cfg.data.train_batch_size, rollout.n, cfg.data.seed
        )
        self.total_steps = cfg.trainer.total_training_steps or (
            cfg.trainer.total_epochs * self.sampler.steps_per_epoch
        )
        self.actor, self.ref, self.critic = build_models(
            cfg, self.arch, self.groups, env, self.total_steps
        )
        self.ctx = stages.StageContext(
            cfg,
            self.groups,
            vocab_shard(self.arch, self.actor.module, self.groups, rollout.temperature),
            use_thd(env),
        )
        self.budgets = token_budgets(cfg)
        self.kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl)
        self.stopper = EarlyStopper(EarlyStopSettings.from_config(cfg))
        self.checkpoints = CheckpointManager(
            run_dir / "checkpoints", cfg.trainer.max_actor_ckpt_to_keep
        )
        self.reward_fn = build_reward_fn(cfg.reward)
        self.profiler = StepProfiler.from_config(cfg)
        self.peak_flops = measure_matmul_flops(
            env.device, DTYPES[cfg.actor_rollout_ref.actor.megatron.dtype]
        )
        self.tracker = MetricTracker.from_config(cfg) if env.is_main else None
        num_val = len(self.val_data) if self.val_data is not None else 0
        self.fleet = RolloutFleet(
            cfg, env, run_dir, self.arch, max(cfg.data.train_batch_size, num_val)
        )

    # ---- weight sync ------------------------------------------------------------------

    def sync_weights(self, version: int) -> dict[str, float]:
        stats = self.fleet.sync(self.actor.module, version)
        metrics = {"perf/weight_sync_bytes": float(stats.num_bytes)}
        if stats.logprob_diff_max is not None:
            metrics["rollout/logprob_diff_max"] = stats.logprob_diff_max
        return metrics

    def close(self) -> None:
        self.fleet.shutdown()
        if self.tracker is not None:
            self.tracker.close()

    # ---- one step ---------------------------------------------------------------------

    def rollout(self, step: int, timer: Timer):
        sampled = self.sampler.next_batch()  # every rank advances its sampler identically
        prompts = [self.train_data[i] for i in sampled.prompt_indices]
        with timer.stage("gen"):
            batch, records, reward_s = self.fleet.generate(
                self.tokenizer, self.reward_fn, prompts, sampled.uids,
                sampled.prompt_indices, sampling_params(self.cfg),
            )  # fmt: skip
        if records is not None:  # rank 0: scoring ran inside the gen stage; report it apart
            write_records(records, self.run_dir / "rollouts" / f"step_{step}.jsonl")
            timer.seconds["gen"] -= reward_s
            timer.seconds["reward"] = reward_s
        return broadcast_batch(batch)

    def train_step(self, step: int) -> dict[str, float]:
        timer, ctx, budgets = Timer(), self.ctx, self.budgets
        start = time.perf_counter()
        batch = self.rollout(step, timer)
        with timer.stage("old_log_prob"):
            stages.compute_old_logprobs(self.actor, batch, ctx, budgets.actor)
        with timer.stage("ref"):
            stages.compute_ref_logprobs(self.ref, batch, ctx, budgets.ref)
        with timer.stage("values"):
            stages.compute_values(self.critic, batch, ctx, budgets.critic)
        with timer.stage("adv"):
            metrics = stages.compute_rewards_and_advantages(batch, self.cfg, self.kl_ctrl.value)
            self.kl_ctrl.update(metrics["actor/reward_kl_penalty"], batch.size)
        with timer.stage("update_critic"):
            metrics |= stages.update_critic(self.critic, batch, ctx, budgets.critic)
        with timer.stage("update_actor"):
            metrics |= stages.update_actor(self.actor, batch, ctx, budgets.actor)
        with timer.stage("update_weights"):
            metrics |= self.sync_weights(step)
        step_s = time.perf_counter() - start
        metrics |= rollout_metrics(batch, self.cfg.data.max_response_length)
        metrics |= timer.metrics() | {"timing_s/step": step_s}
        metrics |= self.perf_metrics(batch, step_s)
        metrics["actor/entropy_old"] = float(
            masked_mean(batch.tensors["old_entropy"], batch.mask_bt())
        )
        return metrics

    def perf_metrics(self, batch, step_s: float) -> dict[str, float]:
        tokens = sum(batch.sequence_lengths)
        world = self.env.world_size
        epochs = {
            "actor": self.cfg.actor_rollout_ref.actor.ppo_epochs,
            "critic": self.cfg.critic.ppo_epochs,
        }
        flops = ppo_step_flops(self.arch, tokens, tokens / batch.size, epochs)
        return {
            "perf/total_num_tokens": float(tokens),
            "perf/throughput": tokens / step_s / world,
            "perf/mfu": flops / step_s / (self.peak_flops * world),
        }

    # ---- validation -------------------------------------------------------------------

    def validate(self) -> dict[str, float]:
        metrics = None
        batch = self.fleet.validate(
            self.tokenizer,
            self.reward_fn,
            list(self.val_data.prompts),
            val_sampling_params(self.cfg),
        )
        if batch is not None:
            metrics = score_by_source(batch)
            metrics["val/test_score/all"] = float(batch.scores_b.mean())
        return broadcast_object(metrics)

    # ---- checkpoints ------------------------------------------------------------------

    def state_dict(self, step: int) -> dict:
        return {
            "step": step,
            "sampler": self.sampler.state_dict(),
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "early_stop": self.stopper.state_dict(),
            "actor_scheduler": self.actor.scheduler.state_dict(),
            "critic_scheduler": self.critic.scheduler.state_dict(),
        }

    def save_checkpoint(self, step: int) -> None:
        with self.checkpoints.writing(step) as tmp:
            if self.env.is_main:
                (tmp / "actor").mkdir()
                (tmp / "critic").mkdir()
            if dist.is_initialized():
                dist.barrier()
            self.actor.save(tmp / "actor")
            self.critic.save(tmp / "critic")
            save_trainer_state(tmp, self.state_dict(step), self.env.rank)
        log.info("checkpoint of step %d written to %s", step, self.checkpoints.path_for(step))

    def load_models(self, path: Path) -> dict:
        """Actor, critic (model + optimizer + LR schedule) and the trainer state at `path`."""
        self.actor.load(path / "actor")
        self.critic.load(path / "critic")
        state = load_trainer_state(path, self.env.rank)
        self.actor.scheduler.load_state_dict(state["actor_scheduler"])
        self.critic.scheduler.load_state_dict(state["critic_scheduler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        return state

    def resume(self) -> int:
        """Load the checkpoint `trainer.resume_mode` names; the step to continue after."""
        path = self.checkpoints.resolve_resume(self.cfg.trainer.resume_mode)
        if path is None:
            return 0
        state = self.load_models(path)
        self.sampler.load_state_dict(state["sampler"])
        self.stopper.load_state_dict(state["early_stop"])
        step = int(state["step"])
        self.sync_weights(step)  # the servers started from the HF weights
        log.info("resumed from %s (step %d)", path, step)
        return step

    def rollback(self, decision: Decision, step: int) -> dict[str, float]:
        """Back to the last good checkpoint's models; data order and step count go on."""
        good = self.stopper.last_good_step
        if good is None or good not in self.checkpoints.complete_steps():
            log.warning("rollback requested (%s) but no good checkpoint is kept", decision.reason)
            return {"early_stop/rollback_skipped": 1.0}
        self.load_models(self.checkpoints.path_for(good))
        self.sync_weights(step)
        log.warning("rolled back to the checkpoint of step %d: %s", good, decision.reason)
        return {"early_stop/rollback_to_step": float(good)}

    # ---- the loop ---------------------------------------------------------------------

    def fit(self) -> int:
        """Train to `total_steps` (or an early stop); returns the last step run."""
        cfg = self.cfg.trainer
        step = self.resume()
        if self.val_data is not None and cfg.val_before_train and step == 0:
            self.log(self.validate(), 0)
        bar = tqdm(
            total=self.total_steps, initial=step, desc="ppo", unit="step",
            disable=not (self.env.is_main and "console" in cfg.logger),
        )  # fmt: skip
        while step < self.total_steps:
            step += 1
            with self.profiler.step(step):
                metrics = self.train_step(step)
            decision = self.stopper.observe_step(
                step, metrics["actor/reward_kl_penalty"], metrics["critic/score/mean"]
            )
            last = step == self.total_steps or decision is not None
            save = (cfg.save_freq > 0 and step % cfg.save_freq == 0) or last
            if self.val_data is not None and (
                (cfg.test_freq > 0 and step % cfg.test_freq == 0) or last
            ):
                val = self.validate()
                metrics |= val
                decision = self.after_validation(step, val, metrics, save) or decision
            if decision is not None:
                metrics[f"early_stop/{decision.action}"] = 1.0
                log.warning("early stop at step %d: %s", step, decision.reason)
            if save or decision is not None:
                self.save_checkpoint(step)
            self.log(metrics, step)
            bar.update(1)
            if decision is not None and decision.action == "stop":
                break
        bar.close()
        return step

    def after_validation(self, step: int, val: dict, metrics: dict, saving: bool):
        """Rollback when validation falls behind training; else mark a good checkpoint."""
        decision = self.stopper.observe_validation(step, val["val/test_score/all"])
        if decision is not None and decision.action == "rollback":
            metrics |= self.rollback(decision, step)
            return None  # rolled back (or could not): training goes on
        if decision is None:
            kept = [s for s in self.checkpoints.complete_steps() if s <= step]
            if saving:
                self.stopper.mark_good(step)  # the checkpoint written at this step
            elif kept:
                self.stopper.mark_good(kept[-1])
        return decision

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracker is not None:
            self.tracker.log(metrics, step=step)
