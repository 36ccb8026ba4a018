"""The planner's table, its verdict and the knobs that would make a config fit.

Each knob is a config change (named by its keys) applied to the plan's inputs; the report
lists those that lower the peak, largest saving first, with the peak each would give.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from rlhf.memory.planner import GIB, KINDS, MemoryPlan, PlanInputs, expert_sizes, plan_memory

AR = "actor_rollout_ref"


@dataclass(frozen=True)
class Suggestion:
    change: str  # the keys to set
    peak: int  # bytes per GPU with the change

    def fits(self, gpu_bytes: int | None) -> bool:
        return gpu_bytes is not None and self.peak <= gpu_bytes


def _megatron(inputs: PlanInputs, **changes) -> PlanInputs:
    roles = tuple(replace(r, megatron=replace(r.megatron, **changes)) for r in inputs.roles)
    reference = inputs.reference
    if (
        reference is not None
        and {"tensor_model_parallel_size", "pipeline_model_parallel_size"} & changes.keys()
    ):
        reference = replace(reference, megatron=roles[0].megatron)
    return replace(inputs, roles=roles, reference=reference)


def _budgets(inputs: PlanInputs) -> PlanInputs:
    roles = tuple(replace(r, token_budget=max(1, r.token_budget // 2)) for r in inputs.roles)
    return replace(inputs, roles=roles)


def _grow(inputs: PlanInputs, key: str) -> PlanInputs | None:
    m, arch = inputs.roles[0].megatron, inputs.arch
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    new = (
        {"tensor_model_parallel_size": tp * 2}
        if key == "tp"
        else {"pipeline_model_parallel_size": pp * 2}
    )
    size = tp * pp * 2 * inputs.sp
    if inputs.world_size % size:
        return None
    if key == "tp" and (arch.num_query_groups % (tp * 2) or arch.num_attention_heads % (tp * 2)):
        return None
    if key == "pp" and arch.num_layers % (pp * 2):
        return None
    return _megatron(inputs, **new)


def _knobs(inputs: PlanInputs) -> list[tuple[str, Callable[[PlanInputs], PlanInputs | None]]]:
    m = inputs.roles[0].megatron
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    gpu = inputs.device != "cpu"
    knobs: list[tuple[str, Callable[[PlanInputs], PlanInputs | None]]] = [
        (
            "megatron.use_distributed_optimizer=true (actor, critic)",
            lambda i: _megatron(i, use_distributed_optimizer=True),
        ),
        (
            "megatron.recompute_granularity=full (actor, critic)",
            lambda i: _megatron(i, recompute_granularity="full"),
        ),
        ("half the token budgets (*ppo_max_token_len_per_gpu)", _budgets),
        (f"megatron.tensor_model_parallel_size={tp * 2}", lambda i: _grow(i, "tp")),
        (f"megatron.pipeline_model_parallel_size={pp * 2}", lambda i: _grow(i, "pp")),
    ]
    if gpu:
        knobs += [
            (
                "megatron.optimizer_offload=true (actor, critic)",
                lambda i: _megatron(i, optimizer_offload=True),
            ),
            (
                "megatron.param_offload=true and grad_offload=true (actor, critic)",
                lambda i: _megatron(i, param_offload=True, grad_offload=True),
            ),
            (f"{AR}.ref.param_offload=true", lambda i: replace(i, ref_offload=True)),
            (f"{AR}.rollout.free_cache_engine=true", lambda i: replace(i, release_rollout=True)),
        ]
    if len(inputs.roles) > 1:
        knobs.append(
            ("algorithm.adv_estimator=grpo (no critic)", lambda i: replace(i, roles=i.roles[:1]))
        )
    return knobs


def suggestions(inputs: PlanInputs, plan: MemoryPlan) -> list[Suggestion]:
    """Single config changes that lower the peak, largest saving first."""
    found = []
    for change, apply in _knobs(inputs):
        changed = apply(inputs)
        if changed is None or changed == inputs:
            continue
        peak = plan_memory(changed, plan.gpu_bytes).peak
        if peak < plan.peak:
            found.append(Suggestion(change, peak))
    return sorted(found, key=lambda s: s.peak)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def expert_text(inputs: PlanInputs, plan: MemoryPlan) -> str:
    """For a mixture-of-experts model: the routed experts' part of the table's rows and
    their layout per GPU; '' for a dense model."""
    moe = inputs.arch.moe
    if moe is None:
        return ""
    m = inputs.roles[0].megatron
    ep, etp = expert_sizes(m)
    expert_dp = inputs.world_size // (etp * ep * m.pipeline_model_parallel_size)
    parts = ", ".join(f"{r.role} {_gib(r.experts)}" for r in plan.rows if r.experts)
    return (
        f"routed experts: {moe.num_experts // ep} of {moe.num_experts} per MoE layer per GPU "
        f"(EP {ep} x expert-TP {etp}; their gradients reduced and optimizer state sharded "
        f"over expert-DP {expert_dp}); their part of the rows above (GiB): {parts}"
    )


def format_plan(plan: MemoryPlan, hints: list[Suggestion] | None = None, experts: str = "") -> str:
    """The table by role and kind (GiB per GPU), the routed experts' part (`experts`), the
    phase peaks and the verdict."""
    header = ("role", "weights", "grads", "master", "optimizer", "activ/KV", "comm", "total")
    rows = [header] + [
        (r.role, *(_gib(getattr(r, k)) for k in KINDS), _gib(r.total)) for r in plan.rows
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    if experts:
        lines.append(experts)
    phases = ", ".join(f"{name} {_gib(v)}" for name, v in plan.phases.items())
    lines.append(f"peak by phase (GiB, with the CUDA runtime on GPU): {phases}")
    lines.append(verdict(plan))
    for hint in hints or []:
        mark = " (fits)" if hint.fits(plan.gpu_bytes) else ""
        lines.append(f"  try {hint.change}: peak {_gib(hint.peak)} GiB{mark}")
    return "\n".join(lines)


def verdict(plan: MemoryPlan) -> str:
    peak = _gib(plan.peak)
    if plan.gpu_bytes is None:
        return f"peak {peak} GiB per GPU (GPU memory unknown: pass --gpu-memory-gb)"
    state = "fits" if plan.fits else "does NOT fit"
    return f"peak {peak} GiB per GPU {state} in {_gib(plan.gpu_bytes)} GiB"


def describe(inputs: PlanInputs, gpu_bytes: int | None) -> tuple[MemoryPlan, str]:
    """The plan and its report (with suggestions when it does not fit)."""
    plan = plan_memory(inputs, gpu_bytes)
    hints = suggestions(inputs, plan) if plan.fits is False else []
    return plan, format_plan(plan, hints, expert_text(inputs, plan))


def startup_report(inputs: PlanInputs) -> tuple[MemoryPlan, str]:
    """What the trainer logs before building its models: the plan for this machine's GPU
    (`inputs`: `PlanInputs.from_config` for the run's world size and device)."""
    import torch

    gpu_bytes = None
    if inputs.device == "cuda" and torch.cuda.is_available():
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    return describe(inputs, gpu_bytes)
