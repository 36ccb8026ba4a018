"""Checkpoint conversion throughput against a plain safetensors read of the same bytes.

    python benchmarks/convert.py [--hidden 512 --layers 8 --vocab 32000]

Builds a random Qwen2-shaped HF checkpoint (fp32) in a temporary directory, then times in
one process (TP = PP = 1, warm page cache for every measurement):
  - a plain `safetensors.torch.load_file` of the checkpoint (the I/O yardstick),
  - hf-to-mcore (sliced reads into Megatron + distributed-checkpoint save), once cold (the
    first save in a process starts Megatron's writer processes) and once warm,
  - mcore-to-hf (distributed-checkpoint load + export to sharded safetensors).
Prints one JSON object with seconds and GB/s for each.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file


def make_checkpoint(out: Path, hidden: int, layers: int, vocab: int) -> int:
    """A random Qwen2-shaped fp32 checkpoint (with the tiny tokenizer); returns its bytes."""
    from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model

    spec = TinyModelSpec(
        family="qwen2",
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
    )
    save_tiny_model(out, spec, vocab_size=vocab)
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()

    from rlhf.distributed import bootstrap
    from rlhf.models import convert
    from rlhf.models.mapping import Placement

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hf_dir = root / "hf"
        nbytes = make_checkpoint(hf_dir, args.hidden, args.layers, args.vocab)
        files = sorted(hf_dir.glob("*.safetensors"))
        for file in files:  # warm the page cache
            load_file(file)
        plain_s = timed(lambda: [t.clone() for f in files for t in load_file(f).values()])

        ctx = bootstrap.init_parallel("auto")
        bootstrap.seed_everything(0)
        placement = Placement.of(ctx)
        # The first Megatron save also starts its writer processes (a one-time cost).
        first_s = timed(lambda: convert.hf_to_mcore(hf_dir, root / "mcore_first", placement))
        to_mcore_s = timed(lambda: convert.hf_to_mcore(hf_dir, root / "mcore", placement))
        to_hf_s = timed(lambda: convert.mcore_to_hf(root / "mcore", root / "hf_back", 2 * 1024**3))
        bootstrap.teardown()

    gb = nbytes / 1e9
    print(
        json.dumps(
            {
                "benchmark": "convert",
                "checkpoint_gb": round(gb, 4),
                "params_millions": round(nbytes / 4 / 1e6, 1),
                "plain_safetensors_read": {
                    "seconds": round(plain_s, 3),
                    "gb_per_s": round(gb / plain_s, 3),
                },
                "hf_to_mcore_first_in_process": {"seconds": round(first_s, 3)},
                "hf_to_mcore": {
                    "seconds": round(to_mcore_s, 3),
                    "gb_per_s": round(gb / to_mcore_s, 3),
                },
                "mcore_to_hf": {"seconds": round(to_hf_s, 3), "gb_per_s": round(gb / to_hf_s, 3)},
                "hf_to_mcore_vs_plain_read": round(plain_s / to_mcore_s, 3),
                "device": "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(),
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
