"""A resumed run continues its W&B, MLflow and SwanLab runs: their ids are kept with the
checkpoint and handed back to the tracker on resume.

Each library runs for real in its offline mode (W&B `WANDB_MODE=offline`, an MLflow file
store, SwanLab `SWANLAB_MODE=offline`), and each test reads what the library wrote to disk
(`tests/unit/tracker_files.py`): one run id holding every step, the resumed part marked as
such. Connections from this process to anything but loopback fail during these tests.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from rlhf.checkpoint import read_trainer_state, save_trainer_state
from rlhf.config import load_config
from rlhf.config.loader import config_to_dict
from rlhf.logging import MetricTracker
from rlhf.logging.backends import TrackerResume
from rlhf.trainer.metrics import TRACKERS_KEY, build_tracker, tracker_resume, tracker_state
from tests.unit.tracker_files import (
    forbid_remote_connections,
    mlflow_runs,
    offline_trackers,
    reset_wandb,
    swanlab_runs,
    wandb_runs,
)

pytestmark = pytest.mark.reliability

BACKENDS = ["mlflow", "swanlab", "wandb"]
KEY = "critic/score/mean"
PROJECT = "proj"


@pytest.fixture
def offline(tmp_path, monkeypatch):
    root = offline_trackers(tmp_path, monkeypatch)
    refused = forbid_remote_connections(monkeypatch)
    reset_wandb()
    yield root
    reset_wandb()
    assert refused == [], f"a tracker tried to reach {refused}"


def stored_runs(name: str, root, run_dir):
    """Backend `name`'s runs as its files hold them, oldest run folder first."""
    if name == "wandb":
        return wandb_runs(root / "wandb", KEY)
    if name == "swanlab":
        return swanlab_runs(run_dir / "swanlog", KEY)
    return mlflow_runs(PROJECT, KEY)


def log_steps(tracker: MetricTracker, steps, offset: float = 0.0) -> None:
    for step in steps:
        tracker.log({KEY: step + offset}, step=step)


def tracker(run_dir, resume=None, loggers=tuple(BACKENDS)) -> MetricTracker:
    return MetricTracker(run_dir, loggers, project=PROJECT, experiment="exp", resume=resume)


def test_each_backend_keeps_one_run_through_a_resume(tmp_path, offline):
    run_dir = tmp_path / "run"
    with tracker(run_dir) as first:
        log_steps(first, [1, 2])
        ids = first.run_ids()
    assert sorted(ids) == BACKENDS
    with tracker(run_dir, TrackerResume(2, ids)) as resumed:
        assert resumed.run_ids() == ids
        log_steps(resumed, [3])

    for name in BACKENDS:
        runs = stored_runs(name, offline, run_dir)
        assert {run.run_id for run in runs} == {ids[name]}, name
        assert [p for run in runs for p in run.points] == [(1, 1.0), (2, 2.0), (3, 3.0)], name
    for name in ("wandb", "swanlab"):  # a second offline folder, marked as continuing the run
        first_part, second_part = stored_runs(name, offline, run_dir)
        assert (first_part.resumed, second_part.resumed) == (False, True), name
        assert second_part.branch_point is None, name  # nothing to rewind: step 2 was the last


def test_a_resume_from_an_older_step_rewinds_wandb_and_redoes_the_steps(tmp_path, offline):
    """The run logged steps 1-4; its checkpoint of step 2 is resumed and redoes 3-4. W&B
    (which ignores steps lower than its last one) is rewound to step 2 first; MLflow keeps
    both values of a redone step, the redone one last; metrics.jsonl holds each step once."""
    run_dir = tmp_path / "run"
    with tracker(run_dir) as first:
        log_steps(first, [1, 2, 3, 4])
        ids = first.run_ids()
    with tracker(run_dir, TrackerResume(2, ids)) as resumed:
        log_steps(resumed, [3, 4], offset=0.5)

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r[KEY]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.5), (4, 4.5)]
    first_part, rewound = stored_runs("wandb", offline, run_dir)
    assert first_part.run_id == rewound.run_id == ids["wandb"]
    assert rewound.branch_point == {"run_id": ids["wandb"], "step": 2}
    assert rewound.points == [(3, 3.5), (4, 4.5)]
    (mlflow_run,) = stored_runs("mlflow", offline, run_dir)
    assert mlflow_run.run_id == ids["mlflow"]
    assert mlflow_run.points == [(1, 1), (2, 2), (3, 3), (4, 4), (3, 3.5), (4, 4.5)]
    swanlab_parts = stored_runs("swanlab", offline, run_dir)
    assert {run.run_id for run in swanlab_parts} == {ids["swanlab"]}
    assert swanlab_parts[1].points == [(3, 3.5), (4, 4.5)]


