"""The tool-use quickstart's tokenizer: the quickstart's byte-level BPE, with merges for tools.

It learns its merges also from whole rendered conversations of the calculator task (the chat
template's tool list, a call, the tool message, the answer; rlhf/quickstart/calculator_task.py),
so that a call and the prompt's tool list take a few dozen tokens, not a few hundred bytes.
`<tool_call>` and `</tool_call>` are whole tokens that are not special (decoding keeps them),
as in Qwen2's vocabulary. The quickstart's own tokenizer is unchanged.
"""

from __future__ import annotations

from typing import cast

from transformers import PreTrainedTokenizerFast

from rlhf.quickstart.calculator_task import (
    CALCULATOR_SCHEMA,
    answer_text,
    draw_problems,
    tool_conversation,
)
from rlhf.quickstart.tokenizer import build_tiny_tokenizer, training_corpus
from rlhf.tools.parser import CLOSE, OPEN

TOOLS_VOCAB_SIZE = 512  # 384 leaves words of the tool list in pieces (190-token prompts)


def tools_corpus(num_conversations: int = 400, seed: int = 0) -> list[str]:
    """The quickstart tokenizer's corpus plus rendered tool conversations (the chat template
    with the calculator listed) and direct answers."""
    renderer = build_tiny_tokenizer()
    texts = training_corpus()
    for problem in draw_problems(num_conversations, seed):
        text = renderer.apply_chat_template(
            tool_conversation(problem), tools=[CALCULATOR_SCHEMA], tokenize=False
        )
        texts.append(cast(str, text))
        texts.append(answer_text(problem.answer))
    return texts


def build_tools_tokenizer(vocab_size: int = TOOLS_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """The tools model's tokenizer: the quickstart's, with merges for tool conversations."""
    return build_tiny_tokenizer(vocab_size, tools_corpus(), added_tokens=(OPEN, CLOSE))
