"""Megatron's torch Adam over CPU parameters takes torch's multi-tensor path
(`rlhf.engine.engine._foreach_on_cpu`): the same update as its per-parameter loop."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from rlhf.engine.engine import _foreach_on_cpu


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def test_cpu_adam_takes_the_multi_tensor_path_with_the_same_update(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 3, 2)]
    loop = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
    fast = [p.detach().clone().requires_grad_() for p in loop]
    reference, optimizer = _adamw(loop), _adamw(fast)
    _foreach_on_cpu(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=optimizer)]))
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]
    for step in grads:
        for p, g in zip(loop, step, strict=True):
            p.grad = g.clone()
        reference.step()
    monkeypatch.setattr(
        importlib.import_module("torch.optim.adam"), "_single_tensor_adam", _refused
    )
    for step in grads:
        for p, g in zip(fast, step, strict=True):
            p.grad = g.clone()
        optimizer.step()
    for got, want in zip(fast, loop, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def _refused(*args, **kwargs):
    pytest.fail("the per-parameter loop ran")
