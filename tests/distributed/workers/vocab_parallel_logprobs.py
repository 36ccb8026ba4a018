"""Worker: vocab-parallel log-probs/entropy and their gradients on TP ranks.

Every rank builds the same full logits (seeded), keeps its vocabulary slice, computes
log-probs and entropy (per CASES: in one chunk at temperature 1, or in chunks of 4 tokens
at temperature 0.7, of every token or of some rows in a shuffled order), backpropagates a
fixed weighted sum, and rank 0 saves the results with the gathered gradient of the full
logits.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from rlhf.models.logprobs import vocab_parallel_logprobs_entropy

VOCAB, PADDED = 50, 64
# name: (token shape, tokens per chunk, temperature, rows of the flat tokens or None: all);
# 19 tokens in chunks of 4 end short, so do 9 rows
CASES = {
    "padded_bs": ((3, 7), None, 1.0, None),
    "packed_t": ((19,), 4, 0.7, None),
    "rows_t": ((19,), 4, 0.7, [17, 3, 4, 5, 11, 0, 12, 13, 18]),
}


def case(shape, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, PADDED, generator=gen) * 3
    targets = torch.randint(0, VOCAB, shape, generator=gen)
    weights = torch.randn(2, *(shape if rows is None else (len(rows),)), generator=gen)
    return logits, targets, weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name, (shape, chunk_tokens, temperature, rows) in CASES.items():
        logits, targets, weights = case(shape, rows, seed=len(name))
        local_vocab = PADDED // world
        local = logits[..., rank * local_vocab : (rank + 1) * local_vocab].clone().requires_grad_()
        logp, entropy = vocab_parallel_logprobs_entropy(
            local,
            targets,
            vocab_start=rank * local_vocab,
            vocab_size=VOCAB,
            group=dist.group.WORLD,
            temperature=temperature,
            chunk_tokens=chunk_tokens,
            rows=None if rows is None else torch.tensor(rows),
        )
        (weights[0] * logp + weights[1] * entropy).sum().backward()
        grads = [torch.empty_like(local.grad) for _ in range(world)]
        dist.all_gather(grads, local.grad.contiguous())
        results[name] = {
            "logp": logp.detach(),
            "entropy": entropy.detach(),
            "grad": torch.cat(grads, -1),
        }
    if rank == 0:
        torch.save(results, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
