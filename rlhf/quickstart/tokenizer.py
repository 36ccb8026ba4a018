"""A small byte-level BPE tokenizer trained locally (no hub access), with a chat template.

Tests and the CPU quickstart need a real HF tokenizer that transformers' `AutoTokenizer`
and SGLang load from a model directory. It uses Qwen2's pre-tokenizer (byte-level, one
token per digit), so a tiny `qwen2` model directory loads it as `Qwen2Tokenizer` with
identical ids, and any text round-trips exactly. Training is deterministic: the same
corpus always gives the same vocabulary.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rlhf.quickstart.arithmetic import make_problems

PAD, BOS, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS]
VOCAB_SIZE = 384

# Qwen2's split: contractions, letter runs, single digits, punctuation runs, whitespace.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML. With `tools` (multi-turn rollouts) a system turn lists their schemas, one JSON
# object a line, after the prompt's own system message if it has one; a tool result is a
# `tool` turn like any other. Without `tools` it renders as it always has.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\nCall a tool by writing "
    '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>. The tools:\n<tools>\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def training_corpus() -> list[str]:
    """Texts the merges are learnt from: quickstart problems, answers and chat roles."""
    texts = ["system user assistant"]
    for row in make_problems(400, seed=0):
        texts.append(row["prompt"][0]["content"])
        texts.append(f"The answer is {row['reward_model']['ground_truth']}. #### 0123456789")
    return texts


def build_tiny_tokenizer(
    vocab_size: int = VOCAB_SIZE,
    corpus: list[str] | None = None,
    added_tokens: tuple[str, ...] = (),
) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE tokenizer on `corpus` (default: `training_corpus()`) and wrap
    it as an HF fast tokenizer; `added_tokens` are whole tokens that are not special (kept
    when decoding), as Qwen2 has `<tool_call>`, with the ids after the trained vocabulary."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(training_corpus() if corpus is None else corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, clean_up_tokenization_spaces=False
    )
    tokenizer.add_tokens(list(added_tokens), special_tokens=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
