"""Every list of allowed values, once: the schema's `Literal` types and the tuples code checks.

The schema annotates fields with these types (so the loader rejects other values with the
full key), and the code that implements a choice imports the same type or its tuple
(`typing.get_args`), so a new value is added in exactly one place.
"""

from __future__ import annotations

from typing import Literal, get_args

AdvEstimator = Literal["gae", "grpo", "rloo", "reinforce_plus_plus"]
KLEstimator = Literal["kl", "abs", "mse", "low_var_kl"]
KLControlType = Literal["fixed", "adaptive"]
LossAggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
LRDecayStyle = Literal["constant", "linear", "cosine"]
TrainDtype = Literal["float32", "bfloat16"]
RolloutDtype = Literal["float32", "bfloat16", "float16"]
RolloutName = Literal["sglang"]
WeightSyncTransport = Literal["tensor", "distributed", "disk"]
Truncation = Literal["left", "right", "error"]
BadRows = Literal["error", "skip"]
GSM8KMethod = Literal["strict", "flexible"]
Device = Literal["auto", "cuda", "cpu"]
Logger = Literal["console", "tensorboard", "wandb", "mlflow"]

ADV_ESTIMATORS: tuple[str, ...] = get_args(AdvEstimator)
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
WEIGHT_SYNC_TRANSPORTS: tuple[str, ...] = get_args(WeightSyncTransport)
LOGGERS: tuple[str, ...] = get_args(Logger)
