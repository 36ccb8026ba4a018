"""Offload and reload bandwidth of the trainer's offload path (rlhf.engine.offload).

`--gib` of model-like state (storages of 64 MiB to 1 GiB, as DDP buffers and Adam states
are) goes off the device into (pinned, on CUDA) host memory and back, `--repeats` times,
through `StorageOffloader`, the code the trainer runs between phases. Prints one JSON
object: GB/s each way (median), the bytes, the device, whether the host copies are pinned.

    python benchmarks/offload_bandwidth.py [--gib 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rlhf.engine.offload import StorageOffloader

SIZES_MIB = (1024, 512, 256, 128, 64)


def state(total_bytes: int, device: torch.device) -> list[torch.Tensor]:
    """Tensors of decreasing sizes adding up to about `total_bytes`."""
    tensors, left, mib = [], total_bytes, 1024**2
    for size in SIZES_MIB * 64:
        if left < size * mib:
            continue
        tensors.append(torch.ones(size * mib, dtype=torch.uint8, device=device))
        left -= size * mib
    return tensors


def timed(call, device: torch.device) -> float:
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=None, help="default: 4 on CUDA, 0.25 on CPU")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gib = args.gib or (4.0 if device.type == "cuda" else 0.25)
    tensors = state(int(gib * 1024**3), device)
    part = StorageOffloader.of(tensors)
    off, back = [], []
    for _ in range(args.repeats):
        off.append(part.nbytes / timed(part.offload, device))
        back.append(part.nbytes / timed(part.reload, device))
    assert all(bool((t == 1).all()) for t in tensors), "the round trip changed the bytes"
    print(
        json.dumps(
            {
                "device": str(device),
                "bytes": part.nbytes,
                "pinned": device.type == "cuda",
                "offload_GBps": round(statistics.median(off) / 1e9, 2),
                "reload_GBps": round(statistics.median(back) / 1e9, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
