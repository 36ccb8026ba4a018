"""The experiment trackers that keep a run elsewhere: W&B, MLflow and SwanLab.

Each is optional (`MetricTracker` skips one that is not installed) and is set up the way
its library is, by its own environment variables (`WANDB_MODE`, `WANDB_DIR`,
`MLFLOW_TRACKING_URI`, `SWANLAB_MODE`, ...). What this module adds is resume: a run's
tracker ids are kept with each checkpoint (`MetricTracker.run_ids`), and a run resumed
from that checkpoint continues those runs instead of starting new ones.

A resumed run redoes the steps after its checkpoint, and the run it continues may have
logged some of them already. W&B ignores a step lower than its last one, so there the run
is rewound to the checkpoint's step first (W&B's `resume_from`, a beta feature); MLflow and
SwanLab take the redone steps as they come (MLflow keeps both values of such a step).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

SWANLAB_DIR = "swanlog"  # under the run dir, unless SWANLAB_LOG_DIR says otherwise


@dataclass(frozen=True)
class TrackerResume:
    """Where a resumed run goes on from: the checkpoint's step and the tracker runs that
    wrote it (backend name -> run id, as `MetricTracker.run_ids()` gave it at the save)."""

    step: int
    run_ids: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RunInfo:
    """What every backend is told about the run."""

    run_dir: Path
    project: str
    experiment: str
    config: dict


class RemoteRun(Protocol):
    """One backend's run: its id (kept with checkpoints), steps in, and its end."""

    run_id: str

    def log(self, values: Mapping[str, float], step: int) -> None: ...

    def finish(self) -> None: ...


class WandbRun:
    """A W&B run: new, continued by id, or rewound to `rewind_to` and continued."""

    def __init__(self, info: RunInfo, resume_id: str | None, rewind_to: int | None):
        import wandb

        if resume_id is None:
            how: dict[str, Any] = {}
        elif rewind_to is not None:  # it logged steps after the checkpoint: drop them first
            how = {"resume_from": f"{resume_id}?_step={rewind_to}"}
        else:
            how = {"id": resume_id, "resume": "allow"}
        self.run = wandb.init(project=info.project, name=info.experiment, config=info.config, **how)
        self.run_id: str = self.run.id

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def finish(self) -> None:
        self.run.finish()


class MlflowRun:
    """An MLflow run in the experiment named `project`: new, or continued by id."""

    def __init__(self, info: RunInfo, resume_id: str | None, rewind_to: int | None):
        import mlflow

        experiment = mlflow.set_experiment(info.project)
        if resume_id is not None and not _mlflow_run_usable(resume_id, experiment.experiment_id):
            resume_id = None
        if resume_id is not None:
            run = mlflow.start_run(run_id=resume_id)
        else:
            run = mlflow.start_run(run_name=info.experiment)
        self.run_id: str = run.info.run_id

    def log(self, values: Mapping[str, float], step: int) -> None:
        import mlflow

        mlflow.log_metrics({k: v for k, v in values.items() if math.isfinite(v)}, step=step)

    def finish(self) -> None:
        import mlflow

        mlflow.end_run()


def _mlflow_run_usable(run_id: str, experiment_id: str) -> bool:
    """Whether the checkpoint's MLflow run can be continued here; says why not."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        run = MlflowClient().get_run(run_id)
    except MlflowException as e:
        log.warning("MLflow run %s of the checkpoint not found (%s); starting a new run", run_id, e)
        return False
    if run.info.lifecycle_stage == "deleted" or run.info.experiment_id != experiment_id:
        log.warning(
            "MLflow run %s of the checkpoint is deleted or in another experiment; "
            "starting a new run",
            run_id,
        )
        return False
    return True


class SwanlabRun:
    """A SwanLab run: new, or continued by id. Its local files (all of them in
    `SWANLAB_MODE=offline`) go to `<run dir>/swanlog` unless SWANLAB_LOG_DIR is set."""

    def __init__(self, info: RunInfo, resume_id: str | None, rewind_to: int | None):
        import swanlab

        how: dict[str, Any] = {"id": resume_id, "resume": "allow"} if resume_id else {}
        env_dir = os.environ.get("SWANLAB_LOG_DIR") or os.environ.get("SWANLAB_LOGDIR")
        self.run = swanlab.init(
            project=info.project,
            name=info.experiment,
            config=info.config,
            log_dir=env_dir or str(info.run_dir / SWANLAB_DIR),
            **how,
        )
        self.run_id: str = self.run.id

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def finish(self) -> None:
        self.run.finish()


# name -> the run of that backend, from (info, the run id to continue, the step to rewind to)
BACKENDS: dict[str, Callable[[RunInfo, str | None, int | None], RemoteRun]] = {
    "wandb": WandbRun,
    "mlflow": MlflowRun,
    "swanlab": SwanlabRun,
}


def start_backend(
    name: str, info: RunInfo, resume: TrackerResume | None, rewind: bool
) -> RemoteRun:
    """Backend `name`'s run: the one `resume` names, if any (rewound to its step when
    `rewind`: the run logged steps after it), else a new one."""
    if resume is None or name not in resume.run_ids:
        run = BACKENDS[name](info, None, None)
        log.info("%s: new run %s", name, run.run_id)
        return run
    run = BACKENDS[name](info, resume.run_ids[name], resume.step if rewind else None)
    if run.run_id == resume.run_ids[name]:
        log.info("%s: continuing run %s after step %d", name, run.run_id, resume.step)
    return run
