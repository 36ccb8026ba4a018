"""HF `config.json` -> our architecture description -> Megatron `TransformerConfig`.

`ModelArch` is the family-independent description both directions of the weight mapping
use. Each supported family has exactly one function mapping its HF config to a `ModelArch`
(`FAMILIES`); `transformer_config` is the one place a `ModelArch` becomes Megatron's
`TransformerConfig`. Anything we would silently get wrong (sliding windows, unknown rope
scaling, biases we do not map) is rejected with an error naming the HF key.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rlhf.config.validate import model_split_problem
from rlhf.models.moe_arch import MoEArch, MoERouter, expert_split_problem
from rlhf.models.vision_arch import VisionArch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rotary scaling (rope type "yarn": DeepSeek-V3's long-context setting)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


@dataclass(frozen=True)
class MLAArch:
    """Multi-latent attention (DeepSeek-V2/V3): queries through a rank-`q_lora_rank`
    bottleneck (None: one projection), keys and values from a shared rank-`kv_lora_rank`
    latent, plus one rotary key of `rope_dim` shared by all heads; a head's query and key
    are `nope_dim` + `rope_dim` wide, its value `v_dim`. `yarn`: the rotary scaling."""

    q_lora_rank: int | None
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    yarn: YarnScaling | None = None


@dataclass(frozen=True)
class Recompute:
    """Megatron activation recompute: which activations are recomputed in the backward.

    granularity "full" recomputes whole transformer layers (`method` "uniform": every group
    of `num_layers` layers keeps only its input; "block": the first `num_layers` layers of
    each stage); "selective" recomputes the core attention of every layer; None keeps all.
    """

    granularity: str | None = None
    method: str | None = None
    num_layers: int | None = None

    @classmethod
    def of(cls, megatron: Any) -> Recompute:
        """From a config's `megatron` section (its recompute_* keys)."""
        return cls(
            megatron.recompute_granularity, megatron.recompute_method, megatron.recompute_num_layers
        )

    def megatron_kwargs(self) -> dict:
        """TransformerConfig's fields; full recompute defaults to uniform over 1 layer."""
        if self.granularity == "full":
            return {
                "recompute_granularity": "full",
                "recompute_method": self.method or "uniform",
                "recompute_num_layers": self.num_layers or 1,
            }
        return {"recompute_granularity": self.granularity}


NO_RECOMPUTE = Recompute()


@dataclass(frozen=True)
class ModelArch:
    """A decoder-only transformer as the weight mapping sees it."""

    family: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    norm_epsilon: float
    rope_theta: float
    max_position_embeddings: int
    tie_embeddings: bool
    qkv_bias: bool = False
    qk_layernorm: bool = False
    rope_scaling: RopeScaling | None = None
    moe: MoEArch | None = None
    rotary_fraction: float = 1.0  # rotary embedding on the first fraction of each head
    mla: MLAArch | None = None  # multi-latent attention (head_dim: a query's nope + rope)
    vision: VisionArch | None = None  # a vision tower whose tokens enter the text (mRoPE)

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dimensions the rotary embedding turns."""
        return int(self.head_dim * self.rotary_fraction)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` has experts (a dense MLP otherwise)."""
        return self.moe is not None and self.moe.layers[layer]


