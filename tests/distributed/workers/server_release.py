"""Worker: colocated servers released on a node of gloo ranks (`PolicyServers.release_memory`).

Rank 0 owns the node's servers; releasing one takes a second (SGLang frees its memory when
asked: on a GPU that is the CUDA call, here a sleep). Every rank writes, after its own
`release_memory` returned, when the device ledger saw SGLang leave its device; rank 0 also
when its last release was done. Rank 0 writes them all as JSON to OUT.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

from rlhf.distributed.bootstrap import init_parallel, teardown
from rlhf.memory import ledger
from rlhf.rollout.policy_servers import PolicyServers

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]  # never called: the release is timed


def servers(ctx) -> PolicyServers:
    """The node's servers as every rank holds them (rank 0 the engine), not launched."""
    fleet = object.__new__(PolicyServers)
    fleet.ctx, fleet.sleeps, fleet.colocated, fleet.asleep = ctx, True, True, set()
    fleet.engine = SimpleNamespace(server_urls=URLS) if ctx.rank == 0 else None
    fleet.weights_released, fleet.released_at = False, 0.0

    def release(url: str) -> None:
        time.sleep(1.0)
        fleet.released_at = time.monotonic()

    fleet._release = release  # type: ignore[method-assign]
    return fleet


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ctx = init_parallel("cpu")
    try:
        book = ledger.reset()
        fleet = servers(ctx)
        fleet.note_started()
        fleet.release_memory()
        left = [e.time_s for e in book.events if e.action == "off" and e.owner == "sglang"]
        mine = {"rank": ctx.rank, "left": min(left), "released_at": fleet.released_at}
        gathered: list = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine)
        if ctx.rank == 0:
            Path(args.out).write_text(json.dumps(gathered))
    finally:
        teardown()


if __name__ == "__main__":
    main()
