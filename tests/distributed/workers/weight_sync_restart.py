"""Worker (1 rank): sync perturbed weights into a launched server, kill the server mid-run,
and check that the restarted server gets the synced weights back (snapshot re-sync)."""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

from rlhf.config.schema import RolloutConfig
from rlhf.config.validate import ParallelDims
from rlhf.distributed import bootstrap
from tests.distributed.workers.weight_sync_parity import perturbed_actor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()
    out = Path(args.out_dir)
    env = bootstrap.init_distributed("cpu")
    bootstrap.init_model_parallel(ParallelDims(world_size=env.world_size))
    bootstrap.seed_everything(0)
    from rlhf.rollout.engine import SamplingParams, SGLangEngine
    from rlhf.weight_sync.factory import build_weight_syncer
    from rlhf.weight_sync.probe import logprob_diff_max, probe_tokens
    from rlhf.weight_sync.syncer import server_weight_version

    topo = bootstrap.sync_topology()
    model, arch = perturbed_actor(args.hf_dir, topo)
    rollout = RolloutConfig(dtype="float32", max_server_restarts=1, retry_backoff_s=0.5)
    with SGLangEngine(
        rollout, args.hf_dir, log_dir=out / "logs", device="cpu", max_total_tokens=2048
    ) as engine:
        url = engine.server_urls[0]
        syncer = build_weight_syncer(
            rollout, [url], arch, topo, run_dir=out, model_path=args.hf_dir
        )
        engine.attach_weight_syncer(syncer)
        engine.update_weights(model, version=7)
        probe = probe_tokens(arch.vocab_size)
        before = logprob_diff_max(model, arch, topo, url, probe)
        os.killpg(engine.group.servers[0].proc.pid, signal.SIGKILL)
        samples = engine.generate([probe[:8], probe[8:16]], SamplingParams(n=2, max_new_tokens=4))
        after = logprob_diff_max(model, arch, topo, url, probe)
        report = {
            "before": before,
            "after": after,
            "samples": len(samples),
            "version": server_weight_version(url),
            "restarts": engine.group.restarts,
        }
    (out / "report.json").write_text(json.dumps(report, default=str))
    bootstrap.teardown()


if __name__ == "__main__":
    main()
