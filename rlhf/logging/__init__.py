"""Metrics (console, metrics.jsonl, TensorBoard, W&B, MLflow), stage timers and profiling."""

from rlhf.logging.profiler import StepProfiler, stage_range
from rlhf.logging.tracker import MetricTracker, Timer

__all__ = ["MetricTracker", "StepProfiler", "Timer", "stage_range"]
