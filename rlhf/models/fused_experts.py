"""HF expert weights stored fused, read as the per-expert tensors the mapping names.

transformers 5 holds a Qwen2/3-MoE layer's experts as two 3-D parameters,
`mlp.experts.gate_up_proj` [E, 2 x I, H] (expert e's gate rows, then its up rows) and
`mlp.experts.down_proj` [E, H, I], and converts them back to per-expert tensors
(`mlp.experts.{e}.gate_proj.weight`, ...) when it saves; a checkpoint written with the
fused names by other tools is read here through the per-expert names, one expert's rows
at a time. Exports always write the per-expert tensors.
"""

from __future__ import annotations

import re

import torch

from rlhf.models.hf_io import HFCheckpointReader

_PER_EXPERT = re.compile(r"^(.+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")


def fused_source(name: str, ffn: int) -> tuple[str, int, int] | None:
    """(fused tensor, expert, row offset) holding per-expert tensor `name` (routed experts of
    intermediate size `ffn`), None for any other name."""
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    prefix, expert, kind = match.group(1), int(match.group(2)), match.group(3)
    if kind == "down":
        return prefix + "down_proj", expert, 0
    return prefix + "gate_up_proj", expert, 0 if kind == "gate" else ffn


def read_expert(
    reader: HFCheckpointReader,
    name: str,
    shape: tuple[int, ...],
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Per-expert tensor `name` (of `shape`; rows [a, b) / columns [a, b) of it), stored
    under its own name or in its layer's fused tensor."""
    source = fused_source(name, shape[0])
    if name in reader or source is None or source[0] not in reader:
        return reader.read(name, rows=rows, cols=cols, expected_shape=shape)
    fused, expert, offset = source
    r0, r1 = rows or (0, shape[0])
    return reader.read_block(fused, expert, rows=(offset + r0, offset + r1), cols=cols)
