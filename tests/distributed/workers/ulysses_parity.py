"""Worker: one forward/backward of an HF-initialised model at TP x Ulysses-SP.

Two inputs of 32 tokens: `padded` (2 rows, causal) and `packed` (one row holding samples
of 7, 13 and 12 tokens with a block-diagonal mask, so samples straddle the SP slices).
Each SP rank feeds its zig-zag slice. Rank 0 writes to OUT, per input: the full-vocabulary
logits [b, s, V], next-token log-probs [b, s], the mean next-token loss and the global
gradient norm after Megatron's DDP reduction (over DP x CP) and optimizer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from rlhf.distributed.bootstrap import init_parallel, seed_everything, teardown

SEQ = 32
PACKED_LENGTHS = (7, 13, 12)


def inputs(vocab: int):
    from rlhf.engine.micro_batch import block_causal_mask

    gen = torch.Generator().manual_seed(5)
    padded = torch.randint(3, vocab, (2, SEQ), generator=gen)
    valid_padded = torch.ones(2, SEQ, dtype=torch.bool)
    valid_padded[:, -1] = False  # the last position predicts nothing
    packed = torch.randint(3, vocab, (1, SEQ), generator=gen)
    valid_packed = torch.ones(1, SEQ, dtype=torch.bool)
    valid_packed[0, torch.tensor(PACKED_LENGTHS).cumsum(0) - 1] = False  # sample ends
    return {
        "padded": (padded, None, valid_padded),
        "packed": (packed, block_causal_mask(list(PACKED_LENGTHS)), valid_packed),
    }


def step(model, ddp, optimizer, ctx, tokens, mask, valid, vocab_size):
    from rlhf.models.forward import gather_vocab
    from rlhf.models.logprobs import vocab_parallel_logprobs_entropy
    from rlhf.parallel.ulysses import combine_positions, zigzag_positions

    positions = zigzag_positions(SEQ, ctx.sp_size, ctx.sp_rank)
    labels = torch.roll(tokens, -1, dims=1)
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    logits = ddp(tokens[:, positions], positions.expand(tokens.shape[0], -1), mask)
    local_vocab = logits.shape[-1]
    logp, _ = vocab_parallel_logprobs_entropy(
        logits,
        labels[:, positions],
        vocab_start=ctx.tp_rank * local_vocab,
        vocab_size=vocab_size,
        group=ctx.tp_group,
    )
    full_logp = combine_positions(logp, positions, SEQ, ctx.sp_group)
    loss = -(full_logp * valid).sum() / valid.sum()
    (loss * ctx.dp_sp_size).backward()  # DDP averages over DP x SP
    ddp.finish_grad_sync()
    _, grad_norm, _ = optimizer.step()
    full_logits = combine_positions(
        gather_vocab(logits.detach(), ctx.tp_group, vocab_size), positions, SEQ, ctx.sp_group
    )
    return {
        "logits": full_logits,
        "logprobs": full_logp.detach(),
        "loss": float(loss),
        "grad_norm": float(grad_norm),
    }


def run(args, ctx) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from rlhf.config.schema import OptimConfig
    from rlhf.engine.engine import OptimizerSettings, build_optimizer
    from rlhf.models.builder import build_model, load_hf_weights
    from rlhf.models.families import load_arch
    from rlhf.models.hf_io import HFCheckpointReader
    from rlhf.models.mapping import Placement

    arch = load_arch(args.model)
    placement = Placement.of(ctx)
    model = build_model(arch, placement, sp=args.sp)
    load_hf_weights(model, HFCheckpointReader(args.model), arch, placement)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    optimizer, _ = build_optimizer([ddp], OptimizerSettings(OptimConfig(lr=0.0), 0.0, 1))
    return {
        name: step(model, ddp, optimizer, ctx, tokens, mask, valid, arch.vocab_size)
        for name, (tokens, mask, valid) in inputs(arch.vocab_size).items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--sp", type=int, default=1)
    args = parser.parse_args()
    ctx = init_parallel("cpu", tp_size=args.tp, sp_size=args.sp)
    try:
        seed_everything(0)
        result = run(args, ctx)
        if ctx.rank == 0:
            torch.save(result, Path(args.out))
    finally:
        teardown()


if __name__ == "__main__":
    main()
