"""Weight-sync throughput per transport next to a same-run memory copy of the same bytes.

    python benchmarks/weight_sync.py [--hidden 512 --layers 8 --vocab 8000 --bucket-mb 64]

One process (TP = PP = 1) holds a Megatron actor built from a random Qwen2-shaped HF
checkpoint and a real SGLang server on the same machine. Each transport syncs the full
model `--repeats` times; the log-prob probe checks every sync. Per transport: the first
sync's seconds and the median of the later ones (the steady state of a run), with the
seconds of each phase (gather: TP/PP gathers, HF layout and bucketing; pack: flatten and
serialize, or write the shard; deliver: the server receives and loads), and the rate as a
share of the memory-copy rate. Prints one JSON object.

`--lora-rank R`: the actor gets rank-R adapters on every linear layer (random, so they
change the policy) and the server runs with SGLang's LoRA on; every transport then syncs
the adapters alone (`rlhf.weight_sync.adapters`) and, after those, the merged weights
(`model.lora_merge`), each checked by the probe: `lora.adapters` and `lora.merged`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def transport_report(syncs: list, memcpy_s: float) -> dict:
    """The first sync (it sets up groups and buffers) and the median of the later ones, the
    steady state a training run sees every step."""
    first, later = syncs[0][0], [stats for stats, _ in syncs[1:]] or [syncs[0][0]]
    steady = statistics.median(s.seconds for s in later)
    phases = {
        k: round(statistics.median(s.phase_s.get(k, 0.0) for s in later), 4)
        for k in later[0].phase_s
    }
    return {
        "first_seconds": round(first.seconds, 3),
        "seconds": round(steady, 3),
        "gb_per_s": round(first.num_bytes / 1e9 / steady, 3),
        "share_of_memcpy_rate": round(memcpy_s / steady, 3),
        "phase_s": phases,
        "buckets": first.num_buckets,
        "probe_logprob_diff_max": max(diff for _, diff in syncs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4, help="syncs per transport")
    parser.add_argument("--lora-rank", type=int, default=0, help="adapters (0: none)")
    args = parser.parse_args()

    from rlhf.distributed import bootstrap
    from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hf_dir = root / "hf"
        spec = TinyModelSpec(
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 11 // 4,
            num_hidden_layers=args.layers,
            num_attention_heads=args.hidden // 64,
            num_key_value_heads=max(1, args.hidden // 256),
        )
        save_tiny_model(hf_dir, spec, vocab_size=args.vocab)
        ctx = bootstrap.init_parallel("auto")
        bootstrap.seed_everything(0)
        report = Bench(ctx, hf_dir, root, device, args).run()
        bootstrap.teardown()
    print(json.dumps(report))


class Bench:
    """The actor, its probe and the server of one benchmark run."""

    def __init__(self, ctx, hf_dir: Path, root: Path, device: str, args):
        from rlhf.config.engine_args import lora_server_kwargs
        from rlhf.config.schema import ModelConfig, RolloutConfig
        from rlhf.engine.engine import MegatronModel
        from rlhf.engine.heads import LogprobHead
        from rlhf.engine.micro_batch import MicroBatchPlanner
        from rlhf.models.builder import build_model, load_hf_weights
        from rlhf.models.families import load_arch
        from rlhf.models.hf_io import HFCheckpointReader
        from rlhf.models.logprobs import VocabShard
        from rlhf.weight_sync.gather import SyncTopology

        self.ctx, self.hf_dir, self.root, self.device, self.args = ctx, hf_dir, root, device, args
        self.topo = SyncTopology.of(ctx)
        self.arch = load_arch(hf_dir)
        model = build_model(self.arch, self.topo.placement, initialize=False)
        load_hf_weights(model, HFCheckpointReader(hf_dir), self.arch, self.topo.placement)
        self.lora = with_adapters(model, self.topo.placement, args.lora_rank)
        vocab = VocabShard.of(ctx, model.padded_vocab_size, self.arch.vocab_size)
        self.head, self.planner = LogprobHead(vocab), MicroBatchPlanner(ctx, thd=False)
        self.actor = MegatronModel(model, ctx)
        self.rollout = RolloutConfig(
            dtype="float32", update_weights_bucket_megabytes=args.bucket_mb
        )
        if self.lora is not None:
            served = ModelConfig(path=str(hf_dir), lora_rank=args.lora_rank)
            self.rollout.engine_kwargs.sglang.update(lora_server_kwargs(served))
        self.version = 0

    def run(self) -> dict:
        from rlhf.rollout.engine import SGLangEngine

        params = [p.detach() for p in self.actor.module.parameters()]
        nbytes = sum(p.numel() * p.element_size() for p in params)
        start = time.perf_counter()
        _copies = [p.clone() for p in params]
        memcpy_s = time.perf_counter() - start
        del _copies
        report: dict = {
            "benchmark": "weight_sync",
            "device": self.device,
            "model_gb": round(nbytes / 1e9, 4),
            "bucket_mb": self.args.bucket_mb,
            "memcpy": {
                "seconds": round(memcpy_s, 4),
                "gb_per_s": round(nbytes / 1e9 / memcpy_s, 3),
            },
        }
        with SGLangEngine(
            self.rollout,
            self.hf_dir,
            log_dir=self.root / "logs",
            device=self.device,
            max_total_tokens=4096,
        ) as engine:
            if self.lora is None:
                report["transports"] = {k: self.syncs(engine, k, memcpy_s) for k in TRANSPORTS}
                return report
            adapters = {k: self.syncs(engine, k, memcpy_s, self.lora) for k in TRANSPORTS}
            merged = {k: self.syncs(engine, k, memcpy_s) for k in TRANSPORTS}  # after: they
            report["lora"] = {"rank": self.args.lora_rank, "adapters": adapters, "merged": merged}
        return report  # rewrite the server's base weights

    def syncs(self, engine, kind: str, memcpy_s: float, lora=None) -> dict:
        """`--repeats` syncs through `kind` (`lora`: the adapters alone), reported."""
        import dataclasses

        from rlhf.engine.engine import probe_logprobs
        from rlhf.rollout.policy_servers import PolicyServers, PolicyWeights
        from rlhf.weight_sync.factory import build_weight_syncer

        cfg = dataclasses.replace(
            self.rollout, weight_sync_transport=kind, weight_sync_snapshot=False
        )
        syncer = build_weight_syncer(
            cfg,
            engine.server_urls,
            self.arch,
            self.topo,
            run_dir=self.root,
            model_path=self.hf_dir,
            adapters=lora,
        )
        servers = PolicyServers(self.ctx, engine, syncer, cfg)
        syncs = []
        for _ in range(self.args.repeats):
            self.version += 1
            tokens = servers.probe_sequence.tokens
            probe = probe_logprobs(self.actor, tokens, self.planner, self.head)
            loaded = servers.load_weights(PolicyWeights(self.actor.module, probe), self.version)
            syncs.append((loaded.stats, loaded.logprob_diff_max))
        syncer.close()
        result = transport_report(syncs, memcpy_s)
        result["gb"] = round(syncs[0][0].num_bytes / 1e9, 5)
        return result


TRANSPORTS = ("tensor", "distributed", "disk")


def with_adapters(model, placement, rank: int):
    """Rank-`rank` adapters on every linear layer of `model`, B random (so that they change
    the policy); their spec (None: rank 0, none)."""
    from rlhf.models.chunks import ModelChunks
    from rlhf.models.lora import LoraSpec, add_lora, is_lora_param, megatron_targets

    if not rank:
        return None
    spec = LoraSpec(rank, 2.0 * rank, megatron_targets("all-linear"))
    chunks = ModelChunks.of(model, placement)
    add_lora(chunks, spec, model.config, placement.tp_rank)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_lora_param(name) and name.endswith("lora_B.weight"):
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
    return spec


if __name__ == "__main__":
    main()
