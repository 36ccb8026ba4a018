"""`rlhf-doctor --simulate`: the memory planner held to the real code at the real shapes.

For a config (or, without `--config`, every shipped GPU config with its model's shape) the
memory simulation runs one rank's build and step in a fresh process
(`rlhf.trainer.memory_simulation`: fake tensors, a fake world; minutes on a CPU) and the
planner's phases are set next to it (`rlhf.memory.simulation_report`). The check fails
when a phase leaves less than 8% of the GPU free or the planner is more than 10% off.
Everything here is simulated, not run on a GPU.

A plain `rlhf-doctor --config C` of a shipped config sets the planner next to the stored
simulation of that config (`STORED`, written by `benchmarks/memory_simulation.py --store`)
at once, as long as the config file and its model's shape are the ones simulated (their
digests); otherwise it says the stored one is stale.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from rlhf.cli.doctor_checks import FAIL, PASS, WARN, Check
from rlhf.config import load_config
from rlhf.memory.planner import GIB, PlanInputs
from rlhf.memory.simulation_report import PhaseRow, compare, problems, table
from rlhf.models.families import arch_from_hf_config

if TYPE_CHECKING:
    from rlhf.trainer.memory_simulation import SimulatedStep

# the shipped GPU configs and the shape of the model each is written for
SHIPPED = {
    "configs/gsm8k_8gpu.yaml": "configs/model_shapes/Qwen2.5-7B.json",
    "configs/qwen3_30b_a3b_grpo_8gpu.yaml": "configs/model_shapes/Qwen3-30B-A3B.json",
    "configs/gsm8k_qwen2.5-0.5b_1gpu.yaml": "configs/model_shapes/Qwen2.5-0.5B.json",
    "configs/gsm8k_2node.yaml": "configs/model_shapes/Qwen2.5-14B.json",
}
GPU_GB = 80.0
MARK = "simulated, not run on a GPU"
STORED = Path("configs/model_shapes/simulated_memory.json")


@dataclass(frozen=True)
class SimulatedConfig:
    """A config's phases, planned and simulated, on one rank."""

    config: str
    model_shape: str
    rank: int
    pp_stage: int
    rows: list[PhaseRow]
    problems: list[str]
    deviations: tuple[str, ...]
    seconds: float

    def report(self) -> str:
        where = f"rank {self.rank}" + (f", pipeline stage {self.pp_stage}" if self.pp_stage else "")
        lines = [
            f"{self.config} ({Path(self.model_shape).stem}), {where}: GiB per GPU, {MARK} "
            f"({self.seconds:.0f} s)",
            table(self.rows),
            "simulated: the trainer's tensors counted on a simulated rank; 'of it planned': "
            "SGLang, the sync's buffers and the CUDA runtime, from the planner",
            *(f"  {d}" for d in self.deviations),
        ]
        return "\n".join(lines)

    def to_json(self) -> dict:
        phases = {
            r.phase: {
                "planned_gib": round(r.planned / GIB, 3),
                "simulated_gib": round(r.simulated / GIB, 3),
                "simulated_over_planned": round(r.ratio, 4),
                "from_planner_gib": round(r.from_planner / GIB, 3),
                "planned_te_gib": round(r.planned_te / GIB, 3),
            }
            for r in self.rows
        }
        return {
            "config": self.config,
            "model_shape": self.model_shape,
            "rank": self.rank,
            "pp_stage": self.pp_stage,
            "note": MARK,
            "phases": phases,
            "problems": self.problems,
            "deviations": list(self.deviations),
            "seconds": self.seconds,
        }


def simulate_config(
    config: str, model_shape: str, overrides: list[str] | None = None, gpu_gb: float = GPU_GB
) -> SimulatedConfig:
    """Simulate `config` (in a subprocess) and compare the planner's phases with it."""
    from rlhf.trainer.memory_simulation import simulate_in_subprocess

    step = simulate_in_subprocess(config, model_shape, overrides)
    return compare_config(config, model_shape, step, overrides, gpu_gb)


