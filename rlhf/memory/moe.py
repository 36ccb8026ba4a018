"""The mixture-of-experts part of the memory plan: expert parameters per EP rank, and what a
MoE layer keeps for its backward, read off Megatron-Core 0.16.1's MoE layer
(`megatron/core/transformer/moe/`: `TopKRouter`, `MoEAlltoAllTokenDispatcher`,
`SequentialMLP`, `SharedExpertMLP`) as `rlhf.models.moe_arch` configures it. With Transformer
Engine the experts are `TEGroupedMLP` (one grouped GEMM, `rlhf.models.gpt.moe_grouped_gemm`):
the same parameters, registered fc1 of every local expert then fc2 of every one (only their
order in DDP's buffer differs), and the same saved tensors: its grouped linears keep their
input as the per-expert linears do (the per-expert splits are views of one tensor) and its
SwiGLU and probability weighting are the same PyTorch code as `SequentialMLP`'s experts run.

Parameters of one MoE layer, in registration order, for E experts of width f (moe_ffn), a
shared expert of width s, hidden size h, on one rank of TP, EP and expert-TP (ETP):

    router          E x h, on every rank (a dense parameter: DDP's main buffer, reduced
                    over DP)
    local experts   E / EP of them, each fc1 2 f / ETP x h and fc2 h x f / ETP: expert
                    parameters (`allreduce=False`), in DDP's expert buffer, reduced and
                    sharded by the distributed optimizer over the expert-data-parallel
                    group (world / (ETP x EP x PP) ranks)
    shared expert   its gate 1 x h (Qwen2-MoE's, on every rank), fc1 2 s / TP x h and fc2
                    h x s / TP, dense parameters (split over TP like a dense MLP)

Activations of one MoE layer, per rank, for the T' tokens that reach the router (the rank's
T tokens, / TP under Megatron's sequence parallelism, which Megatron requires for MoE at
TP > 1), top-k routing, element size e. The all-to-all dispatcher sends each token's k
copies to the experts' EP ranks and gathers them over expert-TP; with balanced routing a
rank's experts receive R = T'.k.ETP rows (a skewed router sends some ranks more; token
dropping at a capacity factor below 1 sends fewer). Saved for the backward:

    router          T'.E.(2e + 1): the gating logits (the top-k and z-loss keep them), the
                    [T', E] routing probabilities and the bool routing map (which the
                    dispatcher also keeps as attributes until the layer's next forward);
                    + T'.E.4 for the fp32 softmax over all experts that the load-balancing
                    loss and pre-softmax routing (`norm_topk_prob` false) keep
    experts         R.h.e, the sorted tokens the experts' fc1 keeps, and R.f'.e (f' = f /
                    ETP) x (the dense MLP's count + 1): fc1's output and the SwiGLU's
                    tensors as in a dense layer, plus the routing-probability-weighted
                    copy fc2 takes (`per_token_scale`)
    shared expert   the dense MLP's count at width s / TP, and its gated output T'.h.e

The permutations, the all-to-alls and the expert-TP gather and reduce-scatter keep no
tensor data for the backward (index_select and scatter_add keep indices, the all-to-all its
splits), but each holds its input and its output at once: 2 x R.h.e in flight while a MoE
layer runs, forward or backward (`dispatcher_in_flight`), counted with the one layer being
run, as the attention's backward working set is.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.models.moe_arch import MoEArch


def moe_layer_params(
    moe: MoEArch, hidden: int, *, tp: int, ep: int, etp: int
) -> list[tuple[int, bool]]:
    """(numel, is an expert parameter) of one MoE layer's MLP on one rank, in
    registration order (router, local experts, shared expert)."""
    h, f = hidden, moe.ffn_hidden_size // etp
    params: list[tuple[int, bool]] = [(moe.num_experts * h, False)]  # router
    for _ in range(moe.num_experts // ep):
        params += [(2 * f * h, True), (h * f, True)]  # fc1 (gate and up), fc2
    if moe.shared_expert_size is not None:
        s = moe.shared_expert_size // tp
        if moe.shared_expert_gate:
            params.append((h, False))
        params += [(2 * s * h, False), (h * s, False)]  # fc1, fc2
    return params


def replicated_params(moe: MoEArch, hidden: int) -> int:
    """Parameters of the whole model that every SGLang TP rank holds in full: each MoE
    layer's router and shared-expert gate (SGLang's `ReplicatedLinear`)."""
    shared_gate = hidden if moe.shared_expert_gate else 0
    return sum(moe.layers) * (moe.num_experts * hidden + shared_gate)


@dataclass(frozen=True)
class MoEShape:
    """One rank's share of a micro-batch at its MoE layers (see the module docstring)."""

    tokens: int  # T': tokens at the router
    routed: int  # R: rows at this rank's experts (balanced routing)
    experts: int  # E
    ffn: int  # f': each expert's width on this rank (moe_ffn / ETP)
    shared_ffn: int  # the shared expert's width on this rank (/ TP); 0 without one
    fp32_scores: bool  # the router keeps an fp32 softmax over all experts

    @classmethod
    def of(
        cls, moe: MoEArch, tokens: int, *, tp: int, etp: int, seq_split: int, aux_loss: bool
    ) -> MoEShape:
        """`tokens`: the rank's micro-batch tokens; `seq_split`: TP under sequence
        parallelism, else 1; `aux_loss`: the load-balancing loss is on."""
        routed_in = tokens // seq_split
        return cls(
            tokens=routed_in,
            routed=routed_in * moe.topk * etp,
            experts=moe.num_experts,
            ffn=moe.ffn_hidden_size // etp,
            shared_ffn=(moe.shared_expert_size or 0) // tp,
            fp32_scores=aux_loss or not moe.norm_topk_prob,
        )

    def router_bytes(self, element: int) -> int:
        scores = 4 if self.fp32_scores else 0
        return self.tokens * self.experts * (2 * element + 1 + scores)

    def expert_bytes(self, hidden: int, element: int, mlp_factor: int) -> int:
        inputs = self.routed * hidden * element
        return inputs + (mlp_factor + 1) * self.routed * self.ffn * element

    def shared_expert_bytes(self, tokens: int, hidden: int, element: int, mlp_factor: int) -> int:
        """The shared expert's MLP over the `tokens` a dense MLP would see, and its gated
        output."""
        if not self.shared_ffn:
            return 0
        return mlp_factor * tokens * self.shared_ffn * element + self.tokens * hidden * element

    def saved_bytes(self, tokens: int, hidden: int, element: int, mlp_factor: int) -> int:
        """What one MoE layer's MLP part saves for the backward (replacing the dense MLP's
        `mlp_factor` x tokens x ffn)."""
        return (
            self.router_bytes(element)
            + self.expert_bytes(hidden, element, mlp_factor)
            + self.shared_expert_bytes(tokens, hidden, element, mlp_factor)
        )

    def dispatcher_in_flight(self, hidden: int, element: int) -> int:
        """A permutation's or all-to-all's input and output, alive at once."""
        return 2 * self.routed * hidden * element
