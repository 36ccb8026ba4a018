"""The typed config tree. Key names follow verl's where verl has one.

Every field carries a one-line doc in `metadata["doc"]` (`rlhf.config.fields.doc`; the
`algorithm` section lives in `rlhf.config.algorithm`) and, where it has one, its allowed
range (`gt`, `ge`, `lt`, `le`), checked by the loader so that the error names the full
dotted key. Cross-field rules live in `rlhf.config.validate`, allowed-value lists in
`rlhf.config.choices`. Only keys that some code reads belong here; the tree grows as
features land. Strings may reference other keys as `${section.key}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf.config.algorithm import AlgorithmConfig
from rlhf.config.choices import (
    BadRows,
    Device,
    GSM8KMethod,
    KLLossType,
    Logger,
    LossAggMode,
    LRDecayStyle,
    OnNonFinite,
    PolicyLossMode,
    RecomputeGranularity,
    RecomputeMethod,
    RolloutMode,
    RouterReplayMode,
    TokenDropPolicy,
    TrainDtype,
    Truncation,
)
from rlhf.config.fields import doc
from rlhf.config.rollout import AsyncRolloutConfig, RolloutConfig


@dataclass
class DataConfig:
    """Prompt data and batch sizes."""

    train_batch_size: int = doc(8, "prompts per training step (before rollout.n expansion)", gt=0)
    max_prompt_length: int = doc(128, "longest prompt in tokens", gt=0)
    max_response_length: int = doc(512, "most tokens generated per response", gt=0)
    seed: int = doc(1, "seed of the prompt order")
    train_files: str | list[str] | None = doc(
        None, "training Parquet: a path, a list, a glob or a URI (hdfs://, s3://, ...)"
    )
    val_files: str | list[str] | None = doc(None, "validation Parquet (same forms as train_files)")
    rollout_files: str | list[str] | None = doc(
        None,
        "stored rollouts to train from (Parquet in the format each step writes as "
        "rollouts/step_N.parquet, rlhf/data/rollout_files.py; same forms as train_files)",
    )
    stored_fraction: float = doc(
        1.0,
        "with rollout_files: the share of each step's prompt groups taken from them (times "
        "train_batch_size must be a whole number); the rest is generated from train_files",
        gt=0,
        le=1,
    )
    prompt_key: str = doc("prompt", "column holding the prompt (chat messages or a string)")
    apply_chat_template: bool = doc(True, "format prompts with the tokenizer's chat template")
    use_sequence_packing: bool = doc(
        True,
        "a micro-batch's samples back to back with no padding; false: each padded to the "
        "micro-batch's longest, the padding computed and masked (verl's padded batches)",
    )
    filter_overlong_prompts: bool = doc(
        False, "drop (and count) prompts longer than max_prompt_length"
    )
    truncation: Truncation = doc(
        "error", "overlong prompts that are not filtered: keep the end, keep the start, or fail"
    )
    bad_rows: BadRows = doc(
        "error", "invalid Parquet rows: fail naming them, or skip them (count + first rows logged)"
    )


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping: a length penalty over the last tokens before the limit."""

    enable: bool = doc(False, "add the penalty to the training scores")
    len: int = doc(
        4, "the buffer: the penalty grows linearly over the last `len` response tokens", gt=0
    )
    penalty_factor: float = doc(1.0, "the penalty at data.max_response_length tokens", ge=0)


