"""rlhf-doctor's memory checks: the planner's per-GPU table for the config and its verdict,
and the host RAM a node needs for its trainer ranks against the node's."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from rlhf.cli.doctor_checks import FAIL, PASS, WARN, Check
from rlhf.config.loader import ConfigError
from rlhf.memory.planner import GIB, MemoryPlan, PlanInputs
from rlhf.memory.report import describe
from rlhf.models.families import ModelArch, arch_from_hf_config, load_arch


def gpu_memory_bytes(gpu_memory_gb: float | None) -> int | None:
    """The flag's value, else the memory of this machine's GPU 0, else None."""
    if gpu_memory_gb is not None:
        return int(gpu_memory_gb * GIB)
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None


def _arch(model_path: str | None, model_config: Path | None) -> ModelArch | None:
    """The policy's architecture: from --model-config, else the model directory's
    config.json (`actor_rollout_ref.model.path`); None without either."""
    if model_config is not None:
        return arch_from_hf_config(json.loads(Path(model_config).read_text()))
    model_dir = Path(model_path or ".")
    return load_arch(model_dir) if (model_dir / "config.json").is_file() else None


def host_memory_bytes(host_memory_gb: float | None) -> int:
    """The flag's value, else this machine's RAM."""
    if host_memory_gb is not None:
        return int(host_memory_gb * GIB)
    import psutil

    return int(psutil.virtual_memory().total)


def check_host_memory(plan: MemoryPlan, host_gb: float | None) -> Check:
    """A node's trainer ranks against its RAM (`rlhf.memory.host`)."""
    need, have = plan.host_bytes / GIB, host_memory_bytes(host_gb) / GIB
    detail = f"{need:.1f} GiB per node for the trainer ranks (estimated) of {have:.1f} GiB"
    if plan.host_bytes > host_memory_bytes(host_gb):
        fix = "fewer offloaded kinds (megatron.*_offload), or nodes with more RAM"
        return Check("host memory", FAIL, detail, fix)
    return Check("host memory", PASS, detail)


def check_memory(
    model_path: str | None,
    plan_inputs: Callable[[ModelArch], PlanInputs],
    model_config: Path | None,
    gpu_gb: float | None,
    host_gb: float | None = None,
) -> tuple[list[Check], str]:
    """(the checks: GPU memory, and host memory on GPU runs; the planner's report or '').
    The policy's shape from `model_config`, else from `model_path`; `plan_inputs`: the
    planner's inputs for it (`PlanInputs.from_config`, bound by the doctor's `main`)."""
    name = "memory"
    try:
        arch = _arch(model_path, model_config)
    except (OSError, ValueError, KeyError) as e:
        return [Check(name, FAIL, f"cannot read the model's config: {e}", "fix --model-config")], ""
    if arch is None:
        fix = "download the model, or pass --model-config (see configs/model_shapes)"
        return [Check(name, WARN, "no model config.json: memory not planned", fix)], ""
    try:
        inputs = plan_inputs(arch)
        gpu_bytes = None if inputs.device == "cpu" else gpu_memory_bytes(gpu_gb)
        plan, report = describe(inputs, gpu_bytes)
    except (ConfigError, ValueError) as e:
        return [Check(name, FAIL, str(e), "fix the parallel sizes")], ""
    if inputs.device == "cpu":
        detail = f"peak {plan.peak / GIB:.2f} GiB per GPU (CPU run: no GPU memory to fit)"
        return [Check(name, PASS, detail)], report
    return [_gpu_verdict(plan, gpu_bytes), check_host_memory(plan, host_gb)], report


def _gpu_verdict(plan: MemoryPlan, gpu_bytes: int | None) -> Check:
    peak = f"peak {plan.peak / GIB:.2f} GiB per GPU"
    if gpu_bytes is None:
        return Check("memory", WARN, f"{peak}; GPU memory unknown", "pass --gpu-memory-gb")
    if not plan.fits:
        fix = "see the suggestions under the memory table"
        return Check("memory", FAIL, f"{peak} exceeds {gpu_bytes / GIB:.2f} GiB", fix)
    return Check("memory", PASS, f"{peak} fits in {gpu_bytes / GIB:.2f} GiB")
