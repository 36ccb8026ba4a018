"""HF <-> Megatron-Core weight mapping for the Llama-style families.

One table (`param_rules`) says which HF tensors make each Megatron parameter and how the
Megatron parameter is laid out across tensor-parallel ranks:

- `REPLICATED`: same on every TP rank (norm weights).
- `ROW`: split along dim 1 (input features of a row-parallel linear).
- `QKV`: `linear_qkv` is grouped per query group: for each KV head g, the q heads of g,
  then k_g, then v_g. Each TP rank holds whole groups, in order.
- `GATE_UP`: `linear_fc1` is [gate_shard; up_shard] on each TP rank.
- `VOCAB`: rows split across TP ranks, padded with zero rows beyond the true vocabulary.
- `COLUMN`: rows (output features of a column-parallel linear) split evenly: multi-latent
  attention's projections (DeepSeek-V3), whose per-head rows are contiguous.

Mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE): the router (HF `mlp.gate`) is replicated;
routed expert e (HF `mlp.experts.{e}.gate_proj/up_proj/down_proj`) lives on the expert-parallel
rank that holds it as local expert e - ep_rank x E / EP, `GATE_UP`/`ROW` over the
expert-TP ranks (`expert=True` rules: names with `{expert}`, split by `Placement.experts()`);
the shared expert and its sigmoid gate (Qwen2-MoE) split over TP as a dense MLP does. The
rules name local expert i as Megatron's `SequentialMLP` does (`mlp.experts.local_experts.{i}.
linear_fc1.weight`); Transformer Engine's grouped GEMM (`TEGroupedMLP`) holds the same tensor,
same shape, as `mlp.experts.linear_fc1.weight{i}`, read through `sequential_expert_name`.

`load_shard` builds this rank's slice from the HF checkpoint reading only those rows or
columns; `shards_to_hf` turns the list of a parameter's TP shards (one shard when TP = 1)
back into full HF tensors. Both directions are used by the converter and by weight sync.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass

import torch

from rlhf.distributed.context import ParallelContext
from rlhf.models.families import ModelArch
from rlhf.models.fused_experts import read_expert
from rlhf.models.hf_io import HFCheckpointReader
from rlhf.models.moe_arch import MoEArch


class Layout(enum.Enum):
    REPLICATED = "replicated"
    ROW = "row"
    QKV = "qkv"
    GATE_UP = "gate_up"
    VOCAB = "vocab"
    COLUMN = "column"


@dataclass(frozen=True)
class ParamRule:
    """Megatron parameter name template <- HF tensor name templates, and the TP layout."""

    mcore: str
    hf: tuple[str, ...]
    layout: Layout
    expert: bool = False  # a routed expert's weight: names hold `{expert}`, split over expert-TP

    def for_expert(self, expert: int) -> ParamRule:
        """This rule with `{expert}` filled in (the global expert index)."""
        fill = str(expert)
        hf = tuple(n.replace("{expert}", fill) for n in self.hf)
        return dataclasses.replace(self, mcore=self.mcore.replace("{expert}", fill), hf=hf)


@dataclass(frozen=True)
class Placement:
    """This rank's place in the tensor- and pipeline-parallel grid, and which of its
    virtual-pipeline chunks a model part is (`vp_stage` of `vp_size`; one chunk without
    interleaving). Mixture-of-experts layers: this rank holds experts
    [ep_rank x E / ep_size, (ep_rank + 1) x E / ep_size) and the `etp_rank`-th of
    `etp_size` slices of each (expert tensor parallelism; None: as TP, Megatron's default).
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    vp_stage: int = 0
    vp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int | None = None
    etp_size: int | None = None

    def __post_init__(self):
        if self.etp_size is None:
            object.__setattr__(self, "etp_size", self.tp_size)
            object.__setattr__(self, "etp_rank", self.tp_rank)

    @classmethod
    def of(cls, ctx: ParallelContext) -> Placement:
        return cls(
            tp_rank=ctx.tp_rank,
            tp_size=ctx.tp_size,
            pp_rank=ctx.pp_rank,
            pp_size=ctx.pp_size,
            ep_rank=ctx.ep_rank,
            ep_size=ctx.ep_size,
            etp_rank=ctx.etp_rank,
            etp_size=ctx.etp_size,
        )

    def first_expert(self, num_experts: int) -> int:
        """The global index of this rank's local expert 0 (of `num_experts` in all)."""
        return self.ep_rank * (num_experts // self.ep_size)

    def experts(self) -> Placement:
        """The view an expert's weights are split by: expert-TP as the tensor-parallel grid."""
        assert self.etp_rank is not None and self.etp_size is not None
        return dataclasses.replace(self, tp_rank=self.etp_rank, tp_size=self.etp_size)

    def chunk(self, vp_stage: int, vp_size: int) -> Placement:
        """The placement of this rank's chunk `vp_stage` of `vp_size`."""
        return dataclasses.replace(self, vp_stage=vp_stage, vp_size=vp_size)

    @property
    def is_first_stage(self) -> bool:
        """This part holds the embedding: the first chunk of the first pipeline stage."""
        return self.pp_rank == 0 and self.vp_stage == 0

    @property
    def is_last_stage(self) -> bool:
        """This part holds the output layer: the last chunk of the last pipeline stage."""
        return self.pp_rank == self.pp_size - 1 and self.vp_stage == self.vp_size - 1

    def first_layer(self, num_layers: int) -> int:
        """The global index of this part's first layer. Megatron's interleaved order: chunk v
        of every stage in turn, so chunk v of stage p starts at (v x PP + p) x L / (PP x VP)."""
        per_part = num_layers // (self.pp_size * self.vp_size)
        return (self.vp_stage * self.pp_size + self.pp_rank) * per_part


# Transformer Engine fuses the pre-attention / pre-MLP norms into the following linear.
TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    # MLA: the q / kv latents' norms, fused into the up projections
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..+)$")
_GROUPED_EXPERT = re.compile(r"^(.*\bmlp\.experts\.)(linear_fc[12])\.weight(\d+)$")


def sequential_expert_name(name: str) -> str:
    """`name`, a local expert's weight in `TEGroupedMLP` (`...mlp.experts.linear_fc1.weight3`),
    as `SequentialMLP` names it (`...mlp.experts.local_experts.3.linear_fc1.weight`); any
    other name as it is. The one name of an expert weight whatever module holds it."""
    match = _GROUPED_EXPERT.match(name)
    if match is None:
        return name
    prefix, linear, expert = match.groups()
    return f"{prefix}local_experts.{expert}.{linear}.weight"


_ANY_LOCAL_EXPERT = re.compile(r"\bmlp\.experts\.local_experts\.(\d+)\.")


def global_expert_name(name: str, placement: Placement, num_experts: int) -> str:
    """`name` of a routed expert's tensor (`...mlp.experts.local_experts.{i}...`, local
    expert i of this EP rank) with the expert's index among all `num_experts`; any other
    name as it is. Two EP ranks' local expert i are different experts."""
    first = placement.first_expert(num_experts)
    return _ANY_LOCAL_EXPERT.sub(
        lambda m: f"mlp.experts.local_experts.{first + int(m.group(1))}.", name
    )


def layer_rules(arch: ModelArch) -> list[ParamRule]:
    """Per-layer rules; names contain `{layer}` (global layer index)."""
    m, h = "decoder.layers.{layer}.", "model.layers.{layer}."
    attn = h + "self_attn."
    rules = [
        ParamRule(m + "input_layernorm.weight", (h + "input_layernorm.weight",), Layout.REPLICATED),
        ParamRule(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), Layout.ROW),
        ParamRule(
            m + "pre_mlp_layernorm.weight",
            (h + "post_attention_layernorm.weight",),
            Layout.REPLICATED,
        ),
        ParamRule(
            m + "mlp.linear_fc1.weight",
            (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
            Layout.GATE_UP,
        ),
        ParamRule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), Layout.ROW),
    ]
    if arch.mla is not None:
        rules += mla_rules(arch, m + "self_attention.", attn)
    else:
        qkv = tuple(attn + f"{p}_proj.weight" for p in "qkv")
        rules.append(ParamRule(m + "self_attention.linear_qkv.weight", qkv, Layout.QKV))
    if arch.moe is not None:
        rules += moe_rules(arch, m, h)
    if arch.qkv_bias:
        qkv_bias = tuple(attn + f"{p}_proj.bias" for p in "qkv")
        rules.append(ParamRule(m + "self_attention.linear_qkv.bias", qkv_bias, Layout.QKV))
    if arch.qk_layernorm and arch.mla is None:  # MLA's latent norms are in `mla_rules`
        for x in "qk":
            rules.append(
                ParamRule(
                    m + f"self_attention.{x}_layernorm.weight",
                    (attn + f"{x}_norm.weight",),
                    Layout.REPLICATED,
                )
            )
    return rules