@dataclass
class RewardConfig:
    """Rule rewards (per data_source), user reward functions, reward models and endpoints."""

    custom_fn: str | None = doc(
        None, "'path/to/file.py:function' replacing the rule rewards (runs that file's code)"
    )
    gsm8k_method: GSM8KMethod = doc(
        "strict", "gsm8k rule: answer after '####' (strict) or the last number (flexible)"
    )
    format_score: float = doc(
        0.0,
        "gsm8k and MATH rules: score of a well-formed but wrong answer (the math_dapo, math "
        "and aime rules score any wrong or missing answer -1, as verl's math_dapo)",
    )
    correct_score: float = doc(1.0, "rule rewards: score of a correct answer")
    model_path: str | None = doc(
        None,
        "HF *ForSequenceClassification dir scoring reward_model.style=model rows (run by the "
        "trainer ranks, sharded like the actor)",
    )
    url: str | None = doc(
        None, "remote reward endpoint scoring the style=model rows instead (POST of a batch)"
    )
    model_scores_every_row: bool = doc(
        False,
        "the reward model (model_path or url) scores every row, whatever its "
        "reward_model.style: no rule rewards (verl's reward_model.enable)",
    )
    request_timeout_s: float = doc(120.0, "seconds one reward.url request may take", gt=0)
    request_retries: int = doc(3, "retries of a failed reward.url request", ge=0)
    num_workers: int = doc(
        1,
        "processes scoring rule rewards in parallel (1: the built-in rules in the generating "
        "process; a custom_fn always runs in worker processes)",
        gt=0,
    )
    timeout_s: float = doc(
        30.0,
        "seconds one call of the reward function may take (custom_fn, or num_workers > 1); "
        "then the run stops naming the sample",
        gt=0,
    )
    overlong_buffer: OverlongBufferConfig = doc(OverlongBufferConfig, "overlong shaping")


@dataclass
class ModelConfig:
    """The policy model (also the reference and, by default, the critic's trunk)."""

    path: str = doc("", "HF model directory (config.json, safetensors, tokenizer)")
    lora_rank: int = doc(
        0,
        "LoRA: the rank of the adapters trained instead of the weights (0: off; the "
        "reference is then the base model with the adapters off)",
        ge=0,
    )
    lora_alpha: float = doc(
        16.0, "LoRA: the adapters' update is scaled by lora_alpha / lora_rank", gt=0
    )
    lora_dropout: float = doc(0.0, "LoRA: dropout on each adapter's input", ge=0, lt=1)
    target_modules: str | list[str] = doc(
        "all-linear",
        "LoRA: the layers adapted: all-linear (every linear layer of the decoder), HF "
        "projection names (q_proj, k_proj, v_proj together; gate_proj, up_proj together; "
        "o_proj; down_proj) or Megatron's (linear_qkv, linear_proj, linear_fc1, linear_fc2)",
    )
    lora_merge: bool = doc(
        False,
        "LoRA: each weight sync sends the servers the base weights with the adapters merged "
        "in (false: only the adapters, which SGLang serves on top of the base model it "
        "loaded; verl's model.lora.merge)",
    )


@dataclass
class MegatronParallelConfig:
    """How one model is laid out with Megatron-Core: its shards and its training dtype."""

    tensor_model_parallel_size: int = doc(1, "TP: shards of every weight matrix", gt=0)
    pipeline_model_parallel_size: int = doc(1, "PP: consecutive groups of layers", gt=0)
    virtual_pipeline_model_parallel_size: int | None = doc(
        None,
        "interleaved pipeline: each PP stage holds this many chunks of L / (PP x VP) layers "
        "(Megatron's interleaved 1F1B: a bubble VP times smaller); null: one chunk per stage",
        gt=0,
    )
    seed: int = doc(42, "seed for weight init and dropout (Megatron RNG tracker)")
    # None only until loaded: `rlhf.config.loader.resolve_unset` sets it by trainer.device
    dtype: TrainDtype = doc(
        None,
        "weights and activations; bfloat16 keeps fp32 master weights, Adam state and "
        "gradient reduction (Megatron's mixed precision; the reference follows the actor); "
        "unset: bfloat16 on GPUs, float32 on the CPU",
    )
    sequence_parallel: bool | None = doc(
        None,
        "Megatron's sequence parallelism: the activations outside the TP-split layers (norms, "
        "residuals, the linears' inputs) split over the TP ranks along the sequence (null: on "
        "when TP > 1; no effect at TP 1)",
    )
    use_distributed_optimizer: bool | None = doc(
        None,
        "shard the fp32 master weights and Adam state over the data-parallel ranks "
        "(DP x Ulysses SP; null: on when there is more than one)",
    )
    recompute_granularity: RecomputeGranularity | None = doc(
        None,
        "activation recompute: full (whole layers) or selective (core attention); null: off",
    )
    recompute_method: RecomputeMethod | None = doc(
        None, "full recompute: uniform (every recompute_num_layers) or block (the first N)"
    )
    recompute_num_layers: int | None = doc(
        None, "full recompute: layers per recomputed unit (uniform) or per stage (block)", gt=0
    )
    expert_model_parallel_size: int = doc(
        1, "EP: mixture-of-experts models' routed experts split over this many ranks", gt=0
    )
    expert_tensor_parallel_size: int | None = doc(
        None, "expert-TP: each routed expert's MLP split over this many ranks (null: TP)", gt=0
    )
    moe_aux_loss_coeff: float = doc(
        0.0,
        "MoE: coefficient of Megatron's load-balancing loss (aux_loss: over each micro-batch's "
        "tokens, averaged over micro-batches and DP ranks); 0: off",
        ge=0,
    )
    moe_z_loss_coeff: float | None = doc(
        None, "MoE: coefficient of the router z-loss (Megatron's; null: off)", ge=0
    )
    moe_expert_capacity_factor: float | None = doc(
        None,
        "MoE token dropping: each expert takes at most factor x its even share of a "
        "micro-batch's routed tokens, the rest is dropped (null: no dropping)",
        gt=0,
    )
    moe_token_drop_policy: TokenDropPolicy = doc(
        "probs", "MoE token dropping: keep the tokens of highest probability, or the first"
    )
    param_offload: bool = doc(False, "GPU: parameters on pinned CPU memory while not in use")
    grad_offload: bool = doc(False, "GPU: gradient buffers on pinned CPU memory while not in use")
    optimizer_offload: bool = doc(
        False, "GPU: master weights and Adam state on pinned CPU memory while not in use"
    )
    override_transformer_config: dict[str, Any] = doc(
        dict,
        "further fields of Megatron-Core's TransformerConfig as they are (verl's key; e.g. "
        "apply_rope_fusion: true), checked against its fields; those set from config.json or "
        "this system's keys are refused, recompute_* and sequence_parallel mean the keys above",
    )


