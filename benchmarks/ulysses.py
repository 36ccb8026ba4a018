"""Ulysses sequence parallelism: memory and time of a long sequence at SP=1 and SP=2.

    python benchmarks/ulysses.py [--seq 8192 --hidden 256 --layers 4 --heads 8 --kv-heads 2]

Runs itself under torchrun (1 rank for SP=1, 2 ranks for SP=2, gloo on CPU / nccl on GPU):
one forward + backward of a next-token loss on one sequence of `--seq` tokens through a
Megatron GPTModel with the local (CPU) or TE (GPU) spec. Prints one JSON object with, per SP
size: step seconds, peak memory per rank (GPU: max allocated; CPU: growth of the peak RSS
over the steps, counted from after the model is built), and the all-to-all bytes one rank
sends per layer per forward, measured in `UlyssesAttention` and computed from the shapes:
(q + k + v + output) of the local slice, with KV heads repeated when needed. The backward
moves the same bytes again.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def theoretical_bytes(args, sp: int, elt: int = 4) -> int:
    """q, k, v (KV heads repeated for the split) and the output of one rank's slice."""
    from rlhf.parallel.ulysses import kv_repeats

    head_dim = args.hidden // args.heads
    repeats = kv_repeats(args.heads, args.kv_heads, sp) if sp > 1 else 1
    per_token = (2 * args.heads + 2 * args.kv_heads * repeats) * head_dim
    return args.seq // sp * per_token * elt


def peak_memory_bytes(device: torch.device, rss_before: int) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024


def worker(args) -> None:
    from rlhf.distributed import bootstrap, launch_env
    from rlhf.models.builder import build_model, load_hf_weights
    from rlhf.models.families import load_arch
    from rlhf.models.hf_io import HFCheckpointReader
    from rlhf.models.mapping import Placement
    from rlhf.parallel.ulysses import UlyssesAttention, combine_positions, zigzag_positions

    sp = launch_env.launched_world_size() or 1
    env = bootstrap.init_parallel("auto", sp_size=sp)
    bootstrap.seed_everything(0)
    arch = load_arch(args.model)
    placement = Placement.of(env)
    model = build_model(arch, placement, sp=sp)
    load_hf_weights(model, HFCheckpointReader(args.model), arch, placement)
    model = model.to(env.device)
    tokens = torch.randint(
        3, arch.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(0)
    )
    positions = zigzag_positions(args.seq, sp, env.sp_rank) if sp > 1 else torch.arange(args.seq)
    local = tokens[:, positions].to(env.device)
    labels = torch.roll(tokens, -1, dims=1)[:, positions].to(env.device)

    def step():
        logits = model(local, positions[None].to(env.device), None)
        loss_local = torch.nn.functional.cross_entropy(
            logits[0].float(), labels[0], reduction="none"
        )
        full = (
            combine_positions(loss_local[None], positions, args.seq, env.sp_group)
            if sp > 1
            else loss_local[None]
        )
        full.mean().backward()

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # model built, no step yet
    step()  # warm-up
    if env.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    step()
    if env.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    ulysses = [m for m in model.modules() if isinstance(m, UlyssesAttention)]
    result = {
        "step_s": round(seconds, 3),
        "peak_memory_bytes_per_rank": peak_memory_bytes(env.device, rss_before),
        "all_to_all_bytes_per_layer": ulysses[0].exchanged_bytes if ulysses else 0,
        "all_to_all_bytes_per_layer_theory": theoretical_bytes(args, sp) if sp > 1 else 0,
        "device": env.device.type,
    }
    if env.rank == 0:
        Path(args.out).write_text(json.dumps(result))
    bootstrap.teardown()


def launch(args, model_dir: Path, sp: int, out: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(sp),
        "--master-port",
        str(29400 + sp),
        __file__,
        "--worker",
        "1",
        "--model",
        str(model_dir),
        "--out",
        str(out),
        "--seq",
        str(args.seq),
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--heads",
        str(args.heads),
        "--kv-heads",
        str(args.kv_heads),
    ]
    threads = max(1, (os.cpu_count() or 1) // sp)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        spec = TinyModelSpec(
            hidden_size=args.hidden,
            intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            max_position_embeddings=args.seq,
        )
        model_dir = save_tiny_model(Path(tmp) / "model", spec)
        results = {
            f"sp{sp}": launch(args, model_dir, sp, Path(tmp) / f"sp{sp}.json") for sp in (1, 2)
        }
    print(json.dumps({"benchmark": "ulysses", "seq": args.seq, **results}, indent=2))


if __name__ == "__main__":
    main()
