"""Which experiment-tracker runs a training run logs to: new ones, or those of its checkpoint.

Each checkpoint keeps the W&B/MLflow/SwanLab run ids in its trainer state (`TRACKERS_KEY`),
so a run resumed from checkpoint N continues the runs that wrote N, also when N is older
than the last step they logged (`rlhf.logging.backends`). Only a checkpoint of this run
directory counts: one of another run (`trainer.resume_mode=<path>`) starts new tracker runs,
so that two run directories never write into one tracker run.
"""

from __future__ import annotations

import logging
from pathlib import Path

from rlhf.checkpoint import read_trainer_state
from rlhf.config.schema import RLHFConfig
from rlhf.logging import MetricTracker
from rlhf.logging.backends import TrackerResume

log = logging.getLogger(__name__)

TRACKERS_KEY = "trackers"  # trainer_state.json: backend name -> run id


def tracker_state(tracker: MetricTracker | None) -> dict[str, dict[str, str]]:
    """The trainer-state entry that names the tracker runs (empty off the main rank)."""
    return {TRACKERS_KEY: tracker.run_ids() if tracker is not None else {}}


def tracker_resume(resume_path: Path | None, checkpoint_root: Path) -> TrackerResume | None:
    """What the tracker of a run resumed from `resume_path` continues; None for a new run."""
    if resume_path is None:
        return None
    state = read_trainer_state(resume_path)
    step = int(state["step"])
    run_ids = dict(state.get(TRACKERS_KEY, {}))  # none in checkpoints from before the key
    if run_ids and resume_path.resolve().parent != checkpoint_root.resolve():
        log.info(
            "%s is not a checkpoint of this run directory (%s): its tracker runs %s are "
            "left alone, new ones start",
            resume_path,
            checkpoint_root,
            run_ids,
        )
        run_ids = {}
    return TrackerResume(step, run_ids)


def build_tracker(
    cfg: RLHFConfig, resume_path: Path | None, checkpoint_root: Path
) -> MetricTracker:
    """The run's tracker (main rank only): `trainer.logger` backends, continuing the tracker
    runs of the checkpoint it resumes from."""
    return MetricTracker.from_config(cfg, tracker_resume(resume_path, checkpoint_root))
