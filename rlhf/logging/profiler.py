"""Where the time of a training step goes: torch.profiler traces and NVTX stage ranges.

`global_profiler.steps` names the few steps worth a trace: profiling every step would slow
the run and fill the disk, so the other steps pay nothing. Each profiled step becomes one
Chrome trace (`<run dir>/profile/step_<N>.json`, open it in Perfetto or chrome://tracing).
`stage_range` marks the stages of a step (gen, reward, update_actor, ...) in those traces
(`stage/<name>`) and as NVTX ranges, so an Nsight Systems capture of a GPU run shows them on
its timeline too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch

from rlhf.config.schema import ProfilerConfig

log = logging.getLogger(__name__)


@contextmanager
def stage_range(name: str) -> Iterator[None]:
    """The body as a range named `name`: in a torch.profiler trace (a profiled step's stages,
    `stage/<name>`) and, when CUDA is available, in NVTX."""
    with torch.profiler.record_function(f"stage/{name}"):
        if not torch.cuda.is_available():
            yield
            return
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()


class StepProfiler:
    """Runs `torch.profiler` around the listed training steps and nothing around the others.

    Usage: `with profiler.step(step): ...` around the whole step. CPU activity is always
    recorded, CUDA activity when CUDA is available; shapes and Python stacks are not (they
    make traces large and slow the step far more than the ops themselves).
    """

    def __init__(self, steps: Iterable[int] | None, out_dir: str | Path) -> None:
        self.steps = frozenset(steps or ())
        self.trace_dir = Path(out_dir) / "profile"

    @classmethod
    def from_config(cls, profiler: ProfilerConfig, run_dir: str | Path) -> StepProfiler:
        """`global_profiler.steps`, traces under the run directory."""
        return cls(profiler.steps, run_dir)

    def trace_path(self, step: int) -> Path:
        return self.trace_dir / f"step_{step}.json"

    def step(self, step: int) -> AbstractContextManager[None]:
        """Context manager for one training step: a profile if `step` is listed, else a no-op."""
        if step not in self.steps:
            return nullcontext()
        return self._profile(step)

    @contextmanager
    def _profile(self, step: int) -> Iterator[None]:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(
            activities=activities, record_shapes=False, with_stack=False
        ) as prof:
            yield
        # Only a step that completed is exported; an exception propagates untouched.
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        path = self.trace_path(step)
        prof.export_chrome_trace(str(path))
        log.info("profile of step %d written to %s", step, path)
