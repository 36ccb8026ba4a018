"""Checkpoints of Megatron's distributed optimizer in a model-space format that resumes exactly
and reshards across DP, TP and PP sizes.

Megatron-Core 0.16.1's own distributed-optimizer checkpoints do not resume on this stack: the
default sharding fails to save, and the "fully reshardable" one loads every parameter's Adam
`step` into ONE shared tensor, so the resumed run silently steps its counter once per
parameter (observed running Megatron-Core on this stack). This format avoids Megatron's loader.

Each rank of a distributed-optimizer group owns a contiguous element range of some
parameters (flattened). It writes, per parameter, that range and its slices of the fp32
master weights and Adam's moments, the parameter's shape on its TP rank and Adam's step
count, wherever the optimizer keeps it: per parameter (torch's Adam, Megatron's choice on
CPU) or per param group (Transformer Engine's and apex's FusedAdam, its choice on GPU).
Parameters are named with their global layer index, so names do not depend on the pipeline
layout:

    <dir>/layout.json              {"format", "tp", "pp", "dp"}   (dp: the optimizer group size)
    <dir>/pp<P>_tp<T>_dp<D>.pt     {name: {"start", "end", "shape", "step", "param", "exp_avg",
                                           "exp_avg_sq"}}

Loading (`rlhf.engine.optimizer_ranges`) memory-maps every saved file and builds each range
this rank owns from the saved ranges, resharding across DP, PP and TP sizes. Files of format
/1 (local layer names, no shapes) load at the saving run's TP and PP sizes.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlhf.checkpoint.manager import write_durable
from rlhf.engine.optimizer_ranges import SavedShards
from rlhf.models.mapping import Layout, layer_index, shift_layer

FORMAT = "rlhf-distributed-optimizer/2"
LOCAL_NAMES_FORMAT = "rlhf-distributed-optimizer/1"
LAYOUT_FILE = "layout.json"
# Megatron's tensor-parallel parameters by name; all others are replicated over TP.
TP_LAYOUTS = {
    "self_attention.linear_qkv.weight": Layout.QKV,
    "self_attention.linear_qkv.bias": Layout.QKV,
    "self_attention.linear_proj.weight": Layout.ROW,
    "mlp.linear_fc1.weight": Layout.GATE_UP,
    "mlp.linear_fc2.weight": Layout.ROW,
    "embedding.word_embeddings.weight": Layout.VOCAB,
    "output_layer.weight": Layout.VOCAB,
    # multi-latent attention (DeepSeek-V3)
    "self_attention.linear_q_proj.weight": Layout.COLUMN,
    "self_attention.linear_q_up_proj.weight": Layout.COLUMN,
    "self_attention.linear_kv_up_proj.weight": Layout.COLUMN,
}


@dataclass(frozen=True)
class OptimizerCoordinate:
    """Where a rank sits: its (pp, tp) shard of the model and its rank among the ranks that
    split that shard's optimizer state (`dp` of them)."""

    pp_rank: int
    tp_rank: int
    dp_rank: int
    tp: int
    pp: int
    dp: int

    def file_name(self, dp_rank: int | None = None) -> str:
        rank = self.dp_rank if dp_rank is None else dp_rank
        return f"pp{self.pp_rank}_tp{self.tp_rank}_dp{rank}.pt"


def distributed_parts(optimizer: Any) -> list[Any]:
    """The DistributedOptimizer instances inside Megatron's (possibly chained) optimizer."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [p for p in parts if hasattr(p, "model_param_group_index_map")]


def coordinate(optimizer: Any, tp: tuple[int, int], pp: tuple[int, int]) -> OptimizerCoordinate:
    """This rank's coordinate; tp and pp are (rank, size) pairs."""
    group = distributed_parts(optimizer)[0].data_parallel_group
    return OptimizerCoordinate(pp[0], tp[0], group.rank(), tp[1], pp[1], group.size())


def local_names(names: dict[Any, str]) -> dict[Any, str]:
    """Global layer names -> the stage-local ones of format /1 (written without interleaving,
    so this rank's layers are one run starting at its smallest index)."""
    layers = [i for name in names.values() if (i := layer_index(name)) is not None]
    first = min(layers, default=0)
    return {param: shift_layer(name, -first) for param, name in names.items()}


def keeps_step_per_parameter(optimizer: Any) -> bool:
    """torch's Adam and AdamW count steps per parameter (`state[p]["step"]`); TE's and
    apex's FusedAdam once per param group (`param_groups[i]["step"]`)."""
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)


