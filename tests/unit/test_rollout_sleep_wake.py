"""Colocated sleep/wake as the trainer drives it (`PolicyServers`), against a
local HTTP server that records SGLang's admin routes; each body is parsed with SGLang's own
request classes. The release itself needs CUDA (tests/gpu/test_sglang_sleep_wake.py runs
it on a real server); on CPU only the command line and the call sequence can be checked:
the order of a colocated weight load (the policy's state off the device, cache emptied,
SGLang's weights, sync, cache emptied, KV cache and CUDA graphs, probe) is recorded with a
policy, syncer and probe that only record their calls (each runs for real in
tests/e2e/test_weight_sync.py)."""

from __future__ import annotations

import http.server
import json
import threading
from contextlib import contextmanager
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from rlhf.config.schema import RolloutConfig
from rlhf.memory import ledger
from rlhf.rollout import policy_servers
from rlhf.rollout.policy_servers import PolicyServers
from rlhf.rollout.sglang_server import build_server_args
from rlhf.trainer.rollouts import SynchronousRollout
from rlhf.weight_sync.probe import ProbeSequence
from rlhf.weight_sync.syncer import SyncStats


class _Recorder(http.server.BaseHTTPRequestHandler):
    calls: ClassVar[list[tuple[int, str, dict]]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.calls.append((self.server.server_port, self.path.lstrip("/"), body))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.fixture
def servers():
    _Recorder.calls = []
    started = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder) for _ in range(2)]
    for server in started:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield [f"http://127.0.0.1:{s.server_port}" for s in started], _Recorder.calls
    for server in started:
        server.shutdown()


def fleet_over(urls: list[str], sleeps: bool, device: str = "cuda") -> PolicyServers:
    """The engine-owning rank, without launching servers; `device` "cuda": as on a GPU, where
    the release and wake are calls to SGLang (recorded here)."""
    fleet = object.__new__(PolicyServers)
    fleet.engine, fleet.sleeps, fleet.asleep = SimpleNamespace(server_urls=urls), sleeps, set()
    fleet.ctx, fleet.colocated = SimpleNamespace(device=torch.device(device)), True
    fleet.weights_released = False
    fleet.probe_sequence = ProbeSequence.text([1, 2, 3])
    return fleet


def parsed(calls):
    from sglang.srt.managers.io_struct import (
        ReleaseMemoryOccupationReqInput,
        ResumeMemoryOccupationReqInput,
    )

    kinds = {
        "release_memory_occupation": ReleaseMemoryOccupationReqInput,
        "resume_memory_occupation": ResumeMemoryOccupationReqInput,
    }
    return [(route, kinds[route](**body).tags) for _, route, body in calls]


def test_sleep_then_wake_weights_then_kv_cache(servers):
    urls, calls = servers
    fleet = fleet_over(urls, sleeps=True)
    fleet.wake(["weights"])  # awake servers (e.g. at resume): nothing to do
    assert calls == []
    fleet.release_memory()
    fleet.wake(["weights"])
    fleet.wake(["kv_cache", "cuda_graph"])
    fleet.wake(["kv_cache", "cuda_graph"])  # already awake
    release, resume = "release_memory_occupation", "resume_memory_occupation"
    assert parsed(calls) == [
        (release, ["weights", "kv_cache", "cuda_graph"]),
        (release, ["weights", "kv_cache", "cuda_graph"]),
        (resume, ["weights"]),
        (resume, ["weights"]),
        (resume, ["kv_cache", "cuda_graph"]),
        (resume, ["kv_cache", "cuda_graph"]),
    ]
    assert {port for port, _, _ in calls} == {int(u.rsplit(":", 1)[1]) for u in urls}


def test_no_sleep_when_disabled(servers):
    urls, calls = servers
    ledger.reset()
    fleet = fleet_over(urls, sleeps=False)
    fleet.note_started()
    fleet.release_memory()
    fleet.wake(["weights"])
    assert calls == [] and not fleet.weights_released
    assert ledger.ledger().holds("sglang", "weights") and ledger.ledger().holds(
        "sglang", "kv_cache"
    )


def test_on_the_cpu_the_same_decisions_run_and_only_the_ledger_records_them(servers):
    """SGLang's release is a CUDA call: on the CPU nothing is asked of the servers, but the
    device ledger goes through the states a GPU run's servers go through."""
    urls, calls = servers
    book = ledger.reset()
    fleet = fleet_over(urls, sleeps=True, device="cpu")
    fleet.note_started()
    assert book.holds("sglang", "weights") and book.holds("sglang", "cuda_graph")
    fleet.release_memory()
    assert not book.holds("sglang") and fleet.weights_released
    fleet.wake(["weights"])
    assert book.holds("sglang", "weights") and not book.holds("sglang", "kv_cache")
    fleet.wake(["kv_cache", "cuda_graph"])
    assert book.holds("sglang", "kv_cache") and calls == []


