"""The router's view of a mixture-of-experts model's training passes, per optimizer step.

Megatron-Core's `TopKRouter` returns, for every token, the experts it goes to (after token
dropping, when `megatron.moe_expert_capacity_factor` is set). A forward hook on each router
accumulates, in training mode only (the update's forwards, not the log-prob passes) and over
the real tokens only (not padding): the top-k assignments each expert of each layer kept,
the router's probabilities summed per expert (softmax over the experts; a sigmoid router's
scores normalised to sum to 1, as Megatron's load-balancing loss takes them),
logsumexp(logits)^2 and the token count. `collect()` sums them over all ranks and reports
ratios, which do not depend on how often a token was seen (TP ranks without sequence
parallelism route the same tokens; full recompute routes them twice):

    moe/max_expert_share, moe/min_expert_share   the most / least loaded expert's share
        of a layer's kept assignments, the worst layer (balanced: 1 / experts)
    moe/mean_max_expert_share                    the max share averaged over MoE layers
    moe/layer_<L>/max_expert_share, .../min_expert_share   per layer (L from 0, global)
    moe/tokens_dropped_fraction                  assignments dropped by the capacity limit
    moe/aux_loss        Megatron's load-balancing loss without its coefficient, experts x
        sum_i f_i P_i (f_i: expert i's share of the top-k assignments, P_i: its mean
        probability), over the whole update batch (Megatron's own is per micro-batch),
        mean over MoE layers; logged whether or not `megatron.moe_aux_loss_coeff` is on
    moe/z_loss          mean of logsumexp(router logits)^2, mean over MoE layers

The router's logits are recomputed in fp32 from its input (tokens x hidden x experts
multiply-adds: small beside the experts). Memory: a few [layers, experts] tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class RouterStats:
    """Accumulates the routing of `chunks`' routers (`TopKRouter` modules) between
    `collect()` calls. `topk`: experts per token; `num_layers`: the whole model's layers."""

    def __init__(self, chunks, num_layers: int, num_experts: int, topk: int, device):
        from megatron.core.transformer.moe.router import TopKRouter

        self.topk = topk
        # per layer: kept assignments and summed probabilities per expert; tokens; sum lse^2
        self.sums = torch.zeros(num_layers, 2 * num_experts + 2, dtype=torch.float64, device=device)
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.register_forward_hook(self._count)

    def _count(self, router, inputs, outputs) -> None:
        if not router.training:
            return
        hidden, padding = inputs[0], inputs[1] if len(inputs) > 1 else None
        _, routing_map = outputs
        experts = routing_map.shape[-1]
        with torch.no_grad():
            routing_map = routing_map.reshape(-1, experts)
            hidden = hidden.reshape(-1, hidden.shape[-1])
            if padding is not None:
                real = ~padding.reshape(-1)
                routing_map, hidden = routing_map[real], hidden[real]
            logits = F.linear(hidden.float(), router.weight.float())
            row = self.sums[router.layer_number - 1]
            row[:experts] += routing_map.sum(0).to(row.dtype)
            probs = router_probabilities(logits, router.config.moe_router_score_function)
            row[experts : 2 * experts] += probs.sum(0).to(row.dtype)
            row[-2] += routing_map.shape[0]
            row[-1] += float(torch.logsumexp(logits, dim=-1).square().sum())

    def collect(self) -> dict[str, float]:
        """The metrics of the training passes since the last call, over all ranks (every
        rank calls, in the same order); then starts counting anew."""
        dist.all_reduce(self.sums)
        metrics = router_metrics(self.sums, self.topk)
        self.sums.zero_()
        return metrics


def router_probabilities(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """Per token, each expert's probability as the load-balancing loss weighs it: a softmax
    over the experts, or (a "sigmoid" router) the sigmoid scores divided by their sum."""
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return torch.softmax(logits, dim=-1)


def router_metrics(sums: torch.Tensor, topk: int) -> dict[str, float]:
    """`sums` [layers, 2 x experts + 2]: kept assignments per expert, summed probabilities
    per expert, routed tokens, summed logsumexp^2 (`RouterStats`)."""
    experts = (sums.shape[1] - 2) // 2
    moe_layers = (sums[:, -2] > 0).nonzero().flatten().tolist()
    if not moe_layers:
        return {}
    metrics: dict[str, float] = {}
    max_shares, min_shares, aux, z = [], [], [], []
    for layer in moe_layers:
        kept, probs = sums[layer, :experts], sums[layer, experts : 2 * experts]
        tokens = sums[layer, -2]
        share = kept / kept.sum().clamp(min=1)
        max_shares.append(float(share.max()))
        min_shares.append(float(share.min()))
        metrics[f"moe/layer_{layer}/max_expert_share"] = max_shares[-1]
        metrics[f"moe/layer_{layer}/min_expert_share"] = min_shares[-1]
        aux.append(float(experts * (kept / (tokens * topk) * probs / tokens).sum()))
        z.append(float(sums[layer, -1] / tokens))
    requested = float(sums[moe_layers, -2].sum()) * topk
    kept_all = float(sums[moe_layers, :experts].sum())
    return metrics | {
        "moe/max_expert_share": max(max_shares),
        "moe/min_expert_share": min(min_shares),
        "moe/mean_max_expert_share": sum(max_shares) / len(max_shares),
        "moe/tokens_dropped_fraction": 1.0 - kept_all / requested,
        "moe/aux_loss": sum(aux) / len(aux),
        "moe/z_loss": sum(z) / len(z),
    }
