"""rlhf-convert: HF <-> Megatron-Core checkpoints, verified against HF transformers.

    rlhf-convert hf-to-mcore HF_DIR OUT_DIR [--tp N] [--pp N] [--ep N] [--etp N]
    rlhf-convert mcore-to-hf MCORE_DIR OUT_DIR [--max-shard-size-mb M] [--peft]
    rlhf-convert verify HF_DIR MCORE_DIR [--tol X] [--tp N] [--pp N] [--ep N] [--etp N]

MCORE_DIR may be a trainer checkpoint's `global_step_N/actor` (a causal LM) or
`global_step_N/critic` (exported as a one-label `*ForTokenClassification` model whose
per-token logits are the critic's values). A LoRA actor exports merged (the base weights
with the adapters' update), or with `--peft` as a PEFT adapter directory for its base model
(`peft.PeftModel.from_pretrained(base, OUT_DIR)`).

Mixture-of-experts models (qwen2_moe, qwen3_moe) also split their experts over `--ep`
ranks and each expert over `--etp` ranks (expert tensor parallelism; default: --tp). The
command needs PP x lcm(TP, EP x ETP) processes (the attention's data-parallel ranks hold
the other experts); with more than one it re-launches itself under torchrun with that many
(or runs as is when torchrun already started it with the right world size). `verify`
prints the largest absolute logit difference and exits 1 above the tolerance. Errors in
the inputs exit 2 with one line naming the file or tensor; those found from the configs and
safetensors headers alone are found before torchrun starts.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from rlhf.errors import UserError, ends_in_one_line


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
    to_hf.add_argument(
        "--peft", action="store_true", help="a LoRA checkpoint's adapters alone, in PEFT's format"
    )
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
        p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
        p.add_argument("--etp", type=int, help="expert tensor-parallel size (default: --tp)")
    return parser.parse_args(argv)


def layout(args: argparse.Namespace):
    """The parallel sizes asked for, as a `Placement` (its ranks are 0), and the number of
    processes they need: PP x lcm(TP, EP x expert-TP)."""
    from rlhf.models.mapping import Placement

    tp, pp, ep = getattr(args, "tp", 1), getattr(args, "pp", 1), getattr(args, "ep", 1)
    etp = getattr(args, "etp", None) or tp
    for flag, size in (("--tp", tp), ("--pp", pp), ("--ep", ep), ("--etp", etp)):
        if size < 1:
            raise UserError(f"{flag} {size}: a parallel size is at least 1")
    placement = Placement(tp_size=tp, pp_size=pp, ep_size=ep, etp_rank=0, etp_size=etp)
    return placement, pp * math.lcm(tp, ep * etp)


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

    sizes, _ = layout(args)
    ctx = bootstrap.init_parallel(
        "auto",
        tp_size=sizes.tp_size,
        pp_size=sizes.pp_size,
        ep_size=sizes.ep_size,
        etp_size=sizes.etp_size,
    )
    try:
        bootstrap.seed_everything(0)
        placement = Placement.of(ctx)
        if args.command == "mcore-to-hf":
            if args.peft:
                convert.mcore_to_peft(args.mcore_dir, args.out_dir)
                print(f"wrote PEFT adapter to {args.out_dir}")
                return 0
            convert.mcore_to_hf(args.mcore_dir, args.out_dir, args.max_shard_size_mb * 1024**2)
            print(f"wrote HF checkpoint to {args.out_dir}")
            return 0
        if args.command == "hf-to-mcore":
            convert.hf_to_mcore(args.hf_dir, args.out_dir, placement)
            if ctx.is_main:
                print(f"wrote Megatron checkpoint ({describe(sizes)}) to {args.out_dir}")
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
    value_model = convert.read_meta(args.mcore_dir).get("head") in convert.SCALAR_HEADS
    tokens = convert.random_tokens(arch.vocab_size, args.batch, args.seq, args.seed)
    images = None
    if arch.vision is not None:  # a picture in every row: the vision tower is checked too
        tokens, images = convert.image_rows(arch, args.batch, args.seq, args.seed)
    logits = forward_logits(model, tokens, micro_batch_size=1, inputs=images)
    diff = torch.zeros((), device=ctx.device)
    failed, error = torch.zeros((), device=ctx.device), None
    if logits is not None:
        full = logits if value_model else gather_vocab(logits, ctx.tp_group, arch.vocab_size)
        full = full.cpu()
        if ctx.tp_rank == 0:
            try:  # transformers' side fails here alone: the other ranks must not wait on it
                want = convert.hf_logits(args.hf_dir, tokens, images)
                diff = (full - want).abs().max().to(ctx.device)
            except (OSError, ValueError, RuntimeError) as e:
                failed, error = torch.ones((), device=ctx.device), e
            if args.dump_logits:
                torch.save(full, args.dump_logits)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    if failed.item():
        return 1
    ok = diff.item() <= args.tol
    if ctx.is_main:
        verdict = "OK" if ok else "FAILED"
        print(
            f"verify: max |logit diff| = {diff.item():.3e} on {args.batch}x{args.seq} random "
            f"tokens{' with a picture each' if images else ''} at {describe(layout(args)[0])} "
            f"(tolerance {args.tol:.1e}): {verdict}"
        )
    return 0 if ok else 1


def describe(sizes) -> str:
    """ "TP 1 PP 2", with "EP 2 ETP 1" when the experts are split."""
    text = f"TP {sizes.tp_size} PP {sizes.pp_size}"
    if sizes.ep_size > 1 or sizes.etp_size != sizes.tp_size:
        text += f" EP {sizes.ep_size} ETP {sizes.etp_size}"
    return text


def preflight(args: argparse.Namespace) -> None:
    """The input checks that need no process group, run before torchrun launches workers:
    a worker that fails ends in torchrun's traceback, after the one-line message."""
    from rlhf.models import convert

    sizes, _ = layout(args)
    if args.command == "hf-to-mcore":
        convert.check_hf_to_mcore(args.hf_dir, args.out_dir, sizes)
    elif args.command == "verify":
        convert.check_verify(args.mcore_dir, sizes)


@ends_in_one_line("rlhf-convert")  # errors in the inputs: one line, exit 2
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    launched = int(os.environ.get("WORLD_SIZE", 0))
    try:
        _, num_procs = layout(args)
        if launched and launched != num_procs:
            raise UserError(
                f"launched with {launched} processes, but --pp x lcm(--tp, --ep x --etp) = "
                f"{num_procs}"
            )
        preflight(args)
        if num_procs > 1 and not launched:
            return relaunch_under_torchrun(num_procs, argv)
        return run(args)
    except (ValueError, KeyError, FileExistsError) as e:  # rlhf.models.convert's input checks
        raise UserError(str(e.args[0] if isinstance(e, KeyError) and e.args else e)) from e


if __name__ == "__main__":
    sys.exit(main())
