"""Worker: vocab-parallel log-probs/entropy and their gradients on TP ranks.

Every rank builds the same full logits (seeded), keeps its vocabulary slice, computes
log-probs and entropy (per CASES: in one chunk at temperature 1, or in chunks of 4 tokens
at temperature 0.7), backpropagates a fixed weighted sum, and rank 0 saves the results
with the gathered gradient of the full logits.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from rlhf.models.logprobs import vocab_parallel_logprobs_entropy

VOCAB, PADDED = 50, 64
# name: (token shape, tokens per chunk, temperature); 19 tokens in chunks of 4 end short
CASES = {"padded_bs": ((3, 7), None, 1.0), "packed_t": ((19,), 4, 0.7)}


def case(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, PADDED, generator=gen) * 3
    targets = torch.randint(0, VOCAB, shape, generator=gen)
    weights = torch.randn(2, *shape, generator=gen)
    return logits, targets, weights


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name, (shape, chunk_tokens, temperature) in CASES.items():
        logits, targets, weights = case(shape, seed=len(name))
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
