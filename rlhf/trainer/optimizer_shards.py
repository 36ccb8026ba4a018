"""Checkpoints of Megatron's distributed optimizer in a model-space format that resumes exactly.

Megatron-Core 0.16.1's own distributed-optimizer checkpoints do not resume on this stack: the
default sharding fails to save, and the "fully reshardable" one loads every parameter's Adam
`step` into ONE shared tensor, so the resumed run silently steps its counter once per
parameter (`../shared/facts/megatron-core-cpu.md`). This format avoids Megatron's loader.

Each rank of a distributed-optimizer group owns a contiguous element range of some
parameters (flattened). It writes, per parameter name, that range and its slices of the fp32
master weights and Adam's moments, with the Adam step count:

    <dir>/layout.json              {"format", "tp", "pp", "dp"}   (dp: the optimizer group size)
    <dir>/pp<P>_tp<T>_dp<D>.pt     {name: {"start", "end", "param", "exp_avg", ...}}

Loading needs the same TP and PP sizes (the parameters themselves are sharded by them). With
the same DP size each rank reads its own file; with another DP size each rank reads the files
of its (PP, TP) coordinate one at a time and cuts its new ranges out of them (resharding).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlhf.checkpoint.manager import write_durable

FORMAT = "rlhf-distributed-optimizer/1"
LAYOUT_FILE = "layout.json"


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


@dataclass(frozen=True)
class _Owned:
    """One parameter range this rank's optimizer owns."""

    name: str
    span: Any  # Megatron's Range: elements [start, end) of the flattened parameter
    main: torch.Tensor  # the fp32 master slice the inner optimizer steps
    state: dict  # the inner optimizer's state of all its parameters


def _owned(optimizer: Any, names: dict[Any, str]) -> Iterator[_Owned]:
    for part in distributed_parts(optimizer):
        for model_param, (group, order) in part.model_param_group_index_map.items():
            main = part.optimizer.param_groups[group]["params"][order]
            span = part._get_model_param_range_map(model_param)["param"]
            yield _Owned(names[model_param], span, main, part.optimizer.state)


def owned_state(optimizer: Any, names: dict[Any, str]) -> dict[str, dict]:
    """This rank's slices, on the CPU: {name: {"start", "end", "param", Adam state...}}."""
    shards = {}
    for owned in _owned(optimizer, names):
        state = owned.state.get(owned.main, {})
        shards[owned.name] = {
            "start": owned.span.start,
            "end": owned.span.end,
            "param": owned.main.detach().cpu().clone(),
            **{key: value.detach().cpu().clone() for key, value in state.items()},
        }
    return shards


def save_optimizer_shards(
    optimizer: Any, names: dict[Any, str], where: OptimizerCoordinate, directory: Path
) -> None:
    """Write this rank's file (and, on global rank 0, the layout) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    if not dist.is_initialized() or dist.get_rank() == 0:
        layout = {"format": FORMAT, "tp": where.tp, "pp": where.pp, "dp": where.dp}
        write_durable(directory / LAYOUT_FILE, json.dumps(layout).encode())
    buffer = io.BytesIO()
    torch.save(owned_state(optimizer, names), buffer)
    write_durable(directory / where.file_name(), buffer.getvalue())


def read_layout(directory: Path) -> dict:
    path = directory / LAYOUT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: no distributed-optimizer state in {directory}")
    layout = json.loads(path.read_text())
    if layout.get("format") != FORMAT:
        raise ValueError(f"{path}: format {layout.get('format')!r}, expected {FORMAT!r}")
    return layout


def load_optimizer_shards(
    optimizer: Any, names: dict[Any, str], where: OptimizerCoordinate, directory: Path
) -> None:
    """Put the saved master weights and Adam state of this rank's ranges into `optimizer`."""
    layout = read_layout(directory)
    if (layout["tp"], layout["pp"]) != (where.tp, where.pp):
        raise ValueError(
            f"the distributed-optimizer state in {directory} was saved with tensor parallel "
            f"size {layout['tp']} and pipeline parallel size {layout['pp']}; this run has "
            f"{where.tp} and {where.pp}. It resumes only with the same TP and PP sizes (the "
            "data-parallel size may differ); resume with the saving run's layout"
        )
    same_dp = layout["dp"] == where.dp
    sources = [where.file_name()] if same_dp else [where.file_name(d) for d in range(layout["dp"])]
    owned = list(_owned(optimizer, names))
    filled = [_Assembly(o.span.start, o.span.end) for o in owned]
    for source in sources:
        saved = torch.load(directory / source, weights_only=True)
        for o, assembly in zip(owned, filled):
            if o.name in saved:
                assembly.add(saved[o.name])
        del saved
    for o, assembly in zip(owned, filled):
        assembly.install(o, directory)


class _Assembly:
    """The elements [start, end) of one parameter's saved tensors, gathered from saved ranges."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.tensors: dict[str, torch.Tensor] = {}
        self.step: torch.Tensor | None = None
        self.covered = 0

    def add(self, entry: dict) -> None:
        lo, hi = max(self.start, entry["start"]), min(self.end, entry["end"])
        if lo >= hi:
            return
        for key, value in entry.items():
            if key in ("start", "end"):
                continue
            if key == "step":
                self.step = value
                continue
            target = self.tensors.setdefault(
                key, torch.empty(self.end - self.start, dtype=value.dtype)
            )
            target[lo - self.start : hi - self.start] = value[
                lo - entry["start"] : hi - entry["start"]
            ]
        self.covered += hi - lo

    def install(self, owned: _Owned, directory: Path) -> None:
        if self.covered != self.end - self.start:
            raise ValueError(
                f"{directory} covers {self.covered} of the {self.end - self.start} elements of "
                f"{owned.name!r} this rank owns: the checkpoint is incomplete or of another model"
            )
        with torch.no_grad():
            owned.main.copy_(self.tensors.pop("param").to(owned.main.device))
        if self.step is None:  # saved before the first optimizer step: no Adam state yet
            owned.state.pop(owned.main, None)
            return
        moments = {k: v.to(device=owned.main.device) for k, v in self.tensors.items()}
        owned.state[owned.main] = {"step": self.step.clone(), **moments}
