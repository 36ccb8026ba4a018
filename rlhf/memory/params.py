"""Parameters, gradient buffers and optimizer shards of one rank, counted without building.

`stage_param_numels` lists the parameters of one (TP rank, PP stage) shard in the order
Megatron-Core's local spec registers them (what DDP lays out, in reverse, in its buffer).
`GradBuffer` reproduces Megatron's `_ParamAndGradBuffer` layout: one bucket (grad-reduce
overlap off), and with the distributed optimizer each parameter starts at a multiple of
64 elements, the buffer ends at a multiple of lcm(DP, 128), and a tied embedding gets a
bucket of its own; each bucket is split evenly over the DP ranks and a rank's optimizer
holds the parameter elements inside its split. With Transformer Engine the layer norms are
fused into the linear layers, which changes only the order (and so the padding, by at most
64 elements per parameter).

Mixture-of-experts layers (`rlhf.memory.moe`) register the router, the local experts and
the shared expert in place of the dense MLP; expert parameters (`Param.expert`) go to DDP's
second buffer, laid out the same way over the expert-data-parallel group. A
vision-language model's vision tower is on the first stage, whole on every TP rank
(`rlhf.models.vision`); the planner counts it trained (`freeze_vision_tower` would save
its gradients and optimizer state).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from rlhf.memory.moe import moe_layer_params
from rlhf.models.families import ModelArch
from rlhf.models.lora import LoraSpec
from rlhf.models.vision_arch import vision_tower_numels


@dataclass(frozen=True)
class Param:
    numel: int
    shared_embedding: bool = False  # tied embeddings split over the first and last stage
    expert: bool = False  # a routed expert's: DDP's expert buffer, over expert-DP ranks


def stage_layers(num_layers: int, pp: int, stage: int, vp: int = 1) -> list[int]:
    """Global indexes of the layers pipeline stage `stage` holds: chunk v of it holds
    L / (PP x VP) layers from (v x PP + stage) x L / (PP x VP) (one chunk without VP)."""
    per_chunk = num_layers // (pp * vp)
    first = [(v * pp + stage) * per_chunk for v in range(vp)]
    return [start + i for start in first for i in range(per_chunk)]


def stage_params(
    arch: ModelArch,
    padded_vocab: int,
    *,
    tp: int,
    pp: int,
    stage: int,
    value_head: bool = False,
    ep: int = 1,
    etp: int | None = None,
    vp: int = 1,
) -> list[Param]:
    """The parameters of pipeline stage `stage` on one TP rank (and, in MoE layers, one EP
    x expert-TP rank: `etp` None is TP), in registration order."""
    h, d = arch.hidden_size, arch.head_dim
    qkv = (arch.num_attention_heads + 2 * arch.num_query_groups) * d // tp
    query = arch.num_attention_heads * d // tp
    ffn = arch.ffn_hidden_size // tp
    tied_split = arch.tie_embeddings and pp > 1 and not value_head
    params: list[Param] = []
    if stage == 0:
        params.append(Param(padded_vocab // tp * h, shared_embedding=tied_split))
    for layer in stage_layers(arch.num_layers, pp, stage, vp):
        params.append(Param(h))  # input_layernorm
        if arch.mla is not None:
            params += mla_params(arch, tp)
        else:
            params.append(Param(h * query))  # linear_proj
            params.append(Param(qkv * h))  # linear_qkv
        if arch.qkv_bias:
            params.append(Param(qkv))
        if arch.qk_layernorm and arch.mla is None:
            params += [Param(d), Param(d)]
        params.append(Param(h))  # pre_mlp_layernorm
        if arch.moe is not None and arch.is_moe_layer(layer):
            for numel, expert in moe_layer_params(arch.moe, h, tp=tp, ep=ep, etp=etp or tp):
                params.append(Param(numel, expert=expert))
        else:
            params.append(Param(2 * ffn * h))  # linear_fc1 (gate and up)
            params.append(Param(h * ffn))  # linear_fc2
    if stage == pp - 1:
        params.append(Param(h))  # final_layernorm
        if value_head:
            params.append(Param(h))
        elif not arch.tie_embeddings or pp > 1:
            params.append(Param(padded_vocab // tp * h, shared_embedding=tied_split))
    if stage == 0 and arch.vision is not None:  # whole on every TP rank, after the GPT's
        params += [Param(n) for n in vision_tower_numels(arch.vision)]
    return params


def mla_params(arch: ModelArch, tp: int) -> list[Param]:
    """A multi-latent attention's parameters on one TP rank, in registration order: the
    output projection, the q down projection (whole on every rank), its latent's norm and
    the q up projection (or the one q projection), the kv down projection (whole), the kv
    up projection and the kv latent's norm."""
    mla, h, heads = arch.mla, arch.hidden_size, arch.num_attention_heads // tp
    assert mla is not None
    q_rows = heads * (mla.nope_dim + mla.rope_dim)
    params = [Param(h * heads * mla.v_dim)]  # linear_proj
    if mla.q_lora_rank is None:
        params.append(Param(q_rows * h))
    else:
        params += [Param(mla.q_lora_rank * h), Param(q_rows * mla.q_lora_rank)]
    params.append(Param((mla.kv_lora_rank + mla.rope_dim) * h))  # linear_kv_down_proj
    params.append(Param(heads * (mla.nope_dim + mla.v_dim) * mla.kv_lora_rank))
    if mla.q_lora_rank is not None:
        params.append(Param(mla.q_lora_rank))  # q_layernorm
    params.append(Param(mla.kv_lora_rank))  # kv_layernorm
    return params


