"""Worker: load HF checkpoints into Megatron at a TP/PP(/EP) layout and save what they compute.

For each `--model NAME=DIR`, the rank holding TP rank 0 of the last pipeline stage writes
`OUT_DIR/NAME.pt`: logits [b, s, vocab] for the tokens in `--tokens`, or with
`--value-model` {"values": [b, s], "head": [1, h]} of the value model built from DIR.
Every rank also writes how many checkpoint bytes it read (`NAME.read.RANK.json`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from rlhf.distributed.bootstrap import init_parallel, seed_everything, teardown
from rlhf.models.mapping import Placement


def build(hf_dir: str, placement, value_model: bool, sequence_parallel: bool):
    """(model, arch, reader): the policy with its HF reader, or the value model (seed 11);
    with Megatron's sequence parallelism when the context has it (TP > 1)."""
    from rlhf.models.builder import build_model, load_hf_weights, value_model_from_hf
    from rlhf.models.families import load_arch
    from rlhf.models.hf_io import HFCheckpointReader

    if value_model:
        (model,), arch = value_model_from_hf(
            hf_dir, placement, seed=11, sequence_parallel=sequence_parallel
        )
        return model, arch, None
    arch = load_arch(hf_dir)
    model = build_model(arch, placement, sequence_parallel=sequence_parallel)
    reader = HFCheckpointReader(hf_dir)
    load_hf_weights(model, reader, arch, placement)
    return model, arch, reader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", action="append", required=True, help="NAME=HF_DIR")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size")
    parser.add_argument("--etp", type=int, default=None, help="expert-TP size (default: TP)")
    parser.add_argument("--tokens", required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--value-model", action="store_true")
    args = parser.parse_args()
    env = init_parallel("cpu", tp_size=args.tp, pp_size=args.pp, ep_size=args.ep, etp_size=args.etp)
    seed_everything(0)
    from rlhf.models.forward import forward_logits, gather_vocab

    placement = Placement.of(env)
    tokens = torch.load(args.tokens)
    for spec in args.model:
        name, hf_dir = spec.split("=", 1)
        model, arch, reader = build(hf_dir, placement, args.value_model, env.sequence_parallel)
        if reader is not None:
            read = {"bytes_read": reader.bytes_read, "total_bytes": reader.total_bytes()}
            Path(args.out_dir, f"{name}.read.{env.rank}.json").write_text(json.dumps(read))
        output = forward_logits(model.eval(), tokens, micro_batch_size=1)
        if output is None:
            continue
        if args.value_model:
            result = {"values": output[..., 0], "head": model.output_layer.weight.detach()}
        else:
            result = gather_vocab(output, env.tp_group, arch.vocab_size)
        if placement.tp_rank == 0 and env.dp_rank == 0:
            torch.save(result, Path(args.out_dir) / f"{name}.pt")
    teardown()


if __name__ == "__main__":
    main()
