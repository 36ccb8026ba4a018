"""The names validation logs (`val-core/openai/gsm8k/reward/mean@4`, ...) reach every tracker,
each under the name it takes (issue 52, item 4), and a tracker's failure is one line.

Each library runs for real in its offline mode (an MLflow file store, W&B and SwanLab
offline), and each test reads back what the library wrote (`tests/unit/tracker_files.py`).
"""

from __future__ import annotations

import json
import logging

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlhf.logging import MetricTracker
from rlhf.logging.names import mlflow_name, swanlab_name
from rlhf.logging.tracker import TrackerError
from rlhf.reward.validation import ValSample, validation_metrics
from tests.unit.tracker_files import (
    forbid_remote_connections,
    mlflow_runs,
    offline_trackers,
    reset_wandb,
    swanlab_runs,
    wandb_runs,
)

pytestmark = pytest.mark.reliability

PROJECT = "proj"
SOURCES = ("openai/gsm8k", "lighteval/MATH")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    root = offline_trackers(tmp_path, monkeypatch)
    refused = forbid_remote_connections(monkeypatch)
    reset_wandb()
    yield root
    reset_wandb()
    assert refused == [], f"a tracker tried to reach {refused}"


def validation_round(scale: float) -> dict[str, float]:
    """The metrics of a validation round: 2 data sources, 2 prompts each, 4 responses."""
    samples = [
        ValSample(source, f"{source}-{prompt}", scale * ((prompt + response) % 2), str(response))
        for source in SOURCES
        for prompt in range(2)
        for response in range(4)
    ]
    # and a name SwanLab would drop (a control character) and MLflow refuse (`//`, `@`)
    return validation_metrics(samples) | {"odd//name\x01@2": scale}


def stored(name: str, root, run_dir, key: str) -> list[tuple[int, float]]:
    """The (step, value) points of `key` that tracker `name` wrote to its files."""
    if name == "wandb":
        runs = wandb_runs(root / "wandb", key)
    elif name == "swanlab":
        runs = swanlab_runs(run_dir / "swanlog", key)
    else:
        runs = mlflow_runs(PROJECT, key)
    return [point for run in runs for point in run.points]


@pytest.mark.parametrize("name", ["mlflow", "wandb", "swanlab"])
def test_validation_names_reach_each_tracker(tmp_path, offline, name):
    run_dir = tmp_path / "run"
    steps = {1: validation_round(1.0), 2: validation_round(0.5)}
    assert "val-core/openai/gsm8k/reward/mean@4" in steps[1]
    assert "val-core/lighteval/MATH/reward/maj@4" in steps[1]
    with MetricTracker(run_dir, [name, "tensorboard"], project=PROJECT) as tracker:
        for step, metrics in steps.items():
            tracker.log(metrics, step=step)

    expected_name = {"mlflow": mlflow_name, "swanlab": swanlab_name}.get(name, str)
    for key in steps[1]:
        points = stored(name, offline, run_dir, expected_name(key))
        assert points == [(step, steps[step][key]) for step in steps], (name, key)
    if name == "mlflow":  # verl's MLflow names
        assert stored(name, offline, run_dir, "val-core/openai/gsm8k/reward/best_at_4")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [set(row) - {"step"} for row in rows] == [set(steps[1])] * 2  # names unchanged
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(steps[1])


NASTY = [
    "val-core/openai/gsm8k/reward/mean@4",
    "a//b",
    "/lead/",
    "a/./b/../c",
    "..x/y",
    ".",
    "",
    "sp ace,comma;semi(paren)[b]+plus=eq%pct#hash?q",
    "tab\there\x01ctl\x7f",
    "ünïcode/名前",
    "x" * 300,
    "x" * 299 + "y",
]


def test_mlflow_names_pass_mlflows_own_checks():
    from mlflow.utils.validation import (
        MAX_ENTITY_KEY_LENGTH,
        _validate_metric,
        _validate_metric_name,
    )

    names = [mlflow_name(n) for n in NASTY]
    for name in names:
        _validate_metric_name(name)
        _validate_metric(name, 1.0, 0, 0)
        assert len(name) <= MAX_ENTITY_KEY_LENGTH, name
    assert names[0] == "val-core/openai/gsm8k/reward/mean_at_4"  # as verl writes it
    assert names[-1] != names[-2]  # long names cut apart
    assert mlflow_name("actor/pg_loss") == "actor/pg_loss"


def test_swanlab_names_are_kept_as_given_by_swanlab():
    from swanlab.sdk.internal.run.fmt import validate_key

    for name in NASTY:
        assert validate_key(swanlab_name(name)) == swanlab_name(name), name
    assert swanlab_name("val-core/openai/gsm8k/reward/mean@4").endswith("mean@4")


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_tracker_failure_is_one_line_and_the_run_goes_on(tmp_path, offline, caplog):
    """MLflow's file store keeps `a/b` as the file `metrics/a/b`: it cannot then keep a
    metric `a`. The step that logs one is lost to MLflow, named in one line; the run goes
    on, metrics.jsonl has every step."""
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING), MetricTracker(run_dir, ["mlflow"], project=PROJECT) as t:
        t.log({"a/b": 1.0}, step=1)
        t.log({"a": 2.0, "c": 2.0}, step=2)
        t.log({"a/b": 3.0}, step=3)
        (failure,) = warnings_of(caplog)
    assert "\n" not in failure
    assert failure.startswith("mlflow failed to record step 2 (metric 'a'): ")
    assert "the run goes on" in failure
    assert warnings_of(caplog)[1] == "mlflow misses 1 steps (steps 2); metrics.jsonl has them"
    assert stored("mlflow", offline, run_dir, "a/b") == [(1, 1.0), (3, 3.0)]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]


def test_a_tracker_that_cannot_start_stops_in_one_line(tmp_path, offline, monkeypatch):
    """MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE is set."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    with pytest.raises(TrackerError) as error:
        MetricTracker(tmp_path / "run", ["mlflow"], project=PROJECT, experiment="exp")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(
        "trainer.logger: mlflow could not start a run (project 'proj', experiment 'exp'): "
        "MlflowException: The filesystem tracking backend"
    )