def mla_rules(arch: ModelArch, m: str, h: str) -> list[ParamRule]:
    """Multi-latent attention (`m`, `h`: the attention's name prefixes): the q projection
    (or its down / up pair around the q latent's norm), the kv down projection (the kv
    latent and the shared rotary key), the kv latent's norm and the kv up projection. The
    down projections are whole on every TP rank (`rlhf.models.gpt`), the others split by
    heads."""
    assert arch.mla is not None
    pairs = [
        ("linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight", Layout.REPLICATED),
        ("kv_layernorm.weight", "kv_a_layernorm.weight", Layout.REPLICATED),
        ("linear_kv_up_proj.weight", "kv_b_proj.weight", Layout.COLUMN),
    ]
    if arch.mla.q_lora_rank is None:
        pairs.append(("linear_q_proj.weight", "q_proj.weight", Layout.COLUMN))
    else:
        pairs += [
            ("linear_q_down_proj.weight", "q_a_proj.weight", Layout.REPLICATED),
            ("q_layernorm.weight", "q_a_layernorm.weight", Layout.REPLICATED),
            ("linear_q_up_proj.weight", "q_b_proj.weight", Layout.COLUMN),
        ]
    return [ParamRule(m + ours, (h + theirs,), layout) for ours, theirs, layout in pairs]


