"""Launching worker scripts under torchrun from tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlhf.distributed.bootstrap import free_port

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "distributed" / "workers"


def run_torchrun(script: str, nproc: int, args: list[str], timeout_s: float = 600) -> None:
    """Run `tests/distributed/workers/<script>` on `nproc` gloo ranks; raise with its log."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()),
        str(WORKERS / script), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise AssertionError(
            f"{script} on {nproc} ranks exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
            f"{proc.stderr[-6000:]}"
        )
