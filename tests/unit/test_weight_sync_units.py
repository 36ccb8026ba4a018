"""Weight-sync pieces that need no server: bucketing, the parity threshold, the factory."""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch

from rlhf import sglang_api
from rlhf.config.schema import RolloutConfig
from rlhf.distributed.context import ParallelContext
from rlhf.models.families import ModelArch
from rlhf.models.mapping import Placement
from rlhf.rollout.policy_servers import PolicyServers, PolicyWeights
from rlhf.weight_sync.factory import build_weight_syncer
from rlhf.weight_sync.gather import SyncTopology, bucketize
from rlhf.weight_sync.probe import LogprobMismatchError, check_parity
from rlhf.weight_sync.snapshot import BackgroundSnapshot
from rlhf.weight_sync.syncer import SyncStats
from rlhf.weight_sync.transports import DiskTransport, DistributedTransport, TensorTransport

ARCH = ModelArch("qwen2", 100, 64, 128, 2, 4, 2, 16, 1e-6, 1e4, 256, False)
TOPO = SyncTopology(Placement(), None, None, (), True)


def test_bucketize_bounds_bucket_size_and_keeps_order():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 20, 5, 40, 1])]  # fp32
    buckets = list(bucketize(iter(tensors), bucket_bytes=100))
    assert [[n for n, _ in b] for b in buckets] == [["t0"], ["t1", "t2"], ["t3"], ["t4"]]
    # a tensor larger than the bound travels alone
    assert all(sum(t.numel() * 4 for _, t in b) <= 100 or len(b) == 1 for b in buckets)


def test_parity_threshold_fails_loudly():
    check_parity(1e-3, None)  # no threshold: only logged
    check_parity(1e-3, 1e-2)
    with pytest.raises(
        LogprobMismatchError, match=r"rollout/logprob_diff_max = 5\.000e-02 exceeds"
    ):
        check_parity(0.05, 1e-2)


def test_the_probe_compares_the_servers_with_the_tensor_the_trainer_handed_over(monkeypatch):
    """`load_weights` asks each server for its log-probs of the probe and compares them
    with the policy's `probe_logprobs` as handed over (nothing calls back into the trainer):
    that tensor 1e-4 off is reported as the diff; 1.0 off fails the parity check."""
    asked, synced = [], []

    def server_logprobs(url, tokens, images=(), lora=None):  # log p(token_t | tokens_<t), t >= 1
        asked.append((url, list(tokens)))
        return [-0.05 * t for t in tokens[1:]]

    def sync(module, version):
        synced.append((module, version))
        return SyncStats(0.0, 0, 0, 0, 0)

    monkeypatch.setattr(sglang_api, "prompt_logprobs", server_logprobs)
    urls = ["http://h:1", "http://h:2"]
    syncer = SimpleNamespace(arch=ARCH, server_urls=urls, topology=TOPO, version=None, sync=sync)
    ctx = SimpleNamespace(device=torch.device("cpu"))
    rollout = RolloutConfig(server_urls=urls, logprob_diff_threshold=1e-2)
    servers = PolicyServers(ctx, None, syncer, rollout)  # type: ignore[arg-type]
    tokens = servers.probe_sequence.tokens
    trainers = torch.tensor([-0.05 * t for t in tokens[1:]])
    loaded = servers.load_weights(PolicyWeights(torch.nn.Identity(), trainers + 1e-4), 3)
    assert loaded.logprob_diff_max == pytest.approx(1e-4, abs=1e-5)
    assert asked == [(url, tokens) for url in urls] and synced[0][1] == 3
    with pytest.raises(LogprobMismatchError, match="exceeds"):  # the mutation: +1.0
        servers.load_weights(PolicyWeights(torch.nn.Identity(), trainers + 1.0), 4)


@pytest.mark.parametrize(
    ("kind", "transport_type"),
    [("tensor", TensorTransport), ("distributed", DistributedTransport), ("disk", DiskTransport)],
)
def test_factory_reads_the_rollout_config(tmp_path, kind, transport_type):
    rollout = RolloutConfig(
        weight_sync_transport=kind, update_weights_bucket_megabytes=3, logprob_diff_threshold=0.1
    )
    syncer = build_weight_syncer(
        rollout, ["http://h:1"], ARCH, TOPO, run_dir=tmp_path, model_path=tmp_path
    )
    assert isinstance(syncer.transport, transport_type)
    assert syncer.bucket_bytes == 3 * 1024 * 1024
    servers = PolicyServers(None, None, syncer, rollout)  # type: ignore[arg-type]  # no ranks
    assert servers.probe_threshold == 0.1  # the owner of the servers checks the probe
    # the disk transport is its own snapshot; the others write one in the background
    assert isinstance(syncer.snapshot, DiskTransport if kind == "disk" else BackgroundSnapshot)
    no_snapshot = RolloutConfig(weight_sync_transport=kind, weight_sync_snapshot=False)
    syncer = build_weight_syncer(no_snapshot, [], ARCH, TOPO, run_dir=tmp_path, model_path=tmp_path)
    assert (syncer.snapshot is None) == (kind != "disk")


