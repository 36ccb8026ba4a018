"""The config tree of `rlhf-train-rm`: a reward model trained from preference pairs.

Its own tree, not a mode of `RLHFConfig`: a reward-model run has no rollout, actor or
critic, and a key the config accepts must work. The trained model's section reuses the
trainer's Megatron layout and optimizer keys (`MegatronParallelConfig`, `OptimConfig`), so
TP, PP (with VP), Ulysses SP, DP, recompute, dtype and the distributed optimizer are set as
for the critic of a PPO run. Keys follow OpenRLHF's `train_rm` and TRL's `RewardTrainer`
where they have one.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.config.choices import Device, Logger
from rlhf.config.fields import doc
from rlhf.config.loader import ConfigError
from rlhf.config.schema import MegatronParallelConfig, OptimConfig
from rlhf.config.validate import (
    ModelShape,
    ParallelLayout,
    check_heads,
    check_model_split,
    check_recompute,
    checked_world_size,
    section_layout,
)


@dataclass
class PreferenceDataConfig:
    """Preference pairs (`rlhf.data.preference`: explicit or implicit prompt layout)."""

    train_files: str | list[str] | None = doc(
        None, "training pairs: Parquet (a path, a list, a glob or a URI)"
    )
    val_files: str | list[str] | None = doc(
        None, "held-out pairs for validation accuracy and loss (same forms)"
    )
    prompt_key: str = doc(
        "prompt", "column of the prompt (absent: implicit prompt, the responses' shared start)"
    )
    chosen_key: str = doc("chosen", "column of the preferred response (or whole conversation)")
    rejected_key: str = doc("rejected", "column of the other response (or whole conversation)")
    apply_chat_template: bool = doc(
        True, "message lists through the tokenizer's chat template; false: contents joined"
    )
    max_length: int = doc(512, "longest side of a pair in tokens (prompt + response)", gt=0)
    drop_overlong: bool = doc(
        False,
        "drop (and count) pairs with a side longer than max_length; false: refuse them "
        "naming file, row and column",
    )
    train_batch_size: int = doc(
        32, "pairs per optimizer step (a multiple of the data-parallel size)", gt=0
    )
    seed: int = doc(1, "seed of the pair order (a new permutation every epoch)")


@dataclass
class RewardModelSection:
    """The trained reward model: the trunk it starts from and how it is laid out."""

    path: str = doc(
        "",
        "HF directory to start from: a causal LM (a fresh seeded score head) or a "
        "*ForSequenceClassification model with num_labels=1 (its score head)",
    )
    max_token_len_per_gpu: int | None = doc(
        None,
        "tokens of one packed micro-batch per GPU; a pair is never split (null: 2 pairs of "
        "data.max_length, i.e. 4 x max_length)",
        gt=0,
    )
    grad_clip: float = doc(1.0, "clip the global gradient norm to this (0: off)", ge=0)
    optim: OptimConfig = doc(lambda: OptimConfig(lr=1e-5), "optimizer")
    ulysses_sequence_parallel_size: int = doc(1, "Ulysses SP size", gt=0)
    megatron: MegatronParallelConfig = doc(MegatronParallelConfig, "Megatron parallel layout")


@dataclass
class RewardTrainerConfig:
    """Run bookkeeping: the same meaning as in `rlhf-train`'s trainer section."""

    project_name: str = doc("rlhf", "project name (loggers)")
    experiment_name: str = doc("reward_model", "experiment name (loggers)")
    default_local_dir: str = doc(
        "runs/${trainer.experiment_name}",
        "run directory: resolved config, metrics, checkpoints, the exported reward_model_hf/",
    )
    nnodes: int = doc(1, "number of nodes", gt=0)
    n_gpus_per_node: int = doc(1, "processes per node (GPUs, or CPU ranks on CPU)", gt=0)
    device: Device = doc("auto", "cuda if available, else cpu")
    logger: list[Logger] = doc(
        lambda: ["console", "tensorboard"],
        "metric backends (metrics.jsonl in the run directory is always written)",
    )
    total_epochs: int = doc(1, "passes over the training pairs", gt=0)
    total_training_steps: int | None = doc(
        None, "optimizer steps to run (null: total_epochs x pairs // train_batch_size)", gt=0
    )
    test_freq: int = doc(-1, "validate every this many steps (-1: only at the end)")
    val_before_train: bool = doc(True, "validate once before the first step")
    save_freq: int = doc(-1, "checkpoint every this many steps (-1: only at the end)")
    resume_mode: str = doc(
        "auto", "auto (latest checkpoint in the run dir), disable, or a checkpoint path"
    )
    max_ckpt_to_keep: int | None = doc(
        None, "keep only the newest K checkpoints (null: keep all)", gt=0
    )


@dataclass
class RewardModelRunConfig:
    """A whole reward-model run."""

    data: PreferenceDataConfig = doc(PreferenceDataConfig, "preference pairs")
    model: RewardModelSection = doc(RewardModelSection, "the trained reward model")
    trainer: RewardTrainerConfig = doc(RewardTrainerConfig, "run bookkeeping")


def token_budget(cfg: RewardModelRunConfig) -> int:
    """Tokens of one micro-batch per GPU (`model.max_token_len_per_gpu`)."""
    return cfg.model.max_token_len_per_gpu or 4 * cfg.data.max_length


def validate_reward_training(
    cfg: RewardModelRunConfig, world_size: int | None = None, shape: ModelShape | None = None
) -> ParallelLayout:
    """Every cross-field rule of a reward-model run; its parallel layout."""
    world = checked_world_size(cfg.trainer, world_size)
    layout = section_layout(cfg.model, "model", world)
    check_recompute(cfg.model.megatron, "model.megatron", shape)
    if shape is not None:
        check_model_split(layout, shape, "model")
        check_heads(layout, shape, "model")
    if not cfg.model.path:
        raise ConfigError("model.path: required (an HF model directory)")
    if not cfg.data.train_files:
        raise ConfigError("data.train_files: required (Parquet preference pairs)")
    if cfg.data.train_batch_size % layout.dp_size:
        raise ConfigError(
            f"data.train_batch_size ({cfg.data.train_batch_size}) must be a multiple of the "
            f"data-parallel size {layout.dp_size} ({layout.describe()}): each DP rank takes "
            "whole pairs"
        )
    if token_budget(cfg) < 2 * cfg.data.max_length:
        raise ConfigError(
            f"model.max_token_len_per_gpu={cfg.model.max_token_len_per_gpu} cannot hold a pair "
            f"of two data.max_length={cfg.data.max_length} sequences (a pair is never split)"
        )
    return layout
