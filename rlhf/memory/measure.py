"""Measured memory: the peak bytes a function allocates, from torch.profiler's allocation events.

On CPU there is no allocator statistic like `torch.cuda.max_memory_allocated`; the
profiler's memory profiling records every allocation and free (`profile_memory=True`), each
an event of +/- bytes at a time, in its event tree. Summing them in time order gives the
bytes allocated at every moment from the start of the call (tensors that existed before
are not counted), and the highest sum is the peak. (torch's memory-timeline analysis
(`_memory_profile`) classifies the same events but asserts on some graphs: tensor-parallel
layers' collectives.) On CUDA the allocator's own peak is used instead.
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
    with profiling_memory() as prof:
        result = fn()
    return result, allocation_peak(prof)


def profiling_memory():
    """torch.profiler recording every CPU allocation and free inside the `with`."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], profile_memory=True)


def allocation_peak(prof) -> int:
    """The most CPU bytes allocated at once during `prof`, above its start."""
    from torch._C._profiler import _EventType

    changes = []
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            changes.append((node.start_time_ns, node.extra_fields.alloc_size))
    current = peak = 0
    for _, size in sorted(changes):
        current += size
        peak = max(peak, current)
    return peak
