"""Worker: bootstrap under torchrun (or alone) and report what each rank sees as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf.distributed.bootstrap import init_parallel, seed_everything, teardown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()
    env = init_parallel("auto", tp_size=args.tp)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    seed_everything(7)
    default_draw = torch.rand(2).tolist()
    with tensor_parallel.get_cuda_rng_tracker().fork():
        tp_draw = torch.rand(2).tolist()
    total = torch.tensor([float(env.rank)])
    dist.all_reduce(total)
    report = {
        "rank": env.rank,
        "world_size": env.world_size,
        "backend": dist.get_backend(),
        "device": str(env.device),
        "tp_size": env.tp_size,
        "tp_rank": env.tp_rank,
        "dp_size": env.dp_size,
        "megatron_agrees": (env.tp_size, env.tp_rank, env.dp_size)
        == (
            ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_data_parallel_world_size(),
        ),
        "rank_sum": total.item(),
        "default_draw": default_draw,
        "tp_draw": tp_draw,
    }
    teardown()
    report["torch_dist_initialized_after_teardown"] = dist.is_initialized()
    report["model_parallel_initialized_after_teardown"] = ps.model_parallel_is_initialized()
    Path(args.out_dir, f"rank{env.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
