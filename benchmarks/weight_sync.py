"""Weight-sync throughput per transport next to a same-run memory copy of the same bytes.

    python benchmarks/weight_sync.py [--hidden 512 --layers 8 --vocab 8000 --bucket-mb 64]

One process (TP = PP = 1) holds a Megatron actor built from a random Qwen2-shaped HF
checkpoint and a real SGLang server on the same machine. Each transport syncs the full
model `--repeats` times; the log-prob probe checks every sync. Per transport: the first
sync's seconds and the median of the later ones (the steady state of a run), with the
seconds of each phase (gather: TP/PP gathers, HF layout and bucketing; pack: flatten and
serialize, or write the shard; deliver: the server receives and loads), and the rate as a
share of the memory-copy rate. Prints one JSON object.
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
    args = parser.parse_args()

    from rlhf.config.schema import RolloutConfig
    from rlhf.distributed import bootstrap
    from rlhf.engine.engine import MegatronModel, probe_logprobs
    from rlhf.engine.heads import LogprobHead
    from rlhf.engine.micro_batch import MicroBatchPlanner
    from rlhf.models.builder import build_model, load_hf_weights
    from rlhf.models.families import load_arch
    from rlhf.models.hf_io import HFCheckpointReader
    from rlhf.models.logprobs import VocabShard
    from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model
    from rlhf.rollout.engine import SGLangEngine
    from rlhf.rollout.policy_servers import PolicyServers, PolicyWeights
    from rlhf.weight_sync.factory import build_weight_syncer
    from rlhf.weight_sync.gather import SyncTopology

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
        topo = SyncTopology.of(ctx)
        arch = load_arch(hf_dir)
        model = build_model(arch, topo.placement, initialize=False)
        load_hf_weights(model, HFCheckpointReader(hf_dir), arch, topo.placement)
        head = LogprobHead(VocabShard.of(ctx, model.padded_vocab_size, arch.vocab_size))
        planner, actor = MicroBatchPlanner(ctx, thd=False), MegatronModel(model, ctx)
        params = [p.detach() for p in model.parameters()]
        nbytes = sum(p.numel() * p.element_size() for p in params)
        start = time.perf_counter()
        _copies = [p.clone() for p in params]
        memcpy_s = time.perf_counter() - start
        del _copies

        results = {}
        rollout = RolloutConfig(dtype="float32", update_weights_bucket_megabytes=args.bucket_mb)
        with SGLangEngine(
            rollout, hf_dir, log_dir=root / "logs", device=device, max_total_tokens=4096
        ) as engine:
            version = 0
            for kind in ("tensor", "distributed", "disk"):
                cfg = RolloutConfig(**{**rollout.__dict__, "weight_sync_transport": kind})
                cfg.weight_sync_snapshot = False
                syncer = build_weight_syncer(
                    cfg, engine.server_urls, arch, topo, run_dir=root, model_path=hf_dir
                )
                servers = PolicyServers(ctx, engine, syncer, cfg)
                syncs = []
                for _ in range(args.repeats):
                    version += 1
                    probe = probe_logprobs(actor, servers.probe_sequence.tokens, planner, head)
                    weights = PolicyWeights(actor.module, probe)
                    loaded = servers.load_weights(weights, version)
                    syncs.append((loaded.stats, loaded.logprob_diff_max))
                results[kind] = transport_report(syncs, memcpy_s)
                syncer.close()
        bootstrap.teardown()
    print(
        json.dumps(
            {
                "benchmark": "weight_sync",
                "device": device,
                "model_gb": round(nbytes / 1e9, 4),
                "bucket_mb": args.bucket_mb,
                "memcpy": {
                    "seconds": round(memcpy_s, 4),
                    "gb_per_s": round(nbytes / 1e9 / memcpy_s, 3),
                },
                "transports": results,
            }
        )
    )


if __name__ == "__main__":
    main()
