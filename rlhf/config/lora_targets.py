"""Which layers LoRA adapts: verl's `target_modules` (HF projection names, Megatron layer
names or "all-linear") as Megatron's fused layers, and back as HF names (PEFT's and
SGLang's `target_modules`). Names only: the adapters are `rlhf.models.lora`."""

from __future__ import annotations

from collections.abc import Iterable

HF_PROJECTIONS = {  # Megatron layer -> the HF projections (verl's target_modules) it holds
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
HF_TO_MEGATRON = {hf: layer for layer, names in HF_PROJECTIONS.items() for hf in names}
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
ROW_PARALLEL = ("linear_proj", "linear_fc2")


def megatron_targets(target_modules: str | Iterable[str]) -> tuple[str, ...]:
    """The Megatron layers that verl's `target_modules` name: "all-linear" (every linear
    layer of the decoder), HF projection names (verl's FSDP scripts) or Megatron layer
    names (its Megatron scripts: `model.lora.target_modules`); ValueError naming what
    cannot be: an unknown name, or part of a fused group."""
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return COLUMN_PARALLEL + ROW_PARALLEL
        target_modules = [target_modules]
    names = [n for t in target_modules for n in HF_PROJECTIONS.get(t, (t,))]
    unknown = sorted(set(names) - set(HF_TO_MEGATRON))
    if unknown:
        raise ValueError(
            f"target_modules: {unknown} are not linear layers adapted here; use 'all-linear', "
            f"names among {sorted(HF_TO_MEGATRON)} or Megatron's {sorted(HF_PROJECTIONS)}"
        )
    for layer, group in HF_PROJECTIONS.items():
        chosen = [n for n in group if n in names]
        if chosen and len(chosen) < len(group):
            raise ValueError(
                f"target_modules: {chosen} without {sorted(set(group) - set(chosen))}: Megatron "
                f"computes {', '.join(group)} in one layer ({layer}), adapted together"
            )
    wanted = {HF_TO_MEGATRON[n] for n in names}
    return tuple(t for t in COLUMN_PARALLEL + ROW_PARALLEL if t in wanted)


def hf_projections(targets: Iterable[str]) -> list[str]:
    """The HF projections of the Megatron layers `targets`, sorted."""
    return sorted(p for t in targets for p in HF_PROJECTIONS[t])
