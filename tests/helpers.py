"""Launching worker scripts under torchrun from tests."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
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
    # Output goes to a file, not a pipe: helper daemons a worker leaves behind (e.g. torch's
    # shared-memory manager, which lives as long as an SGLang server uses its tensors)
    # would keep a pipe open and make the wait hang.
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        log.seek(0)
        output = log.read()
    if proc.returncode != 0:
        raise AssertionError(
            f"{script} on {nproc} ranks exited {proc.returncode}:\n{output[-8000:]}"
        )