def compare_config(
    config: str,
    model_shape: str,
    step: SimulatedStep,
    overrides: list[str] | None = None,
    gpu_gb: float = GPU_GB,
) -> SimulatedConfig:
    """The planner's phases for `config` next to the simulated `step`."""
    cfg = load_config(config, overrides or [])
    arch = arch_from_hf_config(json.loads(Path(model_shape).read_text()))
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    gpu_bytes = int(gpu_gb * GIB)
    inputs = PlanInputs.from_config(cfg, arch, world, "cuda")
    peaks = {name: phase.peak for name, phase in step.phases.items()}
    rows = compare(inputs, peaks, step.pp_stage, gpu_bytes)
    return SimulatedConfig(
        config,
        str(model_shape),
        step.rank,
        step.pp_stage,
        rows,
        problems(rows, gpu_bytes),
        step.deviations,
        step.seconds,
    )


def digest(config: str, model_shape: str) -> str:
    """What a stored simulation was of: the config's and the shape's values (YAML and JSON
    parsed, so that editing a comment does not make it stale)."""
    values = [yaml.safe_load(Path(config).read_text()), json.loads(Path(model_shape).read_text())]
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


def store_shipped(path: Path = STORED) -> dict:
    """Simulate every shipped config and write the steps to `path` (atomically)."""
    from rlhf.trainer.memory_simulation import simulate_in_subprocess

    stored = {
        config: {
            "model_shape": shape,
            "digest": digest(config, shape),
            "step": simulate_in_subprocess(config, shape).to_json(),
        }
        for config, shape in SHIPPED.items()
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stored, indent=1) + "\n")
    os.replace(tmp, path)
    return stored


def check_stored(config: str, gpu_gb: float | None) -> tuple[Check, str]:
    """The doctor's row for a shipped config from its stored simulation (no `--simulate`)."""
    from rlhf.trainer.memory_simulation import SimulatedStep

    name, shape = "memory simulation", SHIPPED[config]
    entry = json.loads(STORED.read_text()).get(config) if STORED.is_file() else None
    if entry is None or entry["digest"] != digest(config, shape):
        why = "none stored" if entry is None else "the stored one is of an older config or shape"
        fix = "rlhf-doctor --simulate, or benchmarks/memory_simulation.py --store"
        return Check(name, WARN, why, fix), ""
    step = SimulatedStep.from_json(entry["step"])
    return _verdict(compare_config(config, shape, step, None, gpu_gb or GPU_GB), f"stored, {MARK}")


def _verdict(simulated: SimulatedConfig, mark: str) -> tuple[Check, str]:
    name = "memory simulation"
    if simulated.problems:
        detail = "; ".join(simulated.problems)
        return Check(name, FAIL, detail, "see the table; fix the planner or the config"), (
            simulated.report()
        )
    peak = max(r.peak for r in simulated.rows) / GIB
    detail = f"every phase within 10% of the planner, peak {peak:.1f} GiB ({mark})"
    return Check(name, PASS, detail), simulated.report()


def check_simulation(
    config: str, model_shape: str | None, overrides: list[str], gpu_gb: float | None
) -> tuple[Check, str]:
    """The doctor's row for `--simulate` and the table (or '' when nothing ran)."""
    name = "memory simulation"
    shape = model_shape or SHIPPED.get(str(Path(config)))
    if shape is None:
        return Check(name, FAIL, "no model shape", "pass --model-config"), ""
    try:
        simulated = simulate_config(config, shape, overrides, gpu_gb or GPU_GB)
    except (RuntimeError, OSError, ValueError) as e:
        return Check(name, FAIL, str(e).splitlines()[0], "see the simulation's output"), ""
    return _verdict(simulated, MARK)


def simulate_shipped(gpu_gb: float | None) -> int:
    """`rlhf-doctor --simulate` without a config: every shipped GPU config; 1 on a problem."""
    failed = 0
    for config, shape in SHIPPED.items():
        check, report = check_simulation(config, shape, [], gpu_gb)
        print(report or f"{config}: {check.detail}", end="\n\n", flush=True)
        failed += check.status == FAIL
    verdict = f"{failed} of {len(SHIPPED)} failed" if failed else "every phase fits"
    print(f"rlhf-doctor --simulate: {verdict} ({MARK})")
    return 1 if failed else 0
