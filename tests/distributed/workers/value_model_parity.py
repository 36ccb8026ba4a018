"""Worker: value models on TP/PP ranks; saves per-token values [b, s] (and the head weight)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from rlhf.config.validate import ParallelDims
from rlhf.distributed.bootstrap import (
    current_placement,
    init_distributed,
    init_model_parallel,
    seed_everything,
    teardown,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", action="append", required=True, help="NAME=HF_DIR")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--tokens", required=True)
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()
    env = init_distributed("cpu")
    init_model_parallel(ParallelDims(world_size=env.world_size, tp=args.tp, pp=args.pp))
    seed_everything(0)
    from rlhf.models.builder import value_model_from_hf
    from rlhf.models.forward import forward_logits

    placement = current_placement()
    tokens = torch.load(args.tokens)
    for spec in args.model:
        name, hf_dir = spec.split("=", 1)
        model, _ = value_model_from_hf(hf_dir, placement, seed=11)
        values = forward_logits(model.eval(), tokens, micro_batch_size=1)
        if values is not None and placement.tp_rank == 0:
            head = model.output_layer.weight.detach()
            torch.save({"values": values[..., 0], "head": head}, Path(args.out_dir) / f"{name}.pt")
    teardown()


if __name__ == "__main__":
    main()
