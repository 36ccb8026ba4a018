"""What the launcher (torchrun, or an equivalent) told this process through its environment,
read without importing torch: the trainer's command line decides from it before its heavy
imports (`rlhf.cli.train`)."""

from __future__ import annotations

import os


def launched_world_size() -> int | None:
    """WORLD_SIZE when started by torchrun (or an equivalent launcher), else None."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


def launched_local_world_size() -> int | None:
    """The processes launched on this node: LOCAL_WORLD_SIZE when started by torchrun,
    WORLD_SIZE when a launcher set only that (one node, as `init_parallel` takes it), else
    None."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else launched_world_size()
