"""HF config -> ModelArch -> TransformerConfig; rope scaling; vocab padding; log-probs at TP1."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from rlhf.models.families import (
    arch_from_hf_config,
    llama3_inv_freq,
    padded_vocab_size,
    transformer_config,
)
from rlhf.models.logprobs import vocab_parallel_logprobs_entropy

ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def hf_dict(family: str, **kw) -> dict:
    base = dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return AutoConfig.for_model(family, **{**base, **kw}).to_dict()


def test_family_specific_fields():
    llama = arch_from_hf_config(hf_dict("llama", rope_scaling=ROPE))
    assert (llama.qkv_bias, llama.qk_layernorm, llama.head_dim) == (False, False, 16)
    assert llama.rope_scaling.original_max_position_embeddings == 64
    qwen2 = arch_from_hf_config(hf_dict("qwen2", tie_word_embeddings=True))
    assert (qwen2.qkv_bias, qwen2.tie_embeddings, qwen2.rope_scaling) == (True, True, None)
    qwen3 = arch_from_hf_config(hf_dict("qwen3", head_dim=32))
    assert (qwen3.qk_layernorm, qwen3.head_dim, qwen3.qkv_bias) == (True, 32, False)
    config = transformer_config(qwen3, tp=2)
    assert (config.kv_channels, config.num_query_groups, config.qk_layernorm) == (32, 2, True)
    assert config.add_qkv_bias is False and config.gated_linear_unit is True


def test_older_config_keys_are_read():
    old = hf_dict("llama")
    old.pop("rope_parameters", None)
    old.update(rope_theta=500000.0, rope_scaling=dict(ROPE, type="llama3"))
    arch = arch_from_hf_config(old)
    assert arch.rope_theta == 500000.0 and arch.rope_scaling.factor == 8.0


def test_unsupported_inputs_are_clear_errors():
    with pytest.raises(
        ValueError,
        match=r"'gpt2'.*supported: deepseek_v3, glm4_moe, llama, qwen2, qwen2_5_vl, qwen2_moe",
    ):
        arch_from_hf_config({"model_type": "gpt2"})
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.5: not supported for llama"):
        arch_from_hf_config(hf_dict("llama", partial_rotary_factor=0.5))
    with pytest.raises(ValueError, match="use_sliding_window"):
        arch_from_hf_config(hf_dict("qwen2", use_sliding_window=True))
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        arch_from_hf_config(hf_dict("llama", rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    arch = arch_from_hf_config(hf_dict("llama", num_key_value_heads=2))
    with pytest.raises(
        ValueError,
        match=r"num_key_value_heads \(2\) must be divisible by the tensor parallel size \(4\)",
    ):
        transformer_config(arch, tp=4)
    with pytest.raises(ValueError, match=r"num_hidden_layers \(2\) must be divisible"):
        transformer_config(arch, pp=4)


def test_llama3_inv_freq_matches_transformers():
    config = AutoConfig.for_model(
        "llama",
        **{k: v for k, v in hf_dict("llama", rope_scaling=ROPE).items() if k != "model_type"},
    )
    reference, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    arch = arch_from_hf_config(config.to_dict())
    ours = llama3_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
    torch.testing.assert_close(ours, reference.float())
    plain = 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16)
    assert not torch.allclose(ours, plain)  # the scaling changes frequencies in this config


@pytest.mark.parametrize(
    ("vocab", "tp", "padded"), [(100, 1, 128), (128, 1, 128), (129, 2, 256), (382, 2, 512)]
)
def test_vocab_padding(vocab, tp, padded):
    assert padded_vocab_size(vocab, 128, tp) == padded


def test_logprobs_single_rank_match_log_softmax_in_bf16_input():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 5, 40, generator=gen) * 2).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 33, (4, 5), generator=gen)
    logp, entropy = vocab_parallel_logprobs_entropy(logits, targets, vocab_start=0, vocab_size=33)
    ref_all = torch.log_softmax(logits.float()[..., :33], -1)
    torch.testing.assert_close(logp, ref_all.gather(-1, targets[..., None])[..., 0])
    torch.testing.assert_close(entropy, -(ref_all.exp() * ref_all).sum(-1))
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    assert torch.all(logits.grad[..., 33:] == 0)


def moe_dict(family: str, **kw) -> dict:
    moe = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, **kw)
    if family == "qwen2_moe":
        moe.setdefault("shared_expert_intermediate_size", 40)
    return hf_dict(family, num_hidden_layers=4, **moe)


def test_moe_families_map_to_megatron_routing_that_equals_transformers():
    qwen3 = arch_from_hf_config(moe_dict("qwen3_moe", norm_topk_prob=True, mlp_only_layers=[2]))
    assert qwen3.qk_layernorm and qwen3.moe.layers == (True, True, False, True)
    config = transformer_config(qwen3, ep=2)
    assert (config.num_moe_experts, config.moe_ffn_hidden_size, config.moe_router_topk) == (
        6,
        24,
        2,
    )
    # renormalised top-k: top-k logits, then softmax over them
    assert config.moe_router_pre_softmax is False and config.moe_layer_freq == [1, 1, 0, 1]
    assert config.moe_expert_capacity_factor is None and config.expert_model_parallel_size == 2
    assert config.moe_shared_expert_intermediate_size is None

    qwen2 = arch_from_hf_config(moe_dict("qwen2_moe", decoder_sparse_step=2))
    assert qwen2.qkv_bias and qwen2.moe.layers == (False, True, False, True)
    config = transformer_config(qwen2, tp=2, etp=1)
    assert config.moe_router_pre_softmax is True  # softmax over all experts, then top-k
    assert config.moe_shared_expert_intermediate_size == 40 and config.moe_shared_expert_gate
    assert config.expert_tensor_parallel_size == 1


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (dict(ep=4), "num_experts (6) must be divisible by the expert parallel size (4)"),
        (dict(tp=2, etp=5), "moe_intermediate_size (24) must be divisible by the expert tensor"),
    ],
)
def test_expert_splits_that_do_not_divide_are_refused(sizes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        transformer_config(arch_from_hf_config(moe_dict("qwen3_moe")), **sizes)
    with pytest.raises(ValueError, match="qwen3 has no experts"):
        transformer_config(arch_from_hf_config(hf_dict("qwen3")), ep=2)
