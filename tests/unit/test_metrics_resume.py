"""A resumed run's metrics.jsonl holds each step once: rows after the checkpoint step go.

The interrupted run wrote rows for steps after its last checkpoint, and may have died in
the middle of one (a torn last line). `MetricTracker.drop_after(K)` rewrites the real file.
"""

from __future__ import annotations

import json
import os

import pytest

from rlhf.logging import MetricTracker

pytestmark = pytest.mark.reliability


def write_lines(path, lines: list[str], torn: str = "") -> None:
    path.write_text("".join(line + "\n" for line in lines) + torn)


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resume_drops_superseded_rows_and_a_torn_last_line(tmp_path, caplog):
    metrics = tmp_path / "metrics.jsonl"
    interrupted = [json.dumps({"step": s, "critic/score/mean": s / 10}) for s in range(5)]
    write_lines(metrics, interrupted, torn='{"step": 5, "critic/sco')
    with MetricTracker(tmp_path, []) as tracker:
        assert tracker.drop_after(2) == 2  # steps 3 and 4; the torn step-5 line is no row
        tracker.log({"critic/score/mean": 0.75}, step=3)
    assert [r["step"] for r in rows(metrics)] == [0, 1, 2, 3]
    assert rows(metrics)[2] == {"step": 2, "critic/score/mean": 0.2}
    assert rows(metrics)[3] == {"step": 3, "critic/score/mean": 0.75}
    assert "dropped 1 unreadable lines (line [6])" in caplog.text


def test_nothing_to_drop_leaves_the_file_alone(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_lines(metrics, [json.dumps({"step": 1, "a/b": 1.0})])
    inode = os.stat(metrics).st_ino
    with MetricTracker(tmp_path, []) as tracker:
        assert tracker.drop_after(1) == 0
        tracker.log({"a/b": 2.0}, step=2)
    assert os.stat(metrics).st_ino == inode  # not rewritten
    assert [r["step"] for r in rows(metrics)] == [1, 2]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temp file left


def test_a_failed_rewrite_keeps_the_old_file_and_the_tracker_working(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    before = [json.dumps({"step": s}) for s in range(4)]
    write_lines(metrics, before)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with MetricTracker(tmp_path, []) as tracker:
        monkeypatch.setattr(os, "replace", disk_full)
        with pytest.raises(OSError, match="No space left"):
            tracker.drop_after(1)
        monkeypatch.undo()
        tracker.log({"a/b": 1.0}, step=4)
    assert [r["step"] for r in rows(metrics)] == [0, 1, 2, 3, 4]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_tensorboard_shows_the_resumed_steps_once(tmp_path):
    """A run that logged steps 1-4, resumed from step 2: TensorBoard (its own event reader)
    shows steps 1-2 of the first run and 3-4 of the resumed one, each once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricTracker(tmp_path, ["tensorboard"]) as first:
        for step in (1, 2, 3, 4):
            first.log({"critic/score/mean": float(step)}, step=step)
    with MetricTracker(tmp_path, ["tensorboard"]) as resumed:
        resumed.drop_after(2)
        for step in (3, 4):
            resumed.log({"critic/score/mean": 10.0 * step}, step=step)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("critic/score/mean")]
    assert scalars == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
