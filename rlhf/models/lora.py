"""LoRA adapters on Megatron's linear layers, split over tensor parallelism like the layer.

An adapted layer computes `W x + (alpha / r) B A x`: the frozen weight W plus a rank-r
update, A [r, in] and B [out, r], B starting at zero so that the adapted model starts as
the base model. Under tensor parallelism each adapter is split the way its layer is:

- a column-parallel layer (`linear_qkv`, `linear_fc1`: outputs split over TP) keeps A whole
  on every TP rank and splits B by rows, a `ColumnParallelLinear` r -> out: its input's
  gradient is summed over TP in the backward, so every rank's A gets the whole gradient;
- a row-parallel layer (`linear_proj`, `linear_fc2`: inputs split) splits A by columns, a
  `RowParallelLinear` in -> r whose output is summed over TP, and keeps B whole.

Under Megatron's sequence parallelism the whole factor sees only this rank's tokens, so
its gradient is marked `sequence_parallel` and summed over TP by Megatron's
`finalize_model_grads`, as the layer norms' are.

A routed expert's layer (`SequentialMLP`'s `local_experts.i.linear_fc1/fc2`) gets adapters
of its own, held by its EP rank and split over expert-TP as the layer is; its token
dispatcher, not the layer, communicates over expert-TP, so the whole factor's gradient is
summed over that group in the adapter's backward, and both factors carry the layer weight's
`allreduce=False` (reduced over expert-DP, with the experts' optimizer).

The adapters hang under their layer (`...linear_qkv.lora_A`, `.lora_B`), so the layer's own
parameter names stay what the checkpoint mapping knows; a forward hook adds their output to
the layer's while they are `enabled` (off: the base model, which is how the reference
policy is computed without a copy of the weights). verl's `target_modules` name HF's
projections; Megatron fuses q/k/v and gate/up, so those are adapted together.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlhf.config.lora_targets import COLUMN_PARALLEL, hf_projections, megatron_targets

VALUE_HEAD = ("output_layer.",)  # a critic's head: new, so trained whole beside its adapters


@dataclass(frozen=True)
class LoraSpec:
    """What to adapt and how: rank r, alpha (the update is scaled by alpha / r), dropout
    on the adapter's input, and the Megatron layers adapted (`megatron_targets`)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, saved: dict) -> LoraSpec:
        """The spec as `dataclasses.asdict` wrote it in a checkpoint's meta file."""
        return cls(**{**saved, "targets": tuple(saved["targets"])})


def lora_spec(model) -> LoraSpec | None:
    """The adapters `actor_rollout_ref.model` asks for (None: lora_rank 0, none)."""
    if not model.lora_rank:
        return None
    targets = megatron_targets(model.target_modules)
    return LoraSpec(model.lora_rank, float(model.lora_alpha), targets, model.lora_dropout)


def peft_config(spec: LoraSpec, base_model: str) -> dict:
    """PEFT's adapter_config.json for adapters of `spec` on the HF model at `base_model`."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": hf_projections(spec.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }


def peft_name(hf_weight: str, factor: str) -> str:
    """PEFT's name of factor `factor` ("lora_A", "lora_B") of the HF weight `hf_weight`."""
    return f"base_model.model.{hf_weight.removesuffix('.weight')}.{factor}.weight"


