"""Metrics reach metrics.jsonl, the console and real TensorBoard event files."""

from __future__ import annotations

import importlib.util
import json
import logging

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlhf.logging import MetricTracker, Timer


def test_jsonl_console_and_tensorboard(tmp_path, capsys):
    with MetricTracker(tmp_path, ["console", "tensorboard"]) as tracker:
        tracker.log({"critic/score/mean": torch.tensor(0.25), "actor/pg_loss": -1.5}, step=1)
        tracker.log({"critic/score/mean": 0.5, "actor/pg_loss": -1.0, "timing_s/step": 2.0}, step=2)

    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [
        {"step": 1, "critic/score/mean": 0.25, "actor/pg_loss": -1.5},
        {"step": 2, "critic/score/mean": 0.5, "actor/pg_loss": -1.0, "timing_s/step": 2.0},
    ]
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "step 1 | critic/score/mean 0.25 | actor/pg_loss -1.5"
    assert out[1].startswith("step 2 | critic/score/mean 0.5 | actor/pg_loss -1")

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scores = events.Scalars("critic/score/mean")
    assert [(e.step, e.value) for e in scores] == [(1, 0.25), (2, 0.5)]
    assert [e.value for e in events.Scalars("timing_s/step")] == [2.0]


def test_jsonl_is_always_written_and_appends(tmp_path):
    for step in (1, 2):
        with MetricTracker(tmp_path, []) as tracker:
            tracker.log({"a/b": step}, step=step)
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert not (tmp_path / "tensorboard").exists()


def test_unknown_logger_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"trainer.logger: unknown \['tensorbord'\]"):
        MetricTracker(tmp_path, ["tensorbord"])


@pytest.mark.parametrize("name", ["wandb", "mlflow", "swanlab"])
def test_missing_optional_backend_is_skipped_with_a_warning(tmp_path, caplog, monkeypatch, name):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda module: None if module == name else find_spec(module)
    )
    with caplog.at_level(logging.WARNING), MetricTracker(tmp_path, [name]) as tracker:
        tracker.log({"x/y": 1.0}, step=1)
        assert tracker.run_ids() == {}
    assert f"{name} but it is not installed" in caplog.text


def test_timer_accumulates_stages():
    timer = Timer()
    for _ in range(2):
        with timer.stage("gen"):
            pass
    with pytest.raises(RuntimeError), timer.stage("update_actor"):
        raise RuntimeError("the stage failed; its time still counts")
    metrics = timer.metrics()
    assert set(metrics) == {"timing_s/gen", "timing_s/update_actor"}
    assert all(v >= 0 for v in metrics.values())
