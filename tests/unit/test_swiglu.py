"""The dense MLP's SwiGLU function (`rlhf.models.swiglu`) equals Megatron's unfused
`silu(gate) * (up + 0)` in its value and gradient, keeps only fc1's output for the
backward, and is what the layer spec builds for dense layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlhf.models.swiglu import SwiGLUMLP, swiglu


def megatron_glu(fc1: torch.Tensor) -> torch.Tensor:
    """Megatron-Core 0.16.1's `MLP.forward` glu with no clamp and offset 0."""
    gate, up = torch.chunk(fc1, 2, dim=-1)
    return F.silu(gate) * (up + 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_and_gradient_equal_megatrons(dtype):
    gen = torch.Generator().manual_seed(0)
    fc1 = (3 * torch.randn(37, 2, 2 * 24, generator=gen)).to(dtype).requires_grad_()
    grad = torch.randn(37, 2, 24, generator=gen).to(dtype)
    expected = megatron_glu(fc1)
    (expected_grad,) = torch.autograd.grad(expected, fc1, grad)
    out = swiglu(fc1)
    (out_grad,) = torch.autograd.grad(out, fc1, grad)
    assert torch.equal(out, expected)
    assert torch.equal(out_grad, expected_grad)


def kept_bytes(glu, fc1: torch.Tensor) -> int:
    """Bytes of the distinct storages `glu`'s autograd graph keeps for the backward."""
    storages = {}

    def keep(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        glu(fc1)
    return sum(storages.values())


def test_the_backward_keeps_only_fc1s_output():
    """fc1's output (T x 2 ffn) alone, where Megatron's glu also keeps the SiLU's output and
    the offset sum (two more T x ffn)."""
    fc1 = torch.randn(16, 1, 32, requires_grad=True)
    size = fc1.numel() * fc1.element_size()
    assert kept_bytes(swiglu, fc1) == size
    assert kept_bytes(megatron_glu, fc1) == 2 * size


def test_dense_layers_get_it_and_experts_keep_megatrons(tiny_config):
    from rlhf.models.gpt import gpt_layer_spec

    assert gpt_layer_spec(tiny_config).submodules.mlp.module is SwiGLUMLP
    moe = gpt_layer_spec(tiny_config, num_experts=4).submodules.mlp.module
    assert moe is not SwiGLUMLP


@pytest.fixture
def tiny_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
    )
