"""Activation memory of one packed micro-batch: what the forward keeps for the backward.

Counted per tensor from what Megatron-Core 0.16.1's layers save for their backward (listed
on CPU with autograd's saved-tensor hooks, see docs/memory.md), for T tokens on one rank with
TP size t and element size e (4: fp32, 2: bf16):

local spec (CPU; unfused attention), per transformer layer
    two RMSNorms          2 x T.h.(8 + e)   fp32 input and normalised copy, then the
                                            linear's input in the model dtype
    rotary embedding      4 x T.d.e         cos/sin of q and k
    core attention        3 x T.q.e         q, k^T, v (k and v expanded to all query heads)
      packed rows         T.q.e + 4.a'.T    per-sample attention (`rlhf.models.packed_
                                            attention`): its output and log-sum-exp
      under Ulysses       a'.T^2.(4 + [e=2].2)  the masked row: softmax output in fp32
                                            (+ its bf16 copy)
    output projection     T.q.e             its input
    SwiGLU MLP            3 x T.f'.e        fc1 output (both halves) and fc2 input
                                            (`rlhf.models.swiglu`); a MoE layer's
                                            experts, Megatron's own SwiGLU: 5 x T.f'.e
                                            (also the SiLU output and the offset sum)
Transformer Engine (GPU; fused attention), estimated from the tensors TE's layers keep (not
measured here): each norm fused into its linear keeps its input and output in the model
dtype (2 x T.h.e), the attention keeps q, k, v unexpanded (T.(q + 2.kv).e) and its output,
with no T^2 term, and the dense MLP keeps fc1's output and fc2's input as on the local spec
(3 x T.f'.e; the experts' grouped MLP the same).
Here q = heads x head_dim / t, kv = key-value groups x head_dim / t, f' = ffn / t,
a' = heads / t (Ulysses: heads / (t x sp) over the sp x T tokens of the whole row). Under
Megatron's sequence parallelism the norms (and the linears' inputs they feed) hold T / t
tokens; the linears gather the rest for their own use.

Recompute (`rlhf.models.families.Recompute`): full keeps only each recomputed unit's input
(T.h.e; T / TP tokens under sequence parallelism) and recomputes one unit at a time in the
backward; selective drops the core
attention's tensors (keeping its q, k, v inputs) and recomputes one layer's at a time.

The peak of a training micro-batch adds to the saved tensors of all the stage's layers the
larger of the last stage's log-prob head (logits T.V' and their gradient in the model
dtype, and two fp32 chunks of C tokens x V': `rlhf.models.logprobs` never copies the logits
whole) and the backward of one layer: its recomputed tensors and, on the local spec under
Ulysses, the a'.T^2 gradients of the softmax output, the scores and the scaled scores (12
bytes per score in fp32, 8 in bf16) alive at once while the layer's MLP and second norm
tensors are already freed.

Mixture-of-experts layers (`rlhf.memory.moe`) save their router's, experts' and shared
expert's tensors instead of the dense MLP's, and the one MoE layer being run (forward, or
backward) adds its dispatcher's buffers in flight. A stage's recompute counts its largest
layer for the one being recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.memory.moe import MoEShape
from rlhf.models.families import NO_RECOMPUTE, ModelArch, Recompute
from rlhf.models.logprobs import default_chunk_tokens


@dataclass(frozen=True)
class ActivationShape:
    """One rank's share of a micro-batch: tokens and the model's per-rank widths."""

    tokens: int  # T on this rank
    hidden: int
    query: int  # q: query width on this rank
    key_value: int  # kv: key (= value) width on this rank
    ffn: int  # f': ffn width on this rank
    heads: int  # a': query heads this rank attends with
    row: int  # tokens of the attention row (T x Ulysses size)
    head_dim: int
    vocab: int  # V': vocabulary slice on this rank
    layers: int  # on this pipeline stage
    element: int  # bytes of the model dtype
    seq_split: int = 1  # Megatron's sequence parallelism: TP (norms hold T / TP tokens)
    moe: MoEShape | None = None  # the MoE layers' share (mixture-of-experts models)
    moe_layers: int = 0  # of `layers`, how many have experts

    @property
    def masked_row(self) -> bool:
        """The local spec attends over the whole row with a T^2 mask only under Ulysses;
        otherwise per sample, without T^2 tensors."""
        return self.row != self.tokens

    @classmethod
    def of(
        cls,
        arch: ModelArch,
        tokens: int,
        padded_vocab: int,
        *,
        tp: int,
        pp: int,
        sp: int,
        element: int,
        sequence_parallel: bool = False,
        moe: MoEShape | None = None,
        moe_layers: int = 0,
    ) -> ActivationShape:
        return cls(
            tokens=tokens,
            hidden=arch.hidden_size,
            query=arch.num_attention_heads * arch.head_dim // tp,
            key_value=arch.num_query_groups * arch.head_dim // tp,
            ffn=arch.ffn_hidden_size // tp,
            heads=arch.num_attention_heads // (tp * sp),
            row=tokens * sp,
            head_dim=arch.head_dim,
            vocab=padded_vocab // tp,
            layers=arch.num_layers // pp,
            element=element,
            seq_split=tp if sequence_parallel else 1,
            moe=moe,
            moe_layers=moe_layers,
        )


def _norms(s: ActivationShape, flash: bool) -> int:
    """Both norms of a layer and the linears' inputs they feed (this rank's sequence slice
    under Megatron's sequence parallelism)."""
    per_element = 2 * s.element if flash else 8 + s.element
    return 2 * s.tokens // s.seq_split * s.hidden * per_element


