"""benchmarks/trl_ppo.py, ppo_vs_plain's TRL yardstick: TRL's PPOTrainer runs the steps and
each stage is timed where TRL spends it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STAGES = ("gen", "ref", "values", "reward", "update")
pytestmark = pytest.mark.slow(reason="a benchmark's yardstick: importing TRL takes ~9 s")


def test_trl_ppo_prints_a_row_of_stages_per_step(tmp_path):
    """Two steps of 2 prompts x 2 samples on the quickstart's data with a one-layer model:
    a row per step with every stage timed (a wrapper that no longer finds its TRL function,
    or names no stage, leaves one missing or at 0) and the rest of the step as `update`."""
    from rlhf.quickstart.data import write_quickstart_data
    from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model

    model = save_tiny_model(tmp_path / "model", TinyModelSpec.scaled(64, 1))
    train, _ = write_quickstart_data(tmp_path / "data", num_train=8, num_val=2)
    script = REPO / "benchmarks" / "trl_ppo.py"
    args = ["--steps", "2", "--prompts", "2", "--n", "2", "--response", "4"]
    done = subprocess.run(
        [sys.executable, str(script), str(model), str(train), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        stages = [row[f"timing_s/{stage}"] for stage in STAGES]
        assert all(s > 0 for s in stages), row
        assert sum(stages) == pytest.approx(row["timing_s/step"], rel=1e-9)
        assert row["tokens"] > 0
