"""Worker: a vision-language HF checkpoint loaded into Megatron at a TP/PP layout; the logits
of `--inputs` (input_ids, position_ids [3, b, s], pixel_values, image_grid_thw), written by
TP rank 0 of the last pipeline stage to `--out`."""

from __future__ import annotations

import argparse

import torch

from rlhf.distributed.bootstrap import init_parallel, seed_everything, teardown
from rlhf.models.mapping import Placement


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    args = parser.parse_args()
    env = init_parallel("cpu", tp_size=args.tp, pp_size=args.pp)
    seed_everything(0)
    from rlhf.models.builder import build_model, load_hf_weights
    from rlhf.models.families import load_arch
    from rlhf.models.forward import forward_logits, gather_vocab
    from rlhf.models.hf_io import HFCheckpointReader

    placement = Placement.of(env)
    arch = load_arch(args.model)
    model = build_model(arch, placement, sequence_parallel=env.sequence_parallel)
    load_hf_weights(model, HFCheckpointReader(args.model), arch, placement)
    batch = torch.load(args.inputs)
    extra = {k: batch[k] for k in ("position_ids", "pixel_values", "image_grid_thw")}
    output = forward_logits(model.eval(), batch["input_ids"], inputs=extra)
    if output is not None:
        logits = gather_vocab(output, env.tp_group, arch.vocab_size)
        if placement.tp_rank == 0:
            torch.save(logits, args.out)
    teardown()


if __name__ == "__main__":
    main()
