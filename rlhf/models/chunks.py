"""A rank's model as Megatron's pipeline schedules see it: a list of chunks.

Without interleaving a pipeline rank holds one `GPTModel` (its stage). With Megatron's
interleaved (virtual) pipeline, `virtual_pipeline_model_parallel_size` = VP, it holds VP
chunks, each a `GPTModel` of L / (PP x VP) consecutive layers: chunk v of stage p has layers
from (v x PP + p) x L / (PP x VP) on (`Placement.first_layer`), the embedding lives in chunk
0 of stage 0 and the output layer in chunk VP - 1 of the last stage. Each chunk names its
layers from 0, so everything that needs a parameter's global identity (HF names, optimizer
checkpoints, the weight sync) goes through the chunk's `Placement`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from rlhf.models.lora import is_lora_param, merged_weights
from rlhf.models.mapping import (
    Placement,
    global_expert_name,
    sequential_expert_name,
    shift_layer,
)


class ModelChunks(nn.ModuleList):
    """This rank's model chunks in schedule order, each with its `Placement`; the chunks
    share one TransformerConfig."""

    def __init__(self, chunks: list[nn.Module], placements: list[Placement]):
        if len(chunks) != len(placements):
            raise ValueError(f"{len(chunks)} chunks but {len(placements)} placements")
        super().__init__(chunks)
        self.placements = list(placements)

    @classmethod
    def of(cls, model: nn.Module, placement: Placement) -> ModelChunks:
        """`model` itself when it is already chunks, else a one-chunk list at `placement`."""
        if isinstance(model, ModelChunks):
            return model
        return cls([model], [placement])

    @property
    def chunks(self) -> list[Any]:
        """The `GPTModel` chunks (Megatron-Core ships no type information)."""
        return list(self)

    @property
    def config(self):
        return self.chunks[0].config

    @property
    def padded_vocab_size(self) -> int:
        return int(self.chunks[0].padded_vocab_size)

    def placed_parameters(self) -> Iterator[tuple[Placement, str, nn.Parameter]]:
        """(chunk placement, chunk-local name, parameter) of every parameter."""
        for placement, chunk in zip(self.placements, self):
            for name, param in chunk.named_parameters():
                yield placement, name, param

    def placed_weights(self) -> Iterator[tuple[Placement, str, torch.Tensor]]:
        """`placed_parameters` and the buffers that are weights of the HF model (a sigmoid
        router's expert bias, `mapped_buffers`): what loading, export and sync carry. LoRA
        adapters' parameters are not HF weights (`rlhf.models.lora`): left out."""
        for placement, name, param in self.placed_parameters():
            if not is_lora_param(name):
                yield placement, name, param
        for placement, chunk in zip(self.placements, self):
            for name, buffer in mapped_buffers(chunk):
                yield placement, name, buffer

    def served_weights(self) -> Iterator[tuple[Placement, str, torch.Tensor]]:
        """`placed_weights` as the policy serves them: a LoRA-adapted layer's weight with
        its adapter's update merged in (`rlhf.models.lora.merged_weights`)."""
        merged = merged_weights(self)
        for placement, name, tensor in self.placed_weights():
            yield placement, name, merged.get(id(tensor), tensor)

    def global_names(self) -> dict[nn.Parameter, str]:
        """Parameter -> its name with the global layer index and a routed expert's global
        index (layout-independent: no two EP ranks share a name), an expert's as
        `SequentialMLP` names it whichever expert module holds it (the same optimizer
        checkpoint resumes on the CPU and with Transformer Engine's grouped GEMM)."""
        num_layers, experts = self.config.num_layers, self.config.num_moe_experts or 0
        return {
            param: shift_layer(
                global_expert_name(sequential_expert_name(name), placement, experts),
                placement.first_layer(num_layers),
            )
            for placement, name, param in self.placed_parameters()
        }

    def sharded_state_dict(self, adapters_only: bool = False) -> dict:
        """Megatron's sharded state dict: the chunk's own, or one entry per chunk. The
        sharded keys carry global layer offsets either way, so a checkpoint loads at any
        pipeline layout. `adapters_only`: the entries of the parameters a LoRA model trains
        alone (its adapters, and a critic's value head: its frozen weights are the HF model
        it was built from)."""
        parts = [chunk.sharded_state_dict() for chunk in self.chunks]
        if adapters_only:
            trained = [_trained_names(chunk) for chunk in self.chunks]
            parts = [{k: v for k, v in part.items() if k in t} for part, t in zip(parts, trained)]
        if len(self) == 1:
            return parts[0]
        return {f"chunk{i}": part for i, part in enumerate(parts)}

    def load_sharded(self, state: dict, adapters_only: bool = False) -> None:
        """Load what `dist_checkpointing.load` returned for `sharded_state_dict()`
        (`adapters_only`: the LoRA adapters alone, every other weight kept as it is)."""
        states = [state] if len(self) == 1 else [state[f"chunk{i}"] for i in range(len(self))]
        for chunk, part in zip(self.chunks, states):
            result = chunk.load_state_dict(part, strict=not adapters_only)
            if adapters_only:
                missing = [k for k in result.missing_keys if k in _trained_names(chunk)]
                if missing or result.unexpected_keys:
                    bad = missing + list(result.unexpected_keys)
                    raise ValueError(f"the checkpoint's adapters do not fit this model: {bad[:5]}")


def _trained_names(chunk: nn.Module) -> set[str]:
    """The names of `chunk`'s parameters that need gradients (a LoRA model's adapters and
    whatever `add_lora` kept trainable)."""
    return {name for name, param in chunk.named_parameters() if param.requires_grad}


MAPPED_BUFFERS = ("mlp.router.expert_bias",)


def mapped_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers of `module` that hold HF weights: Megatron keeps a sigmoid router's
    expert bias (DeepSeek-V3's and GLM-4.5's `e_score_correction_bias`) as a buffer."""
    return [
        (name, buffer)
        for name, buffer in module.named_buffers()
        if buffer is not None and name.endswith(MAPPED_BUFFERS)
    ]
