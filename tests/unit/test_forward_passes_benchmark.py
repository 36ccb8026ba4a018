"""benchmarks/forward_passes.py: rlhf-train runs with its forward-only passes wrapped, each
followed by transformers' forward over the same sequences in the trainer's process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow(reason="a benchmark: a 2-step rlhf-train run with its server")


def test_every_pass_is_timed_beside_a_transformers_forward():
    """Two steps at a one-layer model: the old-log-prob, reference and values passes each
    have both sides timed and a ratio (a wrapper that no longer finds an engine method, or
    names a pass wrongly, leaves that pass without rows and the report fails)."""
    args = ["--steps", "2", "--hidden", "64", "--layers", "1", "--prompts", "2", "--n", "2"]
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "forward_passes.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    passes = json.loads(done.stdout)["passes"]
    assert sorted(passes) == ["old_log_prob", "ref", "values"]
    for timed in passes.values():
        assert timed["rlhf_s"] > 0 and timed["transformers_s"] > 0
        assert timed["ratio"] == timed["rlhf_s"] / timed["transformers_s"]
