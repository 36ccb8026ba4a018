"""Colocated sleep/wake on CUDA: a real SGLang server started as the trainer starts it
(`--enable-memory-saver`, rollout.free_cache_engine) releases its weights, KV cache and CUDA
graphs (the GPU's free memory grows by most of its share), resumes them in the trainer's
order (weights, then KV cache and CUDA graphs), takes the weights again from disk (the
trainer syncs them there) and then generates the tokens it generated before.
Skipped without CUDA, SGLang or torch_memory_saver (SGLang's release needs CUDA)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rlhf import sglang_api
from rlhf.config.schema import RolloutConfig
from rlhf.rollout.policy_servers import CACHE_TAGS, WEIGHT_TAGS
from rlhf.rollout.sglang_server import SGLangServer, build_server_args
from rlhf.utils import free_port

pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("sglang", "torch_memory_saver")),
    reason="needs SGLang and torch_memory_saver (requirements/gpu.txt)",
)


def greedy(url: str) -> list[int]:
    request = {
        "input_ids": [5, 6, 7, 8],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
    }
    return sglang_api.generate(url, request)["output_ids"]


def test_release_and_resume_give_memory_back_and_keep_generating(tiny_qwen2_dir, tmp_path):
    rollout = RolloutConfig(dtype="bfloat16", gpu_memory_utilization=0.3)
    launch = build_server_args(rollout, tiny_qwen2_dir, port=free_port(), device="cuda")
    assert "--enable-memory-saver" in launch.argv
    with SGLangServer(launch, tmp_path / "server.log").start() as server:
        server.wait_healthy(600)
        before = greedy(launch.url)
        awake_free, total = torch.cuda.mem_get_info()
        sglang_api.release_memory_occupation(launch.url, [*WEIGHT_TAGS, *CACHE_TAGS])
        asleep_free, _ = torch.cuda.mem_get_info()
        assert asleep_free - awake_free > 0.5 * rollout.gpu_memory_utilization * total
        sglang_api.resume_memory_occupation(launch.url, WEIGHT_TAGS)
        sglang_api.update_weights_from_disk(launch.url, str(tiny_qwen2_dir), version=1)
        sglang_api.resume_memory_occupation(launch.url, CACHE_TAGS)
        assert greedy(launch.url) == before
