"""Measured vs planned activation memory of the actor's training micro-batch.

    python benchmarks/memory.py [--hidden 256 --layers 4 --tokens 1024 --dtype float32]

A tiny HF-initialised Qwen2 (sized by the flags) is built as the trainer builds its actor,
once per recompute setting (none, selective, full), and one packed micro-batch of exactly
`--tokens` tokens goes through `compute_gradients` (`benchmarks/activation_probe.py`):
torch.profiler's memory timeline on CPU, the CUDA allocator's peak on GPU. The planner's
estimate is for the attention this process runs: Transformer Engine's fused attention when
usable, else the local spec (as on CPU).

Prints one JSON object: per recompute setting the measured and estimated peak bytes and
their ratio, plus device, dtype and model size.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from rlhf.distributed import bootstrap


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of the micro-batch")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    return parser.parse_args()


def main() -> None:
    from activation_probe import measure_activations  # benchmarks/, beside this script

    from rlhf.models.gpt import transformer_engine_usable
    from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model

    args = parse_args()
    ctx = bootstrap.init_parallel("auto" if torch.cuda.is_available() else "cpu")
    attention = "cuda" if transformer_engine_usable() else "cpu"  # fused vs local attention
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model(
            Path(tmp) / "model", TinyModelSpec.scaled(args.hidden, args.layers)
        )
        for recompute in ("none", "selective", "full"):
            found = measure_activations(
                model_dir,
                ctx,
                args.tokens,
                recompute=recompute,
                dtype=args.dtype,
                planned_attention=attention,
            )
            results[recompute] = {
                "measured_bytes": found.peak,
                "estimated_bytes": found.estimate,
                "ratio": round(found.estimate / found.peak, 3),
            }
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    bootstrap.teardown()
    setup = {"tokens": args.tokens, "hidden": args.hidden, "layers": args.layers}
    print(
        json.dumps(
            {
                **setup,
                "dtype": args.dtype,
                "device": ctx.device.type,
                "attention": attention,
                "recompute": results,
            }
        )
    )


if __name__ == "__main__":
    main()
