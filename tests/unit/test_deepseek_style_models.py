"""DeepSeek-style models (GLM-4.5, DeepSeek-V3): the published shapes read as their 355B and
671B parameters with the routing and attention transformers runs, settings Megatron would
compute differently are refused naming the key, the router statistics weigh a sigmoid
router's scores as Megatron's load-balancing loss does, and SGLang's cache holds a
multi-latent model's latents."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

from rlhf.engine.router_stats import router_probabilities
from rlhf.memory.params import stage_params
from rlhf.memory.planner import kv_cache_bytes_per_token, rollout_weight_bytes
from rlhf.models.families import arch_from_hf_config
from rlhf.models.moe_arch import MoEArch

SHAPES = Path(__file__).parents[2] / "configs" / "model_shapes"
GLM45 = json.loads((SHAPES / "GLM-4.5.json").read_text())
DEEPSEEK_V3 = json.loads((SHAPES / "DeepSeek-V3.json").read_text())


def test_glm45_reads_as_355b_parameters_with_its_routing():
    arch = arch_from_hf_config(GLM45)
    moe = arch.moe
    assert moe is not None and arch.family == "glm4_moe"
    assert moe.layers == (False,) * 3 + (True,) * 89
    assert (moe.score_function, moe.expert_bias, moe.scaling_factor) == ("sigmoid", True, 2.5)
    assert (moe.num_groups, moe.group_topk) == (None, None)  # one group: no group choice
    assert (moe.shared_expert_size, moe.shared_expert_gate) == (1536, False)
    assert (arch.rotary_dim, arch.qkv_bias, arch.qk_layernorm) == (64, True, True)
    total = sum(p.numel for p in stage_params(arch, 151552, tp=1, pp=1, stage=0))
    # GLM-4.5: 355B with its multi-token-prediction layer (~3.8B), which is not trained here
    assert 351e9 < total < 353e9, total


@pytest.mark.parametrize(
    "change, message",
    [
        ({"norm_topk_prob": False}, "norm_topk_prob=false with sigmoid routing"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax': only 'sigmoid'"),
        ({"topk_method": "greedy"}, "topk_method='greedy': only 'noaux_tc'"),
        ({"n_group": 8, "topk_group": 3}, "n_group=8: group-limited routing ranks a group"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ],
)
def test_routing_megatron_would_compute_otherwise_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        MoEArch.from_deepseek_hf(GLM45 | change)


def test_group_limited_routing_maps_when_groups_rank_by_their_two_best():
    moe = MoEArch.from_deepseek_hf(GLM45 | {"n_group": 8, "topk_group": 4})
    kwargs = moe.megatron_kwargs(ep=8, etp=1)
    assert (kwargs["moe_router_num_groups"], kwargs["moe_router_group_topk"]) == (8, 4)
    assert kwargs["moe_router_enable_expert_bias"] and kwargs["moe_router_dtype"] == "fp32"
    assert kwargs["moe_router_bias_update_rate"] == 0.0 and not kwargs["moe_shared_expert_gate"]


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_router_statistics_weigh_scores_as_megatrons_aux_loss(score_function):
    logits = torch.randn(7, 6, generator=torch.Generator().manual_seed(0))
    _, megatron = compute_routing_scores_for_aux_loss(logits, 2, score_function)
    assert torch.allclose(router_probabilities(logits, score_function), megatron)


def test_deepseek_v3_reads_as_671b_parameters_with_latent_attention():
    arch = arch_from_hf_config(DEEPSEEK_V3)
    mla, moe = arch.mla, arch.moe
    assert mla is not None and moe is not None and mla.yarn is not None
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.nope_dim, mla.rope_dim) == (1536, 512, 128, 64)
    assert (mla.yarn.factor, mla.yarn.mscale_all_dim) == (40.0, 1.0)
    assert (moe.num_groups, moe.group_topk, moe.shared_expert_size) == (8, 4, 2048)
    assert moe.layers == (False,) * 3 + (True,) * 58
    total = sum(p.numel for p in stage_params(arch, 129280, tp=1, pp=1, stage=0))
    # DeepSeek-V3: 671B without its multi-token-prediction module (14B), which is not trained
    assert 670e9 < total < 672e9, total
    # SGLang caches the 512-wide kv latent and the 64-wide rotary key per layer, every rank
    assert kv_cache_bytes_per_token(arch, 8, "bfloat16") == 61 * 576 * 2
    # the latents' down projections are whole on each of SGLang's TP ranks
    split_all = rollout_weight_bytes(arch, 1, 2)
    assert rollout_weight_bytes(arch, 8, 2) > split_all / 8


def test_deepseek_v3_settings_megatron_would_compute_otherwise_are_refused():
    with pytest.raises(ValueError, match="rope_interleave=false"):
        arch_from_hf_config(DEEPSEEK_V3 | {"rope_interleave": False})
    with pytest.raises(ValueError, match="attention_bias=true"):
        arch_from_hf_config(DEEPSEEK_V3 | {"attention_bias": True})
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        arch_from_hf_config(DEEPSEEK_V3 | {"rope_scaling": {"type": "dynamic", "factor": 2}})