def moe_rules(arch: ModelArch, m: str, h: str) -> list[ParamRule]:
    """The rules of a mixture-of-experts layer's MLP (`m`, `h`: the layer's name prefixes).
    Qwen2-MoE names its gated shared expert `shared_expert`; DeepSeek-V3 and GLM-4.5 their
    ungated ones `shared_experts` and keep the router's expert bias (a Megatron buffer) as
    `mlp.gate.e_score_correction_bias`."""
    assert arch.moe is not None
    expert_m, expert_h = m + "mlp.experts.local_experts.{expert}.", h + "mlp.experts.{expert}."
    gate_up = (expert_h + "gate_proj.weight", expert_h + "up_proj.weight")
    rules = [
        ParamRule(m + "mlp.router.weight", (h + "mlp.gate.weight",), Layout.REPLICATED),
        ParamRule(expert_m + "linear_fc1.weight", gate_up, Layout.GATE_UP, expert=True),
        ParamRule(
            expert_m + "linear_fc2.weight",
            (expert_h + "down_proj.weight",),
            Layout.ROW,
            expert=True,
        ),
    ]
    if arch.moe.expert_bias:
        bias = (h + "mlp.gate.e_score_correction_bias",)
        rules.append(ParamRule(m + "mlp.router.expert_bias", bias, Layout.REPLICATED))
    if arch.moe.shared_expert_size is not None:
        shared_m, shared_h = m + "mlp.shared_experts.", h + _hf_shared_expert(arch.moe)
        shared_gate_up = (shared_h + "gate_proj.weight", shared_h + "up_proj.weight")
        rules += [
            ParamRule(shared_m + "linear_fc1.weight", shared_gate_up, Layout.GATE_UP),
            ParamRule(shared_m + "linear_fc2.weight", (shared_h + "down_proj.weight",), Layout.ROW),
        ]
        if arch.moe.shared_expert_gate:
            gate = (h + "mlp.shared_expert_gate.weight",)
            rules.append(ParamRule(shared_m + "gate_weight", gate, Layout.REPLICATED))
    return rules