@pytest.mark.parametrize(
    ("setting", "urls", "device", "on"),
    [
        (None, None, "cuda", False),  # colocated on GPUs: a resume covers a server crash
        (None, None, "cpu", True),
        (None, ["http://h:1"], "cuda", True),  # servers of their own: restarted and re-synced
        (True, None, "cuda", True),
        (False, ["http://h:1"], "cpu", False),
    ],
)
def test_the_snapshot_is_on_unless_the_servers_share_the_trainers_gpus(setting, urls, device, on):
    """It wrote a full HF copy of the policy inside every sync (15 GB a step at 7B)."""
    from rlhf.weight_sync.factory import snapshot_on

    rollout = RolloutConfig(weight_sync_snapshot=setting, server_urls=urls)
    topology = dataclasses.replace(TOPO, device=torch.device(device))
    assert snapshot_on(rollout, topology) is on


class SlowDisk:
    """A DiskTransport stand-in whose writes wait for `release`; records what it wrote."""

    def __init__(self, fail: bool = False):
        self.release, self.written, self.fail = threading.Event(), [], fail

    def begin(self, version):
        self.written.append(("begin", version))

    def pack(self, bucket, last, version):
        assert self.release.wait(30)
        if self.fail:
            raise OSError("No space left on device")
        self.written.append([(n, t.clone()) for n, t in bucket])

    def load_into(self, url, version):
        self.written.append(("load", url, version))


def test_the_snapshot_is_written_while_the_sync_goes_on():
    disk = SlowDisk()
    snapshot = BackgroundSnapshot(disk)  # type: ignore[arg-type]
    staging = torch.arange(6.0)
    snapshot.begin(4)
    snapshot.pack([("w", staging[:3])], False, 4)  # returns before the write
    staging.zero_()  # the next bucket reuses the sync's memory at once
    assert not any(isinstance(w, list) for w in disk.written)  # nothing written yet
    disk.release.set()
    snapshot.load_into("http://h:1", 4)  # waits for every write first
    ((name, written),) = disk.written[1]
    assert name == "w" and written.tolist() == [0.0, 1.0, 2.0]
    assert disk.written[2] == ("load", "http://h:1", 4)
    snapshot.close()


def test_a_failed_snapshot_write_is_raised_at_the_next_sync():
    disk = SlowDisk(fail=True)
    disk.release.set()
    snapshot = BackgroundSnapshot(disk)  # type: ignore[arg-type]
    snapshot.begin(1)
    snapshot.pack([("w", torch.ones(2))], True, 1)
    with pytest.raises(RuntimeError, match="restart snapshot failed: No space left on device"):
        snapshot.begin(2)
    snapshot.close()


def test_resync_without_snapshot_is_a_clear_error(tmp_path):
    rollout = RolloutConfig(weight_sync_transport="tensor", weight_sync_snapshot=False)
    syncer = build_weight_syncer(rollout, [], ARCH, TOPO, run_dir=tmp_path, model_path=tmp_path)
    syncer.reload("http://h:1")  # nothing synced yet: nothing to do
    syncer.version = 3
    with pytest.raises(RuntimeError, match="http://h:1 restarted with its initial weights"):
        syncer.reload("http://h:1")


def expert_rank(rank: int, world: int, local_world: int, ep: int) -> ParallelContext:
    """Rank `rank` of a TP1 PP1 job of `world` ranks at EP `ep` (expert-TP 1), as Megatron
    numbers them: EP ranks consecutive, expert-DP replicas after one another."""
    return ParallelContext(
        rank=rank,
        world_size=world,
        local_rank=rank % local_world,
        local_world_size=local_world,
        backend="gloo",
        device=torch.device("cpu"),
        tp_rank=0,
        tp_size=1,
        tp_group=None,
        pp_rank=0,
        pp_size=1,
        pp_group=None,
        pp_stage_ranks=(rank,),
        sp_rank=0,
        sp_size=1,
        sp_group=None,
        dp_rank=rank,
        dp_size=world,
        dp_group=None,  # type: ignore[arg-type]  # unused here
        dp_sp_size=world,
        ep_rank=rank % ep,
        ep_size=ep,
        edp_rank=rank // ep,
        edp_size=world // ep,
    )


@pytest.mark.parametrize(("per_node", "takes_part"), [(False, [0, 1]), (True, [0, 1, 4, 5])])
def test_the_senders_expert_parallel_ranks_take_part(per_node, takes_part):
    """8 ranks on 2 nodes at EP2: the sender of replica 0 (or of each node) gets the experts
    of its own EP group, whose other rank is in another data-parallel replica."""
    topologies = [SyncTopology.of(expert_rank(r, 8, 4, 2), per_node) for r in range(8)]
    assert [r for r, t in enumerate(topologies) if t.in_sync_experts] == takes_part
    assert [r for r, t in enumerate(topologies) if t.is_sender] == takes_part[::2]


def test_a_node_without_whole_expert_groups_syncs_its_servers_with_every_rank():
    """EP 4 over nodes of 2 processes: no node holds every expert, so every rank takes part
    in its node's sync (the experts all-gathered over EP) and each node's first rank sends
    (it was refused)."""
    topologies = [SyncTopology.of(expert_rank(r, 4, 2, 4), per_node=True) for r in range(4)]
    assert all(t.everywhere and t.in_sync_experts for t in topologies)
    assert [t.is_sender for t in topologies] == [True, False, True, False]