class LoraAdapter(nn.Module):
    """The rank-r update of one Megatron linear layer (see the module for the TP split)."""

    def __init__(self, layer: nn.Module, column: bool, spec: LoraSpec, config, gated: bool = False):
        super().__init__()
        self.spec, self.column, self.scale, self.enabled = spec, column, spec.scale, True
        self.gated = gated  # B's rows are [gate; up] of this rank's share (fused SwiGLU fc1)
        self.config = config
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
        # a routed expert's layer: split over the expert-TP group, its tokens dispatched
        self.group: Any = layer.tp_group if getattr(layer, "is_expert", False) else None
        self.lora_A: nn.Module
        self.lora_B: nn.Module
        if self.group is None:
            self.lora_A, self.lora_B = _parallel_factors(layer.weight, column, spec.rank, config)
        else:
            self.lora_A, self.lora_B = _expert_factors(layer.weight, column, spec.rank, self.group)
        with torch.no_grad():
            self.lora_B.weight.zero_()  # type: ignore[operator]

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A, B) weights, detached."""
        a, b = self.lora_A.weight, self.lora_B.weight
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return a.detach(), b.detach()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Megatron's distributed-checkpoint entries: the split factor sharded over TP (B's
        rows or A's columns), the whole one replicated; a fused SwiGLU fc1's B as Megatron
        saves that layer's weight (gate and up rows apart), so that any TP layout reads it."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        split = {"lora_B.weight": 0} if self.column else {"lora_A.weight": 1}
        state = self.state_dict(prefix="", keep_vars=True)
        groups = {}
        if self.group is not None:  # an expert's: its TP group, DP set by `SequentialMLP`
            groups = {"tp_group": self.group, "dp_cp_group": (metadata or {})["dp_cp_group"]}
        entries = make_sharded_tensors_for_checkpoint(
            state, prefix, split, sharded_offsets, **groups
        )
        if self.gated:
            key = f"{prefix}lora_B.weight"
            singleton = (metadata or {}).get("singleton_local_shards", False)
            entries[key] = apply_swiglu_sharded_factory(entries[key], sharded_offsets, singleton)
        return entries

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(x)
        if self.group is not None:
            return self._expert_update(x) * self.scale
        if self.column:
            update, _ = self.lora_B(self.lora_A(x))
        else:
            hidden, _ = self.lora_A(x)
            update = self.lora_B(hidden)
        return update * self.scale

    def _expert_update(self, x: torch.Tensor) -> torch.Tensor:
        """B A x on a routed expert's tokens. Its layer leaves the communication over the
        expert-TP group to the token dispatcher (which sums the partial outputs of a
        row-parallel layer and the partial input gradients of a column-parallel one); the
        factor whole on every rank of the group (column: A, row: B) sees only this rank's
        share of the other factor, so its gradient is summed over the group."""
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        a, b = self.lora_A.weight, self.lora_B.weight
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        if self.column:
            a = copy_to_tensor_model_parallel_region(a, group=self.group)
        else:
            b = copy_to_tensor_model_parallel_region(b, group=self.group)
        return nn.functional.linear(nn.functional.linear(x, a), b)


def _parallel_factors(weight, column: bool, rank: int, config) -> tuple[nn.Module, nn.Module]:
    """(A, B) of a layer split over TP (`weight`, this rank's shard: [out / TP, in] or
    [out, in / TP]): column-parallel, A whole and B a `ColumnParallelLinear`; row-parallel,
    A a `RowParallelLinear` and B whole."""
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        set_tensor_model_parallel_attributes,
    )

    assert isinstance(weight, torch.Tensor)
    tp = config.tensor_model_parallel_size
    outputs = weight.shape[0] * (tp if column else 1)
    inputs = weight.shape[1] * (1 if column else tp)
    whole = {"bias": False, "dtype": config.params_dtype, "device": weight.device}
    if column:
        a: nn.Module = nn.Linear(inputs, rank, **whole)
        b: nn.Module = ColumnParallelLinear(
            rank, outputs, config=config, init_method=nn.init.zeros_, bias=False
        )
        mark_sequence_parallel(a, config.sequence_parallel)
    else:
        a = RowParallelLinear(
            inputs,
            rank,
            config=config,
            init_method=kaiming_uniform,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
        )
        b = nn.Linear(rank, outputs, **whole)
        mark_sequence_parallel(b, config.sequence_parallel)
    split = b if column else a
    # Megatron marks a split weight only when it initialises it, which a model built
    # to load weights skips: marked here (optimizer, grad norm and the draw of A read it)
    if not hasattr(split.weight, "tensor_model_parallel"):
        set_tensor_model_parallel_attributes(split.weight, True, 0 if column else 1, 1)
    return a, b


def _expert_factors(weight, column: bool, rank: int, group) -> tuple[nn.Module, nn.Module]:
    """(A, B) of a routed expert's layer: plain linears holding this expert-TP rank's share
    (column: B's rows, row: A's columns), the split one marked as the layer's weight is,
    both reduced over the expert-data-parallel group as the layer's weight is
    (`allreduce`: Megatron's DDP and optimizer put them with the experts')."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    assert isinstance(weight, torch.Tensor)
    out, inp = weight.shape
    a = nn.Linear(inp, rank, bias=False, dtype=weight.dtype, device=weight.device)
    b = nn.Linear(rank, out, bias=False, dtype=weight.dtype, device=weight.device)
    split = b if column else a
    set_tensor_model_parallel_attributes(split.weight, True, 0 if column else 1, 1)
    for param in (a.weight, b.weight):
        param.allreduce = getattr(weight, "allreduce", True)  # type: ignore[attr-defined]
    return a, b


