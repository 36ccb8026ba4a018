"""The planner held to the memory simulation, phase by phase.

The simulation (`rlhf.trainer.memory_simulation`) counts the trainer's tensors on one
simulated rank; what it cannot run comes from the planner and is added to both sides alike:
SGLang's share of a colocated GPU in the phases its servers are awake (the rollout and the
probe, its weights alone during the sync), the weight sync's gathers and buckets
(`sync_bytes`) and the CUDA runtime. The planner is compared on the same layer spec as the
simulation (Megatron's local spec, device "local"), at the simulated rank's pipeline stage;
the plan of a GPU with Transformer Engine is shown next to it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlhf.memory.planner import GIB, GPU_RUNTIME_BYTES, LOCAL_SPEC, PlanInputs, plan_stage

# the simulation's phases (the device ledger's) and the planner's phase each is held to
PLANNED_AS = {
    "build": "build",
    "rollout": "rollout",
    "old_log_prob": "old_log_prob",
    "ref": "reference",
    "values": "values",
    "update_critic": "critic",
    "update_actor": "actor",
    "sync": "weight_sync",
    "probe": "kv_cache_wake",  # next to sleeping servers (the planner's "probe" otherwise)
}
TOLERANCE = 0.10  # the planner within 10% of the simulation, phase by phase
HEADROOM = 0.08  # every phase leaves 8% of the GPU free


@dataclass(frozen=True)
class PhaseRow:
    """One phase: planned (local spec) and simulated bytes on the GPU, and the planner's
    Transformer Engine plan; `from_planner`: the part of `simulated` taken from the plan."""

    phase: str
    planned: int
    simulated: int
    planned_te: int
    from_planner: int

    @property
    def ratio(self) -> float:
        return self.simulated / self.planned if self.planned else float("nan")

    @property
    def peak(self) -> int:
        return max(self.planned, self.simulated, self.planned_te)


def _sglang_bytes(phase: str, inputs: PlanInputs, weights: int, total: int) -> int:
    """SGLang's bytes on this GPU in `phase` (the planner's `rollout` row)."""
    if not inputs.colocated:
        return 0
    if not inputs.release_rollout:
        return total
    return {"rollout": total, "probe": total, "sync": weights}.get(phase, 0)


def compare(
    inputs: PlanInputs, simulated: dict[str, int], stage: int, gpu_bytes: int
) -> list[PhaseRow]:
    """Rows for the phases simulated (`simulated`: the trainer's peak bytes per phase of
    the rank at pipeline stage `stage`), in the step's order."""
    local = plan_stage(replace(inputs, device=LOCAL_SPEC), stage, gpu_bytes)
    gpu = plan_stage(inputs, stage, gpu_bytes)
    sglang = local.row("rollout") if inputs.colocated else None
    weights, total = (sglang.weights, sglang.total) if sglang is not None else (0, 0)
    sync = local.row("actor").communication
    rows = []
    for phase, trainer in simulated.items():
        planned_as = PLANNED_AS.get(phase)
        if phase == "probe" and planned_as not in local.phases:
            planned_as = "probe"  # servers that do not sleep
        if planned_as not in local.phases:
            continue
        added = GPU_RUNTIME_BYTES + _sglang_bytes(phase, inputs, weights, total)
        added += sync if phase == "sync" else 0
        rows.append(
            PhaseRow(
                phase, local.phases[planned_as], trainer + added, gpu.phases[planned_as], added
            )
        )
    return rows


def problems(rows: list[PhaseRow], gpu_bytes: int) -> list[str]:
    """The phases over the GPU's budget less the headroom, or planned more than
    `TOLERANCE` away from the simulation, in words."""
    budget = int(gpu_bytes * (1 - HEADROOM))
    found = []
    for row in rows:
        if row.peak > budget:
            found.append(
                f"{row.phase}: {row.peak / GIB:.1f} GiB leaves less than {HEADROOM:.0%} of "
                f"{gpu_bytes / GIB:.0f} GiB"
            )
        if abs(row.ratio - 1) > TOLERANCE:
            found.append(
                f"{row.phase}: planned {row.planned / GIB:.2f} GiB, simulated "
                f"{row.simulated / GIB:.2f} GiB ({row.ratio:.2f}x)"
            )
    return found


def table(rows: list[PhaseRow]) -> str:
    """The rows in GiB."""
    header = (
        f"{'phase':<14} {'planned':>8} {'simulated':>9} {'sim/plan':>8} "
        f"{'of it planned':>13} {'planned (TE)':>12}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.phase:<14} {r.planned / GIB:>8.2f} {r.simulated / GIB:>9.2f} {r.ratio:>8.3f} "
            f"{r.from_planner / GIB:>13.2f} {r.planned_te / GIB:>12.2f}"
        )
    return "\n".join(lines)