@dataclass
class OptimConfig:
    """Adam with a learning-rate schedule (Megatron's optimizer and scheduler)."""

    lr: float = doc(1e-6, "peak learning rate", gt=0)
    lr_warmup_steps: int = doc(0, "optimizer steps of linear warmup from 0 to lr", ge=0)
    lr_decay_style: LRDecayStyle = doc(
        "constant", "decay after warmup, over the run's optimizer steps"
    )
    min_lr_ratio: float = doc(0.0, "lr decays to lr x min_lr_ratio", ge=0, le=1)
    weight_decay: float = doc(0.01, "decoupled weight decay (AdamW)", ge=0)
    betas: list[float] = doc(lambda: [0.9, 0.999], "Adam beta1, beta2")


@dataclass
class PolicyLossConfig:
    """Which clipped surrogate the actor minimises."""

    loss_mode: PolicyLossMode = doc(
        "vanilla",
        "vanilla: PPO's token ratio (clip_ratio_low/high, dual clip clip_ratio_c); gspo: "
        "the sequence-level ratio of GSPO (set clip_ratio_low/high ~3e-4/4e-4, "
        "loss_agg_mode seq-mean-token-mean)",
    )


@dataclass
class RouterReplayConfig:
    """Mixture-of-experts routing replay (verl's `router_replay`)."""

    mode: RouterReplayMode = doc(
        "disabled",
        "R2: the update's forwards take the experts the old-log-prob pass chose for each "
        "token instead of routing anew; R3 (rollout routing replay): the old-log-prob, "
        "reference and update forwards take the experts SGLang routed each token to",
    )


