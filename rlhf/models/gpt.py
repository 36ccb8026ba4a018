"""Build Megatron-Core `GPTModel`s: the one place that chooses Transformer Engine or local layers.

Transformer Engine is used when CUDA is present and `transformer_engine.pytorch` really
imports (its core library and torch extension load; a package that is merely installed but
cannot load, which Megatron's own guarded imports treat as absent, used to fail at model
build); otherwise the local (pure PyTorch) spec, which is what runs on CPU and in CI.
Decided once per process, with the reason logged when a GPU run falls back.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

log = logging.getLogger(__name__)
TE_MODULE = "transformer_engine.pytorch"


@functools.cache
def transformer_engine_problem() -> str | None:
    """Why this process cannot use Transformer Engine's layers, or None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        importlib.import_module(TE_MODULE)
    # not installed, a missing core or CUDA library (OSError), a failed install check (TE
    # asserts that its packages' versions match)
    except (ImportError, OSError, RuntimeError, AssertionError) as e:
        reason = f"import {TE_MODULE} failed: {type(e).__name__}: {e}"
        log.warning("Transformer Engine unusable (%s): Megatron's local layer spec", reason)
        return reason
    return None


def transformer_engine_usable() -> bool:
    """True when a GPU is visible and Transformer Engine imports (`transformer_engine_problem`)."""
    return transformer_engine_problem() is None


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm (what the local spec's `WrappedTorchNorm` builds), which that wrapper
    refuses under Megatron's sequence parallelism: each TP rank normalises its slice of the
    sequence, so the weight is marked `sequence_parallel` and Megatron's
    `finalize_model_grads` sums its gradient over the TP group."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = True  # type: ignore[attr-defined]


def gpt_block_spec(
    config: TransformerConfig, qk_layernorm: bool = False, moe_layers: list[bool] | None = None
):
    """What `GPTModel` builds its decoder from: the layer spec, or the block's layers and
    final norm when they differ: a mixture-of-experts model's layers (`moe_layers`: whether
    each of this chunk's layers has experts; Megatron's MoE layer with `SequentialMLP`
    experts on the local spec), or, for the local spec under Megatron's sequence
    parallelism, layers and final norm with `SequenceParallelRMSNorm` (Transformer Engine's
    norms support it themselves)."""
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    dense = gpt_layer_spec(config, qk_layernorm)
    local_sp = config.sequence_parallel and not transformer_engine_usable()
    if moe_layers is None and not local_sp:
        return dense
    if moe_layers is None:
        moe_layers = [False] * get_num_layers_to_build(config)
    moe = gpt_layer_spec(config, qk_layernorm, num_experts=config.num_moe_experts)
    if local_sp:
        for spec in (dense, moe):
            _sequence_parallel_norms(spec, qk_layernorm)
    layers = [moe if has_experts else dense for has_experts in moe_layers]
    norm = SequenceParallelRMSNorm if local_sp else LayerNormImpl
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=norm)


def _sequence_parallel_norms(spec: ModuleSpec, qk_layernorm: bool) -> None:
    spec.submodules.input_layernorm = SequenceParallelRMSNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    if qk_layernorm:  # each TP rank normalises its own heads: the gradient is summed too
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = SequenceParallelRMSNorm


def gpt_layer_spec(
    config: TransformerConfig, qk_layernorm: bool = False, num_experts: int | None = None
) -> ModuleSpec:
    """The transformer-layer spec for `config`: TE layers on GPU, local layers otherwise;
    with `num_experts`, a layer whose MLP is Megatron's MoE layer.

    The local spec's core attention computes packed rows per sample
    (`rlhf.models.packed_attention`). With a context-parallel size > 1 the core attention is
    Megatron's (masked on the local spec), wrapped in Ulysses sequence parallelism
    (`rlhf.parallel.ulysses`).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    if transformer_engine_usable():
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, qk_layernorm=qk_layernorm
        )
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=num_experts, normalization=config.normalization, qk_layernorm=qk_layernorm
        )
        if config.context_parallel_size == 1:  # packed rows: attention per sample
            from rlhf.models.packed_attention import PackedDotProductAttention

            spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    if config.context_parallel_size > 1:
        from rlhf.parallel.ulysses import UlyssesAttention

        attention = spec.submodules.self_attention.submodules
        attention.core_attention = functools.partial(
            UlyssesAttention, inner=attention.core_attention
        )
    return spec


def build_gpt_model(
    config: TransformerConfig,
    vocab_size: int,
    max_sequence_length: int,
    *,
    pre_process: bool,
    post_process: bool,
    rotary_base: float = 10000.0,
    tie_embeddings: bool = False,
    qk_layernorm: bool = False,
    vp_stage: int | None = None,
    moe_layers: list[bool] | None = None,
) -> GPTModel:
    """A rotary-embedding decoder (Llama/Qwen style) for this rank's pipeline stage.

    `vocab_size` must already be padded for tensor parallelism; `pre_process` /
    `post_process` say whether this stage holds the embedding / the output layer;
    `vp_stage`: which virtual-pipeline chunk of the stage it is (None without interleaving);
    `moe_layers`: for a mixture-of-experts model, whether each of its layers has experts.
    """
    return GPTModel(
        config=config,
        transformer_layer_spec=gpt_block_spec(config, qk_layernorm, moe_layers),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(rotary_base),
        vp_stage=vp_stage,
    )
