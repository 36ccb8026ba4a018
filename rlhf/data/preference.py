"""Preference pairs from Parquet: what a reward model learns from (issue 33).

Two layouts are read, the ones TRL's and OpenRLHF's preference sets use (column names can
be changed with `prompt_key`, `chosen_key`, `rejected_key`):

- **explicit prompt**: `prompt` (a string, or a list of {role, content} messages), `chosen`
  and `rejected` (each the response: a string, or the assistant message(s) that follow the
  prompt);
- **implicit prompt** (no prompt column; Anthropic HH, TRL's "implicit prompt" sets):
  `chosen` and `rejected` are whole conversations (message lists ending with the assistant
  reply), or whole texts; the shared beginning is the prompt.

An optional `margin` column (a number >= 0) is the pair's margin in the Bradley-Terry loss
(`rlhf.algo.preference`). A pair is two token sequences, prompt + chosen and prompt +
rejected, each scored at its last token. Every problem names file, row and column
(`rlhf.data.parquet.Problem`): a missing column, a null or empty value, a value of the
wrong type, a side (as messages) that does not end with a non-empty assistant reply, a
chosen response equal to the rejected one, a negative margin, images or videos (TRL's
vision preference sets have an `images` column; training is text-only).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf.data.files import DataFile
from rlhf.data.parquet import DataError, Problem, media_problems

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class PreferencePair:
    """One pair: the prompt (None: implicit, inside both), the two responses, the margin."""

    prompt: str | Messages | None
    chosen: str | Messages
    rejected: str | Messages
    margin: float = 0.0
    file: str = ""
    row: int = -1


def read_preference_pairs(
    paths: Sequence[str | os.PathLike | DataFile],
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
) -> list[PreferencePair]:
    """Every pair of `paths`, in order; raises `DataError` listing every problem."""
    pairs: list[PreferencePair] = []
    problems: list[Problem] = []
    for path in paths:
        data_file = path if isinstance(path, DataFile) else DataFile(str(path), str(path))
        file = data_file.name
        try:
            table = pq.read_table(data_file.path, filesystem=data_file.filesystem)
        except (OSError, pa.ArrowInvalid) as e:
            problems.append(Problem(file, None, None, f"not a readable Parquet file ({e})"))
            continue
        missing = [k for k in (chosen_key, rejected_key) if k not in table.column_names]
        if missing:
            problems.append(Problem(file, None, None, f"missing columns {missing}"))
            continue
        explicit = prompt_key in table.column_names
        for row, values in enumerate(table.to_pylist()):
            prompt = values[prompt_key] if explicit else None
            chosen, rejected = values[chosen_key], values[rejected_key]
            found = [
                (key, problem)
                for key, value in (
                    (prompt_key, prompt),
                    (chosen_key, chosen),
                    (rejected_key, rejected),
                )
                if (explicit or key != prompt_key)
                and (problem := text_problem(value) or side_problem(key, value, prompt_key))
            ]
            margin = values.get("margin")
            if margin is not None and not (math.isfinite(margin) and margin >= 0):
                found.append(("margin", f"is {margin}, not a number >= 0"))
            found += media_problems(values, "preference pairs are text-only")
            if not found and chosen == rejected:
                found.append((rejected_key, f"equals {chosen_key}: the pair prefers nothing"))
            problems += [Problem(file, row, column, message) for column, message in found]
            if not found:
                pairs.append(PreferencePair(prompt, chosen, rejected, margin or 0.0, file, row))
    if problems:
        raise DataError(problems, "preference data")
    return pairs


def text_problem(value: Any) -> str | None:
    """What is wrong with a prompt or response value (a non-empty string or message list)."""
    if value is None:
        return "is null"
    if isinstance(value, str):
        return None if value.strip() else "is empty"
    if not isinstance(value, list) or not value:
        return "is neither a string nor a non-empty list of {role, content} messages"
    for message in value:
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            return "has a message without a string 'content'"
        if message.get("role") not in ("system", "user", "assistant", "tool"):
            return f"has a message with role {message.get('role')!r}"
    return None


def side_problem(key: str, value: Any, prompt_key: str) -> str | None:
    """What is wrong with a well-formed chosen or rejected side: as messages, it must end
    with the assistant's reply, and that reply must not be empty (the reward model scores
    each side at the reply's last token)."""
    if key == prompt_key or isinstance(value, str):
        return None
    last = value[-1]
    if last["role"] != "assistant":
        return f"ends with a {last['role']!r} message, not the assistant's reply"
    if not last["content"].strip():
        return "ends with an empty assistant reply"
    return None


