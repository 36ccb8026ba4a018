"""`rlhf-rollout`: stored rollouts (`data.rollout_files`) from any policy, on SGLang.

    rlhf-rollout MODEL --data FILE.parquet [FILE ...] --out DIR [--n 4] [--temperature 1.0]
        [--top-p 1.0] [--max-response-length N] [--batch-size 64] [--server-url URL]
        [--config CFG] [key=value ...]

MODEL is an HF model directory or a trainer checkpoint (as for `rlhf-eval`: `global_step_N`,
its `actor/`, or a `checkpoints/` directory; exported to HF first when it has no HF copy).
An SGLang server is started on it, or `--server-url` names a running one (MODEL then gives
the tokenizer). The config (the defaults, or `--config` and overrides) gives the prompt
length policy (`data.*`), the rewards (`reward.*`), the sampling
(`actor_rollout_ref.rollout`: n, temperature, top_p, top_k, which the options set) and the
servers. DIR gets one `part_NNNNN.parquet` per batch of prompts and `rollout.json`; the
same command on the same DIR resumes after the last stored batch
(`rlhf.rollout.offline`). Errors in the inputs exit 2 with one line; an unreachable server
exits 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

from rlhf.cli.eval import exit_code, policy_hf_dir
from rlhf.config import RLHFConfig, load_config
from rlhf.errors import UserError, ends_in_one_line

AR = "actor_rollout_ref.rollout"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rlhf-rollout", description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="HF model directory or trainer checkpoint")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides")
    parser.add_argument("--data", nargs="+", help="Parquet prompts (default: data.train_files)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--config", help="YAML run config (default: the built-in defaults)")
    parser.add_argument("--n", type=int, help="responses per prompt")
    parser.add_argument("--temperature", type=float, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling threshold")
    parser.add_argument("--max-response-length", type=int, help="tokens per response")
    parser.add_argument("--server-url", help="a running SGLang server serving MODEL")
    parser.add_argument("--batch-size", type=int, default=64, help="prompts per stored file")
    return parser.parse_intermixed_args(argv)


def rollout_config(args: argparse.Namespace) -> RLHFConfig:
    """The config with the command's options applied as overrides."""
    shortcuts = []
    for option, key in (("n", "n"), ("temperature", "temperature"), ("top_p", "top_p")):
        if getattr(args, option) is not None:
            shortcuts.append(f"{AR}.{key}={getattr(args, option)}")
    if args.max_response_length is not None:
        shortcuts.append(f"data.max_response_length={args.max_response_length}")
    if args.server_url:
        shortcuts.append(f"{AR}.server_urls=[{args.server_url}]")
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: must be >= 1")
    return load_config(args.config, [*shortcuts, *args.overrides])


def run(args: argparse.Namespace) -> None:
    """The stored rollouts the command line asks for (`write_rollouts`)."""
    import torch

    from rlhf.rollout.offline import write_rollouts

    cfg = rollout_config(args)
    data = args.data or cfg.data.train_files
    if not data:
        raise UserError("no prompts: pass --data FILE.parquet or set data.train_files")
    data_files = [data] if isinstance(data, str) else list(data)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory(prefix="rlhf_rollout_") as scratch:
        hf_dir = policy_hf_dir(args.model, Path(scratch))
        plan = write_rollouts(
            cfg,
            hf_dir,
            str(args.model),
            data_files,
            args.out,
            device=device,
            batch_size=args.batch_size,
        )
    print(
        f"rlhf-rollout: {plan.prompts} prompts x {plan.n} samples in {plan.batches} files "
        f"under {args.out} (train from them with data.rollout_files={args.out}/part_*.parquet)"
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    return exit_code("rlhf-rollout", lambda: run(args))


main = ends_in_one_line("rlhf-rollout")(main)  # rlhf.errors: one line, exit 2 or 1


if __name__ == "__main__":
    sys.exit(main())
