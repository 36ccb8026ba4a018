"""One place every step's metrics go: `metrics.jsonl` always, plus `trainer.logger` backends.

Metric names follow verl (`actor/pg_loss`, `critic/vf_loss`, `timing_s/gen`, ...). The
JSONL file (one object per step with `step` and every metric) is the record tests and
`tools/plot_metrics.py` read; the console prints one readable line per step; TensorBoard
event files go to `<run dir>/tensorboard`; W&B and MLflow are used when installed and
otherwise skipped with a warning. Only the main rank should create a tracker.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from pathlib import Path

from rlhf.config.choices import LOGGERS
from rlhf.logging.profiler import stage_range

log = logging.getLogger(__name__)

CONSOLE_KEYS = (
    "critic/score/mean",
    "actor/pg_loss",
    "critic/vf_loss",
    "actor/ppo_kl",
    "actor/reward_kl_penalty_coeff",
    "response_length/mean",
    "timing_s/step",
)


def _scalar(value) -> float:
    """Plain float of a number or a 0-d/1-element tensor."""
    return float(value.item() if hasattr(value, "item") else value)


class MetricTracker:
    """Writes each step's metrics to every configured backend."""

    def __init__(
        self,
        run_dir: str | Path,
        loggers: Iterable[str] = ("console",),
        *,
        project: str = "rlhf",
        experiment: str = "run",
        config: Mapping | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        unknown = sorted(set(loggers) - set(LOGGERS))
        if unknown:
            raise ValueError(f"trainer.logger: unknown {unknown}; choose from {list(LOGGERS)}")
        self.loggers = list(loggers)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
        self._tb = self._wandb = self._mlflow = None
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if "wandb" in self.loggers and self._available("wandb"):
            import wandb

            self._wandb = wandb.init(project=project, name=experiment, config=dict(config or {}))
        if "mlflow" in self.loggers and self._available("mlflow"):
            import mlflow

            mlflow.set_experiment(project)
            self._mlflow = mlflow.start_run(run_name=experiment)

    @classmethod
    def from_config(cls, cfg) -> MetricTracker:
        """The tracker for a run: `trainer.logger` backends in `trainer.default_local_dir`."""
        from rlhf.config.loader import config_to_dict

        trainer = cfg.trainer
        return cls(
            trainer.default_local_dir,
            trainer.logger,
            project=trainer.project_name,
            experiment=trainer.experiment_name,
            config=config_to_dict(cfg),
        )

    @staticmethod
    def _available(name: str) -> bool:
        if importlib.util.find_spec(name) is None:
            log.warning("trainer.logger includes %s but it is not installed; skipping it", name)
            return False
        return True

    def log(self, metrics: Mapping[str, object], step: int) -> None:
        """Record one step: every backend gets every metric (floats; non-finite kept as is)."""
        values = {key: _scalar(v) for key, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        if self._mlflow is not None:
            import mlflow

            mlflow.log_metrics({k: v for k, v in values.items() if math.isfinite(v)}, step=step)
        if "console" in self.loggers:
            print(self.console_line(values, step), flush=True)

    @staticmethod
    def console_line(values: Mapping[str, float], step: int) -> str:
        """`step 3 | critic/score/mean 0.125 | ...` with the headline metrics first."""
        keys = [k for k in CONSOLE_KEYS if k in values]
        keys += sorted(k for k in values if k not in CONSOLE_KEYS and "/" in k)[: 8 - len(keys)]
        return " | ".join([f"step {step}"] + [f"{k} {values[k]:.4g}" for k in keys])

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            import mlflow

            mlflow.end_run()

    def __enter__(self) -> MetricTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Timer:
    """Wall time of named stages, reported as `timing_s/<name>` metrics.

    Each stage is also an NVTX range (`stage_range`) on CUDA, so Nsight Systems shows it.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        start = time.perf_counter()
        try:
            with stage_range(name):
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{name}": seconds for name, seconds in self.seconds.items()}
