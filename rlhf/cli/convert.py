"""rlhf-convert: HF <-> Megatron-Core checkpoints, verified against HF transformers.

    rlhf-convert hf-to-mcore HF_DIR OUT_DIR [--tp N] [--pp N]
    rlhf-convert mcore-to-hf MCORE_DIR OUT_DIR [--max-shard-size-mb M]
    rlhf-convert verify HF_DIR MCORE_DIR [--tol X] [--tp N] [--pp N]

MCORE_DIR may be a trainer checkpoint's `global_step_N/actor` (a causal LM) or
`global_step_N/critic` (exported as a one-label `*ForTokenClassification` model whose
per-token logits are the critic's values).

With TP x PP > 1 the command re-launches itself under torchrun with that many processes
(or runs as is when torchrun already started it with the right world size). `verify`
prints the largest absolute logit difference and exits 1 above the tolerance. Errors in
the inputs exit 2 with one line naming the file or tensor; those found from the configs and
safetensors headers alone are found before torchrun starts.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rlhf-convert", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF directory -> Megatron distributed checkpoint")
    to_mcore.add_argument("hf_dir", type=Path)
    to_mcore.add_argument("out_dir", type=Path)
    to_hf = sub.add_parser("mcore-to-hf", help="Megatron checkpoint -> HF safetensors directory")
    to_hf.add_argument("mcore_dir", type=Path)
    to_hf.add_argument("out_dir", type=Path)
    to_hf.add_argument("--max-shard-size-mb", type=int, default=2048)
    verify = sub.add_parser("verify", help="compare logits of an HF and a Megatron checkpoint")
    verify.add_argument("hf_dir", type=Path)
    verify.add_argument("mcore_dir", type=Path)
    verify.add_argument("--tol", type=float, default=1e-4, help="max allowed |logit diff|")
    verify.add_argument("--batch", type=int, default=2)
    verify.add_argument("--seq", type=int, default=64)
    verify.add_argument("--seed", type=int, default=0)
    verify.add_argument("--dump-logits", type=Path, help="also save the Megatron logits here")
    for p in (to_mcore, verify):
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
        p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    return parser.parse_args(argv)


def relaunch_under_torchrun(num_procs: int, argv: list[str]) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(num_procs),
        "-m",
        "rlhf.cli.convert",
        *argv,
    ]
    return subprocess.run(cmd, check=False).returncode


def run(args: argparse.Namespace) -> int:
    from rlhf.distributed import bootstrap
    from rlhf.models import convert
    from rlhf.models.mapping import Placement

    tp, pp = getattr(args, "tp", 1), getattr(args, "pp", 1)
    ctx = bootstrap.init_parallel("auto", tp_size=tp, pp_size=pp)
    try:
        bootstrap.seed_everything(0)
        placement = Placement.of(ctx)
        if args.command == "mcore-to-hf":
            convert.mcore_to_hf(args.mcore_dir, args.out_dir, args.max_shard_size_mb * 1024**2)
            print(f"wrote HF checkpoint to {args.out_dir}")
            return 0
        if args.command == "hf-to-mcore":
            convert.hf_to_mcore(args.hf_dir, args.out_dir, placement)
            if ctx.is_main:
                print(f"wrote Megatron checkpoint (TP {args.tp}, PP {args.pp}) to {args.out_dir}")
            return 0
        return verify(args, ctx)
    finally:
        bootstrap.teardown()


def verify(args: argparse.Namespace, ctx) -> int:
    import torch.distributed as dist

    from rlhf.models import convert
    from rlhf.models.forward import forward_logits, gather_vocab
    from rlhf.models.mapping import Placement

    model, arch = convert.load_mcore(args.mcore_dir, Placement.of(ctx))
    model = model.float().eval()
    value_model = convert.read_meta(args.mcore_dir).get("head") == "value"  # [b, s, 1] values
    tokens = convert.random_tokens(arch.vocab_size, args.batch, args.seq, args.seed)
    logits = forward_logits(model, tokens, micro_batch_size=1)
    diff = torch.zeros((), device=ctx.device)
    if logits is not None:
        full = logits if value_model else gather_vocab(logits, ctx.tp_group, arch.vocab_size)
        full = full.cpu()
        if ctx.tp_rank == 0:
            diff = (full - convert.hf_logits(args.hf_dir, tokens)).abs().max().to(ctx.device)
            if args.dump_logits:
                torch.save(full, args.dump_logits)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    ok = diff.item() <= args.tol
    if ctx.is_main:
        verdict = "OK" if ok else "FAILED"
        print(
            f"verify: max |logit diff| = {diff.item():.3e} on {args.batch}x{args.seq} random "
            f"tokens at TP {args.tp} PP {args.pp} (tolerance {args.tol:.1e}): {verdict}"
        )
    return 0 if ok else 1


def preflight(args: argparse.Namespace) -> None:
    """The input checks that need no process group, run before torchrun launches workers:
    a worker that fails ends in torchrun's traceback, after the one-line message."""
    from rlhf.models import convert

    tp, pp = getattr(args, "tp", 1), getattr(args, "pp", 1)
    if args.command == "hf-to-mcore":
        convert.check_hf_to_mcore(args.hf_dir, args.out_dir, tp, pp)
    elif args.command == "verify":
        convert.check_verify(args.mcore_dir, tp, pp)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    num_procs = getattr(args, "tp", 1) * getattr(args, "pp", 1)
    launched = int(os.environ.get("WORLD_SIZE", 0))
    if launched and launched != num_procs:
        print(
            f"rlhf-convert: error: launched with {launched} processes, "
            f"but --tp x --pp = {num_procs}",
            file=sys.stderr,
        )
        return 2
    try:
        preflight(args)
        if num_procs > 1 and not launched:
            return relaunch_under_torchrun(num_procs, argv)
        return run(args)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"rlhf-convert: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
