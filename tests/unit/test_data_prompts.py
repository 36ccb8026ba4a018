"""Prompts -> token ids: chat template or raw text, and each prompt-length policy."""

from __future__ import annotations

import copy
import json
import logging

import pytest

from rlhf.config import load_config
from rlhf.data.parquet import PromptRow
from rlhf.data.prompts import (
    PromptError,
    build_prompt_dataset,
    load_tokenizer,
    prompt_dataset_from_config,
    prompt_text,
)
from rlhf.quickstart.data import write_quickstart_data
from rlhf.quickstart.tokenizer import build_tiny_tokenizer
from rlhf.rollout.multi_turn_config import load_configured_tools, tool_schemas


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def prompt_row(prompt, index=0):
    return PromptRow(
        data_source="arithmetic",
        prompt=prompt,
        reward_model={"style": "rule", "ground_truth": "1"},
        file="p.parquet",
        row=index,
    )


def templated(content: str) -> str:
    """The tiny tokenizer's chat template written out by hand."""
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


def ids_of(tokenizer, text: str, special: bool = False) -> list[int]:
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def test_chat_template_with_generation_prompt(tokenizer):
    messages = [{"role": "user", "content": "Sam has 3 apples. How many now?"}]
    text_prompt = "Ana has 5 pears."
    data = build_prompt_dataset(
        [prompt_row(messages), prompt_row(text_prompt, 1)], tokenizer, max_prompt_length=512
    )
    assert data[0].input_ids == ids_of(tokenizer, templated(messages[0]["content"]))
    assert tokenizer.decode(data[1].input_ids) == templated(text_prompt)  # a string is a user turn
    assert (data.num_filtered, data.num_truncated) == (0, 0)


def test_raw_prompts_skip_the_template(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2 + 2?"},
    ]
    data = build_prompt_dataset(
        [prompt_row(messages), prompt_row("just text", 1)],
        tokenizer,
        max_prompt_length=512,
        apply_chat_template=False,
    )
    assert data[0].input_ids == ids_of(tokenizer, "Be brief.\n2 + 2?", special=True)
    assert data[1].input_ids == ids_of(tokenizer, "just text", special=True)


def test_missing_chat_template_is_a_clear_error(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(ValueError, match=r"set data\.apply_chat_template=false"):
        build_prompt_dataset([prompt_row("hi")], plain, max_prompt_length=64)


LONG = "Sam has 12 apples and gets 7 more, then loses 3. How many apples now?"


@pytest.mark.parametrize("truncation", ["left", "right"])
def test_truncation_keeps_the_end_or_the_start(tokenizer, truncation):
    full = ids_of(tokenizer, templated(LONG))
    limit = len(full) - 5
    data = build_prompt_dataset(
        [prompt_row(LONG), prompt_row("hi", 1)],
        tokenizer,
        max_prompt_length=limit,
        truncation=truncation,
    )
    expected = full[-limit:] if truncation == "left" else full[:limit]
    assert data[0].input_ids == expected and data[0].truncated
    assert data[1].input_ids == ids_of(tokenizer, templated("hi")) and not data[1].truncated
    assert data.num_truncated == 1


def test_truncation_error_names_row_and_keys(tokenizer):
    full = ids_of(tokenizer, templated(LONG))
    rows = [prompt_row("hi"), prompt_row(LONG, 7)]
    with pytest.raises(ValueError) as err:
        build_prompt_dataset(rows, tokenizer, max_prompt_length=len(full) - 1, truncation="error")
    message = str(err.value)
    assert f"p.parquet: row 7, column 'prompt': prompt is {len(full)} tokens" in message
    assert f"data.max_prompt_length={len(full) - 1}" in message
    assert (
        "data.filter_overlong_prompts=true" in message and "data.truncation=left|right" in message
    )


def test_filter_overlong_drops_and_counts(tokenizer, caplog):
    limit = len(ids_of(tokenizer, templated(LONG))) - 1
    rows = [prompt_row(LONG), prompt_row("hi", 1), prompt_row(LONG + " Twice.", 2)]
    with caplog.at_level(logging.INFO, logger="rlhf.data.prompts"):
        data = build_prompt_dataset(
            rows, tokenizer, max_prompt_length=limit, filter_overlong_prompts=True
        )
    assert [p.row.row for p in data.prompts] == [1]
    assert data.num_filtered == 2
    assert f"dropped 2 of 3 prompts longer than data.max_prompt_length={limit}" in caplog.text
    for filtered in (True, False):  # dropping or refusing them: nothing to train on either way
        with pytest.raises(
            ValueError,
            match=r"no prompts left: all 2 prompts of p\.parquet are longer than "
            r"data\.max_prompt_length=3 \(shortest \d+ tokens, longest \d+\)",
        ):
            build_prompt_dataset(
                [prompt_row(LONG), prompt_row(LONG + " Twice.", 1)],
                tokenizer,
                max_prompt_length=3,
                filter_overlong_prompts=filtered,
            )


def test_dataset_from_config_reads_files_and_tokenizer_dir(tmp_path):
    train, val = write_quickstart_data(tmp_path / "data", num_train=10, num_val=3, seed=1)
    build_tiny_tokenizer().save_pretrained(tmp_path / "tok")
    tokenizer = load_tokenizer(tmp_path / "tok")
    cfg = load_config(
        "configs/quickstart_cpu.yaml",
        [f"data.train_files={train}", f"data.val_files={val}", "data.max_prompt_length=512"],
    )
    train_set = prompt_dataset_from_config(cfg.data, tokenizer, "train")
    val_set = prompt_dataset_from_config(cfg.data, tokenizer, "val")
    assert (len(train_set), len(val_set)) == (10, 3)
    content = train_set[0].row.prompt[0]["content"]
    assert train_set[0].input_ids == ids_of(tokenizer, templated(content))
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        load_tokenizer(tmp_path / "nope")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate <arithmetic> & say the value",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
    {"type": "function", "function": {"name": "clock", "description": "Das Datum – heute"}},
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2 + 2?"},
    {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
    {"role": "tool", "content": "4"},
]


def test_without_tools_the_template_renders_chatml_as_it_always_has(tokenizer):
    by_hand = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CHAT)
    for tools in (None, []):
        text = tokenizer.apply_chat_template(
            CHAT, tools=tools, add_generation_prompt=True, tokenize=False
        )
        assert text == by_hand + "<|im_start|>assistant\n"
        assert prompt_text(CHAT, tokenizer, True, tools) == text


