"""The GPU decisions of the weight sync, run without a GPU (issue 51, items 6 and 8).

Which device a sync buffer is allocated on for the group it travels over (a pipeline
stage's buckets over Megatron's nccl group land on the rank's own GPU, not the CPU), which
trainer rank packs each SGLang TP rank's handle and on which GPU (8-GPU nodes at every
server layout), and that a bucket is packed there. Only the CUDA calls are stood in for:
tensors on `cuda:N` are fake tensors (torch's FakeTensorMode), process-group calls are
recorded."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from rlhf.config.placement import server_gpus
from rlhf.config.schema import RolloutConfig
from rlhf.distributed import cpu_compat
from rlhf.distributed.context import ParallelContext, backend_for, rank_device
from rlhf.models.families import ModelArch
from rlhf.weight_sync import gather, transports
from rlhf.weight_sync.factory import build_weight_syncer
from rlhf.weight_sync.gather import SyncTopology, iter_buckets
from rlhf.weight_sync.handle_plan import HandlePlan, HandleSource, handle_sources
from rlhf.weight_sync.transports import TensorTransport

ARCH = ModelArch("qwen2", 100, 64, 128, 2, 4, 2, 16, 1e-6, 1e4, 256, False)


@pytest.fixture(autouse=True)
def cuda_devices_as_asked():
    """These tests decide about CUDA devices with fake tensors: the CPU compatibility layer,
    installed for good by any earlier test of this process that ran a model on the CPU,
    would turn them into CPU tensors."""
    with cpu_compat.paused():
        yield


CPU = torch.device("cpu")
PP_GROUP = object()  # Megatron's pipeline group, as the recorded calls see it


def gpu_rank(rank: int, world: int, local_world: int, pp: int = 1, backend="nccl"):
    """Rank `rank` of a TP1 job over nodes of `local_world` GPUs: `pp` pipeline stages
    (stage s on ranks s x world / pp onwards), DP over the rest."""
    stride = world // pp
    return ParallelContext(
        rank=rank,
        world_size=world,
        local_rank=rank % local_world,
        local_world_size=local_world,
        backend=backend,
        device=rank_device(backend, rank % local_world),
        tp_rank=0,
        tp_size=1,
        tp_group=None,
        pp_rank=rank // stride,
        pp_size=pp,
        pp_group=PP_GROUP if pp > 1 else None,  # type: ignore[arg-type]
        pp_stage_ranks=tuple(rank % stride + s * stride for s in range(pp)),
        sp_rank=0,
        sp_size=1,
        sp_group=None,
        dp_rank=rank % stride,
        dp_size=stride,
        dp_group=None,  # type: ignore[arg-type]  # unused here
        dp_sp_size=stride,
        edp_rank=rank % stride,
        edp_size=stride,
    )


# ---- item 6: buffers on the device of the group they travel over ---------------------


def test_a_ranks_collective_device_follows_the_backend():
    assert rank_device("nccl", 3) == torch.device("cuda", 3)
    assert rank_device("cpu:gloo,cuda:nccl", 5) == torch.device("cuda", 5)
    assert rank_device("gloo", 3) == CPU
    assert backend_for(torch.device("cuda", 2)) == "nccl" and backend_for(CPU) == "gloo"


@pytest.mark.parametrize(("backend", "device"), [("nccl", "cuda:3"), ("gloo", "cpu")])
def test_the_sync_topology_puts_its_buffers_on_the_ranks_own_device(backend, device):
    topo = SyncTopology.of(gpu_rank(11, 16, 8, backend=backend))
    assert topo.device == torch.device(device)


class RecordedP2P:
    """Point-to-point and broadcast calls of the gather on rank `me`, with the device of
    every buffer; what `me` receives is `incoming` (bucket metadata, then the end)."""

    def __init__(self, monkeypatch, me: int, incoming: list):
        self.me, self.incoming, self.devices = me, list(incoming), []
        for name in ("send_object_list", "recv_object_list", "broadcast_object_list"):
            monkeypatch.setattr(dist, name, self.objects)
        for name in ("send", "recv", "broadcast"):
            monkeypatch.setattr(dist, name, self.tensor)

    def objects(self, objects, src=None, dst=None, group=None, device=None):
        assert group is PP_GROUP
        self.devices.append(("objects", device))
        if src is not None and src != self.me:  # received
            objects[0] = self.incoming.pop(0) if self.incoming else None

    def tensor(self, tensor, src=None, dst=None, group=None):
        assert group is PP_GROUP
        self.devices.append(("tensor", tensor.device))


ONE_BUCKET = [
    [("model.norm.weight", torch.float32, (64,)), ("lm_head.weight", torch.bfloat16, (4, 8))]
]


@pytest.mark.parametrize("everywhere", [False, True], ids=["sender", "everywhere"])
def test_stage_buckets_are_received_on_the_pipeline_groups_gpu(monkeypatch, everywhere):
    """Rank 0 of a PP2 job on nccl (stage 0, the sender) receives stage 1's bucket: its
    buffers (and the objects' tensors) are on cuda:0, as is what it yields."""
    topo = SyncTopology.of(gpu_rank(0, 16, 8, pp=2))
    topo = SyncTopology(**{**topo.__dict__, "everywhere": everywhere})
    monkeypatch.setattr(gather, "iter_stage_tensors", lambda *args: iter(()))  # stage 0: none
    calls = RecordedP2P(monkeypatch, 0, ONE_BUCKET)
    with FakeTensorMode():
        received = [t for bucket in iter_buckets(None, ARCH, topo, 1 << 20) for _, t in bucket]
    assert [tuple(t.shape) for t in received] == [(64,), (4, 8)]
    assert {t.device for t in received} == {torch.device("cuda", 0)}
    assert {device for _, device in calls.devices} == {torch.device("cuda", 0)}, calls.devices


@pytest.mark.parametrize("everywhere", [False, True], ids=["sender", "everywhere"])
def test_a_later_stage_sends_its_buckets_from_its_own_gpu(monkeypatch, everywhere):
    """Rank 4 (the leader of stage 1 on an 8-GPU node) sends its CPU-made bucket from
    cuda:4."""
    topo = SyncTopology.of(gpu_rank(4, 8, 8, pp=2))
    topo = SyncTopology(**{**topo.__dict__, "everywhere": everywhere})
    calls = RecordedP2P(monkeypatch, 4, [])
    with FakeTensorMode():
        tensors = [("model.norm.weight", torch.ones(64)), ("lm_head.weight", torch.ones(4, 8))]
        monkeypatch.setattr(gather, "iter_stage_tensors", lambda *args: iter(tensors))
        list(iter_buckets(None, ARCH, topo, 1 << 20))
    sent = [device for kind, device in calls.devices if kind == "tensor"]
    assert sent == [torch.device("cuda", 4)]
    assert {device for _, device in calls.devices} == {torch.device("cuda", 4)}


# ---- item 8: each server TP rank's handle from its own GPU -------------------------------


@pytest.mark.parametrize(("num_servers", "tp"), [(1, 8), (2, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("node", [0, 1])
def test_each_server_tp_rank_is_handed_a_bucket_on_its_own_gpu(num_servers, tp, node):
    """An 8-GPU node (node 1: ranks 8-15, its own sender) of colocated servers: TP rank r
    of server s sits on GPU s x TP + r, and the trainer rank on that GPU packs its handle
    there; every GPU serves exactly one TP rank."""
    sender = 8 * node
    sources = handle_sources(server_gpus(num_servers, tp, 8), "nccl", sender, 8)
    assert [len(row) for row in sources] == [tp] * num_servers
    for s, row in enumerate(sources):
        for r, source in enumerate(row):
            gpu = s * tp + r
            assert source == HandleSource(sender + gpu, torch.device("cuda", gpu)), (s, r)
    assert sorted(h.rank for row in sources for h in row) == list(range(sender, sender + 8))


def test_on_the_cpu_or_for_external_servers_the_sender_packs_every_handle():
    for backend, colocated, device in [("gloo", True, CPU), ("nccl", False, "cuda:0")]:
        sources = handle_sources(server_gpus(4, 2), backend, 8, 8, colocated)
        assert {h for row in sources for h in row} == {HandleSource(8, torch.device(device))}


def test_a_server_on_a_gpu_without_a_trainer_rank_is_refused():
    with pytest.raises(ValueError, match="GPU 4 has no trainer process on its GPU"):
        handle_sources(server_gpus(2, 4), "nccl", 0, 4)


@pytest.mark.parametrize("rank", [0, 5, 13])
def test_the_factory_plans_the_handles_of_colocated_gpu_servers(monkeypatch, tmp_path, rank):
    """2 nodes x 8 GPUs, 4 servers x TP2 a node (every node syncs its own): rank 13 packs
    TP rank 1 of its node's server 2 on cuda:5; every rank gathers every bucket; the gloo
    groups of the two syncs are made on every rank in the same order."""
    groups: list[list[int]] = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend: groups.append(ranks) or ranks)
    rollout = RolloutConfig(weight_sync_transport="tensor", tensor_model_parallel_size=2)
    topo = SyncTopology.of(gpu_rank(rank, 16, 8), per_node=True)
    urls = [f"http://s{i}" for i in range(4)]
    syncer = build_weight_syncer(rollout, urls, ARCH, topo, run_dir=tmp_path, model_path=tmp_path)
    plan = syncer.transport.plan
    assert groups == [list(range(8)), list(range(8, 16))]
    assert plan.sender == 8 * (rank // 8) and plan.group == groups[rank // 8]
    local = rank % 8
    assert plan.mine() == [(local // 2, local % 2)]
    assert plan.device == torch.device("cuda", local)
    assert syncer.topology.everywhere and syncer.topology.is_sender == (local == 0)


@pytest.mark.parametrize("rank", [3, 9])
def test_one_sync_of_a_two_node_job_takes_handles_from_node_0_only(monkeypatch, tmp_path, rank):
    """Servers of rank 0 (node 0) only: node 1's ranks are in no handle group and pack
    nothing (they still walk every bucket, as the pipeline's broadcasts need them)."""
    groups: list[list[int]] = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend: groups.append(ranks) or ranks)
    rollout = RolloutConfig(weight_sync_transport="tensor", tensor_model_parallel_size=4)
    topo = SyncTopology.of(gpu_rank(rank, 16, 8))
    urls = ["http://s0", "http://s1"]
    syncer = build_weight_syncer(rollout, urls, ARCH, topo, run_dir=tmp_path, model_path=tmp_path)
    plan = syncer.transport.plan
    assert groups == [list(range(8))] and syncer.topology.everywhere
    if rank == 3:
        assert plan.group == groups[0] and plan.mine() == [(0, 3)]
        assert plan.device == torch.device("cuda", 3)
    else:
        assert plan.group is None and plan.mine() == [] and plan.device is None
        assert syncer.transport.pack([("w", torch.ones(2))], last=True, version=1) is None


def test_a_bucket_is_packed_on_the_sources_gpu_and_the_sender_posts_each_servers_handles(
    monkeypatch,
):
    """Rank 0 packs server 0 TP rank 0's handle on cuda:0 and gathers the other three
    (2 servers x TP2); the server at url 1 gets server 1's handles in TP order. After the
    sync the packed tensors go and torch.cuda.ipc_collect runs (on the GPU only)."""
    gpus = [(0, 1), (2, 3)]
    plan = HandlePlan(handle_sources(gpus, "nccl", 0, 4), rank=0, sender=0, group=PP_GROUP)
    serialized, posted, collected = [], [], []
    monkeypatch.setattr(transports, "serialize_handle", lambda p: serialized.append(p) or "h00")

    def gather_object(mine, everyone, dst, group):
        assert dst == 0 and group is PP_GROUP and mine == {(0, 0): "h00"}
        everyone[:] = [mine, {(0, 1): "h01"}, {(1, 0): "h10"}, {(1, 1): "h11"}]

    monkeypatch.setattr(dist, "gather_object", gather_object)
    monkeypatch.setattr(
        transports.sglang_api, "update_weights_from_tensor", lambda *a: posted.append(a)
    )
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: collected.append(True))
    transport = TensorTransport(["http://s0", "http://s1"], plan)
    with FakeTensorMode():
        bucket = [("w", torch.ones(3, 5)), ("b", torch.ones(7, dtype=torch.bfloat16))]
        packed = transport.pack(bucket, last=True, version=4)
    assert [p["flattened_tensor"].device for p in serialized] == [torch.device("cuda", 0)]
    assert packed is not None and packed.handles == [["h00", "h01"], ["h10", "h11"]]
    transport.deliver("http://s1", packed, last=True, version=4)
    assert posted == [("http://s1", ["h10", "h11"], True, 4)]
    transport.after_sync()
    assert collected == [True] and not transport._recent


def test_a_source_that_is_not_the_sender_packs_on_its_gpu_and_returns_nothing(monkeypatch):
    plan = HandlePlan(
        handle_sources([(0, 1), (2, 3)], "nccl", 0, 4), rank=3, sender=0, group=PP_GROUP
    )
    serialized = []
    monkeypatch.setattr(transports, "serialize_handle", lambda p: serialized.append(p) or "h11")
    monkeypatch.setattr(dist, "gather_object", lambda mine, everyone, dst, group: None)
    transport = TensorTransport(["http://s0", "http://s1"], plan)
    with FakeTensorMode():
        assert transport.pack([("w", torch.ones(8))], last=False, version=1) is None
    assert [p["flattened_tensor"].device for p in serialized] == [torch.device("cuda", 3)]


def test_a_cpu_sync_never_asks_cuda_to_collect(monkeypatch):
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: pytest.fail("a CUDA call on the CPU"))
    TensorTransport(["http://s0"], HandlePlan.from_sender(1, 2, CPU)).after_sync()


# ---- colocated servers on several nodes at any layout (issue 52, item 3) -----------------


@pytest.mark.parametrize(("world", "local_world", "pp"), [(2, 1, 2), (16, 8, 2), (16, 8, 4)])
def test_nodes_without_whole_replicas_sync_with_every_rank(world, local_world, pp):
    """PP across nodes (verl's large-model scripts): a node holds some stages only, so every
    rank takes part and each node's first rank sends to its own servers; it needed PP = 1."""
    senders = set()
    for rank in range(world):
        topology = SyncTopology.of(gpu_rank(rank, world, local_world, pp), per_node=True)
        assert topology.everywhere and topology.sender_ranks == tuple(range(0, world, local_world))
        if topology.is_sender:
            senders.add(rank)
        assert topology.sender_rank == rank - rank % local_world
    assert senders == set(range(0, world, local_world))


def test_nodes_with_whole_replicas_sync_from_their_first_replica_alone():
    for rank in range(16):
        topology = SyncTopology.of(gpu_rank(rank, 16, 8), per_node=True)
        assert not topology.everywhere
        assert topology.is_sender == (rank in (0, 8))
        assert topology.in_sync_replica == (rank in (0, 8))
