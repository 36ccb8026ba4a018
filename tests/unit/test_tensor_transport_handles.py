"""The CPU tensor transport's shared-memory handles, read by receivers in other processes.

Each receiver stands for one SGLang server (TP rank): a long-lived process that decodes the
handle with SGLang's own deserializer (its restricted unpickler) and rebuilds the bucket with
its FlattenedTensorBucket, as the server's weight loader does, then lets the tensors go.
Two servers, or the two TP ranks of one, over two syncs through the one staging buffer:
every receiver must read that sync's values.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.multiprocessing as mp

from rlhf.weight_sync.handle_plan import HandlePlan
from rlhf.weight_sync.transports import TensorTransport

pytest.importorskip("sglang")


def _receiver(conn) -> None:
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket as Bucket
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata as Metadata

    fields = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")
    while (handle := conn.recv()) is not None:
        try:
            payload = MultiprocessingSerializer.deserialize(handle)
            # as the server's weight updater reads it: by field name, into its own class
            metadata = [Metadata(**{f: getattr(m, f) for f in fields}) for m in payload["metadata"]]
            bucket = Bucket(flattened_tensor=payload["flattened_tensor"], metadata=metadata)
            loaded = {name: t.clone() for name, t in bucket.reconstruct_tensors()}
            del payload, bucket
            gc.collect()  # the server's loader drops the bucket once the weights are copied
            conn.send(loaded)
        except Exception as e:  # reported to the test
            conn.send(repr(e))


def _bucket(step: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(step)
    return [
        ("odd.bf16", torch.randn(3, 5, generator=gen).to(torch.bfloat16)),  # 30 bytes
        ("after.fp32", torch.randn(7, generator=gen)),  # starts unaligned for fp32
        ("strided.fp32", torch.randn(4, 6, generator=gen).t()),  # not contiguous
    ]


@pytest.fixture(scope="module")
def receivers():
    """Two receiver processes (pipes to them); each decodes what it is sent until None."""
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_receiver, args=(child,), daemon=True) for _, child in pipes]
    for proc in procs:
        proc.start()
    yield [parent for parent, _ in pipes]
    for parent, _ in pipes:
        parent.send(None)
    for proc in procs:
        proc.join(timeout=60)


@pytest.mark.parametrize(
    ("servers", "server_tp_size"), [(2, 1), (1, 2)], ids=["two-servers", "one-server-tp2"]
)
def test_every_receiver_of_every_sync_reads_that_syncs_bucket(receivers, servers, server_tp_size):
    """The receivers are two servers, or the two TP ranks of one; two syncs each."""
    plan = HandlePlan.from_sender(servers, server_tp_size, torch.device("cpu"))
    transport = TensorTransport([f"http://s{i}" for i in range(servers)], plan)
    try:
        for step in (1, 2):
            transport.begin(step)
            bucket = _bucket(step)
            packed = transport.pack(bucket, last=True, version=step)
            assert packed is not None  # on the sender
            for server in range(servers):  # one server after the other, as the syncer delivers
                handles = packed.handles[server]
                assert len(handles) == server_tp_size
                ranks = receivers[server * server_tp_size : (server + 1) * server_tp_size]
                for rank, handle in zip(ranks, handles, strict=True):
                    rank.send(handle)
                for rank in ranks:
                    loaded = rank.recv()
                    assert isinstance(loaded, dict), f"step {step}: receiver failed: {loaded}"
                    for name, tensor in bucket:
                        assert loaded[name].dtype == tensor.dtype
                        assert torch.equal(loaded[name], tensor), (step, name)
    finally:
        transport.close()


PACKS_WITHOUT_SGLANG = """
import sys, torch
from rlhf.weight_sync.transports import flat_payload, serialize_handle
bucket = [("w", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16))]
handle = serialize_handle(flat_payload(bucket, lambda n: torch.empty(n, dtype=torch.uint8)))
print(len(handle), sorted(m for m in sys.modules if m.split(".")[0] == "sglang"))
"""


def test_a_cpu_handle_is_written_without_importing_sglang():
    """The trainer packs and serializes a CPU bucket with torch alone (importing SGLang
    costs a trainer 2.6 s and 270 MB here); the receivers above read what it writes."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", PACKS_WITHOUT_SGLANG], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[1:] == ["[]"]