def test_the_prompt_lists_each_tool_as_transformers_renders_it(tokenizer):
    text = prompt_text(CHAT[:2], tokenizer, True, TOOLS)
    reference = tokenizer.apply_chat_template(
        CHAT[:2], tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert text == reference
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert text.endswith("<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    for tool in TOOLS:
        assert f'"name": "{tool["function"]["name"]}"' in text
        assert f"\n{json.dumps(tool, ensure_ascii=False)}\n" in text  # not HTML-escaped
    user_only = prompt_text("2 + 2?", tokenizer, True, TOOLS)
    assert user_only.startswith("<|im_start|>system\n# Tools\n") and user_only.count("system") == 1
    with pytest.raises(ValueError, match="tools are listed by the chat template"):
        prompt_text("2 + 2?", tokenizer, False, TOOLS)


def test_a_chat_template_that_ignores_tools_is_refused(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    build_prompt_dataset([prompt_row("hi")], plain, max_prompt_length=64)  # fine without tools
    with pytest.raises(PromptError, match=r"chat template ignores `tools`"):
        build_prompt_dataset([prompt_row("hi")], plain, max_prompt_length=64, tools=TOOLS)


def test_dataset_from_config_lists_the_configured_tools(tmp_path):
    train, _ = write_quickstart_data(tmp_path / "data", num_train=4, num_val=2, seed=1)
    build_tiny_tokenizer().save_pretrained(tmp_path / "tok")
    tokenizer = load_tokenizer(tmp_path / "tok")  # the template as saved and read back
    tool_config = tmp_path / "tools.yaml"
    calculator = {"class_name": "rlhf.tools.calculator.Calculator", "tool_schema": TOOLS[0]}
    tool_config.write_text(json.dumps({"tools": [calculator]}))  # JSON is YAML
    multi_turn = "actor_rollout_ref.rollout.multi_turn"
    cfg = load_config(
        "configs/quickstart_cpu.yaml",
        [
            f"data.train_files={train}",
            "data.max_prompt_length=1024",
            f"{multi_turn}.enable=true",
            f"{multi_turn}.tool_config_path={tool_config}",
        ],
    )
    schemas = tool_schemas(load_configured_tools(cfg.actor_rollout_ref.rollout.multi_turn))
    assert schemas == TOOLS[:1]
    with_tools = prompt_dataset_from_config(cfg.data, tokenizer, "train", tools=schemas)
    without = prompt_dataset_from_config(cfg.data, tokenizer, "train")
    for listed, plain in zip(with_tools, without, strict=True):
        messages = plain.row.prompt
        reference = tokenizer.apply_chat_template(
            messages, tools=TOOLS[:1], add_generation_prompt=True, tokenize=False
        )
        assert listed.input_ids == ids_of(tokenizer, reference)
        assert plain.input_ids == ids_of(tokenizer, templated(messages[0]["content"]))
