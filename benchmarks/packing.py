"""Useful-token share of fixed padded micro-batches vs packed token-budget micro-batches.

    python benchmarks/packing.py [--sequences 1024 --mini_batch 256 --dp 8 --budget 4096]

One PPO step's sequences (prompt + response) drawn from a GSM8K-like, long-tailed length
distribution (prompts 50-300 tokens, responses 10-512) are laid out three ways:
  - fixed_padded_to_max_length: `micro_batch_size` sequences per micro-batch, each padded to
    max_prompt + max_response (fixed-shape batches),
  - fixed_padded_to_batch_max: the same micro-batches padded to their longest sequence,
  - packed_token_budget: `rlhf.data.packing` plans (<= budget tokens, DP-balanced) built
    into THD batches by `rlhf.data.packed`.
Prints one JSON object: efficiency = real tokens / processed tokens, dp_imbalance = worst
mini-batch's max/mean - 1 of per-rank real tokens, micro-batches per rank per step.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch


def gsm8k_like_lengths(num: int, seed: int = 0) -> list[int]:
    """Prompt + response lengths: log-normal prompts in [50, 300], long-tailed responses in
    [10, 512] (about 5% hit the 512 cap, like responses cut at max_response_length)."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(110), 0.35, num), 50, 300).astype(int)
    responses = np.clip(rng.lognormal(np.log(170), 0.75, num), 10, 512).astype(int)
    return (prompts + responses).tolist()


def _imbalance(per_rank_per_mini: list[list[int]]) -> float:
    return max(max(t) / (sum(t) / len(t)) - 1 for t in per_rank_per_mini)


def fixed_layout(lengths, mini, dp, micro_bs, padded_len: int | None) -> dict:
    """Contiguous DP split and micro-batches of `micro_bs`; padded to `padded_len` or batch max."""
    processed, micro_count, rank_tokens = 0, 0, []
    for start in range(0, len(lengths), mini):
        per_rank = mini // dp
        ranks = [lengths[start + r * per_rank : start + (r + 1) * per_rank] for r in range(dp)]
        rank_tokens.append([sum(r) for r in ranks])
        for rank in ranks:
            for m in range(0, len(rank), micro_bs):
                micro = rank[m : m + micro_bs]
                processed += len(micro) * (padded_len or max(micro))
                micro_count += 1
    return {
        "efficiency": round(sum(lengths) / processed, 4),
        "dp_imbalance": round(_imbalance(rank_tokens), 4),
        "micro_batches_per_rank": micro_count // dp,
    }


def packed_layout(lengths, mini, dp, budget, pad_multiple) -> dict:
    from rlhf.data.packed import pack_sequences
    from rlhf.data.packing import plan_micro_batches

    plan = plan_micro_batches(
        lengths,
        max_tokens_per_micro_batch=budget,
        dp_size=dp,
        mini_batch_size=mini,
        pad_to_multiple_of=pad_multiple,
    )
    seqs = [torch.ones(n, dtype=torch.long) for n in lengths]
    processed, micro_count, rank_tokens = 0, 0, []
    for mini_batch in plan.assignments:
        rank_tokens.append([sum(lengths[i] for mb in rank for i in mb) for rank in mini_batch])
        for rank in mini_batch:
            for micro in rank:
                packed = pack_sequences([seqs[i] for i in micro], pad_to_multiple_of=pad_multiple)
                assert packed.num_tokens <= budget
                processed += packed.num_tokens
                micro_count += 1
    return {
        "efficiency": round(sum(lengths) / processed, 4),
        "dp_imbalance": round(_imbalance(rank_tokens), 4),
        "micro_batches_per_rank": micro_count // dp,
        "budget_fill": round(sum(lengths) / (micro_count * budget), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=1024, help="samples per step")
    parser.add_argument("--mini_batch", type=int, default=256, help="samples per mini-batch")
    parser.add_argument("--dp", type=int, default=8, help="data-parallel ranks")
    parser.add_argument("--budget", type=int, default=4096, help="tokens per micro-batch")
    parser.add_argument("--micro_batch_size", type=int, default=4, help="fixed layout")
    parser.add_argument("--pad_to_multiple_of", type=int, default=1, help="2 x CP size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    lengths = gsm8k_like_lengths(args.sequences, args.seed)
    common = (lengths, args.mini_batch, args.dp)
    result = {
        "setup": {**vars(args), "max_prompt_length": 300, "max_response_length": 512},
        "lengths": {
            "mean": round(float(np.mean(lengths)), 1),
            "p50": int(np.percentile(lengths, 50)),
            "p95": int(np.percentile(lengths, 95)),
            "max": max(lengths),
        },
        "fixed_padded_to_max_length": fixed_layout(*common, args.micro_batch_size, 300 + 512),
        "fixed_padded_to_batch_max": fixed_layout(*common, args.micro_batch_size, None),
        "packed_token_budget": packed_layout(*common, args.budget, args.pad_to_multiple_of),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
