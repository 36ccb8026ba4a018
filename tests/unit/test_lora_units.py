"""LoRA's decisions that need no process group: verl's target_modules -> Megatron's layers,
and the input an adapter sees next to a layer that fuses its norm (Transformer Engine's
layer-norm linear, which takes the residual stream): the norm's output, as Megatron's own
norm computes it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlhf.models.lora import adapter_input, megatron_targets


def test_targets():
    assert megatron_targets("all-linear") == (
        "linear_qkv",
        "linear_fc1",
        "linear_proj",
        "linear_fc2",
    )
    assert megatron_targets(["o_proj", "q_proj", "k_proj", "v_proj"]) == (
        "linear_qkv",
        "linear_proj",
    )
    assert megatron_targets("down_proj") == ("linear_fc2",)
    with pytest.raises(ValueError, match=r"\['gate_proj'\] without \['up_proj'\]"):
        megatron_targets(["gate_proj"])
    with pytest.raises(ValueError, match=r"\['embed_tokens'\] are not linear layers"):
        megatron_targets(["embed_tokens"])


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_an_adapter_sees_the_fused_norms_output(normalization):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        normalization=normalization,
        layernorm_epsilon=1e-5,
    )
    norm = WrappedTorchNorm(config, hidden_size=8, eps=1e-5)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    fused = nn.Module()  # what TE's layer-norm linear holds of its norm
    fused.layer_norm_weight = norm.weight
    if normalization == "LayerNorm":
        fused.layer_norm_bias = norm.bias
    x = torch.randn(3, 2, 8, generator=gen)
    assert torch.allclose(adapter_input(fused, x, config), norm(x), atol=1e-6)
    plain = nn.Linear(8, 8)  # the local spec: the norm is a module of its own
    assert adapter_input(plain, x, config) is x
