"""The typed config tree. Key names follow verl's where verl has one.

Every field carries a one-line doc in `metadata["doc"]` and, where it has one, its allowed
range (`gt`, `ge`, `le`), checked by the loader so that the error names the full dotted key.
Cross-field rules live in `rlhf.config.validate`. Only keys that some code reads belong here;
the tree grows as features land. Strings may reference other keys as `${section.key}`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


def doc(default: Any, text: str, **kwargs: Any) -> Any:
    """A dataclass field with a default (or factory) and a one-line description."""
    if callable(default):
        return field(default_factory=default, metadata={"doc": text, **kwargs})
    return field(default=default, metadata={"doc": text, **kwargs})


@dataclass
class DataConfig:
    """Prompt data and batch sizes."""

    train_batch_size: int = doc(8, "prompts per training step (before rollout.n expansion)", gt=0)
    max_prompt_length: int = doc(128, "longest prompt in tokens", gt=0)
    max_response_length: int = doc(32, "most tokens generated per response", gt=0)
    seed: int = doc(1, "seed of the prompt order")
    train_files: str | list[str] | None = doc(
        None, "training Parquet: a path, a list, a glob or a URI (hdfs://, s3://, ...)"
    )
    val_files: str | list[str] | None = doc(None, "validation Parquet (same forms as train_files)")
    prompt_key: str = doc("prompt", "column holding the prompt (chat messages or a string)")
    apply_chat_template: bool = doc(True, "format prompts with the tokenizer's chat template")
    filter_overlong_prompts: bool = doc(
        False, "drop (and count) prompts longer than max_prompt_length"
    )
    truncation: Literal["left", "right", "error"] = doc(
        "error", "overlong prompts that are not filtered: keep the end, keep the start, or fail"
    )
    bad_rows: Literal["error", "skip"] = doc(
        "error", "invalid Parquet rows: fail naming them, or skip them (count + first rows logged)"
    )


@dataclass
class RewardConfig:
    """Rule rewards (per data_source) and user reward functions."""

    custom_fn: str | None = doc(
        None, "'path/to/file.py:function' replacing the rule rewards (runs that file's code)"
    )
    gsm8k_method: Literal["strict", "flexible"] = doc(
        "strict", "gsm8k rule: answer after '####' (strict) or the last number (flexible)"
    )
    format_score: float = doc(0.0, "rule rewards: score of a well-formed but wrong answer")
    correct_score: float = doc(1.0, "rule rewards: score of a correct answer")
    model_path: str | None = doc(
        None, "HF *ForSequenceClassification dir scoring reward_model.style=model rows"
    )


@dataclass
class ModelConfig:
    """The policy model (also the reference and, by default, the critic's trunk)."""

    path: str = doc("", "HF model directory (config.json, safetensors, tokenizer)")


@dataclass
class MegatronParallelConfig:
    """How one model is sharded with Megatron-Core."""

    tensor_model_parallel_size: int = doc(1, "TP: shards of every weight matrix", gt=0)
    pipeline_model_parallel_size: int = doc(1, "PP: consecutive groups of layers", gt=0)
    seed: int = doc(42, "seed for weight init and dropout (Megatron RNG tracker)")


@dataclass
class ActorConfig:
    """The trained policy."""

    ppo_mini_batch_size: int = doc(4, "prompts per optimizer step (x rollout.n samples)", gt=0)
    ppo_micro_batch_size_per_gpu: int = doc(2, "samples per forward/backward on one rank", gt=0)
    ulysses_sequence_parallel_size: int = doc(
        1, "Ulysses SP size; mapped onto Megatron's context-parallel group", gt=0
    )
    megatron: MegatronParallelConfig = doc(MegatronParallelConfig, "Megatron parallel layout")


@dataclass
class RefConfig:
    """The frozen reference policy; sharded like the actor."""

    log_prob_micro_batch_size_per_gpu: int = doc(
        4, "samples per reference forward on one rank", gt=0
    )


@dataclass
class RolloutConfig:
    """Generation with SGLang servers."""

    name: Literal["sglang"] = doc("sglang", "rollout engine")
    n: int = doc(2, "responses sampled per prompt", gt=0)
    temperature: float = doc(1.0, "sampling temperature", ge=0)
    top_p: float = doc(1.0, "nucleus sampling threshold", gt=0, le=1)
    top_k: int = doc(-1, "top-k sampling; -1 disables", ge=-1)
    tensor_model_parallel_size: int = doc(1, "TP size of each SGLang server", gt=0)
    gpu_memory_utilization: float = doc(
        0.6, "share of GPU memory SGLang may take (mem fraction)", gt=0, le=1
    )
    dtype: Literal["float32", "bfloat16", "float16"] = doc("bfloat16", "weights/activation dtype")
    server_startup_timeout_s: float = doc(
        300.0, "seconds to wait for a server to become healthy", gt=0
    )
    num_servers: int = doc(1, "SGLang servers to launch (ignored when server_urls is set)", gt=0)
    server_urls: list[str] | None = doc(
        None, "running SGLang servers to use instead of launching (never restarted)"
    )
    use_router: bool = doc(False, "send /generate through an sglang-router in front of the servers")
    max_concurrent_requests: int = doc(64, "most /generate requests in flight at once", gt=0)
    request_timeout_s: float = doc(600.0, "seconds one /generate request may take", gt=0)
    request_retries: int = doc(
        3, "retries of a request after a connection error, 5xx or timeout", ge=0
    )
    retry_backoff_s: float = doc(1.0, "delay before the first retry; doubles per retry", gt=0)
    max_server_restarts: int = doc(2, "restarts allowed per launched server before failing", ge=0)
    weight_sync_transport: Literal["tensor", "distributed", "disk"] = doc(
        "tensor", "how synced weights reach SGLang: shared memory, a process group, or files"
    )
    update_weights_bucket_megabytes: int = doc(
        512, "size bound of one weight-sync bucket (the extra memory a sync needs)", gt=0
    )
    weight_sync_snapshot: bool = doc(
        True, "keep the last synced weights on disk so a restarted server can be re-synced"
    )
    weight_sync_master_address: str = doc(
        "127.0.0.1", "address SGLang servers use to reach rank 0 (distributed transport)"
    )
    logprob_diff_threshold: float | None = doc(
        None, "fail the step when rollout/logprob_diff_max exceeds this (null: only log)", gt=0
    )


@dataclass
class ActorRolloutRefConfig:
    """Policy model, its optimisation, its rollout engine and its frozen reference."""

    model: ModelConfig = doc(ModelConfig, "policy model")
    actor: ActorConfig = doc(ActorConfig, "actor training")
    rollout: RolloutConfig = doc(RolloutConfig, "rollout generation")
    ref: RefConfig = doc(RefConfig, "reference policy")


@dataclass
class CriticConfig:
    """The value model."""

    ppo_mini_batch_size: int = doc(
        4, "prompts per critic optimizer step (x rollout.n samples)", gt=0
    )
    ppo_micro_batch_size_per_gpu: int = doc(2, "samples per forward/backward on one rank", gt=0)
    ulysses_sequence_parallel_size: int = doc(1, "Ulysses SP size for the critic", gt=0)
    megatron: MegatronParallelConfig = doc(MegatronParallelConfig, "Megatron parallel layout")


@dataclass
class KLControlConfig:
    """Coefficient of the KL penalty in the reward (Ziegler et al. 2019)."""

    type: Literal["fixed", "adaptive"] = doc("adaptive", "fixed coefficient or adaptive controller")
    kl_coef: float = doc(0.001, "initial (or fixed) KL coefficient beta", ge=0)
    target_kl: float = doc(0.1, "adaptive: KL the controller steers towards", gt=0)
    horizon: int = doc(10000, "adaptive: steps over which the error is corrected", gt=0)


@dataclass
class AlgorithmConfig:
    """PPO algorithm settings."""

    kl_ctrl: KLControlConfig = doc(KLControlConfig, "KL penalty controller")


@dataclass
class TrainerConfig:
    """Run bookkeeping and placement."""

    project_name: str = doc("rlhf", "project name (loggers)")
    experiment_name: str = doc("run", "experiment name (loggers, run directory)")
    default_local_dir: str = doc(
        "runs/${trainer.experiment_name}", "run directory: resolved config, logs, checkpoints"
    )
    nnodes: int = doc(1, "number of nodes", gt=0)
    n_gpus_per_node: int = doc(1, "processes per node (GPUs, or CPU ranks on CPU)", gt=0)
    device: Literal["auto", "cuda", "cpu"] = doc("auto", "cuda if available, else cpu")
    logger: list[Literal["console", "tensorboard", "wandb", "mlflow"]] = doc(
        lambda: ["console", "tensorboard"],
        "metric backends (metrics.jsonl in the run directory is always written)",
    )


@dataclass
class ProfilerConfig:
    """torch.profiler capture."""

    steps: list[int] | None = doc(None, "training steps to profile, e.g. [1,5,10]")


@dataclass
class RLHFConfig:
    """The whole run."""

    data: DataConfig = doc(DataConfig, "prompt data")
    reward: RewardConfig = doc(RewardConfig, "rule, custom and model rewards")
    actor_rollout_ref: ActorRolloutRefConfig = doc(ActorRolloutRefConfig, "policy, rollout, ref")
    critic: CriticConfig = doc(CriticConfig, "value model")
    algorithm: AlgorithmConfig = doc(AlgorithmConfig, "PPO algorithm")
    trainer: TrainerConfig = doc(TrainerConfig, "run bookkeeping")
    global_profiler: ProfilerConfig = doc(ProfilerConfig, "profiling")
