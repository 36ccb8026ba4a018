"""`rlhf-train-rm`: a reward model trained on preference pairs with Megatron-Core.

The model is the critic's (`value_model_from_hf`: a trunk with a one-output head, laid out
over TP, PP with VP, Ulysses SP and DP exactly as the PPO trainer lays out its critic), and
so are its optimizer, micro-batching and checkpoints (`TrainableMegatronModel`,
`MicroBatchPlanner`, `CheckpointManager`). A step takes `data.train_batch_size` pairs of a
seeded per-epoch permutation, packs both sides of each pair into one micro-batch (the
Bradley-Terry loss compares them; `MicroBatchPlanner.plan_units`) and takes one optimizer
step on the loss averaged over the pairs (`PairLossHead`). A side's score is the head's
output at its last token, what HF's `*ForSequenceClassification` pools.

Validation scores every held-out pair (forward only) and logs val/rm/{loss,accuracy,...}.
A checkpoint is `global_step_N/reward_model/` (the layout `rlhf-convert mcore-to-hf` reads,
head "score") and the trainer state (step, tracker runs, the data order's inputs); a resumed
run continues the same permutation at the next step. At the end the last checkpoint is
exported to `<run dir>/reward_model_hf`, an HF `*ForSequenceClassification` directory that
PPO takes as `reward.model_path`.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from rlhf.checkpoint import CheckpointManager
from rlhf.checkpoint.state import load_trainer_state, read_trainer_state, save_trainer_state
from rlhf.config.loader import config_to_dict
from rlhf.config.reward_training import RewardModelRunConfig, token_budget
from rlhf.config.validate import distributed_optimizer_on, virtual_pipeline_size
from rlhf.data.files import resolve_files
from rlhf.data.preference import TokenizedPair, read_preference_pairs, tokenize_pairs
from rlhf.distributed.context import ParallelContext
from rlhf.engine.build import offload_kinds, use_thd
from rlhf.engine.engine import OptimizerSettings, TrainableMegatronModel
from rlhf.engine.heads import PairLossHead, SequenceScoreHead
from rlhf.engine.micro_batch import MicroBatchPlanner
from rlhf.logging import MetricTracker
from rlhf.models.builder import value_model_from_hf
from rlhf.models.families import ModelArch, Recompute
from rlhf.models.mapping import Placement
from rlhf.models.moe_arch import MoERouter
from rlhf.rollout.batch import RolloutBatch
from rlhf.trainer.export import export_hf, write_export_files
from rlhf.trainer.metrics import tracker_resume, tracker_state
from rlhf.trainer.preflight import check_pair_order, check_pairs_fill_a_batch
from rlhf.utils import torch_dtype

log = logging.getLogger(__name__)

MODEL_DIR = "reward_model"  # inside each checkpoint
EXPORT_DIR = "reward_model_hf"  # inside the run directory
ORDER_KEYS = ("pairs", "train_batch_size", "seed")  # what the data order depends on


def pair_batch(pairs: list[TokenizedPair]) -> RolloutBatch:
    """The 2P sides of `pairs` as samples: pair p's chosen side is sample 2p, its rejected
    side 2p + 1; the tokens both share are the samples' prompt."""
    prompts = [pair.shared for pair in pairs for _ in range(2)]
    responses = [side for pair in pairs for side in (pair.chosen, pair.rejected)]
    return RolloutBatch(
        prompt_ids=prompts,
        response_ids=responses,
        scores_b=torch.zeros(len(responses)),
        data_sources=["preference"] * len(responses),
        uids=[f"pair{i // 2}" for i in range(len(responses))],
    )


def load_pairs(cfg: RewardModelRunConfig, key: str, tokenizer: Any) -> list[TokenizedPair]:
    """The tokenized pairs of `data.<key>` (train_files or val_files)."""
    data = cfg.data
    files = resolve_files(getattr(data, key), f"data.{key}")
    pairs = read_preference_pairs(files, data.prompt_key, data.chosen_key, data.rejected_key)
    tokenized, dropped = tokenize_pairs(
        pairs,
        tokenizer,
        data.apply_chat_template,
        data.max_length,
        data.drop_overlong,
        (data.chosen_key, data.rejected_key),
    )
    if dropped:
        log.warning(
            "data.%s: %d of %d pairs dropped (a side over max_length)", key, dropped, len(pairs)
        )
    return tokenized