class RecordingPolicy:
    """The trained policy as a rollout strategy publishes it (`PPOEngine.serving`): records
    which of its states it holds on the device around the load."""

    module = "the policy's module"

    def __init__(self, trace: list) -> None:
        self.trace = trace

    @contextmanager
    def serving(self, probe, weights_only: bool):
        held = "weights only" if weights_only else "all"
        self.trace.append(f"policy: {held} on the device, probe log-probs computed")
        yield SimpleNamespace(module=self.module, probe_logprobs=torch.zeros(len(probe.tokens) - 1))
        self.trace.append("policy: state back")


def recorded_load(urls, calls, monkeypatch, sleeps: bool) -> list:
    """The sequence of one weight load as the synchronous strategy publishes version 3: the
    recorder's routes (one entry per route and tags, for both servers) among the policy's,
    the syncer's and the cache's."""
    fleet = fleet_over(urls, sleeps)
    fleet.release_memory()
    calls.clear()
    monkeypatch.setattr(policy_servers, "empty_device_cache", lambda: calls.append("empty cache"))

    def sync(module, version):
        assert module == RecordingPolicy.module
        calls.append(f"sync v{version}")
        return SyncStats(0.0, 0, 0, 0, 0)

    fleet.syncer = SimpleNamespace(sync=sync)
    fleet.probe = lambda policy: calls.append("probe") or 0.0
    SynchronousRollout.publish(SimpleNamespace(servers=fleet), RecordingPolicy(calls), 3)
    sequence = []
    for call in calls:
        if isinstance(call, tuple):
            call = f"{call[1]} {call[2]['tags']}"
        if not sequence or sequence[-1] != call:  # the same route to the second server
            sequence.append(call)
    return sequence


def test_a_colocated_weight_load_wakes_the_kv_cache_only_after_the_sync(servers, monkeypatch):
    urls, calls = servers
    assert recorded_load(urls, calls, monkeypatch, sleeps=True) == [
        "policy: weights only on the device, probe log-probs computed",
        "empty cache",
        "resume_memory_occupation ['weights']",
        "sync v3",
        "empty cache",
        "resume_memory_occupation ['kv_cache', 'cuda_graph']",
        "probe",
        "policy: state back",
    ]
    assert len([c for c in calls if isinstance(c, tuple)]) == 2 * len(urls)


def test_servers_that_do_not_sleep_get_the_weights_with_the_policy_on_device(servers, monkeypatch):
    urls, calls = servers
    assert recorded_load(urls, calls, monkeypatch, sleeps=False) == [
        "policy: all on the device, probe log-probs computed",
        "sync v3",
        "probe",
        "policy: state back",
    ]


@pytest.mark.parametrize(
    ("device", "free_cache_engine", "saver"),
    [("cuda", True, True), ("cuda", False, False), ("cpu", True, False)],
)
def test_servers_start_with_the_memory_saver_only_when_they_will_sleep(
    device, free_cache_engine, saver
):
    rollout = RolloutConfig(free_cache_engine=free_cache_engine)
    launch = build_server_args(rollout, "/m", port=30000, device=device)
    assert ("--enable-memory-saver" in launch.argv) == saver


@pytest.mark.parametrize(("device", "free_cache_engine"), [("cuda", True), ("cuda", False)])
def test_a_lora_server_that_sleeps_keeps_its_base_weights_in_host_memory(device, free_cache_engine):
    """A LoRA run syncs only adapters (`rlhf.weight_sync.adapters`): a server that releases
    its weights while the trainer trains must get the base weights back as they were."""
    from rlhf.config.engine_args import lora_server_kwargs
    from rlhf.config.rollout import EngineKwargs
    from rlhf.config.schema import ModelConfig

    lora = EngineKwargs(sglang=lora_server_kwargs(ModelConfig(path="/m", lora_rank=8)))
    rollout = RolloutConfig(free_cache_engine=free_cache_engine, engine_kwargs=lora)
    argv = build_server_args(rollout, "/m", port=30000, device=device).argv
    assert ("--enable-weights-cpu-backup" in argv) == free_cache_engine
    assert "--enable-lora" in argv and "--lora-backend" not in argv  # SGLang's GPU default
    plain = build_server_args(RolloutConfig(free_cache_engine=True), "/m", port=1, device=device)
    assert "--enable-weights-cpu-backup" not in plain.argv  # full syncs rewrite every weight
