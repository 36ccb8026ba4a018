"""Worker: a TP/PP actor with LoRA adapters syncs only its adapters into a running SGLang
server (started with LoRA on, holding the base model), twice, through one delivery.

The base weights are the HF model's as loaded; the adapters get deterministic noise (new
noise for the second sync, so a server left with the first adapters fails). Rank 0 writes
OUT/report.json: each sync's probe diff (SGLang with the adapter vs the trainer's base +
adapters), its bytes and the full model's, the server's weight version, the probe diff
after a restarted server (its adapter unloaded) is reloaded, and SGLang's log-probs of the
probe; and OUT/peft/ the adapters as they were sent (a PEFT directory, for a transformers
+ peft reference).
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import torch

from rlhf.config.schema import RolloutConfig
from rlhf.distributed import bootstrap
from tests.distributed.workers.weight_sync_parity import policy_weights

RANK, ALPHA = 4, 8.0


def noisy_adapters(chunks, tp_rank: int, version: int) -> None:
    """Deterministic noise on every adapter factor (a TP-split one differs by TP rank, a
    whole one is the same on every rank)."""
    from rlhf.models.lora import is_lora_param

    with torch.no_grad():
        for param, name in chunks.global_names().items():
            if not is_lora_param(name):
                continue
            split = getattr(param, "tensor_model_parallel", False)
            seed = zlib.crc32(name.encode()) + (tp_rank if split else 0) + 7919 * version
            noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed))
            param.copy_(0.2 * noise.to(param.dtype))


def lora_actor(hf_dir: str, topo, ctx):
    """The HF model in this rank's Megatron shard, with rank-4 adapters on every linear layer."""
    from rlhf.models.builder import build_model, load_hf_weights
    from rlhf.models.chunks import ModelChunks
    from rlhf.models.families import load_arch
    from rlhf.models.hf_io import HFCheckpointReader
    from rlhf.models.lora import LoraSpec, add_lora, megatron_targets

    arch = load_arch(hf_dir)
    model = build_model(arch, topo.placement, initialize=False)
    load_hf_weights(model, HFCheckpointReader(hf_dir), arch, topo.placement)
    spec = LoraSpec(RANK, ALPHA, megatron_targets("all-linear"))
    chunks = ModelChunks.of(model, topo.placement)
    add_lora(chunks, spec, model.config, ctx.tp_rank)
    return model.eval(), chunks, arch, spec


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--hf-dir", "--server-url", "--delivery", "--out-dir"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--version", type=int, default=1)
    args = parser.parse_args()
    out, url = Path(args.out_dir), args.server_url
    ctx = bootstrap.init_parallel("cpu", tp_size=args.tp, pp_size=args.pp)
    bootstrap.seed_everything(0)
    from rlhf import sglang_api
    from rlhf.rollout.policy_servers import PolicyServers
    from rlhf.weight_sync.adapters import ADAPTER, AdapterSyncer
    from rlhf.weight_sync.gather import SyncTopology, iter_buckets

    topo = SyncTopology.of(ctx)
    model, chunks, arch, spec = lora_actor(args.hf_dir, topo, ctx)
    syncer = AdapterSyncer(
        [url], arch, topo, spec, args.hf_dir, args.delivery, out_root=out / "weights"
    )
    rollout = RolloutConfig(server_urls=[url], logprob_diff_threshold=None)
    servers = PolicyServers(ctx, None, syncer, rollout)  # the owner's load, on every rank
    tokens = servers.probe_sequence.tokens
    report: dict = {"syncs": []}
    for version in (args.version, args.version + 1):
        noisy_adapters(chunks, ctx.tp_rank, version)
        loaded = servers.load_weights(policy_weights(model, arch, ctx, tokens), version)
        sync = {"probe_diff": loaded.logprob_diff_max, "num_bytes": loaded.stats.num_bytes}
        report["syncs"].append(sync)
    full = sum(
        t.numel() * t.element_size() for b in iter_buckets(model, arch, topo, 1 << 30) for _, t in b
    )
    policy = policy_weights(model, arch, ctx, tokens)
    if topo.is_sender:
        report["full_bytes"] = full
        report["adapter_bytes"] = sum(t.numel() * t.element_size() for _, t in syncer.tensors)
        report["weight_version"] = sglang_api.weight_version(url)
        report["sglang_logprobs"] = sglang_api.prompt_logprobs(url, tokens, lora=ADAPTER)
        report["probe_tokens"] = tokens
        sglang_api.unload_lora_adapter(url, ADAPTER)  # as a restarted server holds none
        syncer.reload(url)
        again = torch.tensor(sglang_api.prompt_logprobs(url, tokens, lora=ADAPTER))
        report["reload_diff"] = (again - policy.probe_logprobs).abs().max().item()
        write_peft(syncer, out / "peft")
        (out / "report.json").write_text(json.dumps(report))
    servers.shutdown()
    bootstrap.teardown()


def write_peft(syncer, path: Path) -> None:
    """The adapters the sender sent, as a PEFT adapter directory."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file({n: t.clone() for n, t in syncer.tensors}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(syncer.config))


if __name__ == "__main__":
    main()
