"""Profiled steps write a real Chrome trace with the step's stages in it; other steps write
nothing; stages are NVTX ranges."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from rlhf.logging import StepProfiler, Timer, stage_range


def test_profiled_step_writes_a_chrome_trace_with_the_ops_run_inside(tmp_path):
    profiler, timer = StepProfiler([2], tmp_path), Timer()
    for step in (1, 2, 3):
        with profiler.step(step), timer.stage("update_actor"):
            torch.mm(torch.randn(16, 16), torch.randn(16, 16))

    written = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert written == ["step_2.json"]
    trace = json.loads(profiler.trace_path(2).read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names
    stages = [e for e in trace["traceEvents"] if e.get("name") == "stage/update_actor"]
    (mm,) = [e for e in trace["traceEvents"] if e.get("name") == "aten::mm"]
    assert len(stages) == 1 and stages[0]["ts"] <= mm["ts"] <= stages[0]["ts"] + stages[0]["dur"]


def test_no_listed_steps_writes_nothing(tmp_path):
    for steps in (None, []):
        profiler = StepProfiler(steps, tmp_path)
        with profiler.step(1):
            torch.mm(torch.randn(4, 4), torch.randn(4, 4))
    assert not (tmp_path / "profile").exists()


def test_a_failing_profiled_step_raises_and_exports_nothing(tmp_path):
    profiler = StepProfiler([1], tmp_path)
    with pytest.raises(RuntimeError, match="step failed"), profiler.step(1):
        raise RuntimeError("step failed")
    assert not profiler.trace_path(1).exists()


def test_from_config_reads_steps_and_run_dir(tmp_path):
    cfg = SimpleNamespace(
        global_profiler=SimpleNamespace(steps=[1, 5]),
        trainer=SimpleNamespace(default_local_dir=str(tmp_path)),
    )
    profiler = StepProfiler.from_config(cfg.global_profiler, cfg.trainer.default_local_dir)
    assert profiler.steps == {1, 5}
    assert profiler.trace_path(5) == tmp_path / "profile" / "step_5.json"


@pytest.fixture
def fake_nvtx(monkeypatch) -> list[str]:
    """Pretend CUDA is there and record NVTX pushes and pops."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(f"push {name}"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append("pop"))
    return calls


def test_stage_range_pushes_and_pops_even_on_error(fake_nvtx):
    with stage_range("gen"):
        pass
    with pytest.raises(ValueError), stage_range("reward"):
        raise ValueError("boom")
    assert fake_nvtx == ["push gen", "pop", "push reward", "pop"]


def test_timer_stage_is_an_nvtx_range(fake_nvtx):
    timer = Timer()
    with timer.stage("update_actor"):
        assert fake_nvtx == ["push update_actor"]
    assert fake_nvtx == ["push update_actor", "pop"]
    assert set(timer.metrics()) == {"timing_s/update_actor"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_stage_range_without_cuda_does_nothing(monkeypatch):
    def fail(*args: object) -> None:
        raise AssertionError("NVTX must not be called without CUDA")

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", fail)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", fail)
    with stage_range("gen"):
        pass
