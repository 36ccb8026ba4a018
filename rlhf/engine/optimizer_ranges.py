"""Reading saved distributed-optimizer ranges back (`rlhf.engine.optimizer_shards`' files):
the elements one rank owns, cut from the ranges other ranks saved, across DP, PP and TP sizes.

Every saved file is memory-mapped, so a rank reads only the bytes of the ranges it uses. At
the saving run's TP size a range comes from the same TP rank's saved ranges (whatever the DP
and PP sizes were). At another TP size each saved TP rank's whole tensor is assembled, the
shards are merged in the parameter's TP layout and this rank's shard is cut out of that; the
parameter is whole in host memory for that moment (one parameter at a time).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from rlhf.models.mapping import merge_tp_shards, split_tp_shard

# With tied embeddings and PP > 1 the last stage keeps a copy of the embedding as its output
# layer (same values, same updates); at PP = 1 only the embedding exists.
TIED_COPY = {"output_layer.weight": "embedding.word_embeddings.weight"}
_KEYS = ("start", "end", "shape", "step")


class Assembly:
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
        self.step = entry.get("step", self.step)
        for key, value in entry.items():
            if key in _KEYS:
                continue
            target = self.tensors.setdefault(
                key, torch.empty(self.end - self.start, dtype=value.dtype)
            )
            target[lo - self.start : hi - self.start] = value[
                lo - entry["start"] : hi - entry["start"]
            ]
        self.covered += hi - lo

    def complete(self, name: str, directory: Path) -> Assembly:
        if self.covered != self.end - self.start:
            raise ValueError(
                f"{directory} covers {self.covered} of the {self.end - self.start} elements of "
                f"{name!r} this rank owns: the checkpoint is incomplete or of another model"
            )
        return self

    def install(self, owned: Any, directory: Path) -> None:
        """Into `owned` (an `optimizer_shards._Owned`): master weights, moments and step."""
        self.complete(owned.name, directory)
        with torch.no_grad():
            owned.main.copy_(self.tensors.pop("param").to(owned.main.device))
        if self.step is None:  # saved before the first optimizer step: no Adam state yet
            owned.state.pop(owned.main, None)
            return
        moments = {k: v.to(device=owned.main.device) for k, v in self.tensors.items()}
        if owned.step_per_parameter:
            owned.state[owned.main] = {"step": self.step.clone(), **moments}
            return
        owned.state[owned.main] = moments
        current = owned.group.get("step")
        if isinstance(current, torch.Tensor):
            owned.group["step"] = self.step.to(current.device, current.dtype).clone()
        else:
            owned.group["step"] = int(self.step.item())


class SavedShards:
    """Every saved range of a checkpoint's optimizer directory, by parameter name."""

    def __init__(self, directory: Path, layout: dict) -> None:
        self.directory, self.tp = directory, layout["tp"]
        self.entries: dict[str, list[tuple[int, dict]]] = defaultdict(list)
        for pp in range(layout["pp"]):
            for tp in range(layout["tp"]):
                for dp in range(layout["dp"]):
                    path = directory / f"pp{pp}_tp{tp}_dp{dp}.pt"
                    if not path.is_file():
                        raise FileNotFoundError(f"{path} not found: the checkpoint is incomplete")
                    for name, entry in torch.load(path, mmap=True, weights_only=True).items():
                        self.entries[name].append((tp, entry))

    def _saved(self, name: str, tp_rank: int) -> list[dict]:
        if name not in self.entries and name in TIED_COPY:
            name = TIED_COPY[name]
        return [entry for rank, entry in self.entries.get(name, []) if rank == tp_rank]

    def assembly(self, owned: Any, tp_rank: int, tp: int) -> Assembly:
        """The range `owned` covers on TP rank `tp_rank` of `tp`."""
        found = Assembly(owned.span.start, owned.span.end)
        if tp == self.tp:
            for entry in self._saved(owned.name, tp_rank):
                found.add(entry)
            return found
        whole = [self._whole(owned.name, rank) for rank in range(self.tp)]
        layout, shape = owned.tp_layout(), owned.model_param.shape
        first = whole[0][0]
        merged: dict[str, Any] = {"start": 0, "end": math.prod(shape), "step": first.step}
        for key in first.tensors:
            full = merge_tp_shards(layout, [w.tensors[key].view(s) for w, s in whole])
            merged[key] = split_tp_shard(layout, full, tp_rank, tp, shape).reshape(-1)
        found.add(merged)
        return found

    def _whole(self, name: str, tp_rank: int) -> tuple[Assembly, torch.Size]:
        """One saved TP rank's whole tensors of `name`, and their shape."""
        entries = self._saved(name, tp_rank)
        if not entries:
            raise ValueError(f"{self.directory} has no optimizer state of {name!r}")
        shape = torch.Size(entries[0]["shape"])
        whole = Assembly(0, math.prod(shape))
        for entry in entries:
            whole.add(entry)
        return whole.complete(name, self.directory), shape
