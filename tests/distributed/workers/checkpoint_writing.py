"""Worker: every rank writes its own file into `CheckpointManager.writing`, for three steps."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from rlhf.checkpoint import CheckpointManager, load_trainer_state, save_trainer_state
from rlhf.distributed.bootstrap import init_parallel, teardown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    args = parser.parse_args()
    env = init_parallel("cpu")
    manager = CheckpointManager(args.root, keep_last=2)
    torch.manual_seed(100 + env.rank)
    for step in (1, 2, 3):
        with manager.writing(step) as d:
            (d / f"shard_rank{env.rank}.txt").write_text(f"step {step} rank {env.rank}")
            save_trainer_state(d, {"global_step": step}, rank=env.rank)
        expected = torch.rand(2).tolist()
    latest = manager.latest()
    state = load_trainer_state(latest, rank=env.rank)
    report = {
        "latest": str(latest),
        "state": state,
        "rng_restored": torch.rand(2).tolist() == expected,
    }
    Path(args.root, f"report_rank{env.rank}.json").write_text(json.dumps(report))
    teardown()


if __name__ == "__main__":
    main()