def mark_sequence_parallel(whole: nn.Module, on: bool) -> None:
    """A factor whole on every TP rank that sees only this rank's tokens under sequence
    parallelism: its gradient is summed over TP (Megatron's `finalize_model_grads`)."""
    for param in whole.parameters():
        param.sequence_parallel = on  # type: ignore[attr-defined]


def kaiming_uniform(weight: torch.Tensor) -> None:
    """PEFT's (and nn.Linear's) initialisation of A."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def adapter_input(layer: nn.Module, x: torch.Tensor, config) -> torch.Tensor:
    """What the layer's matrix multiplies: its input, normalised first when the layer fuses
    the norm before it (Transformer Engine's `TELayerNormColumnParallelLinear`, which holds
    `layer_norm_weight`: its input is the residual stream, not the norm's output)."""
    weight = getattr(layer, "layer_norm_weight", None)
    if weight is None:
        return x
    eps, h = config.layernorm_epsilon, x.float()
    if config.normalization == "RMSNorm":
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    else:
        normed = nn.functional.layer_norm(h, (h.shape[-1],), eps=eps)
    gamma = weight.float() + (1.0 if config.layernorm_zero_centered_gamma else 0.0)
    normed = normed * gamma
    bias = getattr(layer, "layer_norm_bias", None)
    if bias is not None:
        normed = normed + bias.float()
    return normed.to(x.dtype)


def _add_update(layer: nn.Module, args: tuple, output):
    adapter = layer.lora
    assert isinstance(adapter, LoraAdapter)
    if not adapter.enabled:
        return output
    out, bias = output
    update = adapter(adapter_input(layer, args[0], adapter.config))
    return out + update.to(out.dtype), bias


def _with_adapter(layer: nn.Module, layer_entries):
    """The layer's distributed-checkpoint entries with its adapter's as the adapter splits
    them (the layer's own method would call every tensor under it unsplit)."""

    def sharded_state_dict(prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        own = layer_entries(prefix, sharded_offsets, metadata)
        entries = {k: v for k, v in own.items() if not k.startswith(f"{prefix}lora.")}
        adapter = layer.lora
        assert isinstance(adapter, LoraAdapter)
        return entries | adapter.sharded_state_dict(f"{prefix}lora.", sharded_offsets, metadata)

    return sharded_state_dict


def add_lora(
    chunks, spec: LoraSpec, config, tp_rank: int, seed: int = 0, keep: tuple[str, ...] = ()
) -> int:
    """Adapt the `spec.targets` layers of every part of `chunks` (`ModelChunks`) and freeze
    all their other parameters but those whose names start with one of `keep` (a critic's
    new value head, `output_layer.`); returns the adapted layers' count. Each A is drawn as
    PEFT draws it (uniform in +-1 / sqrt(in)) from a generator seeded by `seed` and the
    layer's global name, whole, and this TP rank (`tp_rank`) keeps its columns of a
    row-parallel one: the same adapters at any layout. B starts at zero."""
    adapted = 0
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            param.requires_grad_(name.startswith(keep))
        for name, layer in list(chunk.named_modules()):
            kind = name.rsplit(".", 1)[-1]
            if kind not in spec.targets or name.startswith("vision_model"):
                continue
            if not isinstance(getattr(layer, "weight", None), torch.Tensor):
                raise ValueError(
                    f"{name} ({type(layer).__name__}) holds no single weight to adapt: "
                    "Transformer Engine's grouped experts take no adapters; set "
                    "megatron.override_transformer_config.moe_grouped_gemm=false"
                )
            gated = kind == "linear_fc1" and config.gated_linear_unit
            layer.lora = LoraAdapter(layer, kind in COLUMN_PARALLEL, spec, config, gated)
            layer.register_forward_hook(_add_update)
            layer.sharded_state_dict = _with_adapter(layer, layer.sharded_state_dict)
            adapted += 1
    if not adapted:
        raise ValueError(f"no layer named {spec.targets} to adapt")
    _draw_a(chunks, tp_rank, seed)
    return adapted


@torch.no_grad()
def _draw_a(chunks, tp_rank: int, seed: int) -> None:
    owners = {id(a.lora_A.weight): a for a in adapters(chunks)}
    for param, name in chunks.global_names().items():
        adapter = owners.get(id(param))
        if adapter is None:
            continue
        group = adapter.group  # an expert's layer is split over the expert-TP group
        tp = chunks.config.tensor_model_parallel_size if group is None else group.size()
        part = tp_rank if group is None else group.rank()
        rank, local = param.shape
        whole = local if adapter.column else local * tp
        digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
        bound = 1.0 / math.sqrt(whole)
        full = (torch.rand(rank, whole, generator=gen, dtype=torch.float64) * 2 - 1) * bound
        shard = full if whole == local else full[:, part * local : (part + 1) * local]
        param.copy_(shard.to(param.dtype))


def spec_of(chunks: Iterable[nn.Module]) -> LoraSpec | None:
    """The adapters' spec of a model (None: not adapted)."""
    return next((a.spec for a in adapters(chunks)), None)


def adapters(chunks: Iterable[nn.Module]) -> Iterator[LoraAdapter]:
    for chunk in chunks:
        yield from (m for m in chunk.modules() if isinstance(m, LoraAdapter))


def is_lora_param(name: str) -> bool:
    """A parameter name of an adapter (`...lora.lora_A.weight`)."""
    return ".lora." in f".{name}"


@torch.no_grad()
def peft_factors(adapter: LoraAdapter, rule, index, split: list[torch.Tensor], arch):
    """(PEFT name, tensor) of `adapter`'s factors, whole, given its split factor's TP shards
    `split` (column-parallel: B's, row-parallel: A's) and its layer weight's mapping rule
    (`rlhf.models.mapping.resolve`): a fused layer's B split as its weight is, its A shared
    by the projections."""
    from rlhf.models.mapping import shards_to_hf

    a, b = adapter.factors()
    if adapter.column:
        for hf_name, part in shards_to_hf(rule, index, split, arch):
            yield peft_name(hf_name, "lora_A"), a
            yield peft_name(hf_name, "lora_B"), part
    else:
        ((hf_name, whole),) = shards_to_hf(rule, index, split, arch)
        yield peft_name(hf_name, "lora_A"), whole
        yield peft_name(hf_name, "lora_B"), b


@torch.no_grad()
def merged_weights(chunks: Iterable[nn.Module]) -> dict[int, torch.Tensor]:
    """id(an adapted layer's weight) -> that weight with its enabled adapter's update
    merged in: this rank's shard of W + (alpha / r) B A (column-parallel: B's rows, A whole;
    row-parallel: A's columns, B whole), in the weight's dtype."""
    merged = {}
    for chunk in chunks:
        for layer in chunk.modules():
            adapter = getattr(layer, "lora", None)
            if not isinstance(adapter, LoraAdapter) or not adapter.enabled:
                continue
            a, b = adapter.factors()
            update = b.float() @ a.float()
            weight = layer.weight
            assert isinstance(weight, torch.Tensor)
            merged[id(weight)] = (weight.float() + adapter.scale * update).to(weight.dtype)
    return merged


@contextlib.contextmanager
def adapters_off(chunks: Iterable[nn.Module]) -> Iterator[None]:
    """Inside: the base model (every adapter's update left out)."""
    found = list(adapters(chunks))
    for adapter in found:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in found:
            adapter.enabled = True
