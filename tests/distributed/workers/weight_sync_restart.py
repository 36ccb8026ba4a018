"""Worker (1 rank): load perturbed weights into a launched server through its owner
(`PolicyServers`), kill the server mid-run, and check that the restarted server gets the
loaded weights back (the owner's restart hook reloads the tensor transport's snapshot,
written by the disk transport's code: its own last version directory under that transport)."""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

from rlhf.config.schema import RolloutConfig
from rlhf.distributed import bootstrap
from tests.distributed.workers.weight_sync_parity import (
    perturbed_actor,
    policy_weights,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()
    out = Path(args.out_dir)
    ctx = bootstrap.init_parallel("cpu")
    bootstrap.seed_everything(0)
    from rlhf import sglang_api
    from rlhf.rollout.engine import SamplingParams, SGLangEngine
    from rlhf.rollout.policy_servers import PolicyServers
    from rlhf.weight_sync.factory import build_weight_syncer
    from rlhf.weight_sync.gather import SyncTopology

    topo = SyncTopology.of(ctx)
    model, arch = perturbed_actor(args.hf_dir, topo, version=7)
    rollout = RolloutConfig(
        dtype="float32",
        max_server_restarts=1,
        retry_backoff_s=0.5,
        weight_sync_transport="tensor",
    )
    with SGLangEngine(
        rollout, args.hf_dir, log_dir=out / "logs", device="cpu", max_total_tokens=2048
    ) as engine:
        url = engine.server_urls[0]
        syncer = build_weight_syncer(
            rollout, [url], arch, topo, run_dir=out, model_path=args.hf_dir
        )
        servers = PolicyServers(ctx, engine, syncer, rollout)  # registers the restart hook
        policy = policy_weights(model, arch, ctx, servers.probe_sequence.tokens)
        before = servers.load_weights(policy, 7).logprob_diff_max
        probe = servers.probe_sequence.tokens
        os.killpg(engine.group.servers[0].proc.pid, signal.SIGKILL)
        samples = engine.generate([probe[:8], probe[8:16]], SamplingParams(n=2, max_new_tokens=4))
        after = servers.probe(policy)
        report = {
            "before": before,
            "after": after,
            "samples": len(samples),
            "version": sglang_api.weight_version(url),
            "restarts": engine.group.restarts,
        }
        syncer.close()
    (out / "report.json").write_text(json.dumps(report, default=str))
    bootstrap.teardown()


if __name__ == "__main__":
    main()