@dataclass
class ActorConfig:
    """The trained policy."""

    ppo_mini_batch_size: int = doc(4, "prompts per optimizer step (x rollout.n samples)", gt=0)
    ppo_micro_batch_size_per_gpu: int = doc(
        2, "sizes the default micro-batch token budget (x the longest prompt + response)", gt=0
    )
    ppo_max_token_len_per_gpu: int | None = doc(
        None,
        "token budget of one packed micro-batch (null: ppo_micro_batch_size_per_gpu x "
        "(data.max_prompt_length + data.max_response_length))",
        gt=0,
    )
    use_dynamic_bsz: bool = doc(
        True,
        "micro-batches packed to ppo_max_token_len_per_gpu tokens and balanced over the DP "
        "ranks; false: ppo_micro_batch_size_per_gpu samples each, in order (verl's fixed mode)",
    )
    ppo_epochs: int = doc(1, "passes over each step's rollouts", gt=0)
    clip_ratio: float = doc(0.2, "PPO clip epsilon", gt=0, le=1)
    clip_ratio_low: float | None = doc(None, "lower clip epsilon (null: clip_ratio)", ge=0, lt=1)
    clip_ratio_high: float | None = doc(None, "upper clip epsilon (null: clip_ratio)", ge=0)
    clip_ratio_c: float | None = doc(
        3.0, "dual-clip bound for negative advantages (null: off)", gt=1
    )
    loss_agg_mode: LossAggMode = doc(
        "token-mean", "how per-token losses are aggregated (rlhf/algo/losses.py)"
    )
    policy_loss: PolicyLossConfig = doc(PolicyLossConfig, "policy loss")
    entropy_coeff: float = doc(0.0, "weight of the entropy bonus", ge=0)
    use_kl_loss: bool = doc(False, "add kl_loss_coef x KL(actor || ref) to the actor's loss")
    kl_loss_coef: float = doc(0.001, "weight of the KL loss (use_kl_loss)", ge=0)
    kl_loss_type: KLLossType = doc(
        "low_var_kl", "KL estimator of the KL loss; a trailing + takes k2's gradient"
    )
    grad_clip: float = doc(1.0, "clip the global gradient norm to this (0: off)", ge=0)
    optim: OptimConfig = doc(OptimConfig, "optimizer")
    ulysses_sequence_parallel_size: int = doc(
        1, "Ulysses SP size; mapped onto Megatron's context-parallel group", gt=0
    )
    freeze_vision_tower: bool = doc(
        False,
        "a vision-language policy's vision tower keeps its loaded weights (no gradients or "
        "optimizer state for it); refused for a text policy",
    )
    megatron: MegatronParallelConfig = doc(MegatronParallelConfig, "Megatron parallel layout")
    router_replay: RouterReplayConfig = doc(RouterReplayConfig, "MoE routing replay")


@dataclass
class RefConfig:
    """The frozen reference policy; sharded like the actor."""

    log_prob_micro_batch_size_per_gpu: int | None = doc(
        None,
        "sizes the reference forward token budget (x the longest sequence); null, with the "
        "two keys below null too: the old-log-prob forward's micro-batches (the same model "
        "shape and memory)",
        gt=0,
    )
    log_prob_max_token_len_per_gpu: int | None = doc(
        None, "token budget of one reference forward micro-batch (null: see above)", gt=0
    )
    log_prob_use_dynamic_bsz: bool | None = doc(
        None,
        "token-budget micro-batches; false: log_prob_micro_batch_size_per_gpu samples each "
        "(null: as the old-log-prob forward)",
    )
    ulysses_sequence_parallel_size: int | None = doc(
        None, "Ulysses SP size of the reference (null: the actor's, which it must equal)", gt=0
    )
    param_offload: bool = doc(False, "GPU: keep the reference on pinned CPU memory between uses")


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
        4, "prompts per critic optimizer step (x rollout.n samples; unset: the actor's)", gt=0
    )
    ppo_micro_batch_size_per_gpu: int = doc(
        2, "sizes the default micro-batch token budget (x the longest prompt + response)", gt=0
    )
    ppo_max_token_len_per_gpu: int | None = doc(
        None, "token budget of one packed micro-batch (null: as for the actor)", gt=0
    )
    model: ModelConfig = doc(
        lambda: ModelConfig(path="${actor_rollout_ref.model.path}"),
        "critic trunk (an HF causal LM or *ForSequenceClassification directory)",
    )
    use_dynamic_bsz: bool = doc(
        True,
        "token-budget micro-batches; false: ppo_micro_batch_size_per_gpu samples each (unset: "
        "the actor's)",
    )
    ppo_epochs: int = doc(1, "passes over each step's rollouts (unset: the actor's)", gt=0)
    cliprange_value: float | None = doc(0.5, "value clipping around the old values (null: off)")
    loss_agg_mode: LossAggMode = doc(
        "token-mean", "how per-token value losses are aggregated (unset: the actor's)"
    )
    grad_clip: float = doc(1.0, "clip the global gradient norm to this (0: off)", ge=0)
    optim: OptimConfig = doc(lambda: OptimConfig(lr=1e-5), "optimizer")
    ulysses_sequence_parallel_size: int = doc(
        1, "Ulysses SP size for the critic (unset: the actor's)", gt=0
    )
    megatron: MegatronParallelConfig = doc(
        MegatronParallelConfig, "Megatron parallel layout (sizes unset: the actor's)"
    )


