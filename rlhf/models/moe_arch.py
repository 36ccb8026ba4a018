"""The mixture-of-experts part of a model: HF config.json -> `MoEArch` -> Megatron's MoE fields.

Two ways of routing exist among the families:

- Qwen2-MoE and Qwen3-MoE (`MoEArch.from_hf`): `num_experts`, `num_experts_per_tok`,
  `moe_intermediate_size`, `norm_topk_prob`, `decoder_sparse_step`, `mlp_only_layers`; a
  softmax router; Qwen2-MoE adds a shared expert with a sigmoid gate.
- DeepSeek-V3 and GLM-4.5 (`MoEArch.from_deepseek_hf`): the first `first_k_dense_replace`
  layers dense, a sigmoid router whose choice adds a per-expert bias
  (`e_score_correction_bias`, aux-loss-free balancing) and may be limited to the best
  `topk_group` of `n_group` expert groups, weights renormalised and scaled by
  `routed_scaling_factor`, `n_shared_experts` shared experts without a gate.

`MoEArch` holds that, `megatron_kwargs` is its part of
`rlhf.models.families.transformer_config`; `MoERouter` the training-only router settings
(load-balancing and z-loss, token dropping).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoEArch:
    """The mixture-of-experts part of a model: `layers[i]` says whether layer i has experts;
    `norm_topk_prob`: the top-k weights are renormalised to sum to 1;
    `shared_expert_size`: the intermediate size of the shared expert(s), None without;
    `shared_expert_gate`: the shared expert's output is scaled by a sigmoid gate (Qwen2-MoE).
    `score_function` "softmax" or "sigmoid"; `expert_bias`: a per-expert bias is added to
    the scores to choose the experts (not to weigh them); `scaling_factor` multiplies the
    weights (None: 1); `num_groups` / `group_topk`: the top k come from the best
    `group_topk` of `num_groups` groups of experts (None: no groups)."""

    num_experts: int
    topk: int
    ffn_hidden_size: int
    norm_topk_prob: bool
    layers: tuple[bool, ...]
    shared_expert_size: int | None = None
    shared_expert_gate: bool = False
    score_function: str = "softmax"
    expert_bias: bool = False
    scaling_factor: float | None = None
    num_groups: int | None = None
    group_topk: int | None = None

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
            shared_expert_gate=shared_expert,
        )

    @classmethod
    def from_deepseek_hf(cls, hf: dict) -> MoEArch:
        """From a DeepSeek-V3 or GLM-4.5 config.json (transformers' `DeepseekV3MoE` /
        `Glm4MoeMoE`): layer i has experts from `first_k_dense_replace` on. Settings whose
        forward Megatron's router does not compute are refused, naming the key."""
        topk, experts = hf["num_experts_per_tok"], hf["n_routed_experts"]
        groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
        for key, supported in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if hf.get(key, supported) != supported:
                raise ValueError(f"config.json {key}={hf[key]!r}: only {supported!r} is supported")
        if hf.get("moe_layer_freq", 1) != 1:
            freq = hf["moe_layer_freq"]
            raise ValueError(f"config.json moe_layer_freq={freq}: only 1 is supported")
        if topk > 1 and not hf.get("norm_topk_prob", True):
            raise ValueError(
                "config.json norm_topk_prob=false with sigmoid routing is not supported "
                "(Megatron's sigmoid router always renormalises the top-k weights)"
            )
        if groups > 1 and topk != 2 * group_topk:
            raise ValueError(
                f"config.json n_group={groups}: group-limited routing ranks a group by its "
                f"2 best experts, Megatron by its num_experts_per_tok / topk_group = "
                f"{topk} / {group_topk} best; supported only when these agree"
            )
        shared = hf.get("n_shared_experts") or 0
        scaling = float(hf.get("routed_scaling_factor") or 1.0)
        return cls(
            num_experts=experts,
            topk=topk,
            ffn_hidden_size=hf["moe_intermediate_size"],
            norm_topk_prob=True,
            layers=tuple(i >= hf["first_k_dense_replace"] for i in range(hf["num_hidden_layers"])),
            shared_expert_size=shared * hf["moe_intermediate_size"] if shared else None,
            score_function="sigmoid",
            expert_bias=True,
            scaling_factor=None if scaling == 1.0 else scaling,
            num_groups=groups if groups > 1 else None,
            group_topk=group_topk if groups > 1 else None,
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
        - sigmoid routing (DeepSeek-V3, GLM-4.5): sigmoid scores plus the expert bias choose
          the top k (within the best groups), the chosen scores without bias renormalised
          and scaled: transformers' `noaux_tc` router. The router runs in fp32 as
          transformers' does; the bias stays as loaded (`moe_router_bias_update_rate` 0:
          rollouts and training route alike; `override_transformer_config` may set a rate,
          and the weight sync sends the bias every step).
        - shared expert: Megatron's `moe_shared_expert_gate` multiplies the shared expert's
          output by sigmoid(x @ gate_weight.T), gate_weight [1, hidden]: transformers' gate.
        - `router` (None: `NO_ROUTER_LOSS`): the load-balancing and z-losses (gradients
          only; the forward is unchanged) and token dropping (changes the forward).
        - `grouped_gemm`: the experts run as one grouped GEMM (Transformer Engine's; decided
          by `rlhf.models.gpt.moe_grouped_gemm`), else one GEMM per expert. Same arithmetic.
        """
        sigmoid = self.score_function == "sigmoid"
        return {
            "num_moe_experts": self.num_experts,
            "moe_ffn_hidden_size": self.ffn_hidden_size,
            "moe_router_topk": self.topk,
            "moe_router_score_function": self.score_function,
            "moe_router_pre_softmax": not sigmoid and not self.norm_topk_prob,
            "moe_router_topk_scaling_factor": self.scaling_factor,
            "moe_router_enable_expert_bias": self.expert_bias,
            "moe_router_bias_update_rate": 0.0,
            "moe_router_num_groups": self.num_groups,
            "moe_router_group_topk": self.group_topk,
            "moe_router_dtype": "fp32" if sigmoid else None,
            "moe_token_dispatcher_type": "alltoall",
            "moe_grouped_gemm": grouped_gemm,
            "moe_shared_expert_intermediate_size": self.shared_expert_size,
            "moe_shared_expert_gate": self.shared_expert_gate,
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
    or `decoder_sparse_step` say, and leave a dense layer's MLP weights unloaded (its
    DeepSeek-style models build the first `first_k_dense_replace` layers dense)."""
    if moe is None or all(moe.layers) or family not in ("qwen2_moe", "qwen3_moe"):
        return None
    dense = [i for i, has_experts in enumerate(moe.layers) if not has_experts]
    return (
        f"the {family} model has dense layers {dense} among its mixture-of-experts layers "
        "(mlp_only_layers / decoder_sparse_step in its config.json): SGLang 0.5.23 builds every "
        f"{family} layer with experts and cannot serve it"
    )