@dataclass(frozen=True)
class _Owned:
    """One parameter range this rank's optimizer owns."""

    name: str
    model_param: torch.Tensor  # the model's parameter (its shape on this TP rank)
    span: Any  # Megatron's Range: elements [start, end) of the flattened parameter
    main: torch.Tensor  # the fp32 master slice the inner optimizer steps
    state: dict  # the inner optimizer's state of all its parameters
    group: dict  # the main slice's param group (where FusedAdam counts steps)
    step_per_parameter: bool

    def step(self) -> torch.Tensor | None:
        """Adam's step count, None before the first step."""
        state = self.state.get(self.main, {})
        step = state.get("step") if self.step_per_parameter else self.group.get("step")
        if not state or step is None:
            return None
        return torch.as_tensor(step, dtype=torch.float32).detach().cpu().clone()

    def tp_layout(self) -> Layout:
        if not getattr(self.model_param, "tensor_model_parallel", False):
            return Layout.REPLICATED
        for suffix, layout in TP_LAYOUTS.items():
            if self.name.endswith(suffix):
                return layout
        raise KeyError(f"{self.name}: no tensor-parallel layout known to reshard it")


def _owned(optimizer: Any, names: dict[Any, str]) -> Iterator[_Owned]:
    for part in distributed_parts(optimizer):
        inner = part.optimizer
        per_parameter = keeps_step_per_parameter(inner)
        for model_param, (group, order) in part.model_param_group_index_map.items():
            main = inner.param_groups[group]["params"][order]
            span = part._get_model_param_range_map(model_param)["param"]
            yield _Owned(
                names[model_param],
                model_param,
                span,
                main,
                inner.state,
                inner.param_groups[group],
                per_parameter,
            )


def owned_state(optimizer: Any, names: dict[Any, str]) -> dict[str, dict]:
    """This rank's slices, on the CPU: {name: {"start", "end", "shape", "step", "param",
    moments...}} ("step" only after the first optimizer step)."""
    shards = {}
    for owned in _owned(optimizer, names):
        state = owned.state.get(owned.main, {})
        entry = {
            "start": owned.span.start,
            "end": owned.span.end,
            "shape": list(owned.model_param.shape),
            "param": owned.main.detach().cpu().clone(),
            **{k: v.detach().cpu().clone() for k, v in state.items() if k != "step"},
        }
        step = owned.step()
        if step is not None:
            entry["step"] = step
        shards[owned.name] = entry
    return shards


def save_optimizer_shards(
    optimizer: Any, names: dict[Any, str], where: OptimizerCoordinate, directory: Path
) -> None:
    """Write this rank's file (and, on global rank 0, the layout) into `directory`.
    `names`: the model's parameter names with global layer indices."""
    optimizer_shards_writer(optimizer, names, where, directory)()


def optimizer_shards_writer(
    optimizer: Any, names: dict[Any, str], where: OptimizerCoordinate, directory: Path
) -> Callable[[], None]:
    """`save_optimizer_shards` in two halves: this rank's state copied to host memory now,
    its files written by the function returned (in a background save, by the writer)."""
    directory.mkdir(parents=True, exist_ok=True)
    layout = {"format": FORMAT, "tp": where.tp, "pp": where.pp, "dp": where.dp}
    writes_layout = not dist.is_initialized() or dist.get_rank() == 0
    state = owned_state(optimizer, names)

    def write() -> None:
        if writes_layout:
            write_durable(directory / LAYOUT_FILE, json.dumps(layout).encode())
        buffer = io.BytesIO()
        torch.save(state, buffer)
        write_durable(directory / where.file_name(), buffer.getvalue())

    return write


def read_layout(directory: Path) -> dict:
    path = directory / LAYOUT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: no distributed-optimizer state in {directory}")
    layout = json.loads(path.read_text())
    if layout.get("format") not in (FORMAT, LOCAL_NAMES_FORMAT):
        raise ValueError(f"{path}: format {layout.get('format')!r}, expected {FORMAT!r}")
    return layout


def load_optimizer_shards(
    optimizer: Any, names: dict[Any, str], where: OptimizerCoordinate, directory: Path
) -> None:
    """Put the saved master weights and Adam state of this rank's ranges into `optimizer`."""
    layout = read_layout(directory)
    if layout["format"] == LOCAL_NAMES_FORMAT:
        if (layout["tp"], layout["pp"]) != (where.tp, where.pp):
            raise ValueError(
                f"the distributed-optimizer state in {directory} was written in format "
                f"{LOCAL_NAMES_FORMAT}, which resumes only with the saving run's tensor and "
                f"pipeline parallel sizes ({layout['tp']} and {layout['pp']}; this run has "
                f"{where.tp} and {where.pp})"
            )
        names = local_names(names)
    saved = SavedShards(directory, layout)
    for owned in _owned(optimizer, names):
        saved.assembly(owned, where.tp_rank, where.tp).install(owned, directory)