def _hf_shared_expert(moe: MoEArch) -> str:
    """The HF name prefix of a layer's shared expert(s): Qwen2-MoE's gated one, or
    DeepSeek-V3's and GLM-4.5's ungated ones."""
    return "mlp.shared_expert." if moe.shared_expert_gate else "mlp.shared_experts."


def global_rules(arch: ModelArch) -> list[ParamRule]:
    """Embedding, final norm and output layer (tied models read the embedding for both)."""
    head = "model.embed_tokens.weight" if arch.tie_embeddings else "lm_head.weight"
    return [
        ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Layout.VOCAB),
        ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), Layout.REPLICATED),
        ParamRule("output_layer.weight", (head,), Layout.VOCAB),
    ]


VISION_PREFIX, HF_VISION_PREFIX = "vision_model.", "visual."


def resolve(arch: ModelArch, name: str, placement: Placement) -> tuple[ParamRule, int | None]:
    """The rule for a local Megatron parameter name (either expert module's) and its global
    layer index (if any). A vision tower's parameters (`rlhf.models.vision`) keep their
    HF names under another prefix, whole on every rank."""
    if arch.vision is not None and name.startswith(VISION_PREFIX):
        hf = HF_VISION_PREFIX + name.removeprefix(VISION_PREFIX)
        return ParamRule(name, (hf,), Layout.REPLICATED), None
    match = _LAYER.match(sequential_expert_name(name))
    if match is None:
        for rule in global_rules(arch):
            if rule.mcore == name:
                return rule, None
        raise KeyError(f"no HF mapping for Megatron parameter {name!r}")
    local, rest = int(match.group(1)), TE_ALIASES.get(match.group(2), match.group(2))
    layer = placement.first_layer(arch.num_layers) + local
    expert = _LOCAL_EXPERT.match(rest)
    if expert is not None and arch.moe is not None:  # local expert index -> global
        rest = expert.group(1) + "{expert}" + expert.group(3)
        first = placement.first_expert(arch.moe.num_experts)
    for rule in layer_rules(arch):
        if rule.mcore == f"decoder.layers.{{layer}}.{rest}":
            if rule.expert:
                assert expert is not None
                return rule.for_expert(first + int(expert.group(2))), layer
            return rule, layer
    raise KeyError(f"no HF mapping for Megatron parameter {name!r}")


def layer_index(name: str) -> int | None:
    """The layer index in a Megatron parameter name (None outside the layers)."""
    match = _LAYER.match(name)
    return None if match is None else int(match.group(1))


def shift_layer(name: str, shift: int) -> str:
    """`name` with its layer index moved by `shift` (a name outside the layers unchanged):
    chunk-local <-> global names."""
    match = _LAYER.match(name)
    if match is None:
        return name
    return f"decoder.layers.{int(match.group(1)) + shift}.{match.group(2)}"


def hf_names(rule: ParamRule, layer: int | None) -> list[str]:
    return [n.format(layer=layer) for n in rule.hf]


def is_vision_tensor(arch: ModelArch, hf_name: str) -> bool:
    """A vision tower's HF tensor: its shapes are its module's (built from its config)."""
    return arch.vision is not None and hf_name.startswith(HF_VISION_PREFIX)


def expected_hf_shape(arch: ModelArch, hf_name: str) -> tuple[int, ...]:
    """The shape an HF tensor must have according to the config (for clear errors); a
    KeyError for a tensor the config does not size (a vision tower's, `is_vision_tensor`)."""
    h, hd, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * hd, arch.num_query_groups * hd
    leaf = hf_name.split(".layers.")[-1].split(".", 1)[-1] if ".layers." in hf_name else hf_name
    leaf = re.sub(r"^mlp\.experts\.\d+\.", "mlp.experts.{e}.", leaf)
    shapes = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "model.embed_tokens.weight": (arch.vocab_size, h),
        "lm_head.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if arch.moe is not None:
        shapes |= _moe_shapes(arch)
    if arch.mla is not None:
        shapes |= _mla_shapes(arch)
    return shapes[leaf]


