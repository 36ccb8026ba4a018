"""Read HF safetensors checkpoints slice by slice; write sharded safetensors with an index.

`HFCheckpointReader.read(name, rows=..., cols=...)` reads only the requested rows/columns
of one tensor from disk (safetensors' lazy slices), so a tensor-parallel rank never
materialises the full model.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from rlhf.errors import UserError

INDEX_NAME = "model.safetensors.index.json"
DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
SINGLE_NAME = "model.safetensors"


class CheckpointFileError(ValueError, UserError):
    """A weights file that cannot be read (truncated, not safetensors); names the file."""


def open_safetensors(path: Path):
    """`safe_open` of `path`; a damaged file is a one-line `CheckpointFileError`.

    safetensors checks the header against the file size, so a download or copy cut short
    is found here, from the header alone, instead of while the weights load."""
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as e:
        raise CheckpointFileError(
            f"{path} ({path.stat().st_size} bytes) is not a readable safetensors file: {e}; "
            "truncated by an interrupted download or copy? fetch it again"
        ) from None


class HFCheckpointReader:
    """Tensor name -> shard file map of an HF model directory, with sliced reads."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.weight_map = self._weight_map()
        self._handles: dict[str, object] = {}
        self.bytes_read = 0  # what this reader has pulled from disk, for tests and benchmarks

    def _weight_map(self) -> dict[str, str]:
        index = self.model_dir / INDEX_NAME
        if index.is_file():
            return json.loads(index.read_text())["weight_map"]
        single = self.model_dir / SINGLE_NAME
        if not single.is_file():
            raise FileNotFoundError(
                f"{self.model_dir}: neither {INDEX_NAME} nor {SINGLE_NAME} found "
                "(only safetensors checkpoints are supported)"
            )
        with open_safetensors(single) as f:
            return {name: SINGLE_NAME for name in f.keys()}  # noqa: SIM118

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, name: str):
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is not in the checkpoint {self.model_dir}")
        return self._file_handle(self.weight_map[name], name)

    def _file_handle(self, file: str, name: str):
        if file not in self._handles:
            path = self.model_dir / file
            if not path.is_file():
                raise FileNotFoundError(
                    f"shard file {path} (holding {name!r}) is missing from the checkpoint"
                )
            self._handles[file] = open_safetensors(path)
        return self._handles[file]

    def check_files(self) -> None:
        """Open every shard once (headers only): a missing or damaged one fails now."""
        first: dict[str, str] = {}
        for name, file in self.weight_map.items():
            first.setdefault(file, name)
        for file, name in first.items():
            self._file_handle(file, name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(
        self,
        name: str,
        rows: tuple[int, int] | None = None,
        cols: tuple[int, int] | None = None,
        expected_shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """Tensor `name` (or rows [a, b) / columns [a, b) of it), checking its full shape."""
        shape = self.shape(name)
        if expected_shape is not None and shape != tuple(expected_shape):
            raise ValueError(
                f"tensor {name!r} has shape {list(shape)} in {self.model_dir}, but the config "
                f"implies {list(expected_shape)}"
            )
        view = self._handle(name).get_slice(name)
        if rows is None and cols is None:
            tensor = view[:]
        else:
            r0, r1 = rows if rows is not None else (0, shape[0])
            tensor = view[r0:r1] if cols is None else view[r0:r1, cols[0] : cols[1]]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def read_block(
        self, name: str, index: int, rows: tuple[int, int], cols: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Rows [a, b) (and columns [a, b)) of block `index` of a 3-D tensor (fused experts)."""
        shape = self.shape(name)
        if len(shape) != 3 or index >= shape[0] or rows[1] > shape[1]:
            raise ValueError(
                f"tensor {name!r} has shape {list(shape)} in {self.model_dir}: no block "
                f"{index} with rows {rows[0]}..{rows[1]}"
            )
        c0, c1 = cols or (0, shape[2])
        view = self._handle(name).get_slice(name)
        tensor = view[index : index + 1, rows[0] : rows[1], c0:c1][0]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def total_bytes(self) -> int:
        """Size of all tensors in the checkpoint (from the headers; nothing is read)."""
        total = 0
        for name in self.weight_map:
            view = self._handle(name).get_slice(name)
            total += math.prod(view.get_shape()) * DTYPE_BYTES[view.get_dtype()]
        return total


def write_sharded_safetensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    max_shard_bytes: int = 2 * 1024**3,
) -> dict[str, str]:
    """Write `tensors` into `model-0000i-of-0000n.safetensors` shards plus the index json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if sizes[-1] and sizes[-1] + nbytes > max_shard_bytes:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensor.contiguous()
        sizes[-1] += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tmp = out / f".{file}.tmp"
        save_file(shard, tmp, metadata={"format": "pt"})
        os.replace(tmp, out / file)
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
    return weight_map
