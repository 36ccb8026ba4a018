"""The `actor_rollout_ref.rollout` section: generation with SGLang servers (its own module to
keep rlhf/config/schema.py within the file-size rule)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf.config.choices import (
    RolloutDtype,
    RolloutName,
    ToolCallFormat,
    TruncateSide,
    WeightSyncTransport,
)
from rlhf.config.fields import doc


@dataclass
class ValKwargs:
    """Sampling for validation (verl's `rollout.val_kwargs`)."""

    do_sample: bool = doc(False, "sample (true) or decode greedily (false)")
    n: int = doc(1, "responses per validation prompt", gt=0)
    temperature: float = doc(0.0, "sampling temperature when do_sample", ge=0)
    top_p: float = doc(1.0, "nucleus threshold when do_sample", gt=0, le=1)
    top_k: int = doc(-1, "top-k when do_sample; -1 disables", ge=-1)


@dataclass
class EngineKwargs:
    """Arguments passed to the rollout engine as they are."""

    sglang: dict[str, Any] = doc(
        dict,
        "extra SGLang server arguments by their ServerArgs name (chunked_prefill_size: 4096); "
        "checked against SGLang's parser",
    )


@dataclass
class MultiTurnConfig:
    """Conversations with tool calls (verl's `rollout.multi_turn`; rlhf/rollout/multi_turn.py)."""

    enable: bool = doc(
        False,
        "each response is a conversation: the policy's tool calls run and their results are "
        "appended as tool messages before it goes on (needs tool_config_path)",
    )
    tool_config_path: str | None = doc(
        None,
        "YAML file listing the tools in verl's layout (tools: [{class_name, config, "
        "tool_schema}], rlhf/tools/base.py); their schemas are shown in the prompt",
    )
    format: ToolCallFormat = doc(
        "hermes", "how a turn writes tool calls: <tool_call>{JSON}</tool_call> (Qwen2.5, Qwen3)"
    )
    max_assistant_turns: int = doc(5, "most policy turns in one conversation", gt=0)
    max_user_turns: int = doc(5, "most rounds of tool messages in one conversation", gt=0)
    max_parallel_calls: int = doc(
        1, "most tool calls run per turn (concurrently); further calls answer an error", gt=0
    )
    max_tool_response_length: int = doc(
        256, "characters of one tool result the policy reads; longer ones are cut", gt=0
    )
    tool_response_truncate_side: TruncateSide = doc(
        "middle",
        "where an overlong tool result is cut: left keeps its end, right its start, middle "
        "both ends",
    )
    tool_timeout_s: float = doc(
        60.0,
        "seconds one tool call may take; then the policy reads a timeout error (this "
        "system's key, verl has none)",
        gt=0,
    )


@dataclass
class RolloutConfig:
    """Generation with SGLang servers."""

    name: RolloutName = doc("sglang", "rollout engine")
    n: int = doc(1, "responses sampled per prompt", gt=0)
    temperature: float = doc(1.0, "sampling temperature", ge=0)
    top_p: float = doc(1.0, "nucleus sampling threshold", gt=0, le=1)
    top_k: int = doc(-1, "top-k sampling; -1 disables", ge=-1)
    sampling_seed: int | None = doc(
        None,
        "seed every sampled request: sample j of a prompt drawn as uid u (epoch:row) gets a "
        "seed derived from (this, u, j), so a resumed run samples what the uninterrupted one "
        "did (SGLang's sampling_seed; on CPU through rlhf's SGLang plugin, on GPU the servers "
        "it launches run --enable-deterministic-inference); null: unseeded",
        ge=0,
    )
    tensor_model_parallel_size: int = doc(1, "TP size of each SGLang server", gt=0)
    gpu_memory_utilization: float = doc(
        0.6, "share of GPU memory SGLang may take (mem fraction)", gt=0, le=1
    )
    free_cache_engine: bool = doc(
        True,
        "GPU, colocated: SGLang releases its weights and KV cache while the trainer trains "
        "and resumes them for generation (sleep/wake); CPU: the server stays up",
    )
    dtype: RolloutDtype = doc("bfloat16", "weights/activation dtype")
    server_startup_timeout_s: float = doc(
        300.0, "seconds to wait for a server to become healthy", gt=0
    )
    num_servers: int = doc(1, "SGLang servers to launch (ignored when server_urls is set)", gt=0)
    server_urls: list[str] | None = doc(
        None, "running SGLang servers to use instead of launching (never restarted)"
    )
    use_router: bool = doc(False, "send /generate through an sglang-router in front of the servers")
    max_concurrent_requests: int = doc(
        64, "most /generate requests in flight at once on each server", gt=0
    )
    request_timeout_s: float = doc(
        120.0,
        "seconds one /generate attempt may take; a hung server is reported after about "
        "(request_retries + 1) x this, so raise it only for responses that take longer",
        gt=0,
    )
    request_retries: int = doc(
        3, "retries of a request after a connection error, 5xx or timeout", ge=0
    )
    retry_backoff_s: float = doc(1.0, "delay before the first retry; doubles per retry", gt=0)
    max_server_restarts: int = doc(2, "restarts allowed per launched server before failing", ge=0)
    weight_sync_transport: WeightSyncTransport = doc(
        "tensor", "how synced weights reach SGLang: shared memory, a process group, or files"
    )
    update_weights_bucket_megabytes: int = doc(
        512, "size bound of one weight-sync bucket (the extra memory a sync needs)", gt=0
    )
    weight_sync_snapshot: bool | None = doc(
        None,
        "keep the last synced weights on disk (written in the background) so a restarted "
        "server can be re-synced; null: on, except for servers colocated on GPUs",
    )
    weight_sync_master_address: str = doc(
        "127.0.0.1",
        "address of training rank 0's node that the SGLang servers reach for the distributed "
        "transport (the default: servers on this host); a server URL naming another host "
        "needs a non-loopback one (launch/slurm*.sbatch pass the first node's)",
    )
    log_prob_micro_batch_size_per_gpu: int | None = doc(
        None,
        "sizes the token budget of the actor's old-log-prob forward (x the longest prompt + "
        "response; null: the actor's update budget)",
        gt=0,
    )
    log_prob_max_token_len_per_gpu: int | None = doc(
        None, "token budget of one old-log-prob forward micro-batch (null: see above)", gt=0
    )
    log_prob_use_dynamic_bsz: bool | None = doc(
        None,
        "token-budget micro-batches for the old-log-prob forward; false: "
        "log_prob_micro_batch_size_per_gpu (null: the actor's) samples each (null: as the "
        "actor's use_dynamic_bsz)",
    )
    logprob_diff_threshold: float | None = doc(
        None, "fail the step when rollout/logprob_diff_max exceeds this (null: only log)", gt=0
    )
    val_kwargs: ValKwargs = doc(ValKwargs, "validation sampling")
    engine_kwargs: EngineKwargs = doc(EngineKwargs, "arguments for the engine itself")
    multi_turn: MultiTurnConfig = doc(MultiTurnConfig, "multi-turn rollouts with tool calls")


@dataclass
class AsyncRolloutConfig:
    """Asynchronous rollout (`trainer.rollout_mode=async`, rlhf/trainer/rollouts.py)."""

    max_staleness: int = doc(
        1,
        "how many policy versions older than the one being trained a sample's first token "
        "may be; the servers run this many steps' batches ahead, and a sample older than "
        "this is dropped (counted in async/dropped_stale)",
        gt=0,
    )
    partial_rollout: bool = doc(
        True,
        "a sample cut by a weight update keeps its tokens and goes on under the new weights "
        "(false: it starts again, wholly under the new weights)",
    )
