"""The locally built tokenizer and tiny HF models load through transformers' Auto classes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf.quickstart.arithmetic import make_problems
from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model
from rlhf.quickstart.tokenizer import build_tiny_tokenizer


def test_tokenizer_is_deterministic_and_lossless():
    a, b = build_tiny_tokenizer(), build_tiny_tokenizer()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    for text in ["Sam has 12 apples. #### 19", "Ünïcode, tabs\tand\nnew lines: -3.5 $1,000"]:
        assert a.decode(a(text)["input_ids"]) == text
    assert a.convert_ids_to_tokens(a("2026")["input_ids"]) == ["2", "0", "2", "6"]


def test_auto_tokenizer_of_tiny_qwen2_gives_identical_ids(tiny_qwen2_dir):
    ours, auto = build_tiny_tokenizer(), AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    messages = make_problems(3, seed=5)
    for row in messages:
        kwargs = {"add_generation_prompt": True, "tokenize": True, "return_dict": False}
        assert auto.apply_chat_template(row["prompt"], **kwargs) == ours.apply_chat_template(
            row["prompt"], **kwargs
        )
    text = auto.apply_chat_template(
        messages[0]["prompt"], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    assert auto.eos_token == "<|im_end|>" and auto.pad_token == "<|endoftext|>"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_models_load_and_run(tmp_path, family):
    out = save_tiny_model(tmp_path / family, TinyModelSpec(family=family, tie_word_embeddings=True))
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == family
    assert model.config.tie_word_embeddings is True
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, len(build_tiny_tokenizer()))


def test_problems_are_seeded_and_answers_correct():
    assert make_problems(5, seed=1) == make_problems(5, seed=1)
    assert make_problems(5, seed=1) != make_problems(5, seed=2)
    for row in make_problems(50, seed=3):
        words = row["prompt"][0]["content"].replace(".", " ").split()
        a, b = int(words[2]), int(words[6])
        expected = a + b if "gets" in words else a - b
        assert row["reward_model"]["ground_truth"] == str(expected)