class RewardModelTrainer:
    """One reward-model run on this rank (every rank builds one; collectives inside)."""

    def __init__(
        self, cfg: RewardModelRunConfig, ctx: ParallelContext, run_dir: Path, arch: ModelArch
    ):
        from transformers import AutoTokenizer

        self.cfg, self.ctx, self.run_dir, self.arch = cfg, ctx, run_dir, arch
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.train_pairs = load_pairs(cfg, "train_files", tokenizer)
        self.val_pairs = load_pairs(cfg, "val_files", tokenizer) if cfg.data.val_files else []
        size = cfg.data.train_batch_size
        self.steps_per_epoch = len(self.train_pairs) // size
        check_pairs_fill_a_batch(size, len(self.train_pairs))
        epochs = cfg.trainer.total_epochs
        self.total_steps = cfg.trainer.total_training_steps or epochs * self.steps_per_epoch
        self.model = self._build_model()
        self.planner = MicroBatchPlanner(
            ctx, use_thd(ctx), interleaved=virtual_pipeline_size(cfg.model.megatron) > 1
        )
        self.budget = token_budget(cfg)
        self.manager = CheckpointManager(run_dir / "checkpoints", cfg.trainer.max_ckpt_to_keep)
        self.resume_path = self.manager.resolve_resume(cfg.trainer.resume_mode)
        self.tracker = None
        if ctx.is_main:
            resume = tracker_resume(self.resume_path, self.manager.root)
            self.tracker = MetricTracker.from_config(cfg.trainer, config_to_dict(cfg), resume)

    def _build_model(self) -> TrainableMegatronModel:
        cfg, ctx = self.cfg, self.ctx
        megatron = cfg.model.megatron
        module, _ = value_model_from_hf(
            cfg.model.path,
            Placement.of(ctx),
            vp_size=virtual_pipeline_size(megatron),
            seed=megatron.seed,
            params_dtype=torch_dtype(megatron.dtype),
            sp=ctx.sp_size,
            recompute=Recompute.of(megatron),
            overrides=megatron.override_transformer_config,
            sequence_parallel=ctx.sequence_parallel,
            router=MoERouter.of(megatron),
        )
        distributed = distributed_optimizer_on(megatron, ctx.dp_sp_size)
        settings = OptimizerSettings(
            cfg.model.optim, cfg.model.grad_clip, self.total_steps, distributed
        )
        model = TrainableMegatronModel(module.to(ctx.device), ctx, settings)
        model.offload_between_uses(offload_kinds(megatron), "reward_model")
        return model

    def step_pairs(self, step: int) -> list[int]:
        """The training pairs of `step` (from 1): a slice of its epoch's seeded permutation."""
        epoch, index = divmod(step - 1, self.steps_per_epoch)
        generator = torch.Generator().manual_seed(self.cfg.data.seed + epoch)
        order = torch.randperm(len(self.train_pairs), generator=generator)
        size = self.cfg.data.train_batch_size
        return order[index * size : (index + 1) * size].tolist()

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step on the pairs of `step`; its metrics (the same on every rank)."""
        pairs = [self.train_pairs[i] for i in self.step_pairs(step)]
        batch = pair_batch(pairs)
        units = [[2 * p, 2 * p + 1] for p in range(len(pairs))]
        micro_batches = self.planner.plan_units(batch, self.budget, units)
        head = PairLossHead(torch.tensor([p.margin for p in pairs]), len(pairs))
        update = self.model.train_mini_batch(micro_batches, head)
        if update.skipped:
            raise FloatingPointError(f"step {step}: a gradient of the reward model is not finite")
        return {**update.outputs, "rm/lr": update.lr, "rm/grad_norm": update.grad_norm}

    def scores(self, pairs: list[TokenizedPair]) -> tuple[torch.Tensor, torch.Tensor]:
        """[P] chosen and [P] rejected scores (forward only, every rank gets them all)."""
        dp = self.ctx.dp_size
        padded = pairs + [pairs[0]] * (-len(pairs) % dp)  # whole pairs on every DP rank
        (scores,) = self.planner.per_sample(
            self.model, pair_batch(padded), self.budget, SequenceScoreHead(), ("scores",), 1
        )
        scores = scores[: 2 * len(pairs), 0]
        return scores[0::2], scores[1::2]

    def validate(self) -> dict[str, float]:
        """val/rm/* over every held-out pair; empty without data.val_files."""
        if not self.val_pairs:
            return {}
        from rlhf.algo.preference import bradley_terry_loss

        chosen, rejected = self.scores(self.val_pairs)
        margins = torch.tensor([p.margin for p in self.val_pairs])
        _, metrics = bradley_terry_loss(chosen, rejected, margins)
        return {f"val/{name}": float(value) for name, value in metrics.items()}

    def save(self, step: int) -> None:
        """The checkpoint of `step` (all ranks), published atomically."""
        ctx = self.ctx
        with self.manager.writing(step) as tmp:
            model_dir = tmp / MODEL_DIR
            model_dir.mkdir(parents=True, exist_ok=True)
            self.model.save(model_dir)
            if ctx.is_main:
                write_export_files(
                    model_dir,
                    self.cfg.model.path,
                    self.arch,
                    self.model.module.padded_vocab_size,
                    torch_dtype(self.cfg.model.megatron.dtype),
                    Placement.of(ctx),
                    "score",
                )
            state = {
                "step": step,
                "scheduler": self.model.scheduler.state_dict(),
                **self.order_state(),
                **tracker_state(self.tracker),
            }
            save_trainer_state(tmp, state, ctx.rank)
        log.info("checkpoint of step %d written to %s", step, self.manager.path_for(step))

    def order_state(self) -> dict[str, int]:
        data = self.cfg.data
        return {
            "pairs": len(self.train_pairs),
            "train_batch_size": data.train_batch_size,
            "seed": data.seed,
        }

    def resume(self) -> int:
        """The step the run goes on from (0: a new run): the checkpoint's model, optimizer,
        LR schedule and RNG states loaded, its data order checked to be this run's."""
        path = self.resume_path
        if path is None:
            return 0
        check_pair_order(path, read_trainer_state(path), self.order_state())
        self.model.load(path / MODEL_DIR)
        state = load_trainer_state(path, self.ctx.rank)
        self.model.scheduler.load_state_dict(state["scheduler"])
        step = int(state["step"])
        log.info("resumed from %s at step %d", path, step)
        return step

    def fit(self) -> int:
        """Train to the last step (validating and checkpointing as configured), export the
        model to HF; the last step."""
        trainer = self.cfg.trainer
        start = self.resume()
        if start == 0 and trainer.val_before_train:
            self.log(self.validate(), 0)
        step = start
        for step in range(start + 1, self.total_steps + 1):
            metrics = self.train_step(step)
            last = step == self.total_steps
            if last or (trainer.test_freq > 0 and step % trainer.test_freq == 0):
                metrics |= self.validate()
            self.log(metrics | {"rm/epoch": (step - 1) // self.steps_per_epoch}, step)
            if last or (trainer.save_freq > 0 and step % trainer.save_freq == 0):
                self.save(step)
        if step not in self.manager.complete_steps():
            self.save(step)
        self.export(step)
        return step

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracker is not None and metrics:
            self.tracker.log(metrics, step)

    def export(self, step: int) -> Path:
        """`<run dir>/reward_model_hf` from the checkpoint of `step` (main rank; replaced only
        once the new export is complete)."""
        out = self.run_dir / EXPORT_DIR
        if self.ctx.is_main:
            fresh = out.with_name(f"{EXPORT_DIR}.step_{step}")
            shutil.rmtree(fresh, ignore_errors=True)
            export_hf(self.manager.path_for(step) / MODEL_DIR, fresh)
            old = out.with_name(f"{EXPORT_DIR}.old")
            if out.exists():
                os.replace(out, old)
            os.replace(fresh, out)
            shutil.rmtree(old, ignore_errors=True)
            log.info("reward model of step %d exported to %s", step, out)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        return out

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
