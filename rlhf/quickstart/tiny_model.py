"""Tiny randomly initialised HF causal LMs, written to disk for tests and the CPU quickstart.

No model hub is reachable from CI, so every model a test or the quickstart uses is built
here from a config with a fixed seed and saved as safetensors next to the tiny tokenizer.
The mixture-of-experts family (qwen3_moe, for `make quickstart-moe`) keeps the dense
model's attention and widths: only each layer's MLP becomes routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from rlhf.quickstart.tokenizer import build_tiny_tokenizer

DENSE_FAMILIES = ("llama", "qwen2", "qwen3")
MOE_FAMILIES = ("qwen3_moe",)
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES


@dataclass(frozen=True)
class TinyMoESpec:
    """The routed experts of a tiny MoE model. Every layer has experts (SGLang 0.5.23's
    qwen3_moe builds every layer sparse, whatever `mlp_only_layers` says), and top-k of
    them run per token, so the defaults compute what the dense model's 128-wide MLP does."""

    num_experts: int = 8  # divisible by expert parallel sizes 1, 2, 4 and 8
    num_experts_per_tok: int = 2  # top-k
    moe_intermediate_size: int = 64  # each expert's MLP width
    norm_topk_prob: bool = True  # the top-k routing weights are renormalised to sum to 1


@dataclass(frozen=True)
class TinyModelSpec:
    """Architecture of a tiny model; defaults give ~0.2M parameters."""

    family: str = "qwen2"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    rope_scaling: dict | None = None
    seed: int = 0
    moe: TinyMoESpec | None = None  # the experts; set exactly for the MoE families

    @classmethod
    def for_family(cls, family: str, seed: int = 0) -> TinyModelSpec:
        """The quickstart model of `family`: a MoE family gets the default `TinyMoESpec`."""
        return cls(family=family, seed=seed, moe=TinyMoESpec() if family in MOE_FAMILIES else None)

    @classmethod
    def scaled(cls, hidden: int, layers: int) -> TinyModelSpec:
        """A benchmark-sized model: ffn 4 x hidden, 64-wide heads, two heads per KV group."""
        return cls(
            hidden_size=hidden,
            intermediate_size=hidden * 4,
            num_hidden_layers=layers,
            num_attention_heads=max(4, hidden // 64),
            num_key_value_heads=max(2, hidden // 128),
        )


def tiny_hf_config(spec: TinyModelSpec, vocab_size: int, pad_token_id: int, eos_token_id: int):
    """The transformers config object for `spec` (fp32, rope theta 10000)."""
    if spec.family not in FAMILIES:
        raise ValueError(
            f"unknown tiny model family {spec.family!r}; supported: {', '.join(FAMILIES)}"
        )
    if (spec.family in MOE_FAMILIES) != (spec.moe is not None):
        raise ValueError(
            f"tiny model family {spec.family!r} "
            + ("needs a TinyMoESpec" if spec.moe is None else "is dense: it takes no TinyMoESpec")
        )
    return AutoConfig.for_model(
        spec.family,
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=spec.rope_scaling,
        pad_token_id=pad_token_id,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        torch_dtype="float32",
        **(moe_fields(spec.moe) if spec.moe is not None else {}),
    )


def moe_fields(moe: TinyMoESpec) -> dict:
    """The config.json fields of Qwen3-MoE's experts, every layer sparse."""
    return {
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "norm_topk_prob": moe.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def save_tiny_model(
    out_dir: str | Path,
    spec: TinyModelSpec = TinyModelSpec(),
    vocab_size: int | None = None,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> Path:
    """Write tokenizer + randomly initialised model (safetensors) for `spec` into `out_dir`.

    `vocab_size` larger than the tokenizer's gives a bigger embedding (for benchmarks);
    `tokenizer` replaces the quickstart's (`build_tiny_tokenizer()`).
    """
    out = Path(out_dir)
    tokenizer = tokenizer or build_tiny_tokenizer()
    tokenizer.save_pretrained(out)
    vocab = max(vocab_size or 0, len(tokenizer))
    config = tiny_hf_config(spec, vocab, tokenizer.pad_token_id, tokenizer.eos_token_id)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out
