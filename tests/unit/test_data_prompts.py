"""Prompts -> token ids: chat template or raw text, and each prompt-length policy."""

from __future__ import annotations

import copy
import logging

import pytest

from rlhf.config import load_config
from rlhf.data.parquet import PromptRow
from rlhf.data.prompts import (
    build_prompt_dataset,
    load_tokenizer,
    prompt_dataset_from_config,
)
from rlhf.quickstart.data import write_quickstart_data
from rlhf.quickstart.tokenizer import build_tiny_tokenizer


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