def _scores(s: ActivationShape) -> int:
    """The softmax output(s) of the local spec's unfused attention."""
    return s.heads * s.row * s.row * (4 + (2 if s.element == 2 else 0))


def core_attention_bytes(s: ActivationShape, flash: bool) -> int:
    """What the core attention saves beyond its q, k, v inputs."""
    if flash:
        return s.tokens * s.query * s.element  # its output (and a small log-sum-exp)
    expanded = (
        3 * s.tokens * s.query * s.element - s.tokens * (s.query + 2 * s.key_value) * s.element
    )
    if not s.masked_row:  # per-sample attention: its output and log-sum-exp
        return expanded + s.tokens * s.query * s.element + 4 * s.heads * s.tokens
    return expanded + _scores(s)


def layer_bytes(s: ActivationShape, flash: bool, moe: bool = False) -> int:
    """Everything one layer (a MoE layer: `moe`) saves for its backward without recompute."""
    e, t = s.element, s.tokens
    inputs = t * (s.query + 2 * s.key_value) * e  # q, k, v as the core attention gets them
    rope = 4 * t * s.head_dim * e
    projection = t * s.query * e
    return (
        _norms(s, flash)
        + rope
        + inputs
        + core_attention_bytes(s, flash)
        + projection
        + (_moe_mlp(s, flash) if moe else _mlp(s))
    )


def _mlp_factor(flash: bool) -> int:
    """T x ffn tensors a MoE layer's expert MLP saves (TE's grouped MLP; on the local spec
    Megatron's SwiGLU also keeps the SiLU output and the offset sum)."""
    return 3 if flash else 5


def _mlp(s: ActivationShape) -> int:
    """A dense MLP's saved tensors: fc1's output and fc2's input (`rlhf.models.swiglu`)."""
    return 3 * s.tokens * s.ffn * s.element


def _moe_mlp(s: ActivationShape, flash: bool) -> int:
    assert s.moe is not None
    return s.moe.saved_bytes(s.tokens, s.hidden, s.element, _mlp_factor(flash))


def _dispatcher(s: ActivationShape) -> int:
    """The all-to-all dispatcher's buffers while a MoE layer runs (0 without MoE layers)."""
    if s.moe is None or not s.moe_layers:
        return 0
    return s.moe.dispatcher_in_flight(s.hidden, s.element)


def _stage_layers(s: ActivationShape, flash: bool) -> tuple[int, int, int]:
    """(what all the stage's layers save, the largest layer's, the smallest layer's)."""
    dense, moe = layer_bytes(s, flash), 0
    sizes = [dense] if s.layers > s.moe_layers else []
    if s.moe_layers:
        moe = layer_bytes(s, flash, moe=True)
        sizes.append(moe)
    total = (s.layers - s.moe_layers) * dense + s.moe_layers * moe
    return total, max(sizes), min(sizes)


