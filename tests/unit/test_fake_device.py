"""The simulated device (rlhf.memory.fake_device): live bytes of the storages on the stand-in
for the GPU, counted exactly under fake tensors, and the values a step reads on the host."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf.memory.fake_device import simulated_device


def test_live_bytes_count_device_storages_until_they_are_freed():
    with simulated_device() as counter:
        a = torch.empty(1000, device="cuda")  # the stand-in device: 4,000 bytes
        assert a.device.type == "meta"
        assert counter.live == 4000
        torch.empty(1000)  # host memory is not the GPU's
        view = a[10:]
        assert counter.live == 4000
        b = a * 2
        assert counter.live == 8000
        del b
        assert counter.refresh() == 4000
        assert counter.peak == 8000
        assert counter.reset_peak() == 4000
        del view


def test_a_storage_emptied_or_refilled_by_resize_counts_its_new_size():
    """The offloader moves a model off the device by `storage.resize_(0)` (no op runs)."""
    with simulated_device() as counter:
        a = torch.zeros(1000, device="cuda")
        counter.reset_peak()
        a.untyped_storage().resize_(0)
        assert counter.live == 0
        a.untyped_storage().resize_(4000)
        assert counter.live == 4000
        assert counter.peak == 4000


def test_a_module_moves_to_the_device_trains_and_is_counted():
    with simulated_device() as counter:
        layer = torch.nn.Linear(64, 32, bias=False).to("cuda")
        assert layer.weight.device.type == "meta"
        assert counter.live == 64 * 32 * 4
        x = torch.ones(16, 64, device="cuda", requires_grad=True)
        layer(x).sum().backward()
        assert layer.weight.grad.shape == (32, 64)
        assert counter.refresh() == 2 * 64 * 32 * 4 + 16 * 64 * 4 * 2  # weight, grad, x, x.grad


def test_small_integer_tensors_carry_their_values_and_weight_values_read_as_one():
    with simulated_device():
        bounds = torch.tensor([0, 3, 5]).to("cuda")
        assert bounds.tolist() == [0, 3, 5]
        ids = torch.arange(10, device="cuda")
        assert ids[ids > 6].tolist() == [7, 8, 9]  # a bool mask selects what it selects
        assert torch.bincount(torch.tensor([0, 2, 2])).tolist() == [1, 0, 2]
        norm = torch.ones(4, device="cuda").norm()
        assert norm.item() == 1.0  # depends on the weights: read as 1
        assert bool(torch.isfinite(norm).all())


def test_attention_keeps_no_scores_on_the_stand_in_device():
    """The fused kernel, as the real local-spec run and TE take: no T x T scores."""
    with simulated_device() as counter:
        q, k, v = (torch.empty(1, 2, 256, 16, device="cuda") for _ in range(3))
        counter.reset_peak()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert out.shape == (1, 2, 256, 16)
        assert counter.peak - 3 * q.numel() * 4 < 256 * 256 * 4  # one head's scores


def test_a_parameter_moved_to_the_device_keeps_megatrons_attributes():
    """`allreduce=False` is what puts a routed expert's gradient in DDP's expert buffer."""
    with simulated_device():
        layer = torch.nn.Linear(4, 4)
        layer.weight.allreduce = False
        layer.to("cuda")
        assert layer.weight.device.type == "meta"
        assert layer.weight.allreduce is False
