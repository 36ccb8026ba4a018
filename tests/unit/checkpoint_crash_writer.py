"""Helper for the SIGKILL test: save step 1, then write step 2 slowly until killed.

Run as `python checkpoint_crash_writer.py <root>`; the test kills it once the temp dir of
step 2 holds part of the big file. If nobody kills it, it gives up after a bounded time.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from rlhf.checkpoint import CheckpointManager, save_trainer_state

MODEL_STEP_1 = torch.arange(1000, dtype=torch.float32)
CHUNK = b"x" * (1 << 20)
MAX_CHUNKS = 600  # about 60 s at 0.1 s per chunk


def main(root: Path) -> None:
    manager = CheckpointManager(root, keep_last=None)
    torch.manual_seed(1)
    with manager.writing(1) as d:
        torch.save({"w": MODEL_STEP_1}, d / "model.pt")
        save_trainer_state(d, {"global_step": 1}, rank=0)
    with manager.writing(2) as d:
        save_trainer_state(d, {"global_step": 2}, rank=0)
        with open(d / "big.bin", "wb") as f:
            for _ in range(MAX_CHUNKS):
                f.write(CHUNK)
                f.flush()
                time.sleep(0.1)
    sys.exit("was not killed")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
