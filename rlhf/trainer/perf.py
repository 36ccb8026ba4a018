"""Throughput and MFU of a PPO step, against a matmul rate measured on this machine.

MFU divides the model FLOPs a step needed by the FLOPs the hardware could have done in the
step's wall time. The peak is measured (a large fp32/bf16 matmul, once per run) rather than
read from a spec sheet, so the number means the same thing on a laptop CPU and on an H200.
"""

from __future__ import annotations

import time

import torch

from rlhf.models.families import ModelArch


def flops_per_token(arch: ModelArch, seq_len: float) -> float:
    """Forward FLOPs per token: 2 x matmul parameters + attention scores (2 x 2 x s x d)."""
    h, layers, kv = arch.hidden_size, arch.num_layers, arch.num_query_groups * arch.head_dim
    q = arch.num_attention_heads * arch.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * arch.ffn_hidden_size
    matmul = layers * per_layer + h * arch.vocab_size
    attention = layers * 2 * q * seq_len  # QK^T and PV, causal: half of 2 x s x q each
    return 2.0 * matmul + 2.0 * attention


def ppo_step_flops(
    arch: ModelArch, num_tokens: int, seq_len: float, forward_passes: int, train_epochs: int
) -> float:
    """Model FLOPs of one step: `forward_passes` forward-only passes (old log-probs, and the
    reference's and the critic's when there are those) plus forward + backward (3x forward)
    of `train_epochs` update epochs over the batch (actor and critic together)."""
    forward = flops_per_token(arch, seq_len) * num_tokens
    return forward_passes * forward + 3 * forward * train_epochs


def matmul_size(device: torch.device) -> int:
    """The side of the yardstick's matmul: on a GPU large enough (~1.1 TFLOP, about a
    millisecond on an H200) that the GPU, not the host launching kernels (a few
    microseconds each), sets the rate; a 1024 matmul there ran at the launch rate and
    understated the peak, inflating MFU."""
    return 8192 if device.type == "cuda" else 1024


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype, size: int | None = None
) -> float:
    """Sustained FLOP/s of a square matmul on `device` (a same-run yardstick for MFU)."""
    size = size or matmul_size(device)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    _sync(device)
    repeats, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.3:
        a @ b
        repeats += 1
    _sync(device)
    return 2.0 * size**3 * repeats / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
