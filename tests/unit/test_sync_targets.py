"""The syncer's bookkeeping without servers: which servers a sync still delivers to, and the
seconds it counts per phase."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from rlhf.sglang_api import SGLangAPIError
from rlhf.weight_sync import syncer
from rlhf.weight_sync.handle_plan import HandlePlan, HandleSource
from rlhf.weight_sync.syncer import Phases, Targets
from rlhf.weight_sync.transports import TensorTransport

CPU = torch.device("cpu")


def test_a_server_that_stops_answering_is_set_aside_and_the_others_get_every_call():
    forgotten: list[str] = []
    targets = Targets(["http://a", "http://b", "http://c"], 5, True, forgotten.append)
    delivered = []

    def deliver(url: str, bucket: int) -> None:
        if url == "http://b" and bucket == 2:
            raise SGLangAPIError("http://b: connection refused", url, unreachable=True)
        delivered.append((url, bucket))

    for bucket in (1, 2, 3):
        targets.each(deliver, bucket)
    assert sorted(delivered, key=lambda d: (d[1], d[0])) == [
        ("http://a", 1),
        ("http://b", 1),
        ("http://c", 1),
        ("http://a", 2),
        ("http://c", 2),
        ("http://a", 3),
        ("http://c", 3),
    ]
    assert targets.live == ["http://a", "http://c"]
    assert targets.lost == ["http://b"]
    assert forgotten == ["http://b"]


@pytest.mark.parametrize("concurrent", [True, False])
def test_deliveries_to_several_servers_overlap_when_the_transport_allows(concurrent):
    """Each delivery waits until every server's delivery has started: deliveries one after
    another never get there (the barrier times out and the sync fails)."""
    urls = ["http://a", "http://b", "http://c"]
    all_started = threading.Barrier(len(urls), timeout=2)

    def deliver(url: str) -> None:
        try:
            all_started.wait()
        except threading.BrokenBarrierError as e:
            raise SGLangAPIError(f"{url}: answered alone", url, unreachable=False) from e

    targets = Targets(list(urls), 1, concurrent, lambda url: None)
    if concurrent:
        targets.each(deliver)
        assert targets.live == urls
    else:
        with pytest.raises(SGLangAPIError, match="answered alone"):
            targets.each(deliver)


def test_a_failure_the_server_answered_fails_the_sync():
    forgotten: list[str] = []
    targets = Targets(["http://a", "http://b"], 1, True, forgotten.append)

    def deliver(url: str) -> None:
        raise SGLangAPIError(f"{url}: 400 bad weight name", url, unreachable=False)

    with pytest.raises(SGLangAPIError, match="bad weight name"):
        targets.each(deliver)
    assert targets.live == ["http://a", "http://b"] and targets.lost == []
    assert forgotten == []


def test_phases_add_up_per_name_including_the_time_to_produce_each_item(monkeypatch):
    clock = itertools.count(0.0, 1.0)  # every reading of the clock is one second later
    monkeypatch.setattr(syncer.time, "perf_counter", lambda: next(clock))
    phases = Phases()
    items = list(phases.iterate("gather", iter(["b1", "b2"])))
    for _ in items:
        with phases("deliver"):
            pass
    with phases("deliver"):
        pass
    assert items == ["b1", "b2"]
    # three next() calls (the last finds the end), each between two readings: 1 s each
    assert phases.seconds == {"gather": 3.0, "deliver": 3.0}


@pytest.mark.parametrize("overlapped", [True, False])
def test_a_buckets_delivery_runs_while_the_next_is_packed_when_the_transport_allows(overlapped):
    """Each delivery waits (up to 2 s) for the next bucket's pack to begin: overlapped, it
    sees it; one at a time, it never does. Deliveries keep their order either way, and a
    failed delivery's error reaches the syncer."""
    phases, order, saw_next_pack = Phases(), [], []
    packing = [threading.Event() for _ in range(4)]

    def deliver(bucket: int) -> None:
        saw_next_pack.append(packing[bucket + 1].wait(timeout=2 if overlapped else 0.05))
        order.append(bucket)

    with syncer.Deliveries(overlapped, phases) as deliveries:
        for bucket in range(3):
            packing[bucket].set()  # what `pack` would do now
            deliveries.start(deliver, bucket)
        packing[3].set()
    assert order == [0, 1, 2]
    assert saw_next_pack == [overlapped] * 3
    assert phases.seconds["deliver"] > 0

    def fail(bucket: int) -> None:
        raise SGLangAPIError(f"bucket {bucket} refused", "http://a", unreachable=False)

    failing = syncer.Deliveries(overlapped, Phases())
    with pytest.raises(SGLangAPIError, match="bucket 0 refused"), failing as deliveries:
        deliveries.start(fail, 0)


@pytest.mark.parametrize(("rank", "depth"), [(0, 2), (1, 3)], ids=["sender", "other-source"])
def test_the_tensor_transport_packs_consecutive_buckets_into_different_staging_buffers(rank, depth):
    """The bucket being delivered is never overwritten by a later pack: shared-memory
    buffers take turns, two on the sender (bucket k + 2 reuses bucket k's), three on
    another rank that packs (it may run one bucket ahead of the sender's deliveries)."""
    plan = HandlePlan([[HandleSource(rank, CPU)]], rank, sender=0)
    transport = TensorTransport(["http://a"], plan)
    buckets = [[("w", torch.full((64,), float(k)))] for k in range(depth + 1)]
    flats = [transport.payload(b, CPU)["flattened_tensor"] for b in buckets]
    pointers = [f.untyped_storage().data_ptr() for f in flats]
    assert len(set(pointers[:depth])) == depth and pointers[depth] == pointers[0]
    assert torch.equal(flats[1][:256].view(torch.float32), buckets[1][0][1])
