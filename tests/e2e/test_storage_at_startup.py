"""A run directory that cannot take the run's checkpoints fails `rlhf-train` at startup, in
one line and before any SGLang server starts, instead of at the first save after the
training it was meant to keep."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlhf.quickstart.data import write_quickstart_data
from tests.helpers import REPO, ppo_overrides, small_filesystem

pytestmark = pytest.mark.reliability
CONFIG = str(REPO / "configs" / "quickstart_cpu.yaml")


def train_fails_in_one_line(args: list[str]) -> str:
    cmd = [sys.executable, "-m", "rlhf.cli.train", "--config", CONFIG, *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("rlhf-train:")]
    return line


def test_read_only_run_directory(tiny_qwen2_dir, tmp_path):
    data = write_quickstart_data(tmp_path / "data", num_train=16, num_val=4)
    with small_filesystem(tmp_path / "ro", 1024, read_only=True) as ro:
        line = train_fails_in_one_line(ppo_overrides(tiny_qwen2_dir, data, ro / "run", 2))
    assert line.startswith(f"rlhf-train: error: run directory {ro / 'run'} cannot be written")


def test_checkpoint_directory_too_small(tiny_qwen2_dir, tmp_path):
    data = write_quickstart_data(tmp_path / "data", num_train=16, num_val=4)
    with small_filesystem(tmp_path / "small", 1024) as small:
        line = train_fails_in_one_line(ppo_overrides(tiny_qwen2_dir, data, small / "run", 2))
        assert not (small / "run" / "logs").exists()  # no SGLang server was started
    checkpoints = small / "run" / "checkpoints"
    assert line.startswith(f"rlhf-train: error: checkpoint directory {checkpoints} has ")
    assert "a checkpoint of this run takes about" in line