def _attention_backward(s: ActivationShape, flash: bool) -> int:
    """Bytes a layer's backward adds at its peak, the attention's (local spec): a'.T^2
    gradients of the softmax output, the scores and the scaled scores, three fp32 ones in
    fp32 (measured ~8 bytes per score in bf16, where the softmax runs in fp32 and its bf16
    gradients are cast), while the MLP and the second norm's tensors are already freed."""
    if flash or not s.masked_row:
        return 0
    scores = (12 if s.element == 4 else 8) * s.heads * s.row * s.row
    return max(0, scores - _mlp(s) - _norms(s, flash) // 2)


def head_bytes(s: ActivationShape, *, training: bool) -> int:
    """The last stage's logits and the log-prob head's working tensors
    (`rlhf.models.logprobs`): two fp32 chunks of tokens, and in training the logits'
    gradient in the model dtype. A forward holds the logits once: Megatron returns them
    [1, T, V'] as `transpose(0, 1).contiguous()` of [T, 1, V'], already contiguous with
    one sample per row, so no copy is made (the memory simulation at the shipped shapes)."""
    logits = s.tokens * s.vocab * s.element
    working = 2 * min(s.tokens, default_chunk_tokens(s.vocab)) * s.vocab * 4
    if training:
        return 2 * logits + working
    return logits + working


def embedding_backward_bytes(s: ActivationShape, *, flash: bool) -> int:
    """The first stage's last backward: the word embedding's dense V' x h gradient in the
    model dtype, which torch's CPU kernel accumulates in an fp32 copy for bf16 (measured);
    on GPU (`flash`) the CUDA kernel accumulates per unique token instead. By then every
    layer's saved tensors are freed, so it competes with the whole rest of the peak."""
    accumulate = 4 if s.element == 2 and not flash else 0
    return s.vocab * s.hidden * (s.element + accumulate)


def _layer_input(s: ActivationShape) -> int:
    """A layer's input, what full recompute keeps of it: this rank's sequence slice under
    Megatron's sequence parallelism (the hidden states between layers are [T / TP, h])."""
    return s.tokens // s.seq_split * s.hidden * s.element


def training_peak(
    s: ActivationShape,
    recompute: Recompute = NO_RECOMPUTE,
    *,
    flash: bool,
    last_stage: bool = True,
    lm_head: bool = True,
    first_stage: bool = True,
    in_flight: int = 1,
    chunks: int = 1,
    gradient_from_next: bool = False,
) -> int:
    """Peak activation bytes of a training micro-batch's forward and backward
    (`lm_head` False: a value model, whose [T, 1] output head holds next to nothing), with
    the saved tensors of `in_flight` micro-batches alive at once (`pipeline_in_flight`),
    each through one of the stage's `chunks` virtual-pipeline chunks (1/`chunks` of its
    layers). `gradient_from_next`: the backward starts from the output's gradient received
    from the next pipeline stage ([T, h], alive through the backward)."""
    total, largest, smallest = _stage_layers(s, flash)
    final = _norms(s, flash) // 2 if last_stage else 0
    if recompute.granularity == "full":
        unit = recompute.num_layers or 1
        if (recompute.method or "uniform") == "uniform":
            kept = -(-s.layers // unit) * _layer_input(s)
            recomputing = unit * largest
        else:  # block: the first `unit` layers recompute, the rest keep everything
            recomputed = min(unit, s.layers)
            kept = recomputed * (_layer_input(s) - smallest) + total
            recomputing = largest
        saved = kept + final
        backward = recomputing + _attention_backward(s, flash)
    elif recompute.granularity == "selective":
        core = core_attention_bytes(s, flash)
        saved = total - s.layers * core + final
        backward = core + _attention_backward(s, flash)
    else:
        saved = total + final
        backward = _attention_backward(s, flash)
    backward += _dispatcher(s)
    head = head_bytes(s, training=True) if last_stage and lm_head else 0
    embedding = embedding_backward_bytes(s, flash=flash) if first_stage else 0
    held, waiting = in_flight * saved // chunks, (in_flight - 1) * saved // chunks
    received = s.tokens * s.hidden * s.element if gradient_from_next else 0
    return max(held + max(head, backward) + received, waiting + embedding)


def pipeline_in_flight(pp: int, stage: int, vp: int = 1) -> int:
    """Micro-batch forwards stage `stage` has run before its first backward, that one
    included (when a mini-batch has that many): Megatron's 1F1B warms up with PP - s - 1;
    interleaved, with (PP - s - 1) x 2 + (VP - 1) x PP chunk forwards (groups of PP)."""
    if vp == 1:
        return pp - stage
    return (pp - stage - 1) * 2 + (vp - 1) * pp + 1


def forward_peak(
    s: ActivationShape, *, flash: bool, last_stage: bool = True, lm_head: bool = True
) -> int:
    """Peak of a forward-only micro-batch (reference, old log-probs): nothing is kept, so the
    largest of one layer's working tensors and the head's."""
    head = head_bytes(s, training=False) if last_stage and lm_head else 0
    return max(_stage_layers(s, flash)[1] + _dispatcher(s), head)