def _mla_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    assert arch.mla is not None
    mla, h, heads = arch.mla, arch.hidden_size, arch.num_attention_heads
    q_rows, kv_rank = heads * (mla.nope_dim + mla.rope_dim), mla.kv_lora_rank
    shapes = {
        "self_attn.kv_a_proj_with_mqa.weight": (kv_rank + mla.rope_dim, h),
        "self_attn.kv_a_layernorm.weight": (kv_rank,),
        "self_attn.kv_b_proj.weight": (heads * (mla.nope_dim + mla.v_dim), kv_rank),
        "self_attn.o_proj.weight": (h, heads * mla.v_dim),
    }
    if mla.q_lora_rank is None:
        return shapes | {"self_attn.q_proj.weight": (q_rows, h)}
    return shapes | {
        "self_attn.q_a_proj.weight": (mla.q_lora_rank, h),
        "self_attn.q_a_layernorm.weight": (mla.q_lora_rank,),
        "self_attn.q_b_proj.weight": (q_rows, mla.q_lora_rank),
    }


def _moe_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    assert arch.moe is not None
    h, f, s = arch.hidden_size, arch.moe.ffn_hidden_size, arch.moe.shared_expert_size
    experts = arch.moe.num_experts
    shapes: dict[str, tuple[int, ...]] = {
        "mlp.gate.weight": (experts, h),
        "mlp.gate.e_score_correction_bias": (experts,),
        "mlp.experts.{e}.gate_proj.weight": (f, h),
        "mlp.experts.{e}.up_proj.weight": (f, h),
        "mlp.experts.{e}.down_proj.weight": (h, f),
        "mlp.experts.gate_up_proj": (experts, 2 * f, h),  # fused (fused_experts.py)
        "mlp.experts.down_proj": (experts, h, f),
    }
    if s is not None:
        shared = _hf_shared_expert(arch.moe)
        shapes |= {
            shared + "gate_proj.weight": (s, h),
            shared + "up_proj.weight": (s, h),
            shared + "down_proj.weight": (h, s),
            "mlp.shared_expert_gate.weight": (1, h),
        }
    return shapes


def _rows(total: int, placement: Placement) -> tuple[int, int]:
    per_rank = total // placement.tp_size
    return placement.tp_rank * per_rank, (placement.tp_rank + 1) * per_rank


def load_shard(
    rule: ParamRule,
    layer: int | None,
    reader: HFCheckpointReader,
    arch: ModelArch,
    placement: Placement,
    padded_vocab: int,
) -> torch.Tensor:
    """This rank's slice of one Megatron parameter, read from the HF checkpoint."""
    names = hf_names(rule, layer)
    if rule.expert:
        placement = placement.experts()

    def read(name: str, **kw) -> torch.Tensor:
        if rule.expert:  # stored per expert or fused
            return read_expert(reader, name, expected_hf_shape(arch, name), **kw)
        expected = None if is_vision_tensor(arch, name) else expected_hf_shape(arch, name)
        return reader.read(name, expected_shape=expected, **kw)

    if rule.layout is Layout.REPLICATED:
        return read(names[0])
    if rule.layout is Layout.ROW:
        shape = expected_hf_shape(arch, names[0])
        return read(names[0], cols=_rows(shape[1], placement))
    if rule.layout is Layout.COLUMN:
        return read(names[0], rows=_rows(expected_hf_shape(arch, names[0])[0], placement))
    if rule.layout is Layout.GATE_UP:
        ffn = expected_hf_shape(arch, names[0])[0]  # the dense, a routed or the shared expert's
        return torch.cat([read(n, rows=_rows(ffn, placement)) for n in names])
    if rule.layout is Layout.QKV:
        return _load_qkv(names, read, arch, placement)
    return _load_vocab(names[0], read, arch, placement, padded_vocab)


def _load_qkv(names, read, arch: ModelArch, placement: Placement) -> torch.Tensor:
    groups = arch.num_query_groups // placement.tp_size
    g0 = placement.tp_rank * groups
    hd, qpg = arch.head_dim, arch.heads_per_group
    q = read(names[0], rows=(g0 * qpg * hd, (g0 + groups) * qpg * hd))
    k = read(names[1], rows=(g0 * hd, (g0 + groups) * hd))
    v = read(names[2], rows=(g0 * hd, (g0 + groups) * hd))
    tail = q.shape[1:]
    grouped = torch.cat(
        [
            q.reshape(groups, qpg * hd, *tail),
            k.reshape(groups, hd, *tail),
            v.reshape(groups, hd, *tail),
        ],
        dim=1,
    )
    return grouped.reshape(groups * (qpg + 2) * hd, *tail)


