"""Metrics (console, metrics.jsonl, TensorBoard, W&B, MLflow) and stage timers."""

from rlhf.logging.tracker import LOGGERS, MetricTracker, Timer

__all__ = ["LOGGERS", "MetricTracker", "Timer"]
