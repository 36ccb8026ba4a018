"""The mixture-of-experts part of a model: HF config.json -> `MoEArch` -> Megatron's MoE fields.

Qwen2-MoE and Qwen3-MoE describe their experts the same way (`num_experts`,
`num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`, `decoder_sparse_step`,
`mlp_only_layers`); Qwen2-MoE adds a shared expert with a sigmoid gate. `MoEArch` holds
that, `megatron_kwargs` is its part of `rlhf.models.families.transformer_config`;
`MoERouter` the training-only router settings (load-balancing and z-loss, token dropping).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoEArch:
    """The mixture-of-experts part of a model (Qwen2-MoE / Qwen3-MoE): `layers[i]` says
    whether layer i has experts; `norm_topk_prob`: the top-k softmax probabilities are
    renormalised to sum to 1; `shared_expert_size`: the intermediate size of the shared
    expert (with its sigmoid gate), None without one."""

    num_experts: int
    topk: int
    ffn_hidden_size: int
    norm_topk_prob: bool
    layers: tuple[bool, ...]
    shared_expert_size: int | None = None

    @classmethod
    def from_hf(cls, hf: dict, shared_expert: bool) -> MoEArch:
        """From a Qwen MoE config.json: layer i has experts unless it is in `mlp_only_layers`
        or (i + 1) is not a multiple of `decoder_sparse_step` (transformers' rule)."""
        step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
        layers = tuple(
            i not in dense and (i + 1) % step == 0 for i in range(hf["num_hidden_layers"])
        )
        return cls(
            # transformers 5 writes Qwen3-MoE's as `num_local_experts` (published: num_experts)
            num_experts=hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"],
            topk=hf["num_experts_per_tok"],
            ffn_hidden_size=hf["moe_intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            layers=layers,
            shared_expert_size=hf["shared_expert_intermediate_size"] if shared_expert else None,
        )

    def megatron_kwargs(
        self, ep: int, etp: int, router: MoERouter | None = None, grouped_gemm: bool = False
    ) -> dict:
        """TransformerConfig's MoE fields, chosen so that the forward is transformers' exactly:

        - routing: transformers takes softmax over all experts, then the top k; with
          `norm_topk_prob` it divides them by their sum. Megatron's `moe_router_pre_softmax`
          is the first (softmax, then top k, no renormalisation); without it Megatron takes
          the top k logits and a softmax over them, which is the renormalised form
          (exp(l_i) / sum over the top k of exp(l_j)). No scaling factor.
        - shared expert: Megatron's `moe_shared_expert_gate` multiplies the shared expert's
          output by sigmoid(x @ gate_weight.T), gate_weight [1, hidden]: transformers' gate.
        - `router` (None: `NO_ROUTER_LOSS`): the load-balancing and z-losses (gradients
          only; the forward is unchanged) and token dropping (changes the forward).
        - `grouped_gemm`: the experts run as one grouped GEMM (Transformer Engine's; decided
          by `rlhf.models.gpt.moe_grouped_gemm`), else one GEMM per expert. Same arithmetic.
        """
        return {
            "num_moe_experts": self.num_experts,
            "moe_ffn_hidden_size": self.ffn_hidden_size,
            "moe_router_topk": self.topk,
            "moe_router_score_function": "softmax",
            "moe_router_pre_softmax": not self.norm_topk_prob,
            "moe_router_topk_scaling_factor": None,
            "moe_token_dispatcher_type": "alltoall",
            "moe_grouped_gemm": grouped_gemm,
            "moe_shared_expert_intermediate_size": self.shared_expert_size,
            "moe_shared_expert_gate": self.shared_expert_size is not None,
            "moe_layer_freq": [int(x) for x in self.layers],
            "expert_model_parallel_size": ep,
            "expert_tensor_parallel_size": etp,
            **(router or NO_ROUTER_LOSS).megatron_kwargs(),
        }


@dataclass(frozen=True)
class MoERouter:
    """The router's training settings, Megatron's names (`megatron.moe_*` keys):
    `aux_loss_coeff` of the load-balancing loss (Megatron's "aux_loss" type, per
    micro-batch), `z_loss_coeff` (None: off), token dropping at `capacity_factor` (None:
    none) keeping tokens by `token_drop_policy`; `replay`: the routers can record and
    replay routes (`rlhf.engine.route_replay`)."""

    aux_loss_coeff: float = 0.0
    z_loss_coeff: float | None = None
    capacity_factor: float | None = None
    token_drop_policy: str = "probs"
    replay: bool = False  # Megatron's RouterReplay in every router (routing replay)

    @classmethod
    def of(cls, megatron: Any) -> MoERouter:
        """From a config's `megatron` section."""
        return cls(
            megatron.moe_aux_loss_coeff,
            megatron.moe_z_loss_coeff,
            megatron.moe_expert_capacity_factor,
            megatron.moe_token_drop_policy,
        )

    def megatron_kwargs(self) -> dict:
        return {
            "moe_router_load_balancing_type": "aux_loss" if self.aux_loss_coeff > 0 else "none",
            "moe_aux_loss_coeff": self.aux_loss_coeff,
            "moe_z_loss_coeff": self.z_loss_coeff,
            "moe_expert_capacity_factor": self.capacity_factor,
            "moe_token_drop_policy": self.token_drop_policy,
            "moe_enable_routing_replay": self.replay,
        }


NO_ROUTER_LOSS = MoERouter()


def expert_split_problem(
    moe: MoEArch | None, family: str, tp: int, ep: int, etp: int
) -> str | None:
    """What does not divide when the experts are split over `ep` ranks and each expert's
    MLP (and the shared expert's, over TP) over `etp` ranks; None when it all does."""
    if moe is None:
        if ep > 1 or etp != tp:
            return f"expert parallel size {ep} (expert-TP {etp}): {family} has no experts"
        return None
    if moe.num_experts % ep:
        return (
            f"num_experts ({moe.num_experts}) must be divisible by the expert parallel size ({ep})"
        )
    if moe.ffn_hidden_size % etp:
        return (
            f"moe_intermediate_size ({moe.ffn_hidden_size}) must be divisible by the expert "
            f"tensor parallel size ({etp})"
        )
    if moe.shared_expert_size is not None and moe.shared_expert_size % tp:
        return (
            f"shared_expert_intermediate_size ({moe.shared_expert_size}) must be divisible by "
            f"the tensor parallel size ({tp})"
        )
    return None


def sglang_serving_problem(moe: MoEArch | None, family: str) -> str | None:
    """Why SGLang 0.5.23 would serve this model wrongly, or None: its `qwen2_moe` and
    `qwen3_moe` build every layer as a mixture-of-experts layer, whatever `mlp_only_layers`
    or `decoder_sparse_step` say, and leave a dense layer's MLP weights unloaded."""
    if moe is None or all(moe.layers):
        return None
    dense = [i for i, has_experts in enumerate(moe.layers) if not has_experts]
    return (
        f"the {family} model has dense layers {dense} among its mixture-of-experts layers "
        "(mlp_only_layers / decoder_sparse_step in its config.json): SGLang 0.5.23 builds every "
        f"{family} layer with experts and cannot serve it"
    )
