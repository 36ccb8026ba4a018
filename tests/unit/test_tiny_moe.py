"""The tiny Qwen3-MoE of `make quickstart-moe`: transformers loads it as Qwen3MoeForCausalLM
with the chosen experts and top-k in every layer, the dense quickstart model's attention and
widths, and rlhf's model-directory checks read the same experts from it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

from rlhf.cli.make_tiny_model import main as make_tiny_model
from rlhf.models.model_dir import check_model_dir, read_model_arch
from rlhf.models.moe_arch import MoEArch
from rlhf.quickstart.tiny_model import TinyModelSpec, TinyMoESpec, save_tiny_model
from rlhf.quickstart.tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    """The quickstart MoE model as `rlhf-make-tiny-model --family qwen3_moe` writes it."""
    out = tmp_path_factory.mktemp("tiny_moe") / "model"
    assert make_tiny_model([str(out), "--family", "qwen3_moe"]) == 0
    return out


def test_it_loads_as_qwen3_moe_with_top2_of_8_experts_in_every_layer(tiny_moe_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    assert isinstance(model, Qwen3MoeForCausalLM)
    config = model.config
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (8, 2, True)
    assert config.moe_intermediate_size == 64
    for layer in model.model.layers:  # every MLP routed, none dense
        assert layer.mlp.experts.gate_up_proj.shape == (8, 2 * 64, 64)
        assert layer.mlp.gate.top_k == 2


def test_it_keeps_the_dense_quickstart_models_attention_and_widths(tiny_moe_dir):
    dense = TinyModelSpec()
    config = AutoModelForCausalLM.from_pretrained(tiny_moe_dir).config
    assert config.hidden_size == dense.hidden_size
    assert config.num_hidden_layers == dense.num_hidden_layers
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        dense.num_attention_heads,
        dense.num_key_value_heads,
        dense.hidden_size // dense.num_attention_heads,
    )
    moe = TinyMoESpec()  # top-k experts compute as wide an MLP as the dense model's
    assert moe.num_experts_per_tok * moe.moe_intermediate_size == dense.intermediate_size
    assert config.vocab_size == len(build_tiny_tokenizer())


def test_rlhf_reads_the_same_experts_from_it(tiny_moe_dir):
    expected = MoEArch(
        num_experts=8, topk=2, ffn_hidden_size=64, norm_topk_prob=True, layers=(True, True)
    )
    assert read_model_arch(tiny_moe_dir).moe == expected
    arch = check_model_dir(tiny_moe_dir, "actor_rollout_ref.model.path")  # shapes match
    assert arch.family == "qwen3_moe" and arch.moe == expected
    assert arch.hidden_size == 64 and arch.qk_layernorm


def test_an_existing_model_is_kept(tiny_moe_dir, capsys):
    assert make_tiny_model([str(tiny_moe_dir), "--family", "qwen3_moe"]) == 0
    assert "already present" in capsys.readouterr().out


@pytest.mark.parametrize(
    "spec",
    [TinyModelSpec(family="qwen3_moe"), TinyModelSpec(family="qwen2", moe=TinyMoESpec())],
    ids=["moe-without-experts", "dense-with-experts"],
)
def test_experts_are_given_exactly_for_the_moe_family(tmp_path, spec):
    with pytest.raises(ValueError, match="tiny model family"):
        save_tiny_model(tmp_path, spec)
