"""The dense MLP's SwiGLU as one autograd function, on every layer spec.

Megatron-Core 0.16.1's `MLP` with a gated SiLU and no activation fusion (this project's
setting: `bias_activation_fusion=False`) computes `silu(a) * (b + glu_linear_offset)` from
the two halves of fc1's output with autograd keeping, besides fc1's output, the SiLU's
output and the offset sum (two more T x ffn tensors per layer, with TE's linears as on the
local spec), and its backward concatenates the halves' gradients into a third. Here
`SwiGLUMLP` runs `swiglu`: the forward keeps only fc1's output, the backward writes both
halves' gradients straight into one [..., 2 ffn] tensor. The values are the same (an offset
of 0 adds nothing); the saved activations of the MLP drop from 5 to 3 T x ffn tensors per
layer (fc1's output and fc2's input, `rlhf.memory.activations`), and each layer does three
fewer T x ffn passes (the offset sum, the concatenation, a multiplication in the backward).

Any other MLP setting (a clamp, an offset, fused or TE activations, per-token scales) runs
Megatron's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP
from torch import Tensor


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fc1: Tensor) -> Tensor:
        gate, up = fc1.chunk(2, dim=-1)
        ctx.save_for_backward(fc1)
        return F.silu(gate).mul_(up)  # in place: one T x ffn allocation less

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (fc1,) = ctx.saved_tensors
        gate, up = fc1.chunk(2, dim=-1)
        halves = torch.empty_like(fc1)
        grad_gate, grad_up = halves.chunk(2, dim=-1)
        torch.mul(grad, F.silu(gate), out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return halves


def swiglu(fc1: Tensor) -> Tensor:
    """silu(gate) * up of fc1's output [..., 2 ffn] = [gate | up], keeping only fc1's output
    for the backward."""
    return _SwiGLU.apply(fc1)


class SwiGLUMLP(MLP):
    """Megatron's `MLP` whose plain SwiGLU runs as `swiglu` (see the module)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.plain_swiglu = (
            config.gated_linear_unit
            and config.activation_func is F.silu
            and not config.bias_activation_fusion
            and not getattr(config, "use_te_activation_func", False)
            and getattr(config, "activation_func_clamp_value", None) is None
            and not getattr(config, "glu_linear_offset", 0.0)
        )

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if not self.plain_swiglu or per_token_scale is not None:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        return self.linear_fc2(swiglu(intermediate))
