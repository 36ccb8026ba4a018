"""Every list of allowed values, once: the schema's `Literal` types and the tuples code checks.

The schema annotates fields with these types (so the loader rejects other values with the
full key), and the code that implements a choice imports the same type or its tuple
(`typing.get_args`), so a new value is added in exactly one place.
"""

from __future__ import annotations

from typing import Literal, get_args

AdvEstimator = Literal["gae", "grpo", "rloo", "reinforce_plus_plus"]
KLEstimator = Literal["kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3"]
# A KL loss may also use an estimator with a straight-through k2 gradient ("+", see algo/kl.py).
KLLossType = Literal[
    "kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3", "kl+", "k1+", "low_var_kl+", "k3+"
]
KLControlType = Literal["fixed", "adaptive"]
LossAggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
LRDecayStyle = Literal["constant", "linear", "cosine"]
PolicyLossMode = Literal["vanilla", "gspo"]
RolloutISLevel = Literal["token", "sequence"]
FilterGroupsMetric = Literal["score", "seq_reward"]
TrainDtype = Literal["float32", "bfloat16"]
RecomputeGranularity = Literal["full", "selective"]
RecomputeMethod = Literal["uniform", "block"]
RouterReplayMode = Literal["disabled", "R2", "R3"]  # verl's names
TokenDropPolicy = Literal["probs", "position"]  # Megatron's moe_token_drop_policy
RolloutDtype = Literal["float32", "bfloat16", "float16"]
RolloutName = Literal["sglang"]
WeightSyncTransport = Literal["tensor", "distributed", "disk"]
Truncation = Literal["left", "right", "error"]
BadRows = Literal["error", "skip"]
GSM8KMethod = Literal["strict", "flexible"]
Device = Literal["auto", "cuda", "cpu"]
Logger = Literal["console", "tensorboard", "wandb", "mlflow", "swanlab"]
OnNonFinite = Literal["stop", "skip"]
ToolCallFormat = Literal["hermes"]  # how a turn writes tool calls (rlhf/tools/parser.py)
TruncateSide = Literal["left", "right", "middle"]  # where an overlong tool result is cut
# when a step's batch is generated (rlhf/trainer/rollouts.py)
RolloutMode = Literal["sync", "one_step_off", "async"]

ADV_ESTIMATORS: tuple[str, ...] = get_args(AdvEstimator)
CRITIC_ESTIMATORS: tuple[str, ...] = ("gae",)  # the estimators that need a value model
# the estimators that compare the samples of one prompt (a group of one has no baseline)
GROUP_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo")
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
KL_LOSS_TYPES: tuple[str, ...] = get_args(KLLossType)
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
WEIGHT_SYNC_TRANSPORTS: tuple[str, ...] = get_args(WeightSyncTransport)
LOGGERS: tuple[str, ...] = get_args(Logger)
TOOL_CALL_FORMATS: tuple[str, ...] = get_args(ToolCallFormat)
TRUNCATE_SIDES: tuple[str, ...] = get_args(TruncateSide)
