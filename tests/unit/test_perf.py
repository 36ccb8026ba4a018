"""The MFU yardstick (rlhf.trainer.metrics): the matmul rate a step's FLOPs are divided by."""

from __future__ import annotations

import torch

from rlhf.trainer.metrics import matmul_size, measure_matmul_flops

H200_BF16_FLOPS = 989e12  # dense, the spec sheet's
LAUNCH_S = 5e-6  # a kernel launch from Python, about


def test_on_a_gpu_the_yardstick_matmul_outlasts_its_launch_many_times():
    """A 1024 matmul (2.1 GFLOP) takes ~2 us on an H200, less than its launch: the loop then
    measured the host's launch rate and MFU came out inflated."""
    size = matmul_size(torch.device("cuda", 0))
    assert 2 * size**3 / H200_BF16_FLOPS > 100 * LAUNCH_S


def test_the_cpu_rate_is_measured():
    assert matmul_size(torch.device("cpu")) == 1024
    assert measure_matmul_flops(torch.device("cpu"), torch.float32, size=256) > 1e8