def _rope_settings(hf: dict, default_theta: float = 10000.0) -> tuple[float, str, dict]:
    """(rope theta, rope type, the type's parameters) from either transformers-5
    `rope_parameters` or the older `rope_theta` / `rope_scaling`."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    return float(theta), kind, scaling


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    """rope theta and (Llama-3) scaling of the Llama-style families."""
    theta, kind, scaling = _rope_settings(hf)
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ValueError(f"config.json rope type {kind!r} is not supported (supported: llama3)")
    return float(theta), RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _rotary_fraction(hf: dict, default: float) -> float:
    """`partial_rotary_factor`, top-level or (transformers 5) in `rope_parameters`."""
    params = hf.get("rope_parameters") or {}
    return float(hf.get("partial_rotary_factor", params.get("partial_rotary_factor", default)))


def _decoder_arch(
    hf: dict,
    family: str,
    rotary_fraction: float = 1.0,
    rope: tuple[float, RopeScaling | None] | None = None,
    **family_fields,
) -> ModelArch:
    """Fields shared by the Llama-style families; `rotary_fraction`: the family's default
    `partial_rotary_factor` (a family with 1.0 refuses any other); `rope`: (theta, scaling)
    of a family that reads its rotary settings itself (None: `_rope`)."""
    fraction = _rotary_fraction(hf, rotary_fraction)
    if rotary_fraction == 1.0 and fraction != 1.0:
        raise ValueError(
            f"config.json partial_rotary_factor={fraction}: not supported for {family}"
        )
    if hf.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window=true is not supported")
    if hf.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={hf['hidden_act']!r}: only silu is supported")
    heads = hf["num_attention_heads"]
    theta, scaling = _rope(hf) if rope is None else rope
    return ModelArch(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        norm_epsilon=hf["rms_norm_eps"],
        rope_theta=theta,
        max_position_embeddings=hf["max_position_embeddings"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        rotary_fraction=fraction,
        **family_fields,
    )


def llama_arch(hf: dict) -> ModelArch:
    """Llama 2/3 (incl. Llama-3 rope scaling; optional attention_bias)."""
    return _decoder_arch(hf, "llama", qkv_bias=bool(hf.get("attention_bias", False)))


def qwen2_arch(hf: dict) -> ModelArch:
    """Qwen2/2.5: QKV bias always, output projection without bias."""
    return _decoder_arch(hf, "qwen2", qkv_bias=True)


def qwen3_arch(hf: dict) -> ModelArch:
    """Qwen3 (dense): RMSNorm on q and k per head, explicit head_dim, no QKV bias."""
    return _decoder_arch(
        hf, "qwen3", qkv_bias=bool(hf.get("attention_bias", False)), qk_layernorm=True
    )


def qwen2_moe_arch(hf: dict) -> ModelArch:
    """Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (QKV bias, `qkv_bias`), routed
    experts plus a shared expert with a sigmoid gate; dense layers by `mlp_only_layers` /
    `decoder_sparse_step`."""
    moe = MoEArch.from_hf(hf, shared_expert=True)
    return _decoder_arch(hf, "qwen2_moe", qkv_bias=bool(hf.get("qkv_bias", True)), moe=moe)


def qwen3_moe_arch(hf: dict) -> ModelArch:
    """Qwen3-MoE: Qwen3 attention (q/k RMSNorm per head), routed experts, no shared expert."""
    moe = MoEArch.from_hf(hf, shared_expert=False)
    bias = bool(hf.get("attention_bias", False))
    return _decoder_arch(hf, "qwen3_moe", qkv_bias=bias, qk_layernorm=True, moe=moe)


def glm4_moe_arch(hf: dict) -> ModelArch:
    """GLM-4.5 / GLM-4.6 / GLM-4.5-Air: grouped-query attention with QKV bias
    (`attention_bias`), optional q/k RMSNorm per head (`use_qk_norm`), rotary embedding on
    the first `partial_rotary_factor` (0.5) of each head; DeepSeek-style experts
    (`MoEArch.from_deepseek_hf`). The multi-token-prediction layer
    (`num_nextn_predict_layers`) is not part of the model trained here (transformers skips
    it too)."""
    return _decoder_arch(
        hf,
        "glm4_moe",
        rotary_fraction=0.5,
        qkv_bias=bool(hf.get("attention_bias", False)),
        qk_layernorm=bool(hf.get("use_qk_norm", False)),
        moe=MoEArch.from_deepseek_hf(hf),
    )


def _yarn(hf: dict) -> YarnScaling | None:
    """The YaRN scaling of a config.json (`rope_scaling`, or transformers 5's
    `rope_parameters`); None without scaling; other rope types are refused."""
    _, kind, scaling = _rope_settings(hf)
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"config.json rope type {kind!r} is not supported (supported: yarn)")
    return YarnScaling(
        factor=float(scaling["factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast", 32)),
        beta_slow=float(scaling.get("beta_slow", 1)),
        mscale=float(scaling.get("mscale", 1)),
        mscale_all_dim=float(scaling.get("mscale_all_dim", 0)),
    )


def deepseek_v3_arch(hf: dict) -> ModelArch:
    """DeepSeek-V3 / R1 (and Kimi-K2, Moonlight: the same `deepseek_v3` model type):
    multi-latent attention with interleaved rotary dimensions (`rope_interleave`, which
    Megatron's MLA takes as it is) and optional YaRN scaling; DeepSeek-style experts
    (`MoEArch.from_deepseek_hf`). The multi-token-prediction layers are not part of the
    model trained here (transformers skips them too)."""
    if hf.get("attention_bias"):
        raise ValueError("config.json attention_bias=true is not supported for deepseek_v3")
    if not hf.get("rope_interleave", True):
        raise ValueError("config.json rope_interleave=false is not supported for deepseek_v3")
    nope, rope = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    mla = MLAArch(
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"],
        nope_dim=nope,
        rope_dim=rope,
        v_dim=hf["v_head_dim"],
        yarn=_yarn(hf),
    )
    theta, _, _ = _rope_settings(hf)
    heads = {"head_dim": nope + rope, "num_key_value_heads": hf["num_attention_heads"]}
    moe = MoEArch.from_deepseek_hf(hf)
    # qk_layernorm: the q and kv latents' norms (Megatron's MLA q/kv layernorms)
    return _decoder_arch(
        {**hf, **heads}, "deepseek_v3", rope=(theta, None), qk_layernorm=True, moe=moe, mla=mla
    )


def qwen2_5_vl_arch(hf: dict) -> ModelArch:
    """Qwen2.5-VL: a Qwen2 language model (QKV bias) with multimodal rotary positions
    (`mrope_section`) and a vision tower (`VisionArch`). Its text settings are at the top
    level of a published config.json, under `text_config` in one transformers 5 writes."""
    text = {**hf, **(hf.get("text_config") or {})}
    theta, kind, rope = _rope_settings(text, default_theta=1000000.0)
    section = rope.get("mrope_section")
    if not section:
        raise ValueError("config.json of qwen2_5_vl has no mrope_section (rope_scaling)")
    if kind not in ("default", "mrope"):
        raise ValueError(f"config.json rope type {kind!r} is not supported for qwen2_5_vl")
    tied = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    vision = VisionArch.from_hf(hf, "qwen2_5_vl", section)
    return _decoder_arch(
        {**text, "tie_word_embeddings": tied},
        "qwen2_5_vl",
        rope=(theta, None),
        qkv_bias=True,
        vision=vision,
    )


FAMILIES: dict[str, Callable[[dict], ModelArch]] = {
    "llama": llama_arch,
    "qwen2": qwen2_arch,
    "qwen3": qwen3_arch,
    "qwen2_moe": qwen2_moe_arch,
    "qwen3_moe": qwen3_moe_arch,
    "glm4_moe": glm4_moe_arch,
    "deepseek_v3": deepseek_v3_arch,
    "qwen2_5_vl": qwen2_5_vl_arch,
}


def arch_from_hf_config(hf: dict) -> ModelArch:
    """Dispatch on `model_type`; unknown families are a clear error listing the supported."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ValueError(
            f"unsupported model family {family!r} (config.json model_type); "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[family](hf)


def read_hf_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (an HF model directory is expected)")
    return json.loads(path.read_text())


def load_arch(model_dir: str | Path) -> ModelArch:
    return arch_from_hf_config(read_hf_config(model_dir))


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of `divisible_by x tp` (Megatron's padding)."""
    multiple = divisible_by * tp
    return math.ceil(vocab_size / multiple) * multiple


def check_parallel_sizes(
    arch: ModelArch, tp: int, pp: int, vp: int = 1, ep: int = 1, etp: int | None = None
) -> None:
    """Megatron splits heads over TP ranks and layers over PP stages (x VP chunks), experts
    over EP ranks and each expert's MLP over expert-TP ranks (`etp`, None: TP, Megatron's
    default); needs only the config, so the CLIs check it before launching any worker."""
    problem = model_split_problem(arch, tp, pp, vp)
    if problem is not None:
        raise ValueError(problem[1])
    expert_problem = expert_split_problem(arch.moe, arch.family, tp, ep, etp or tp)
    if expert_problem is not None:
        raise ValueError(expert_problem)


def transformer_config(
    arch: ModelArch,
    *,
    tp: int = 1,
    pp: int = 1,
    vp: int = 1,
    sp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    params_dtype: torch.dtype = torch.float32,
    use_cpu_initialization: bool = True,
    perform_initialization: bool = True,
    recompute: Recompute = NO_RECOMPUTE,
    sequence_parallel: bool = False,
    overrides: dict | None = None,
    router: MoERouter | None = None,
):
    """The one mapping from `ModelArch` to Megatron-Core's `TransformerConfig`.

    `overrides`: further `TransformerConfig` fields as they are (verl's
    `megatron.override_transformer_config`, checked by `check_transformer_overrides`).

    `sequence_parallel`: Megatron's sequence parallelism over the TP group (TP > 1 only).
    `vp`: virtual-pipeline chunks per stage (Megatron's interleaved 1F1B when > 1).
    `ep`, `etp`: expert parallel and expert tensor parallel sizes (mixture-of-experts models;
    `etp` None: TP, as Megatron has it); `router`: the router's training settings
    (`megatron.moe_*`; None: no router losses, no token dropping).

    `perform_initialization=False` skips Megatron's random init for models whose weights
    are about to be loaded from a checkpoint.
    """
    check_parallel_sizes(arch, tp, pp, vp, ep, etp)
    moe = _moe_fields(arch, ep, etp or tp, router, overrides or {})
    attention = _attention_fields(arch)
    fields = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        bias_activation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        # Interleaved: each direction in its own p2p call (as Megatron-LM runs it). Batched,
        # a 2-stage pipeline sends an activation and a gradient to the same peer in one
        # batch, and with variable sequence lengths their shape messages cross (a hang).
        overlap_p2p_comm=vp > 1,
        batch_p2p_comm=vp == 1,
        # a stage's output goes to the next stage and is not needed for its own backward
        # (which gets the gradient from there): freed once sent, as Megatron-LM does
        deallocate_pipeline_outputs=pp > 1,
        context_parallel_size=sp,  # Ulysses runs on the context-parallel group
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        # the fused masked softmax exists only as a compiled extension (Apex / TE builds)
        masked_softmax_fusion=importlib.util.find_spec("scaled_masked_softmax_cuda") is not None,
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=perform_initialization,
        **recompute.megatron_kwargs(),
        **moe,
        **attention,
    )
    return _config_class(arch)(**{**fields, **(overrides or {})})


def _config_class(arch: ModelArch) -> type:
    """Megatron's `TransformerConfig`, or its `MLATransformerConfig` for latent attention."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return TransformerConfig if arch.mla is None else MLATransformerConfig


def _attention_fields(arch: ModelArch) -> dict:
    """The rotary sections of multimodal rotary positions (a vision-language model), or
    `MLATransformerConfig`'s fields for multi-latent attention, whose rotary embedding is
    its own (plain, or YaRN with its attention scale); none for the others."""
    if arch.vision is not None:
        return {"mrope_section": list(arch.vision.mrope_section)}
    mla = arch.mla
    if mla is None:
        return {}
    yarn = mla.yarn
    fields = dict(
        multi_latent_attention=True,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.nope_dim,
        qk_pos_emb_head_dim=mla.rope_dim,
        v_head_dim=mla.v_dim,
        rotary_base=arch.rope_theta,
        rope_type="rope" if yarn is None else "yarn",
        mscale=1.0,
        mscale_all_dim=0.0,
    )
    if yarn is not None:
        fields |= dict(
            rotary_scaling_factor=yarn.factor,
            original_max_position_embeddings=yarn.original_max_position_embeddings,
            beta_fast=yarn.beta_fast,
            beta_slow=yarn.beta_slow,
            mscale=yarn.mscale,
            mscale_all_dim=yarn.mscale_all_dim,
        )
    return fields


def _moe_fields(
    arch: ModelArch, ep: int, etp: int, router: MoERouter | None, overrides: dict
) -> dict:
    """The MoE part of the config; the experts' GEMMs as `rlhf.models.gpt` decides (one
    grouped GEMM with Transformer Engine's layers, unless overridden)."""
    from rlhf.models.gpt import GROUPED_GEMM_KEY, moe_grouped_gemm

    override = overrides.get("moe_grouped_gemm")
    if arch.moe is None:
        if override is not None:
            log.warning("%s: ignored, %s has no experts", GROUPED_GEMM_KEY, arch.family)
        return {}
    return arch.moe.megatron_kwargs(ep, etp, router, grouped_gemm=moe_grouped_gemm(override))


def llama3_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Rotary inverse frequencies with Llama-3 scaling (all four published parameters).

    Wavelengths shorter than original_len / high_freq_factor are kept, longer than
    original_len / low_freq_factor are divided by `factor`, and those in between are
    interpolated linearly in original_len / wavelength.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    orig = scaling.original_max_position_embeddings
    smooth = (orig / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(
        wavelen > orig / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq
    )
    medium = (wavelen <= orig / scaling.low_freq_factor) & (
        wavelen >= orig / scaling.high_freq_factor
    )
    return torch.where(medium, interpolated, scaled)


# set from the model's config.json or this system's own keys: not overridable
_DERIVED_FIELDS = {
    "num_layers": "the model's config.json",
    "hidden_size": "the model's config.json",
    "ffn_hidden_size": "the model's config.json",
    "num_attention_heads": "the model's config.json",
    "num_query_groups": "the model's config.json",
    "kv_channels": "the model's config.json",
    "normalization": "the model's config.json",
    "layernorm_epsilon": "the model's config.json",
    "gated_linear_unit": "the model's config.json",
    "activation_func": "the model's config.json",
    "add_bias_linear": "the model's config.json",
    "add_qkv_bias": "the model's config.json",
    "qk_layernorm": "the model's config.json",
    "num_moe_experts": "the model's config.json",
    "moe_ffn_hidden_size": "the model's config.json",
    "moe_router_topk": "the model's config.json",
    "moe_router_pre_softmax": "the model's config.json",
    "moe_router_score_function": "the model's config.json",
    "multi_latent_attention": "the model's config.json",
    "mrope_section": "the model's config.json",
    "q_lora_rank": "the model's config.json",
    "kv_lora_rank": "the model's config.json",
    "qk_head_dim": "the model's config.json",
    "qk_pos_emb_head_dim": "the model's config.json",
    "v_head_dim": "the model's config.json",
    "rope_type": "the model's config.json",
    "rotary_scaling_factor": "the model's config.json",
    "moe_router_topk_scaling_factor": "the model's config.json",
    "moe_router_enable_expert_bias": "the model's config.json",
    "moe_router_num_groups": "the model's config.json",
    "moe_router_group_topk": "the model's config.json",
    "moe_shared_expert_intermediate_size": "the model's config.json",
    "moe_shared_expert_gate": "the model's config.json",
    "moe_layer_freq": "the model's config.json",
    "expert_model_parallel_size": "megatron.expert_model_parallel_size (rlhf-convert --ep)",
    "expert_tensor_parallel_size": "megatron.expert_tensor_parallel_size (rlhf-convert --etp)",
    "moe_router_load_balancing_type": "megatron.moe_aux_loss_coeff (aux_loss when > 0)",
    "moe_aux_loss_coeff": "megatron.moe_aux_loss_coeff",
    "moe_z_loss_coeff": "megatron.moe_z_loss_coeff",
    "moe_expert_capacity_factor": "megatron.moe_expert_capacity_factor",
    "moe_token_drop_policy": "megatron.moe_token_drop_policy",
    "tensor_model_parallel_size": "megatron.tensor_model_parallel_size",
    "pipeline_model_parallel_size": "megatron.pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size": "megatron.virtual_pipeline_model_parallel_size",
    "context_parallel_size": "ulysses_sequence_parallel_size",
    "params_dtype": "megatron.dtype",
    "pipeline_dtype": "megatron.dtype",
    "bf16": "megatron.dtype",
    "fp16": "megatron.dtype",
}
# fields whose other values build a model nothing here maps or runs
_REFUSED_VALUES = {
    "moe_use_legacy_grouped_gemm": (
        True,
        "Megatron's legacy GroupedMLP (fused weight1/weight2 experts) has no HF weight mapping "
        "here; moe_grouped_gemm alone gives Transformer Engine's grouped GEMM",
    ),
}


def check_transformer_overrides(overrides: dict, key: str) -> None:
    """Each `key.<field>` names a field of Megatron's `TransformerConfig` that this system
    does not set from the model or its own keys, with a value it can build (no legacy
    grouped experts; grouped experts only with Transformer Engine); raises ValueError
    naming the first that does not."""
    import dataclasses
    import difflib

    from megatron.core.transformer import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    for name in overrides:
        if name in _DERIVED_FIELDS:
            raise ValueError(f"{key}.{name}: set by {_DERIVED_FIELDS[name]} here, not overridden")
        if name in _REFUSED_VALUES and overrides[name] == _REFUSED_VALUES[name][0]:
            raise ValueError(f"{key}.{name}={overrides[name]}: {_REFUSED_VALUES[name][1]}")
        if name == "moe_grouped_gemm":  # true without Transformer Engine: refused now
            from rlhf.models.gpt import moe_grouped_gemm

            moe_grouped_gemm(overrides[name], key=f"{key}.{name}")
        if name not in fields:
            near = difflib.get_close_matches(name, sorted(fields), n=1, cutoff=0.7)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ValueError(
                f"{key}.{name}: not a field of Megatron-Core's TransformerConfig{hint}"
            )