def mla_replicated_params(arch: ModelArch) -> int:
    """Parameters of the whole model's multi-latent attention that every TP rank holds in
    full (`mla_params`' unsplit ones): the latents' down projections and norms."""
    mla, h = arch.mla, arch.hidden_size
    assert mla is not None
    q_down = (mla.q_lora_rank or 0) * (h + 1)  # projection and the q latent's norm
    kv_down = (mla.kv_lora_rank + mla.rope_dim) * h + mla.kv_lora_rank
    return arch.num_layers * (q_down + kv_down)


def lora_params(
    arch: ModelArch,
    spec: LoraSpec,
    *,
    tp: int,
    pp: int,
    stage: int,
    vp: int = 1,
    ep: int = 1,
    etp: int | None = None,
) -> list[Param]:
    """The LoRA adapters of pipeline stage `stage` on one TP rank (`rlhf.models.lora`: a
    column-parallel layer's A whole and B split by rows, a row-parallel layer's A split by
    columns and B whole), in registration order. A MoE layer's MLP: each of this EP rank's
    routed experts (split over expert-TP `etp`, None: TP; `expert` parameters) and the
    shared expert."""
    h, d = arch.hidden_size, arch.head_dim
    qkv = (arch.num_attention_heads + 2 * arch.num_query_groups) * d
    attention = {  # layer -> (inputs, outputs, column-parallel)
        "linear_proj": (arch.num_attention_heads * d, h, False),
        "linear_qkv": (h, qkv, True),
    }
    params: list[Param] = []
    for layer in stage_layers(arch.num_layers, pp, stage, vp):
        for name in (n for n in attention if n in spec.targets):  # as Megatron registers
            params += _adapter(spec, *attention[name], tp)
        mlp = [n for n in ("linear_fc1", "linear_fc2") if n in spec.targets]
        if arch.moe is None or not arch.is_moe_layer(layer):
            params += _mlp_adapters(spec, mlp, h, arch.ffn_hidden_size, tp)
            continue
        for _ in range(arch.moe.num_experts // ep):
            experts = _mlp_adapters(spec, mlp, h, arch.moe.ffn_hidden_size, etp or tp)
            params += [dataclasses.replace(p, expert=True) for p in experts]
        if arch.moe.shared_expert_size is not None:
            params += _mlp_adapters(spec, mlp, h, arch.moe.shared_expert_size, tp)
    return params


def _mlp_adapters(spec: LoraSpec, targets: Sequence[str], h: int, ffn: int, tp: int) -> list[Param]:
    sizes = {"linear_fc1": (h, 2 * ffn, True), "linear_fc2": (ffn, h, False)}
    return [p for name in targets for p in _adapter(spec, *sizes[name], tp)]


def _adapter(spec: LoraSpec, inputs: int, outputs: int, column: bool, tp: int) -> list[Param]:
    r = spec.rank
    if column:
        return [Param(r * inputs), Param(outputs // tp * r)]
    return [Param(r * (inputs // tp)), Param(outputs * r)]


@dataclass(frozen=True)
class GradBuffer:
    """Megatron DDP's buffer for one rank's parameters and its split over DP ranks."""

    numel: int  # elements, padding included
    owned: tuple[int, ...]  # parameter elements each DP rank's optimizer holds

    @classmethod
    def layout(cls, params: list[Param], dp: int, distributed: bool) -> GradBuffer:
        if not distributed:
            total = sum(p.numel for p in params)
            return cls(total, tuple(total for _ in range(dp)))
        end_divisor = math.lcm(dp, 128)
        spans: list[tuple[int, int]] = []
        buckets: list[tuple[int, int]] = []
        start = bucket_start = 0
        for p in reversed(params):
            start = -(-start // 64) * 64
            if p.shared_embedding and start > bucket_start:
                start = -(-start // end_divisor) * end_divisor
                buckets.append((bucket_start, start))
                bucket_start = start
            spans.append((start, start + p.numel))
            start += p.numel
            if p.shared_embedding:
                start = -(-start // end_divisor) * end_divisor
                buckets.append((bucket_start, start))
                bucket_start = start
        if start > bucket_start:
            end = -(-start // end_divisor) * end_divisor
            buckets.append((bucket_start, end))
            start = end
        owned = [0] * dp
        for lo, hi in buckets:
            size = (hi - lo) // dp
            for rank in range(dp):
                a, b = lo + rank * size, lo + (rank + 1) * size
                owned[rank] += sum(max(0, min(b, e) - max(a, s)) for s, e in spans)
        return cls(start, tuple(owned))
