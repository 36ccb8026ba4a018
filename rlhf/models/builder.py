"""Build this rank's Megatron model for an HF checkpoint: policy (LM head) or value model.

The weights come from the HF safetensors (each rank reads only its own slices) or are left
to Megatron's initialisation when a Megatron checkpoint will be loaded into the model.
"""

from __future__ import annotations

from typing import Any  # Megatron's GPTModel: Megatron-Core ships no type information

import torch
from torch import nn
from tqdm import tqdm

from rlhf.models.chunks import ModelChunks
from rlhf.models.families import (
    NO_RECOMPUTE,
    ModelArch,
    Recompute,
    llama3_inv_freq,
    padded_vocab_size,
    transformer_config,
)
from rlhf.models.gpt import build_gpt_model
from rlhf.models.hf_io import HFCheckpointReader
from rlhf.models.mapping import Placement, load_shard, resolve
from rlhf.models.moe_arch import MoERouter

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128


def build_chunks(
    arch: ModelArch,
    placement: Placement,
    *,
    vp_size: int = 1,
    padded_vocab: int | None = None,
    params_dtype: torch.dtype = torch.float32,
    sp: int = 1,
    initialize: bool = True,
    recompute: Recompute = NO_RECOMPUTE,
    sequence_parallel: bool = False,
    overrides: dict | None = None,
    router: MoERouter | None = None,
) -> ModelChunks:
    """This pipeline rank's `GPTModel` chunks for `arch`: `vp_size` of them under Megatron's
    interleaved pipeline (`rlhf.models.chunks`), one otherwise; they share one config.

    `padded_vocab` defaults to the vocabulary padded to a multiple of 128 x TP; a model
    that will load a Megatron checkpoint passes the checkpoint's padded size instead.
    `initialize=False` leaves the weights uninitialised (they are loaded next).
    """
    vocab = padded_vocab or padded_vocab_size(
        arch.vocab_size, MAKE_VOCAB_SIZE_DIVISIBLE_BY, placement.tp_size
    )
    if vocab % placement.tp_size:
        raise ValueError(f"padded vocabulary {vocab} is not divisible by TP {placement.tp_size}")
    config = transformer_config(
        arch,
        tp=placement.tp_size,
        pp=placement.pp_size,
        vp=vp_size,
        sp=sp,
        ep=placement.ep_size,
        etp=placement.etp_size,
        params_dtype=params_dtype,
        perform_initialization=initialize,
        recompute=recompute,
        sequence_parallel=sequence_parallel,
        overrides=overrides,
        router=router,
    )
    placements = [placement.chunk(v, vp_size) for v in range(vp_size)]
    chunks = [_build_chunk(arch, config, p, vocab, initialize) for p in placements]
    return ModelChunks([c.to(params_dtype) for c in chunks], placements)


def build_model(arch: ModelArch, placement: Placement, **kwargs):
    """This pipeline stage's `GPTModel` (no interleaving); keywords as `build_chunks`."""
    (model,) = build_chunks(arch, placement, **kwargs)
    return model


def _build_chunk(arch: ModelArch, config, placement: Placement, vocab: int, initialize: bool):
    model = build_gpt_model(
        config,
        vocab,
        arch.max_position_embeddings,
        pre_process=placement.is_first_stage,
        post_process=placement.is_last_stage,
        rotary_base=arch.rope_theta,
        rotary_percent=arch.rotary_fraction,
        tie_embeddings=arch.tie_embeddings,
        qk_layernorm=arch.qk_layernorm,
        vp_stage=placement.vp_stage if placement.vp_size > 1 else None,
        moe_layers=_moe_layers(arch, placement),
        vision=arch.vision,
    )
    if not initialize:
        mark_tensor_parallel_weights(model)
    if arch.rope_scaling is not None:
        model.rotary_pos_emb.inv_freq = llama3_inv_freq(
            arch.rotary_dim, arch.rope_theta, arch.rope_scaling
        ).to(model.rotary_pos_emb.inv_freq.device)
    model.padded_vocab_size = vocab
    return model


def _moe_layers(arch: ModelArch, placement: Placement) -> list[bool] | None:
    """Whether each layer of this model part has experts (None for a dense model)."""
    if arch.moe is None:
        return None
    first = placement.first_layer(arch.num_layers)
    per_part = arch.num_layers // (placement.pp_size * placement.vp_size)
    return list(arch.moe.layers[first : first + per_part])


