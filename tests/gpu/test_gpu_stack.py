"""GPU path: nccl, CUDA devices, Transformer Engine layers when importable; no CPU patches.

Skipped without CUDA (tests/conftest.py marks this folder `gpu`).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from rlhf.distributed import cpu_compat
from rlhf.distributed.bootstrap import init_parallel, seed_everything, teardown


@pytest.fixture
def gpu_world():
    ctx = init_parallel("auto")
    seed_everything(0)
    yield ctx
    teardown()


def test_bootstrap_selects_nccl_and_cuda(gpu_world):
    assert gpu_world.backend == "nccl"
    assert gpu_world.device.type == "cuda"
    assert not cpu_compat.is_applied()  # installed only for CPU processes


def test_gpt_forward_on_gpu_uses_expected_spec(gpu_world):
    from megatron.core.transformer import TransformerConfig

    from rlhf.models.gpt import build_gpt_model, transformer_engine_usable

    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        params_dtype=torch.bfloat16,
        bf16=True,
    )
    model = build_gpt_model(config, 128, 64, pre_process=True, post_process=True).cuda()
    tokens = torch.randint(0, 128, (2, 16), device="cuda")
    positions = torch.arange(16, device="cuda").expand(2, 16)
    logits = model(tokens, positions, None)
    assert logits.shape == (2, 16, 128) and logits.is_cuda
    has_te = importlib.util.find_spec("transformer_engine") is not None
    assert transformer_engine_usable() == has_te
    layer_types = {type(m).__module__ for m in model.modules()}
    assert any("transformer_engine" in t for t in layer_types) == has_te
