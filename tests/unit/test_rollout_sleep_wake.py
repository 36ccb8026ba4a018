"""Colocated sleep/wake as the trainer drives it (`PolicyServers`), against a
local HTTP server that records SGLang's admin routes; each body is parsed with SGLang's own
request classes. The release itself needs CUDA (tests/gpu/test_sglang_sleep_wake.py runs
it on a real server); on CPU only the command line and the call sequence can be checked."""

from __future__ import annotations

import http.server
import json
import threading
from types import SimpleNamespace
from typing import ClassVar

import pytest

from rlhf.config.schema import RolloutConfig
from rlhf.rollout.policy_servers import PolicyServers
from rlhf.rollout.sglang_server import build_server_args


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


def fleet_over(urls: list[str], sleeps: bool) -> PolicyServers:
    fleet = object.__new__(PolicyServers)  # the engine-owning rank, without launching servers
    fleet.engine, fleet.sleeps, fleet.asleep = SimpleNamespace(server_urls=urls), sleeps, set()
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
    fleet.resume_memory(["weights"])  # awake servers (e.g. at resume): nothing to do
    assert calls == []
    fleet.release_memory()
    fleet.resume_memory(["weights"])
    fleet.resume_memory(["kv_cache"])
    fleet.resume_memory(["kv_cache"])  # already awake
    release, resume = "release_memory_occupation", "resume_memory_occupation"
    assert parsed(calls) == [
        (release, ["weights", "kv_cache"]),
        (release, ["weights", "kv_cache"]),
        (resume, ["weights"]),
        (resume, ["weights"]),
        (resume, ["kv_cache"]),
        (resume, ["kv_cache"]),
    ]
    assert {port for port, _, _ in calls} == {int(u.rsplit(":", 1)[1]) for u in urls}


def test_no_sleep_on_cpu_or_when_disabled(servers):
    urls, calls = servers
    fleet = fleet_over(urls, sleeps=False)
    fleet.release_memory()
    fleet.resume_memory(["weights"])
    assert calls == []


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
