"""One place every step's metrics go: `metrics.jsonl` always, plus `trainer.logger` backends.

Metric names follow verl (`actor/pg_loss`, `critic/vf_loss`, `timing_s/gen`, ...). The
JSONL file (one object per step with `step` and every metric) is the record tests and
`rlhf-plot` read; the console prints one readable line per step; TensorBoard
event files go to `<run dir>/tensorboard`; W&B, MLflow and SwanLab (`rlhf.logging.backends`)
are used when installed and otherwise skipped with a warning. A resumed run continues their
runs (ids kept with the checkpoint). Only the main rank should create a tracker.

Each remote tracker gets the names it takes (`rlhf.logging.names`: MLflow's `mean@4` is
`mean_at_4`). A tracker that cannot start stops the run before its first step, in one line
(nothing is lost yet, and a run the user watches in MLflow should not go on unseen); one
that fails later (an outage, a name its store refuses) costs its record of that step only:
one line names the tracker, the step and the metric, the run goes on, metrics.jsonl keeps
every step, and the close lists the steps a tracker missed.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from rlhf.config.choices import LOGGERS
from rlhf.errors import UserError
from rlhf.logging.backends import BACKENDS, RemoteRun, RunInfo, TrackerResume, start_backend
from rlhf.logging.names import NameMap
from rlhf.logging.profiler import stage_range
from rlhf.utils import atomic_output

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"

CONSOLE_KEYS = (
    "critic/score/mean",
    "actor/pg_loss",
    "critic/vf_loss",
    "actor/ppo_kl",
    "actor/reward_kl_penalty_coeff",
    "response_length/mean",
    "timing_s/step",
)


class TrackerError(ValueError, UserError):
    """A tracker of `trainer.logger` that could not start its run; the message names it."""


def _scalar(value) -> float:
    """Plain float of a number or a 0-d/1-element tensor."""
    return float(value.item() if hasattr(value, "item") else value)


class TrackedRun(Protocol):
    """The trainer section's keys a tracker reads (rlhf-train's and rlhf-train-rm's)."""

    @property
    def default_local_dir(self) -> str: ...

    @property
    def logger(self) -> Sequence[str]: ...

    @property
    def project_name(self) -> str: ...

    @property
    def experiment_name(self) -> str: ...


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
        resume: TrackerResume | None = None,
    ):
        """`resume`: the checkpoint a resumed run goes on from; its rows of later steps leave
        metrics.jsonl (`drop_after`) and the W&B/MLflow/SwanLab runs it names continue."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        unknown = sorted(set(loggers) - set(LOGGERS))
        if unknown:
            raise ValueError(f"trainer.logger: unknown {unknown}; choose from {list(LOGGERS)}")
        self.loggers = list(loggers)
        self.metrics_path = self.run_dir / METRICS_FILE
        self._jsonl = open(self.metrics_path, "a")  # noqa: SIM115 (closed in close())
        self._tb = None
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        # the ids of backends not used now stay with the checkpoints, for a later resume
        self._kept_ids = dict(resume.run_ids) if resume is not None else {}
        logged_after = resume is not None and self.drop_after(resume.step) > 0
        info = RunInfo(self.run_dir, project, experiment, dict(config or {}))
        self._remote: dict[str, RemoteRun] = {
            name: _start(name, info, resume, rewind=logged_after)
            for name in BACKENDS
            if name in self.loggers and self._available(name)
        }
        self._names = {name: NameMap(name) for name in self._remote}
        self._missed: dict[str, list[int]] = {name: [] for name in self._remote}

    @classmethod
    def from_config(
        cls, trainer: TrackedRun, config: dict, resume: TrackerResume | None = None
    ) -> MetricTracker:
        """The tracker for a run: `trainer.logger` backends in `trainer.default_local_dir`;
        `config`: the run's whole config as a dict (what each backend records)."""
        return cls(
            trainer.default_local_dir,
            trainer.logger,
            project=trainer.project_name,
            experiment=trainer.experiment_name,
            config=config,
            resume=resume,
        )

    def run_ids(self) -> dict[str, str]:
        """Backend name -> the id of its run: what a checkpoint keeps, so that a run resumed
        from it continues these runs (`TrackerResume.run_ids`)."""
        return {**self._kept_ids, **{name: run.run_id for name, run in self._remote.items()}}

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
        os.fsync(self._jsonl.fileno())  # on disk before the step's checkpoint is published
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        for name, run in self._remote.items():
            self._log_remote(name, run, values, step)
        if "console" in self.loggers:
            print(self.console_line(values, step), flush=True)

    def _log_remote(
        self, name: str, run: RemoteRun, values: Mapping[str, float], step: int
    ) -> None:
        """One tracker's record of a step; a failure is a warning line (see the module)."""
        names = self._names[name]
        try:
            run.log(names.rename(values), step)
        except Exception as e:  # any error of the tracker's library: the run must go on
            self._missed[name].append(step)
            metric = names.named_in(str(e))
            what = f"metric {metric!r}" if metric else f"its {len(values)} metrics"
            log.warning(
                "%s failed to record step %d (%s): %s; the run goes on, metrics.jsonl has the step",
                name,
                step,
                what,
                _first_line(e),
            )

    @staticmethod
    def console_line(values: Mapping[str, float], step: int) -> str:
        """`step 3 | critic/score/mean 0.125 | ...` with the headline metrics first."""
        keys = [k for k in CONSOLE_KEYS if k in values]
        keys += sorted(k for k in values if k not in CONSOLE_KEYS and "/" in k)[: 8 - len(keys)]
        return " | ".join([f"step {step}"] + [f"{k} {values[k]:.4g}" for k in keys])

    def drop_after(self, step: int) -> int:
        """Remove the rows of steps after `step` from metrics.jsonl (and from what TensorBoard
        shows: its writer starts anew with `purge_step`); returns how many rows went.

        Why: a run resumed from the checkpoint of step K runs steps K+1, ... again, and the
        interrupted run may already have written rows for them; kept, the file would hold
        two rows for such a step and the curves would go back in time. A line that is not a
        JSON object (the torn last line of a crash) is dropped with a warning: appending
        after it would glue the next row onto it. The file is replaced atomically, so a crash
        in here leaves it as it was. Call it before logging the first resumed step.
        """
        self._jsonl.close()
        try:
            old = self.metrics_path.read_text()
            kept, superseded = _rows_up_to(old, step)
            new = "".join(line + "\n" for line in kept)
            if new != old:
                with atomic_output(self.metrics_path) as tmp:
                    tmp.write_text(new)
        finally:
            self._jsonl = open(self.metrics_path, "a")  # noqa: SIM115 (closed in close())
        if self._tb is not None:  # TensorBoard hides the earlier events of steps > `step`
            from torch.utils.tensorboard import SummaryWriter

            self._tb.close()
            self._tb = SummaryWriter(log_dir=self._tb.log_dir, purge_step=step + 1)
        if superseded:
            log.info("%s: dropped %d rows of steps after %d", self.metrics_path, superseded, step)
        return superseded

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        for name, run in self._remote.items():
            try:
                run.finish()
            except Exception as e:  # the tracker's library; metrics.jsonl is complete
                log.warning("%s failed to finish its run %s: %s", name, run.run_id, _first_line(e))
            if self._missed[name]:
                log.warning(
                    "%s misses %d steps (%s); metrics.jsonl has them",
                    name,
                    len(self._missed[name]),
                    _steps_text(self._missed[name]),
                )

    def __enter__(self) -> MetricTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _start(name: str, info: RunInfo, resume: TrackerResume | None, rewind: bool) -> RemoteRun:
    """Backend `name`'s run; its failure is one line naming the tracker (see the module)."""
    try:
        return start_backend(name, info, resume, rewind)
    except Exception as e:  # any error of the tracker's library, e.g. its server unreachable
        raise TrackerError(
            f"trainer.logger: {name} could not start a run (project {info.project!r}, "
            f"experiment {info.experiment!r}): {_first_line(e)}; fix that or leave {name} "
            "out of trainer.logger"
        ) from e


def _first_line(error: BaseException) -> str:
    """The error's type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _steps_text(steps: list[int]) -> str:
    """`steps 3, 4, 9` (the first ten, then how many more)."""
    shown = ", ".join(str(s) for s in steps[:10])
    more = f" and {len(steps) - 10} more" if len(steps) > 10 else ""
    return f"steps {shown}{more}"


def _rows_up_to(text: str, step: int) -> tuple[list[str], int]:
    """The lines of a metrics.jsonl text to keep (rows of steps <= `step`, and rows without
    a step) and the number of rows of later steps; unreadable lines are left out, named in
    a warning."""
    kept: list[str] = []
    superseded = 0
    unreadable: list[int] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            unreadable.append(number)
        elif isinstance(row.get("step"), int | float) and row["step"] > step:
            superseded += 1
        else:
            kept.append(line)
    if unreadable:
        log.warning(
            "metrics.jsonl: dropped %d unreadable lines (line %s), e.g. a torn "
            "last line from a crash",
            len(unreadable),
            unreadable[:10],
        )
    return kept, superseded


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
