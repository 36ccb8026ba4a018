"""Rollout throughput on SGLang servers through `SGLangEngine`, for a tiny model.

    python benchmarks/rollout.py [--prompts 32 --n 4 --max-new-tokens 64 --servers 1]

Builds a tiny random Qwen2 (`rlhf.quickstart.tiny_model`) in a temporary directory, launches the
server(s) (CPU without CUDA), runs one warm-up batch and then one measured batch of
arithmetic prompts. Prints one JSON object:
  - tokens_per_s: generated tokens / wall time of the measured batch (client side);
  - engine_share: sum of SGLang's per-request `meta_info.e2e_latency` (tokenise, queue,
    prefill, decode, detokenise inside the server) / sum of the client-side time of the same
    requests. The rest is HTTP, JSON and our client; overlapping requests count in both sums
    alike, so this is the share of a request's life spent inside the engine;
  - startup_s, wall_s, samples, generated_tokens, requests, and the settings.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from rlhf.config.schema import RolloutConfig
from rlhf.data.prompts import encode_prompts
from rlhf.quickstart.arithmetic import make_problems
from rlhf.quickstart.tiny_model import save_tiny_model
from rlhf.rollout.engine import SamplingParams, SGLangEngine


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--router", action="store_true", help="route through sglang-router")
    return parser.parse_args()


def measure(args: argparse.Namespace, workdir: Path) -> dict:
    model_dir = save_tiny_model(workdir / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = make_problems(args.prompts, seed=0)
    prompts = encode_prompts([r["prompt"] for r in rows], tokenizer, apply_chat_template=True)
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    rollout = RolloutConfig(
        dtype="float32" if device == "cpu" else "bfloat16",
        num_servers=args.servers,
        use_router=args.router,
    )
    start = time.perf_counter()
    with SGLangEngine(
        rollout,
        model_dir,
        log_dir=workdir / "logs",
        device=device,
        max_total_tokens=max(2048, args.prompts * args.n * longest) if device == "cpu" else None,
    ) as engine:
        startup_s = time.perf_counter() - start
        engine.generate(prompts, params)  # warm-up
        engine.generate(prompts, params)
        stats = engine.last_stats
    return {
        "benchmark": "rollout",
        "device": device,
        "servers": args.servers,
        "router": args.router,
        "prompts": args.prompts,
        "n": args.n,
        "max_new_tokens": args.max_new_tokens,
        "startup_s": round(startup_s, 2),
        "wall_s": round(stats.wall_s, 3),
        "requests": stats.requests,
        "samples": stats.samples,
        "generated_tokens": stats.generated_tokens,
        "tokens_per_s": round(stats.tokens_per_s, 1),
        "engine_share": None if stats.engine_share is None else round(stats.engine_share, 3),
    }


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="rollout_bench_") as tmp:
        print(json.dumps(measure(args, Path(tmp))))


if __name__ == "__main__":
    main()