def test_the_checkpoint_keeps_the_ids_and_its_resume_continues_them(tmp_path, offline):
    """The trainer's path: `build_tracker` from the config, the ids into the checkpoint's
    trainer state, and `build_tracker` from that checkpoint on resume."""
    run_dir = tmp_path / "run"
    overrides = [
        f"trainer.default_local_dir={run_dir}",
        "trainer.logger=[console,mlflow,wandb]",
        f"trainer.project_name={PROJECT}",
    ]
    cfg = load_config("configs/quickstart_cpu.yaml", overrides)
    root = run_dir / "checkpoints"
    checkpoint = root / "global_step_2"
    with build_tracker(cfg.trainer, config_to_dict(cfg), None, root) as first:
        log_steps(first, [1, 2])
        save_trainer_state(checkpoint, {"step": 2, **tracker_state(first)}, rank=0)
        ids = first.run_ids()
    assert read_trainer_state(checkpoint)[TRACKERS_KEY] == ids
    with build_tracker(cfg.trainer, config_to_dict(cfg), checkpoint, root) as resumed:
        log_steps(resumed, [3])

    for name in ("mlflow", "wandb"):
        runs = stored_runs(name, offline, run_dir)
        assert {run.run_id for run in runs} == {ids[name]}, name
        assert [step for run in runs for step, _ in run.points] == [1, 2, 3], name


def write_state(checkpoint, state: dict) -> None:
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))


def test_only_a_checkpoint_of_this_run_dir_names_runs_to_continue(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    ids = {"mlflow": "abc", "wandb": "x1"}
    write_state(root / "global_step_2", {"step": 2, TRACKERS_KEY: ids})
    write_state(tmp_path / "other" / "checkpoints" / "global_step_4", {"step": 4, **{}})
    foreign = tmp_path / "elsewhere" / "checkpoints" / "global_step_6"
    write_state(foreign, {"step": 6, TRACKERS_KEY: ids})

    assert tracker_resume(None, root) is None  # a new run: new tracker runs
    assert tracker_resume(root / "global_step_2", root) == TrackerResume(2, ids)
    # a checkpoint saved before the ids were kept, and one of another run directory
    assert tracker_resume(tmp_path / "other/checkpoints/global_step_4", root) == TrackerResume(4)
    assert tracker_resume(foreign, root) == TrackerResume(6)


def test_ids_of_backends_not_used_now_stay_for_a_later_resume(tmp_path):
    resume = TrackerResume(2, {"wandb": "x1"})
    with tracker(tmp_path, resume, loggers=["console"]) as resumed:
        assert resumed.run_ids() == {"wandb": "x1"}
    assert tracker_state(None) == {TRACKERS_KEY: {}}  # ranks other than the main one


def test_the_trainers_checkpoint_state_names_the_tracker_runs(tmp_path):
    """`PPOTrainer.state_dict` (what `save_trainer_state` writes) carries the run ids."""
    from rlhf.trainer.loop import PPOTrainer

    part = SimpleNamespace(state_dict=dict)
    batches = SimpleNamespace(sampler_state=dict)
    with tracker(tmp_path, TrackerResume(2, {"wandb": "x1"}), loggers=[]) as metrics:
        trainer = SimpleNamespace(
            batches=batches, kl_ctrl=part, stopper=part, engine=part, tracker=metrics
        )
        assert PPOTrainer.state_dict(trainer, 3)[TRACKERS_KEY] == {"wandb": "x1"}


def test_a_lost_mlflow_run_gives_a_new_run_and_says_so(tmp_path, offline, caplog):
    lost = "0" * 32
    with (
        caplog.at_level(logging.WARNING),
        tracker(tmp_path, TrackerResume(2, {"mlflow": lost}), ["mlflow"]) as resumed,
    ):
        log_steps(resumed, [3])
        new_id = resumed.run_ids()["mlflow"]
    assert new_id != lost
    assert f"MLflow run {lost} of the checkpoint not found" in caplog.text
    assert [run.run_id for run in stored_runs("mlflow", offline, tmp_path)] == [new_id]
