"""Build the `WeightSyncer` a run's config asks for (`actor_rollout_ref.rollout.*`)."""

from __future__ import annotations

from pathlib import Path

from rlhf.config.placement import server_gpus
from rlhf.config.schema import RolloutConfig
from rlhf.models.families import ModelArch
from rlhf.models.lora import LoraSpec
from rlhf.weight_sync.adapters import AdapterSyncer
from rlhf.weight_sync.gather import SyncTopology
from rlhf.weight_sync.handle_plan import tensor_handle_plan
from rlhf.weight_sync.snapshot import BackgroundSnapshot
from rlhf.weight_sync.syncer import WeightSyncer
from rlhf.weight_sync.transports import (
    DiskTransport,
    DistributedTransport,
    TensorTransport,
    Transport,
)

Syncer = WeightSyncer | AdapterSyncer


def build_weight_syncer(
    rollout: RolloutConfig,
    server_urls: list[str],
    arch: ModelArch,
    topology: SyncTopology,
    *,
    run_dir: str | Path,
    model_path: str | Path,
    adapters: LoraSpec | None = None,
) -> Syncer:
    """Transport, bucket size and restart snapshot from the rollout config (every rank
    calls it alike: the tensor transport's plan may make process groups); with `adapters`
    (LoRA synced alone) the `AdapterSyncer`, its tensors travelling as the transport says.

    Disk weights go under `<run_dir>/weights/` (the snapshot under `weights_snapshot/`);
    `model_path` supplies the config and tokenizer files copied next to them.
    """
    run_dir = Path(run_dir)
    kind = rollout.weight_sync_transport
    if adapters is not None:
        return AdapterSyncer(
            server_urls,
            arch,
            topology,
            adapters,
            model_path,
            kind,
            server_tp_size=rollout.tensor_model_parallel_size,
            out_root=run_dir / "weights",
        )
    transport: Transport
    if kind == "tensor":
        # colocated servers (launched by the run) sit on the node's GPUs by this rule
        colocated = rollout.server_urls is None
        gpus = server_gpus(len(server_urls), rollout.tensor_model_parallel_size)
        plan, topology = tensor_handle_plan(gpus, colocated, topology)
        transport = TensorTransport(server_urls, plan)
    elif kind == "distributed":
        transport = DistributedTransport(
            server_urls,
            rollout.tensor_model_parallel_size,
            rollout.weight_sync_master_address,
            topology.device,
        )
    else:
        transport = DiskTransport(run_dir / "weights", Path(model_path))
    snapshot = None
    if snapshot_on(rollout, topology) and kind != "disk":
        snapshot = BackgroundSnapshot(DiskTransport(run_dir / "weights_snapshot", Path(model_path)))
    return WeightSyncer(
        transport,
        server_urls,
        arch,
        topology,
        bucket_bytes=rollout.update_weights_bucket_megabytes * 1024 * 1024,
        snapshot=snapshot,
    )


def snapshot_on(rollout: RolloutConfig, topology: SyncTopology) -> bool:
    """`rollout.weight_sync_snapshot`; unset: on, except for servers colocated on GPUs (a
    full HF copy of the policy written every step, for a server crash on the trainer's own
    GPUs, which a resume from the last checkpoint covers)."""
    if rollout.weight_sync_snapshot is not None:
        return rollout.weight_sync_snapshot
    return not (rollout.server_urls is None and topology.device.type == "cuda")