def mark_tensor_parallel_weights(model: Any) -> None:
    """Give TP-sharded weights the attributes Megatron's initialisation would have set.

    Megatron-Core 0.16.1 marks a Column/RowParallelLinear or VocabParallelEmbedding weight
    as `tensor_model_parallel` only inside its random initialisation. Without the mark, the
    gradient norm (and so clipping) counts the weight on TP rank 0 only, as if it were
    replicated: measured here, a TP2 critic built from HF weights reported 7.67 where TP1
    reported 9.43 for the same gradient.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not getattr(weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)


@torch.no_grad()
def load_hf_weights(
    model: Any,
    reader: HFCheckpointReader,
    arch: ModelArch,
    placement: Placement,
    *,
    progress: bool = False,
    skip: tuple[str, ...] = (),
) -> None:
    """Copy this rank's slices of the HF checkpoint into `model` (one chunk at `placement`,
    or `ModelChunks`; shapes are checked)."""
    chunks = ModelChunks.of(model, placement)
    params = [(pl, n, p) for pl, n, p in chunks.placed_weights() if n not in skip]
    for part, name, param in tqdm(
        params, desc="load HF weights", disable=not progress, unit="tensor"
    ):
        rule, layer = resolve(arch, name, part)
        shard = load_shard(rule, layer, reader, arch, part, chunks.padded_vocab_size)
        if shard.shape != param.shape:
            raise ValueError(
                f"Megatron parameter {name!r} has shape {list(param.shape)} on this rank, "
                f"but the HF tensors give {list(shard.shape)}"
            )
        param.copy_(shard.to(param.dtype))


class ValueHead(nn.Module):
    """Scalar head replacing the LM output layer: hidden [s, b, h] -> values [s, b, 1].

    Replicated on every TP rank (its input, the final-norm output, is identical there, so
    its gradients are too). Called like Megatron's output layer and returns (output, bias).
    Under Megatron's sequence parallelism each TP rank holds a slice of the sequence: the
    head gathers it first, and its backward hands each rank its slice's gradient back.
    """

    def __init__(
        self, hidden_size: int, dtype: torch.dtype = torch.float32, sequence_parallel: bool = False
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_sbh, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_sbh = gather_from_sequence_parallel_region(
                hidden_sbh, tensor_parallel_output_grad=False
            )
        return hidden_sbh @ self.weight.t(), None


def attach_value_head(model: Any, arch: ModelArch, seed: int = 0) -> Any:
    """Turn a policy model into a value model (on the last stage); head initialised N(0, 1/h)."""
    if getattr(model, "post_process", False):
        head = ValueHead(
            arch.hidden_size,
            dtype=next(model.parameters()).dtype,
            sequence_parallel=model.config.sequence_parallel,
        )
        gen = torch.Generator().manual_seed(seed)
        head.weight.data.normal_(0.0, arch.hidden_size**-0.5, generator=gen)
        model.output_layer = head
        model.share_embeddings_and_output_weights = False
    return model


@torch.no_grad()
def load_score_head(model: Any, reader: HFCheckpointReader) -> None:
    """Value head from an HF `*ForSequenceClassification` checkpoint's `score.weight`."""
    if not getattr(model, "post_process", False):
        return
    score = reader.read("score.weight")
    if score.shape[0] != 1:
        raise ValueError(
            f"score.weight has {score.shape[0]} labels; a value/reward model needs exactly 1"
        )
    model.output_layer.weight.copy_(score.to(model.output_layer.weight.dtype))


def value_model_from_hf(
    hf_dir,
    placement: Placement,
    *,
    vp_size: int = 1,
    seed: int = 0,
    params_dtype: torch.dtype = torch.float32,
    sp: int = 1,
    recompute: Recompute = NO_RECOMPUTE,
    sequence_parallel: bool = False,
    overrides: dict | None = None,
    router: MoERouter | None = None,
) -> tuple[ModelChunks, ModelArch]:
    """Critic / reward model chunks (`build_chunks`) from an HF directory.

    The trunk comes from the checkpoint; the scalar head (on the last chunk of the last
    stage) from its `score.weight` when it is a `*ForSequenceClassification` checkpoint,
    otherwise it is freshly initialised (critic started from the actor). Returns (chunks,
    arch).
    """
    from rlhf.models.families import load_arch

    arch = load_arch(hf_dir)
    reader = HFCheckpointReader(hf_dir)
    chunks = build_chunks(
        arch,
        placement,
        vp_size=vp_size,
        params_dtype=params_dtype,
        sp=sp,
        initialize=False,
        recompute=recompute,
        sequence_parallel=sequence_parallel,
        overrides=overrides,
        router=router,
    )
    for chunk in chunks:
        attach_value_head(chunk, arch, seed)
    load_hf_weights(chunks, reader, arch, placement, skip=("output_layer.weight",))
    if "score.weight" in reader:
        for chunk in chunks:
            load_score_head(chunk, reader)
    return chunks, arch
