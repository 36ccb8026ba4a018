"""Worker: the actor's (or `--role critic`) gradients and peak activation memory per
recompute setting.

For each `--variants` entry (none, selective, full) `benchmarks/activation_probe.py` builds
the actor with that `megatron.recompute_granularity` and measures one packed micro-batch of
exactly `--tokens` tokens through `compute_gradients`. Rank 0 writes, per variant, the
gradients, the measured peak bytes and the memory planner's activation estimate.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from rlhf.distributed.bootstrap import init_parallel, teardown


def main() -> None:
    from benchmarks.activation_probe import measure_activations

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--variants", default="none,selective,full")
    parser.add_argument("--role", default="actor", choices=["actor", "critic"])
    parser.add_argument("--sequence-parallel", choices=["true", "false"])
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--vp", type=int, default=1, help="virtual-pipeline chunks per stage")
    parser.add_argument(
        "--chunk-mib", type=int, help="the log-prob head's fp32 chunk (default: its own)"
    )
    args = parser.parse_args()
    if args.chunk_mib is not None:  # read at call time by the head and by the planner
        from rlhf.models import logprobs

        logprobs.CHUNK_BYTES = args.chunk_mib * 2**20
    split = None if args.sequence_parallel is None else args.sequence_parallel == "true"
    ctx = init_parallel("cpu", tp_size=args.tp, pp_size=args.pp, sequence_parallel=split)
    try:
        results = {}
        for recompute in args.variants.split(","):
            found = measure_activations(
                args.model,
                ctx,
                args.tokens,
                role=args.role,
                sequence_parallel=split,
                micro_batches=args.micro_batches,
                vp=args.vp,
                recompute=recompute,
                dtype=args.dtype,
            )
            results[recompute] = {
                "grads": found.grads,
                "peak": found.peak,
                "estimate": found.estimate,
            }
        if ctx.rank == 0:
            torch.save(results, Path(args.out))
    finally:
        teardown()


if __name__ == "__main__":
    main()
