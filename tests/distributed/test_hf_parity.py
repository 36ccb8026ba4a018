"""HF checkpoints loaded into Megatron at TP1, TP2, PP2 and TP2 x PP2 give the logits of
HF transformers on the same tokens (fp32, within 1e-4), for every supported family (at TP2
with Megatron's sequence parallelism, on by default there: qk-norm families included)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model
from tests.helpers import run_torchrun

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so that scaling changes the model
}
MODELS = {
    "llama_rope_scaled": TinyModelSpec(family="llama", rope_scaling=LLAMA3_ROPE, seed=1),
    "qwen2_untied": TinyModelSpec(family="qwen2", seed=2),
    "qwen2_tied": TinyModelSpec(family="qwen2", tie_word_embeddings=True, seed=3),
    "qwen3": TinyModelSpec(family="qwen3", seed=4),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_models")
    dirs = {name: save_tiny_model(root / name, spec) for name, spec in MODELS.items()}
    vocab = json.loads((dirs["qwen3"] / "config.json").read_text())["vocab_size"]
    tokens = torch.randint(0, vocab, (2, 96), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, root / "tokens.pt")
    reference = {}
    for name, path in dirs.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            reference[name] = model(tokens).logits
    return dirs, root / "tokens.pt", reference


def test_rope_scaling_is_active(hf_models):
    dirs, _, _ = hf_models
    config = json.loads((dirs["llama_rope_scaled"] / "config.json").read_text())
    params = config.get("rope_parameters") or config.get("rope_scaling")
    assert params["rope_type"] == "llama3"


@pytest.mark.parametrize(
    ("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)], ids=["tp1", "tp2", "pp2", "tp2pp2"]
)
def test_megatron_logits_match_transformers(hf_models, tmp_path, tp, pp):
    dirs, tokens, reference = hf_models
    args = ["--tp", str(tp), "--pp", str(pp), "--tokens", str(tokens), "--out-dir", str(tmp_path)]
    for name, path in dirs.items():
        args += ["--model", f"{name}={path}"]
    run_torchrun("hf_model_parity.py", tp * pp, args)
    for name, want in reference.items():
        got = torch.load(tmp_path / f"{name}.pt")
        assert got.shape == want.shape, name
        diff = (got - want).abs().max().item()
        assert diff < 1e-4, f"{name} at TP{tp} PP{pp}: max |logit diff| = {diff}"
        # Each rank reads only its slices: about 1 / (TP x PP) of the checkpoint, plus the
        # replicated norms; a tied model with PP > 1 also reads the embedding (its output
        # layer) on the last stage.
        spec = MODELS[name]
        embed_bytes = got.shape[-1] * spec.hidden_size * 4
        for rank in range(tp * pp):
            read = json.loads((tmp_path / f"{name}.read.{rank}.json").read_text())
            share = read["bytes_read"] / read["total_bytes"]
            limit = 1.0 if tp * pp == 1 else 1 / (tp * pp) + 0.1
            if spec.tie_word_embeddings and pp > 1:
                limit += embed_bytes / read["total_bytes"] / tp
            assert share <= limit, f"{name} rank {rank} read {share:.0%} of the checkpoint"