@dataclass
class EarlyStopConfig:
    """When a run stops or rolls back by itself (every event is logged with its reason)."""

    kl_threshold: float | None = doc(
        None, "mean KL per step counted as too high (null: 2 x algorithm.kl_ctrl.target_kl)", gt=0
    )
    kl_patience: int = doc(0, "stop after this many consecutive high-KL steps (0: off)", ge=0)
    reward_plateau_patience: int = doc(
        0, "stop when the training reward has not improved for this many steps (0: off)", ge=0
    )
    reward_plateau_min_delta: float = doc(0.01, "smallest reward gain counted as improvement", ge=0)
    rollback_val_ratio: float | None = doc(
        None,
        "roll back to the last good checkpoint when the validation reward falls below this "
        "ratio of the training reward since the previous validation (null: off)",
        gt=0,
        le=1,
    )
    ppo_kl_bound: float | None = doc(
        None, "stop a step's PPO epochs early once a mini-batch's ppo_kl exceeds this", gt=0
    )


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
    device: Device = doc("auto", "cuda if available, else cpu")
    save_hf: bool = doc(
        False,
        "also write HF copies of the actor and critic at each checkpoint (global_step_N/"
        "actor_hf, critic_hf; converted on rank 0 by a CPU process that holds a whole model)",
    )
    logger: list[Logger] = doc(
        lambda: ["console", "tensorboard"],
        "metric backends (metrics.jsonl in the run directory is always written)",
    )
    total_epochs: int = doc(1, "passes over the training prompts", gt=0)
    total_training_steps: int | None = doc(
        None, "steps to run (null: total_epochs x steps per epoch)", gt=0
    )
    test_freq: int = doc(-1, "validate every this many steps (-1: never; also at the end)")
    val_before_train: bool = doc(True, "validate once before the first step")
    save_freq: int = doc(-1, "checkpoint every this many steps (-1: only at the end)")
    critic_warmup: int = doc(
        0,
        "steps at the start in which only the critic trains: the actor is not updated (its "
        "weights, optimizer state and LR schedule stay), as verl's critic_warmup",
        ge=0,
    )
    async_save: bool = doc(
        False,
        "write checkpoints in the background: the step waits only for a snapshot in host "
        "memory, the pointer moves when every rank's files are written "
        "(checkpoint/background.py)",
    )
    resume_mode: str = doc(
        "auto", "auto (latest checkpoint in the run dir), disable, or a checkpoint path"
    )
    resume_accept_changes: list[str] = doc(
        list,
        "keys (or whole sections, e.g. algorithm) whose change from the checkpoint's config a "
        "resume accepts; other changes to what is trained are refused (trainer/preflight.py)",
    )
    max_actor_ckpt_to_keep: int | None = doc(
        None, "keep only the newest K checkpoints (null: keep all)", gt=0
    )
    early_stop: EarlyStopConfig = doc(EarlyStopConfig, "early stopping and rollback")
    preemption_grace_s: float = doc(
        30.0,
        "seconds from SIGTERM to the scheduler's SIGKILL (SLURM KillWait, Kubernetes "
        "terminationGracePeriodSeconds): on SIGTERM the run ends after the current step, "
        "with a checkpoint when one fits in what is left (0: never)",
        ge=0,
    )
    rollout_mode: RolloutMode = doc(
        "sync",
        "sync: each step generates its batch, then trains; one_step_off: the servers generate "
        "step N+1's batch while step N trains (weights synced between batches); async: they "
        "keep trainer.async_rollout.max_staleness batches ahead, paused around each weight "
        "sync (both need disaggregated servers, rollout.server_urls)",
    )
    async_rollout: AsyncRolloutConfig = doc(AsyncRolloutConfig, "rollout_mode=async settings")
    on_nonfinite: OnNonFinite = doc(
        "stop",
        "a NaN/inf in a step's log-probs, values, advantages, losses or gradients: stop the "
        "run with one line naming it, or skip that update (weights stay as they were)",
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
