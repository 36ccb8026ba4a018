"""Measured memory: the peak bytes a function allocates, from torch.profiler's memory profile.

On CPU there is no allocator statistic like `torch.cuda.max_memory_allocated`; the profiler's
memory timeline (every tensor storage created and destroyed while profiling, in order) gives
the same number: the highest total of storages alive at once, counted from the start of the
call (tensors that existed before are not counted). It uses the profiler's memory-timeline
machinery (`_memory_profile`, the code behind `export_memory_timeline`), which needs
`record_shapes` and `with_stack`. On CUDA the allocator's own peak is used instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def peak_bytes_during(fn: Callable[[], T], device: torch.device) -> tuple[T, int]:
    """fn()'s result and the most bytes it had allocated on `device` at any one time."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        return result, torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        result = fn()
    current = peak = 0
    for _, action, (key, _), size in prof._memory_profile().timeline:
        if key.device.type != "cpu":
            continue
        if action == Action.CREATE:
            current += size
        elif action == Action.DESTROY:
            current -= size
        peak = max(peak, current)
    return result, peak
