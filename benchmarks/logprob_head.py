"""The log-prob / entropy head alone: bytes per logit and seconds, forward and training.

    python benchmarks/logprob_head.py [--tokens 4096 --vocab 151936 --dtype bfloat16]

One rank, the whole vocabulary (what one TP rank of a 152k-vocabulary model holds at TP1).
Random logits in the model dtype stand for the output layer's; the head turns them into
per-token log-probs and entropies (`rlhf.models.logprobs`), and a training pass backpropagates
a weighted sum of both into the logits. Memory is the peak of everything alive during the
call, the logits included, divided by tokens x vocabulary: `rlhf.memory.measure` (the
profiler's memory timeline on CPU, the allocator's peak on CUDA). The same is measured for
`torch.log_softmax` over fp32 logits (what a plain implementation does) as a reference.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from rlhf.memory.measure import peak_bytes_during
from rlhf.models.logprobs import vocab_parallel_logprobs_entropy


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args(argv)


def project_head(logits, targets, temperature):
    return vocab_parallel_logprobs_entropy(
        logits, targets, vocab_start=0, vocab_size=logits.shape[-1], temperature=temperature
    )


def log_softmax_head(logits, targets, temperature):
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets[:, None])[:, 0]
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def measure(head: Callable, args, device: torch.device) -> dict[str, float]:
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.tokens, args.vocab, generator=gen) * 2).to(device, dtype)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device)
    weights = torch.randn(2, args.tokens, generator=gen).to(device)
    logit_bytes = logits.numel() * logits.element_size()

    def forward():
        with torch.no_grad():
            return head(logits, targets, args.temperature)

    def train():
        leaf = logits.detach().requires_grad_()
        logp, entropy = head(leaf, targets, args.temperature)
        (weights[0] * logp + weights[1] * entropy).sum().backward()
        return leaf.grad

    found = {}
    for name, fn in {"forward": forward, "training": train}.items():
        fn()  # warm-up
        _, peak = peak_bytes_during(fn, device)
        seconds = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        found[f"{name}_bytes_per_logit"] = round((logit_bytes + peak) / logits.numel(), 2)
        found[f"{name}_seconds"] = round(min(seconds), 4)
    return found


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {
        "tokens": args.tokens,
        "vocab": args.vocab,
        "dtype": args.dtype,
        "device": device.type,
        "project_head": measure(project_head, args, device),
        "log_softmax_fp32": measure(log_softmax_head, args, device),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
