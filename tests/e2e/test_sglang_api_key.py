"""A real SGLang CPU server (and an sglang-router in front) started with the run's API key:
requests without it are refused, the project's clients (which send it) work on every kind
of route: health, /generate, a model-info read and a weight update."""

from __future__ import annotations

import pytest
import requests

from rlhf.config.rollout import RolloutConfig
from rlhf.rollout import sglang_api
from rlhf.rollout.client import GenerateClient, generate_payload
from rlhf.rollout.sglang_server import SGLangServer, build_router_args, build_server_args
from rlhf.utils import free_ports

pytestmark = pytest.mark.reliability

KEY = "e2e-api-key-4f1c"
SAMPLING = {"n": 2, "temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}


def refused_without_key(url: str) -> list[int]:
    """Status codes of /generate and a weight update sent with no key and a wrong key."""
    generate = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
    calls = [("generate", generate), ("update_weights_from_disk", {"model_path": "/nowhere"})]
    codes = []
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for route, body in calls:
            codes.append(requests.post(f"{url}/{route}", json=body, headers=headers, timeout=30)
                         .status_code)  # fmt: skip
    return codes


def test_keyed_server_and_router_refuse_strangers_and_serve_the_run(
    tiny_qwen2_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv(sglang_api.API_KEY_ENV, KEY)
    server_port, router_port, metrics_port = free_ports(3)
    rollout = RolloutConfig(dtype="float32")
    launch = build_server_args(rollout, tiny_qwen2_dir, port=server_port, device="cpu",
                               max_total_tokens=1024)  # fmt: skip
    server = SGLangServer(launch, tmp_path / "server.log").start()
    router = None
    try:
        server.wait_healthy(300)  # /health needs no key (probes)
        assert refused_without_key(server.url) == [401] * 4
        result = GenerateClient([server.url]).generate([generate_payload([1, 2, 3], SAMPLING)])
        assert [len(g.output_ids) for g in result[0].generations] == [4, 4]
        sglang_api.update_weights_from_disk(server.url, str(tiny_qwen2_dir), version=7)
        assert sglang_api.weight_version(server.url) == "7"

        router_launch = build_router_args([server.url], port=router_port,
                                          metrics_port=metrics_port)  # fmt: skip
        router = SGLangServer(router_launch, tmp_path / "router.log").start()
        router.wait_healthy(120)
        assert requests.post(f"{router.url}/generate", json={}, timeout=30).status_code == 401
        via_router = GenerateClient([router.url]).generate([generate_payload([4, 5], SAMPLING)])
        assert [len(g.output_ids) for g in via_router[0].generations] == [4, 4]
        assert sglang_api.router_healthy_workers(router.url) == {server.url}
    finally:
        if router is not None:
            router.stop()
        server.stop()
