"""Worker: a TP/PP actor perturbs its weights, syncs them into a running SGLang server
through one transport, and reports the probe diff, the server's weight version, the
exported HF weights (for an HF greedy reference) and, optionally, its recomputation of
SGLang's sampled log-probs."""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlhf.config.schema import RolloutConfig
from rlhf.distributed import bootstrap


def policy_weights(model, arch, ctx, probe_tokens: list[int]):
    """A bare Megatron module as `PolicyServers.load_weights` takes a policy (always on its
    device), with its log-probs of the probe through the trainer's packed forward."""
    from rlhf.rollout.policy_servers import PolicyWeights

    probe = actor_logprobs(model, arch, ctx, probe_tokens)
    return PolicyWeights(model, probe)


def perturb(model, placement, version: int) -> None:
    """Deterministic noise, different for every version (a sync that leaves the server's
    earlier weights fails the comparison); replicated parameters get the same noise on
    every TP rank."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            sharded = getattr(param, "tensor_model_parallel", False)
            seed = (
                zlib.crc32(name.encode()) + (placement.tp_rank if sharded else 0) + 7919 * version
            )
            noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed))
            param.add_(0.05 * noise.to(param.dtype))


def perturbed_actor(hf_dir: str, topo, version: int):
    """The HF model loaded into this rank's Megatron shard, then perturbed; with its arch."""
    from rlhf.models.builder import build_model, load_hf_weights
    from rlhf.models.families import load_arch
    from rlhf.models.hf_io import HFCheckpointReader

    arch = load_arch(hf_dir)
    model = build_model(arch, topo.placement, initialize=False)
    load_hf_weights(model, HFCheckpointReader(hf_dir), arch, topo.placement)
    perturb(model, topo.placement, version)
    return model.eval(), arch


def make_transport(kind: str, url: str, out_dir: Path, hf_dir: str, plan=None):
    """`plan`: the tensor transport's handle plan (default: the sender packs)."""
    from rlhf.weight_sync import transports
    from rlhf.weight_sync.handle_plan import HandlePlan

    if kind == "tensor":
        plan = plan or HandlePlan.from_sender(1, 1, torch.device("cpu"))
        return transports.TensorTransport([url], plan)
    if kind == "distributed":
        return transports.DistributedTransport([url], server_tp_size=1, master_address="127.0.0.1")
    return transports.DiskTransport(out_dir / "disk_weights", Path(hf_dir))


def actor_logprobs(model, arch, ctx, tokens: list[int]) -> torch.Tensor:
    """log p(token_t | tokens_<t), t >= 1, through the trainer's packed forward path."""
    from rlhf.engine.engine import MegatronModel, probe_logprobs
    from rlhf.engine.heads import LogprobHead
    from rlhf.engine.micro_batch import MicroBatchPlanner
    from rlhf.models.logprobs import VocabShard

    head = LogprobHead(VocabShard.of(ctx, model.padded_vocab_size, arch.vocab_size))
    planner = MicroBatchPlanner(ctx, thd=False)
    return probe_logprobs(MegatronModel(model, ctx), tokens, planner, head)


def recompute_sampled_logprobs(model, arch, ctx, topo, url: str, prompts: list[list[int]]):
    """Max |SGLang sampled log-prob - actor log-prob| over n=2 samples of each prompt."""
    from rlhf import sglang_api

    request = {
        "input_ids": prompts,
        "sampling_params": {"n": 2, "temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 3},
        "return_logprob": True,
    }
    worst = torch.zeros(1)
    samples = sglang_api.generate(url, request) if topo.is_sender else None
    samples = broadcast_from_rank0(samples)
    for i, sample in enumerate(samples):
        prompt = prompts[i // 2]
        sglang = torch.tensor([lp for lp, *_ in sample["meta_info"]["output_token_logprobs"]])
        actor = actor_logprobs(model, arch, ctx, prompt + sample["output_ids"])
        worst = torch.maximum(worst, (actor[len(prompt) - 1 :] - sglang).abs().max())
    return worst.item()


def broadcast_from_rank0(obj):
    holder = [obj]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--hf-dir", "--server-url", "--transport", "--out-dir"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--version", type=int, default=1)
    parser.add_argument("--check-sampling", action="store_true")
    parser.add_argument(
        "--handles-from", type=int, help="tensor transport: the rank that packs the handle"
    )
    args = parser.parse_args()
    out = Path(args.out_dir)
    ctx = bootstrap.init_parallel("cpu", tp_size=args.tp, pp_size=args.pp)
    bootstrap.seed_everything(0)
    from rlhf import sglang_api
    from rlhf.rollout.policy_servers import PolicyServers
    from rlhf.weight_sync.gather import SyncTopology, iter_buckets
    from rlhf.weight_sync.probe import probe_tokens
    from rlhf.weight_sync.syncer import WeightSyncer

    topo, plan = SyncTopology.of(ctx), None
    if args.handles_from is not None:  # that rank packs on its own: every rank gets buckets
        from rlhf.weight_sync.handle_plan import HandleSource, plan_handles

        source = HandleSource(args.handles_from, torch.device("cpu"))
        plan, topo = plan_handles({0: [[source]]}, topo)
        assert topo.everywhere
    model, arch = perturbed_actor(args.hf_dir, topo, args.version)
    transport = make_transport(args.transport, args.server_url, out, args.hf_dir, plan)
    syncer = WeightSyncer(transport, [args.server_url], arch, topo, bucket_bytes=64 * 1024)
    rollout = RolloutConfig(server_urls=[args.server_url], logprob_diff_threshold=None)
    servers = PolicyServers(ctx, None, syncer, rollout)  # the owner's load, on every rank
    policy = policy_weights(model, arch, ctx, servers.probe_sequence.tokens)
    loaded = servers.load_weights(policy, args.version)
    report = {
        "handles_from": args.handles_from,
        "probe_diff": loaded.logprob_diff_max,
        "num_buckets": loaded.stats.num_buckets,
        "max_bucket_bytes": loaded.stats.max_bucket_bytes,
    }
    if args.check_sampling:
        prompts = [probe_tokens(arch.vocab_size, 10, seed=s) for s in (5, 6)]
        report["sampled_logprob_diff"] = recompute_sampled_logprobs(
            model, arch, ctx, topo, args.server_url, prompts
        )
    staged = [None] * ctx.world_size  # which ranks packed into shared memory
    packed_here = getattr(transport, "_staging", [None])[0] is not None
    torch.distributed.all_gather_object(staged, packed_here)
    report["packed_on_ranks"] = [rank for rank, packed in enumerate(staged) if packed]
    exported = [t for bucket in iter_buckets(model, arch, topo, 1 << 30) for t in bucket]
    servers.shutdown()  # closes the syncer: the distributed transport destroys its group
    report["open_groups_after_close"] = len(getattr(transport, "groups", {}))
    if topo.is_sender:
        report["weight_version"] = sglang_api.weight_version(args.server_url)
        save_file({n: t.contiguous() for n, t in exported}, out / "exported.safetensors")
        (out / "report.json").write_text(json.dumps(report))
    bootstrap.teardown()


if __name__ == "__main__":
    main()
