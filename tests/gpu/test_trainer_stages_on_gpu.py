"""The trainer's Megatron stages on CUDA (nccl) against the same stages on CPU and HF.

The worker of tests/distributed/test_ppo_stages.py runs with `--device cuda` (fp32 and
bf16) and with `--device cpu` (fp32), one rank each: packed old log-probs, one PPO actor
update (Adam, grad clip), the log-probs after it and a checkpoint round trip (synchronous and
in the background, `trainer.async_save`). In fp32 TF32 stays off (torch's default), so only
summation order separates the devices. Skipped without CUDA (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_ppo_stages import assert_bf16_update_matches_fp32, hf_response_logprobs
from tests.helpers import run_worker_layouts

# one rank each: name -> (ranks, worker arguments)
RUNS = {
    "cuda": (1, ["--device", "cuda", "--dtype", "float32"]),
    "cpu": (1, ["--device", "cpu", "--dtype", "float32"]),
    "cuda_bf16": (1, ["--device", "cuda", "--dtype", "bfloat16"]),
}


@pytest.fixture(scope="module")
def runs(tiny_qwen2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_stages")
    return run_worker_layouts("ppo_stages.py", RUNS, tiny_qwen2_dir, out)


def test_stages_ran_on_cuda(runs):
    assert runs["cuda"]["device"] == runs["cuda_bf16"]["device"] == "cuda"
    assert runs["cpu"]["device"] == "cpu"
    assert all(run["checkpoint_round_trip"] for run in runs.values())
    # trainer.async_save on CUDA: Megatron's device-to-host preload, then the fork
    assert all(run["background_round_trip"] for run in runs.values())


def test_packed_logprobs_on_cuda_match_hf(runs, tiny_qwen2_dir):
    reference = hf_response_logprobs(tiny_qwen2_dir, runs["cuda"]["batch"])
    torch.testing.assert_close(runs["cuda"]["logprobs_before"], reference, atol=1e-4, rtol=0)


def test_update_on_cuda_matches_cpu(runs):
    cuda, cpu = runs["cuda"], runs["cpu"]
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/entropy"):
        assert cuda["metrics"][key] == pytest.approx(cpu["metrics"][key], rel=1e-3, abs=1e-5), key
    torch.testing.assert_close(cuda["logprobs_after"], cpu["logprobs_after"], atol=1e-3, rtol=0)
    assert (cuda["logprobs_after"] - cuda["logprobs_before"]).abs().max() > 1e-3
    for name, value in cpu["weights"].items():
        torch.testing.assert_close(cuda["weights"][name], value, atol=1e-4, rtol=0, msg=name)


def test_bf16_update_on_cuda_is_the_fp32_update_up_to_rounding(runs):
    assert_bf16_update_matches_fp32(runs["cuda_bf16"], runs["cpu"])