def pair_texts(pair: PreferencePair, tokenizer: Any, apply_chat_template: bool) -> tuple[str, str]:
    """The two texts the reward model scores: prompt + chosen and prompt + rejected, through
    the chat template (messages) or joined as they are (raw text), each ended by the
    tokenizer's end-of-sequence token."""
    return (
        conversation_text(pair.prompt, pair.chosen, tokenizer, apply_chat_template),
        conversation_text(pair.prompt, pair.rejected, tokenizer, apply_chat_template),
    )


def conversation_text(
    prompt: str | Messages | None, response: str | Messages, tokenizer: Any, templated: bool
) -> str:
    """One side of a pair as the text the reward model reads (a whole conversation given as
    one string, the implicit-prompt text layout, is read as it is).

    Through the chat template, a side ending in an assistant reply is written as a PPO
    sample is scored: the template of the messages before it with the generation prompt,
    then the reply's content and the end-of-sequence token, which is where the policy stops
    (templates that add a newline after their end token would otherwise move the scored last
    token off it)."""
    eos = tokenizer.eos_token or ""
    if not templated or (prompt is None and isinstance(response, str)):
        parts = [as_text(prompt), as_text(response)] if prompt is not None else [as_text(response)]
        return "".join(parts) + eos
    messages = as_messages(prompt, "user") + as_messages(response, "assistant")
    *context, last = messages
    if last["role"] != "assistant" or not context:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    opening = tokenizer.apply_chat_template(context, tokenize=False, add_generation_prompt=True)
    return opening + last["content"] + eos


def as_text(value: str | Messages) -> str:
    return value if isinstance(value, str) else "\n".join(m["content"] for m in value)


def as_messages(value: str | Messages | None, role: str) -> Messages:
    if value is None:
        return []
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value)


@dataclass(frozen=True)
class TokenizedPair:
    """A pair as token ids: `shared`, the tokens both sides start with (at least one short of
    either side), then each side's own tokens; the reward model scores each side at its last
    token."""

    shared: list[int]
    chosen: list[int]
    rejected: list[int]
    margin: float = 0.0

    @property
    def longest(self) -> int:
        return len(self.shared) + max(len(self.chosen), len(self.rejected))


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a side's text; the tokenizer's special tokens (a BOS) are added unless
    the text already starts with its BOS (a chat template writes it)."""
    bos = getattr(tokenizer, "bos_token", None)
    add = not (bos and text.startswith(bos))
    return list(tokenizer(text, add_special_tokens=add)["input_ids"])


def split_shared(chosen: list[int], rejected: list[int]) -> int:
    """How many leading tokens the two sides share, leaving each at least one of its own."""
    limit = min(len(chosen), len(rejected)) - 1
    n = 0
    while n < limit and chosen[n] == rejected[n]:
        n += 1
    return n


def tokenize_pairs(
    pairs: Sequence[PreferencePair],
    tokenizer: Any,
    apply_chat_template: bool,
    max_length: int,
    drop_overlong: bool = False,
    columns: tuple[str, str] = ("chosen", "rejected"),
) -> tuple[list[TokenizedPair], int]:
    """Every pair as token ids, and how many were dropped for a side longer than
    `max_length` (`drop_overlong`; otherwise a `DataError` names each such side by file, row
    and column, `columns` being the chosen and rejected column names)."""
    out: list[TokenizedPair] = []
    problems: list[Problem] = []
    for pair in pairs:
        texts = pair_texts(pair, tokenizer, apply_chat_template)
        chosen, rejected = (text_ids(tokenizer, text) for text in texts)
        long = [
            (c, len(ids)) for c, ids in zip(columns, (chosen, rejected)) if len(ids) > max_length
        ]
        if long and not drop_overlong:
            problems += [
                Problem(
                    pair.file, pair.row, column, f"{n} tokens, more than max_length {max_length}"
                )
                for column, n in long
            ]
        if long:
            continue
        if chosen == rejected:
            problems.append(
                Problem(pair.file, pair.row, columns[1], "tokenizes as the chosen side")
            )
            continue
        n = split_shared(chosen, rejected)
        out.append(TokenizedPair(chosen[:n], chosen[n:], rejected[n:], pair.margin))
    if problems:
        raise DataError(problems, "preference data")
    return out, len(pairs) - len(out)
