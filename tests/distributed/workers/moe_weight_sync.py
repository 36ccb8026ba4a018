"""Worker: a mixture-of-experts actor at an EP x expert-TP x TP x PP layout syncs into a
running SGLang server once per transport, perturbing its weights before each sync.

After every sync it reports (rank 0, OUT_DIR/report.json) the probe's log-prob difference
(the trainer's probe path against SGLang's), the server's weight version and SGLang's greedy
tokens for PROMPTS with their log-probs, and writes the weights as the gather exported them
(OUT_DIR/<transport>.safetensors): the test compares SGLang's greedy tokens with
transformers' on those weights.
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlhf.config.schema import RolloutConfig
from rlhf.distributed import bootstrap
from rlhf.models.mapping import sequential_expert_name
from tests.distributed.workers.weight_sync_parity import (
    make_transport,
    policy_weights,
)

PROMPTS = [[5, 17, 33, 2, 90, 41], [12, 7, 7, 64, 11]]


def perturb(model, placement, version: int) -> None:
    """Deterministic noise, new for every version. Copies of a parameter get the same noise:
    a routed expert's slice is the same on every rank with its EP and expert-TP rank, any
    other parameter's on every rank with its TP rank (or on all, when not TP-split). A
    sigmoid router's expert bias (a buffer) too: the sync must carry it."""
    from rlhf.models.chunks import mapped_buffers

    with torch.no_grad():
        for name, param in [*model.named_parameters(), *mapped_buffers(model)]:
            if ".local_experts." in sequential_expert_name(name):  # either expert module
                shard = 1 + placement.ep_rank * 64 + placement.experts().tp_rank
            else:
                shard = placement.tp_rank if getattr(param, "tensor_model_parallel", False) else 0
            seed = zlib.crc32(name.encode()) + 1009 * shard + 7919 * version
            noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed))
            param.add_(0.05 * noise.to(param.dtype))


def sglang_greedy(url: str) -> list[dict]:
    """SGLang's greedy continuations of PROMPTS: tokens and their log-probs."""
    from rlhf import sglang_api

    params = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
    request = {"input_ids": PROMPTS, "sampling_params": params, "return_logprob": True}
    return [
        {
            "tokens": item["output_ids"],
            "logprobs": [lp for lp, *_ in item["meta_info"]["output_token_logprobs"]],
        }
        for item in sglang_api.generate(url, request)
    ]


def sync_once(ctx, topo, model, arch, args, transport: str, version: int) -> dict:
    """Perturb, load through the owner of the servers (sync + probe), and report."""
    from rlhf import sglang_api
    from rlhf.rollout.policy_servers import PolicyServers
    from rlhf.weight_sync.gather import iter_buckets
    from rlhf.weight_sync.syncer import WeightSyncer

    out = Path(args.out_dir)
    perturb(model, topo.placement, version)
    moved = make_transport(transport, args.server_url, out, args.hf_dir)
    syncer = WeightSyncer(moved, [args.server_url], arch, topo, bucket_bytes=64 * 1024)
    rollout = RolloutConfig(server_urls=[args.server_url], logprob_diff_threshold=None)
    servers = PolicyServers(ctx, None, syncer, rollout)
    policy = policy_weights(model, arch, ctx, servers.probe_sequence.tokens)
    loaded = servers.load_weights(policy, version)
    exported = [t for bucket in iter_buckets(model, arch, topo, 1 << 30) for t in bucket]
    servers.shutdown()
    if not topo.is_sender:
        return {}
    save_file({n: t.contiguous() for n, t in exported}, out / f"{transport}.safetensors")
    return {
        "probe_diff": loaded.logprob_diff_max,
        "num_buckets": loaded.stats.num_buckets,
        "weight_version": sglang_api.weight_version(args.server_url),
        "greedy": sglang_greedy(args.server_url),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--hf-dir", "--server-url", "--out-dir"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--transports", default="tensor,distributed,disk")
    for flag in ("--tp", "--pp", "--ep"):
        parser.add_argument(flag, type=int, default=1)
    parser.add_argument("--etp", type=int, default=None, help="expert-TP size (default: TP)")
    parser.add_argument("--version", type=int, default=1, help="of the first sync")
    args = parser.parse_args()
    ctx = bootstrap.init_parallel(
        "cpu", tp_size=args.tp, pp_size=args.pp, ep_size=args.ep, etp_size=args.etp
    )
    bootstrap.seed_everything(0)
    from rlhf.models.builder import build_model, load_hf_weights
    from rlhf.models.families import load_arch
    from rlhf.models.hf_io import HFCheckpointReader
    from rlhf.weight_sync.gather import SyncTopology

    topo = SyncTopology.of(ctx)
    arch = load_arch(args.hf_dir)
    model = build_model(arch, topo.placement, initialize=False)
    load_hf_weights(model, HFCheckpointReader(args.hf_dir), arch, topo.placement)
    model.eval()
    report = {}
    for i, transport in enumerate(args.transports.split(",")):
        report[transport] = sync_once(ctx, topo, model, arch, args, transport, args.version + i)
    if topo.is_sender:
        (Path(args.out_dir) / "report.json").write_text(json.dumps(report))
    bootstrap.teardown()


if __name__ == "__main__":
    main()