def _load_vocab(name, read, arch: ModelArch, placement: Placement, padded_vocab: int):
    r0, r1 = _rows(padded_vocab, placement)
    real_end = max(r0, min(r1, arch.vocab_size))
    real = read(name, rows=(r0, real_end))  # zero rows when this shard is all padding
    padding = real.new_zeros(r1 - real_end, arch.hidden_size)
    return torch.cat([real, padding])


def _joined(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The shards concatenated along `dim`; a single shard as it is."""
    return shards[0] if len(shards) == 1 else torch.cat(shards, dim=dim)


def shards_to_hf(
    rule: ParamRule, layer: int | None, shards: list[torch.Tensor], arch: ModelArch
) -> list[tuple[str, torch.Tensor]]:
    """Full HF tensors from the TP shards of one Megatron parameter (in TP-rank order)."""
    names = hf_names(rule, layer)
    if rule.layout is Layout.REPLICATED:
        return [(names[0], shards[0])]
    # ROW and VOCAB give one HF tensor per parameter, so at TP = 1 the parameter itself (or
    # a slice) is the result: no copy. The layouts that split a parameter in several HF
    # tensors copy, so that no two exported tensors share memory (safetensors refuses that).
    if rule.layout is Layout.ROW:
        return [(names[0], _joined(shards, dim=1))]
    if rule.layout is Layout.VOCAB:
        return [(names[0], _joined(shards, dim=0)[: arch.vocab_size])]
    if rule.layout is Layout.COLUMN:
        return [(names[0], _joined(shards, dim=0))]
    if rule.layout is Layout.GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        gate = torch.cat([g for g, _ in halves])
        up = torch.cat([u for _, u in halves])
        return [(names[0], gate), (names[1], up)]
    full = torch.cat(shards, dim=0)
    hd, qpg = arch.head_dim, arch.heads_per_group
    tail = full.shape[1:]
    grouped = full.reshape(arch.num_query_groups, (qpg + 2) * hd, *tail)
    q, k, v = grouped.split([qpg * hd, hd, hd], dim=1)
    return [
        (names[0], q.reshape(-1, *tail)),
        (names[1], k.reshape(-1, *tail)),
        (names[2], v.reshape(-1, *tail)),
    ]


def merge_tp_shards(layout: Layout, shards: list[torch.Tensor]) -> torch.Tensor:
    """One Megatron parameter as it is at TP = 1 (vocabulary padding rows kept) from its TP
    shards in rank order; the inverse of `split_tp_shard`."""
    if layout is Layout.REPLICATED:
        return shards[0]
    if layout is Layout.ROW:
        return _joined(shards, dim=1)
    if layout is Layout.GATE_UP:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([g for g, _ in halves] + [u for _, u in halves])
    return _joined(shards, dim=0)  # QKV: whole query groups per rank; VOCAB, COLUMN: rows


def split_tp_shard(
    layout: Layout, full: torch.Tensor, rank: int, size: int, shape: torch.Size
) -> torch.Tensor:
    """TP rank `rank`'s shard (of `shape`) at TP size `size` of a parameter as it is at
    TP = 1. VOCAB: the padded vocabulary may differ between TP sizes, so rows are dropped
    from or zero rows added to the end (all padding) to make `size` x shape[0]."""
    if layout is Layout.REPLICATED:
        return full
    if layout is Layout.ROW:
        return full.chunk(size, dim=1)[rank]
    if layout is Layout.GATE_UP:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
    if layout is Layout.VOCAB:
        rows = shape[0] * size
        full = full[:rows]
        if full.shape[0] < rows:
            full = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
    return full.chunk(size, dim=0)[rank]


def skip_on_export(arch: ModelArch, rule: ParamRule) -> bool:
    """Tied models have no separate `lm_head.weight` in HF checkpoints."""
    return arch.tie_embeddings and rule.mcore == "output_layer.weight"
