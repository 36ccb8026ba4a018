"""Build Megatron-Core `GPTModel`s: the one place that chooses Transformer Engine or local layers.

Transformer Engine is used when CUDA is present and `transformer_engine.pytorch` really
imports (its core library and torch extension load; a package that is merely installed but
cannot load, which Megatron's own guarded imports treat as absent, used to fail at model
build); otherwise the local (pure PyTorch) spec, which is what runs on CPU and in CI.
Decided once per process, with the reason logged when a GPU run falls back.

Mixture-of-experts layers follow the same choice (`moe_grouped_gemm`): with Transformer
Engine their routed experts are Megatron's `TEGroupedMLP` (one grouped GEMM over all local
experts; parameters `mlp.experts.linear_fc1.weight{i}`), on the local spec `SequentialMLP`
(one GEMM per expert; `mlp.experts.local_experts.{i}.linear_fc1.weight`). The weight mapping
reads both names (`rlhf.models.mapping`); Megatron writes both to the same checkpoint keys.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.router import TopKRouter
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


GROUPED_GEMM_KEY = "megatron.override_transformer_config.moe_grouped_gemm"


def moe_grouped_gemm(override: bool | None = None, key: str = GROUPED_GEMM_KEY) -> bool:
    """Whether MoE layers run their routed experts as Transformer Engine's grouped GEMM
    (`TEGroupedMLP`) rather than one GEMM per expert (`SequentialMLP`): with TE's layers,
    unless `override` (the config's `key`) says no. Grouped GEMM without TE is refused:
    Megatron would build its legacy `GroupedMLP`, which needs the `grouped_gemm` package and
    CUDA and whose fused weights nothing here maps."""
    problem = transformer_engine_problem()
    if override is None:
        return problem is None
    if override and problem is not None:
        raise ValueError(
            f"{key}=true needs Transformer Engine's layers ({problem}); without them the "
            "experts run one GEMM each (SequentialMLP): remove the override"
        )
    return bool(override)


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
    each of this chunk's layers has experts; Megatron's MoE layer, its experts as
    `config.moe_grouped_gemm` says), or, for the local spec under Megatron's sequence
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
    attention = spec.submodules.self_attention.submodules
    if hasattr(attention, "kv_layernorm"):  # MLA: the latents of this rank's sequence slice
        attention.q_layernorm = attention.kv_layernorm = SequenceParallelRMSNorm
    elif qk_layernorm:  # each TP rank normalises its own heads: the gradient is summed too
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

    grouped = bool(num_experts) and config.moe_grouped_gemm
    mla = bool(config.multi_latent_attention)
    if transformer_engine_usable():
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts,
            moe_grouped_gemm=grouped,
            qk_layernorm=qk_layernorm,
            multi_latent_attention=mla,
        )
        if num_experts:
            _local_checkpoint_keys(spec)
    else:
        if grouped:  # a config built without `moe_grouped_gemm`'s decision
            moe_grouped_gemm(override=True)  # raises: no grouped GEMM on the local spec
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=num_experts,
            normalization=config.normalization,
            qk_layernorm=qk_layernorm,
            multi_latent_attention=mla,
        )
        if config.context_parallel_size == 1:  # packed rows: attention per sample
            from rlhf.models.packed_attention import PackedDotProductAttention

            spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
            if mla:
                from rlhf.models.packed_attention import PackedMLASelfAttention

                spec.submodules.self_attention.module = PackedMLASelfAttention
    if mla:
        _replicated_latent_projections(spec)
    if not num_experts:  # the dense MLP's SwiGLU as one function (rlhf.models.swiglu)
        from rlhf.models.swiglu import SwiGLUMLP

        spec.submodules.mlp.module = SwiGLUMLP
    if num_experts:
        _check_experts(spec, grouped)
        spec.submodules.mlp.submodules.router = PaddingSafeRouter
    if config.context_parallel_size > 1:
        from rlhf.parallel.ulysses import UlyssesAttention

        attention = spec.submodules.self_attention.submodules
        attention.core_attention = functools.partial(
            UlyssesAttention, inner=attention.core_attention
        )
    return spec


class PaddingSafeRouter(TopKRouter):
    """Megatron-Core 0.16.1's `TopKRouter` whose expert-bias token count takes a padded batch.

    With `moe_router_enable_expert_bias` (DeepSeek-V3, GLM-4.5) Megatron counts the tokens
    each expert got, masking the [tokens, experts] routing map with the [tokens] padding
    mask as it is: a shape error in every training forward of a padded batch whose token
    count is not the number of experts. Here the mask is one column (True: padding)."""

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask=None):
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)


def _replicated_latent_projections(spec: ModuleSpec) -> None:
    """MLA's down projections (to the q and kv latents) whole on every TP rank, on every
    backend, as Megatron builds them with Transformer Engine (`TELinear`, "duplicated").

    The local spec would build them column-parallel (each TP rank a slice of the latent,
    gathered after), where Megatron-Core 0.16.1 loses gradient: the rotary key it cuts from
    the gathered kv latent serves every head, but the gather's backward keeps only this
    rank's slice of the gradient, which holds only this rank's heads' share (measured: a
    TP2 update's grad norm 3.1793 against one rank's 3.1776). Whole, the key is gathered
    over the sequence-parallel ranks and its gradient summed there; Megatron's plain
    `Linear` marks the weight sequence-parallel, so its gradient is summed over TP."""
    from megatron.core.post_training.modelopt.layers import Linear

    attention = spec.submodules.self_attention.submodules
    attention.linear_q_down_proj = attention.linear_kv_down_proj = Linear


def _local_checkpoint_keys(spec: ModuleSpec) -> None:
    """A TE MoE layer writes its pre-MLP norm under the key the local spec writes it under.

    Megatron's local spec stores both norms under the keys of TE's fused norm-linears
    (`sharded_state_dict_keys_map`), also in MoE layers, where TE keeps the pre-MLP norm a
    module of its own (`pre_mlp_layernorm.weight`): a MoE checkpoint written on a GPU would
    not load on the CPU (`trainer.save_hf` exports there) nor the other way."""
    keys = dict(spec.submodules.sharded_state_dict_keys_map)
    keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    spec.submodules.sharded_state_dict_keys_map = keys


EXPERT_MODULES = {False: "SequentialMLP", True: "TEGroupedMLP"}


def _check_experts(spec: ModuleSpec, grouped: bool) -> None:
    """The spec's experts are the module whose parameter names the weight mapping knows
    (Megatron falls back to its legacy `GroupedMLP`, fused `weight1`/`weight2`, when TE's
    grouped linear layers are missing)."""
    experts = spec.submodules.mlp.submodules.experts
    name = getattr(experts, "module", experts).__name__
    if name != EXPERT_MODULES[grouped]:
        raise ValueError(
            f"Megatron built the experts as {name}, not {EXPERT_MODULES[grouped]} "
            f"(moe_grouped_gemm={grouped}): its parameters have no HF mapping here; "
            f"set {GROUPED_GEMM_KEY}=false"
        )


def build_gpt_model(
    config: TransformerConfig,
    vocab_size: int,
    max_sequence_length: int,
    *,
    pre_process: bool,
    post_process: bool,
    rotary_base: float = 10000.0,
    rotary_percent: float = 1.0,
    tie_embeddings: bool = False,
    qk_layernorm: bool = False,
    vp_stage: int | None = None,
    moe_layers: list[bool] | None = None,
    vision=None,
) -> GPTModel:
    """A rotary-embedding decoder (Llama/Qwen style) for this rank's pipeline stage.

    `vocab_size` must already be padded for tensor parallelism; `pre_process` /
    `post_process` say whether this stage holds the embedding / the output layer;
    `vp_stage`: which virtual-pipeline chunk of the stage it is (None without interleaving);
    `moe_layers`: for a mixture-of-experts model, whether each of its layers has experts;
    `rotary_percent`: the fraction of each head the rotary embedding turns; `vision` (a
    `VisionArch`): a vision-language model (`rlhf.models.vision`), its tower on the first
    stage, multimodal rotary positions.
    """
    model_class = GPTModel
    if vision is not None:
        from rlhf.models.vision import VisionLanguageGPT

        model_class = VisionLanguageGPT
    model = model_class(
        config=config,
        transformer_layer_spec=gpt_block_spec(config, qk_layernorm, moe_layers),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=tie_embeddings,
        position_embedding_type="rope" if vision is None else "mrope",
        rotary_base=int(rotary_base),
        rotary_percent=rotary_percent,
        vp_stage=vp_stage,
    )
    if vision is not None:
        from rlhf.models.vision_arch import build_vision_tower

        model.vision = vision
        if pre_process:
            model.vision_model = build_vision_tower(vision, config.params_dtype)
    return model
