"""Prompt rows -> token ids: chat template (or raw text) and the prompt-length policy.

Rollouts send token ids to SGLang, so the prompt is tokenized once here, with the policy
model's own tokenizer and chat template (generation prompt added), and its length is settled
before any batch is formed: overlong prompts are dropped and counted
(`data.filter_overlong_prompts`), or cut from the left or right, or rejected with the file
and row (`data.truncation`). When no prompt fits, the error names the files, the limit and
the shortest and longest prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from rlhf.config.choices import Truncation
from rlhf.data.images import ImageProcessor
from rlhf.data.parquet import GroundTruthCheck, PromptRow, read_prompt_rows
from rlhf.errors import UserError

log = logging.getLogger(__name__)


class PromptError(ValueError, UserError):
    """Prompts that cannot be used as the config asks: longer than `data.max_prompt_length`,
    rows no scorer here can score, or a chat template that cannot list the tools."""


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt row and its token ids (at most `data.max_prompt_length` of them); a row with
    images (a vision-language policy) has each image's tokens expanded in `input_ids`, one
    per merged patch, and `grids` holds each image's patch grid (frames, rows, columns)."""

    row: PromptRow
    input_ids: list[int]
    truncated: bool = False
    grids: tuple[tuple[int, int, int], ...] = ()


@dataclass
class PromptDataset:
    """Encoded prompts in file order, and how many were dropped or cut for length."""

    prompts: list[EncodedPrompt]
    num_filtered: int = 0
    num_truncated: int = 0

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> EncodedPrompt:
        return self.prompts[index]

    def scored_by_model(self) -> PromptDataset:
        """The same prompts, every row's reward_model.style 'model'."""
        prompts = [replace(p, row=p.row.scored_by_model()) for p in self.prompts]
        return PromptDataset(prompts, self.num_filtered, self.num_truncated)


def load_tokenizer(path: str | Path):
    """The HF tokenizer in a local model directory (no hub access), with a vocabulary.

    Without its tokenizer files transformers still builds a tokenizer, an empty one, from
    config.json alone; that is refused here naming the files, instead of showing up later
    as prompts of no tokens or a missing chat template.
    """
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {path} (a local model dir)")
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not set(tokenizer.get_vocab()) - set(tokenizer.all_special_tokens):
        files = sorted(set(getattr(tokenizer, "vocab_files_names", {}).values()))
        missing = [f for f in files if not Path(path, f).is_file()]
        raise FileNotFoundError(
            f"{path}: the tokenizer has no vocabulary (missing tokenizer files: "
            f"{', '.join(missing) or 'unknown'}); copy the model's tokenizer files there"
        )
    return tokenizer


def _messages(prompt: str | list[dict[str, str]]) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def prompt_text(
    prompt: str | list[dict[str, str]],
    tokenizer: Any,
    apply_chat_template: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The text the model sees: chat template + generation prompt, or the raw text.

    Raw mode uses a string prompt as is and joins the contents of a message list with
    newlines; the tokenizer then adds its usual special tokens (e.g. BOS). `tools` (OpenAI
    function schemas; multi-turn rollouts) go to the chat template, which lists them.
    """
    if not apply_chat_template:
        if tools:
            raise ValueError("tools are listed by the chat template: it must be applied")
        return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "data.apply_chat_template is true but the tokenizer has no chat template; "
            "set data.apply_chat_template=false to use the raw prompt text"
        )
    return tokenizer.apply_chat_template(
        _messages(prompt), tools=tools, add_generation_prompt=True, tokenize=False
    )


def check_template_lists_tools(tokenizer: Any, tools: list[dict[str, Any]]) -> None:
    """A chat template that renders the same with and without `tools` would hide them from
    the policy: refused."""
    probe = [{"role": "user", "content": "?"}]
    if prompt_text(probe, tokenizer, True, tools) == prompt_text(probe, tokenizer, True):
        raise PromptError(
            "actor_rollout_ref.rollout.multi_turn: the tokenizer's chat template ignores "
            "`tools` (it renders the same without them), so the policy would not see its "
            "tools; use a model whose template lists tools (Qwen2.5, Qwen3, ...)"
        )


def encode_prompts(
    prompts: Sequence[str | list[dict[str, str]]],
    tokenizer: Any,
    apply_chat_template: bool,
    tools: list[dict[str, Any]] | None = None,
) -> list[list[int]]:
    """Token ids of each prompt (templated text is tokenized without extra special tokens);
    `tools` as `prompt_text` takes them."""
    texts = [prompt_text(p, tokenizer, apply_chat_template, tools) for p in prompts]
    if not texts:
        return []
    encoded = tokenizer(texts, add_special_tokens=not apply_chat_template)
    return [list(ids) for ids in encoded["input_ids"]]


def fit_length(ids: list[int], max_length: int, truncation: Truncation) -> list[int] | None:
    """`ids` cut to `max_length` ('left' keeps the end, 'right' the start); None for 'error'."""
    if len(ids) <= max_length:
        return ids
    if truncation == "left":
        return ids[-max_length:]
    if truncation == "right":
        return ids[:max_length]
    if truncation == "error":
        return None
    raise ValueError(f"data.truncation must be left, right or error, got {truncation!r}")


def _all_overlong(rows: Sequence[PromptRow], lengths: list[int], max_prompt_length: int) -> str:
    """The message when no prompt fits: which files, the limit, the shortest and longest."""
    files = sorted({str(row.file) for row in rows})
    shown = ", ".join(files[:3]) + (f" (+{len(files) - 3} more)" if len(files) > 3 else "")
    return (
        f"no prompts left: all {len(rows)} prompts of {shown} are longer than "
        f"data.max_prompt_length={max_prompt_length} (shortest {min(lengths)} tokens, longest "
        f"{max(lengths)}); raise data.max_prompt_length to at least {min(lengths)}, or cut "
        "them with data.truncation=left|right and data.filter_overlong_prompts=false"
    )


IMAGES_UNCUT = " (a prompt with images is never cut: its image tokens would not match its images)"


def _encode_images(
    rows: Sequence[PromptRow],
    encoded: list[list[int]],
    processor: ImageProcessor | None,
    apply_chat_template: bool,
    tools: list[dict[str, Any]] | None,
) -> list[tuple[tuple[int, int, int], ...]]:
    """Each row's image grids (() for a text row); the rows with images re-encoded in
    `encoded` by the processor (their image tokens expanded)."""
    grids: list[tuple[tuple[int, int, int], ...]] = [() for _ in rows]
    with_images = [i for i, row in enumerate(rows) if row.images]
    if not with_images:
        return grids
    if processor is None:
        raise PromptError(
            f"{rows[with_images[0]].origin}: a row with images needs a vision-language policy"
        )
    if not apply_chat_template or tools:
        raise PromptError(
            "prompts with images are rendered by the processor's chat template, without "
            "tools: set data.apply_chat_template=true (multi-turn rollouts with images are not "
            "supported)"
        )
    for i in with_images:
        encoded[i], inputs = processor.encode(rows[i].prompt, rows[i].images)
        grids[i] = tuple(inputs.grids)
    return grids


def build_prompt_dataset(
    rows: Sequence[PromptRow],
    tokenizer: Any,
    *,
    max_prompt_length: int,
    apply_chat_template: bool = True,
    filter_overlong_prompts: bool = False,
    truncation: Truncation = "error",
    prompt_key: str = "prompt",
    tools: list[dict[str, Any]] | None = None,
    processor: ImageProcessor | None = None,
) -> PromptDataset:
    """Encode `rows` and apply the length policy (filtering first, then truncation); length
    problems are `PromptError`s: data.max_prompt_length does not suit the data. `tools`: the
    tool schemas every prompt lists (`rlhf.rollout.multi_turn_config.tool_schemas`);
    `processor`: a vision-language policy's, which encodes the rows with images."""
    if not rows:
        raise ValueError("no prompt rows to encode")
    if tools:
        check_template_lists_tools(tokenizer, tools)
    dataset = PromptDataset(prompts=[])
    encoded = encode_prompts([r.prompt for r in rows], tokenizer, apply_chat_template, tools)
    grids = _encode_images(rows, encoded, processor, apply_chat_template, tools)
    lengths = [len(ids) for ids in encoded]
    cut = truncation in ("left", "right") and not filter_overlong_prompts
    if not cut and min(lengths) > max_prompt_length:
        raise PromptError(_all_overlong(rows, lengths, max_prompt_length))
    for row, ids, grid in zip(rows, encoded, grids):
        if len(ids) > max_prompt_length and filter_overlong_prompts:
            dataset.num_filtered += 1
            continue
        fitted = fit_length(ids, max_prompt_length, "error" if grid else truncation)
        if fitted is None:
            raise PromptError(
                f"{row.file}: row {row.row}, column '{prompt_key}': prompt is {len(ids)} tokens, "
                f"longer than data.max_prompt_length={max_prompt_length}; set "
                "data.filter_overlong_prompts=true to drop such prompts or "
                f"data.truncation=left|right to cut them{IMAGES_UNCUT if grid else ''}"
            )
        dataset.num_truncated += fitted is not ids
        dataset.prompts.append(EncodedPrompt(row, fitted, fitted is not ids, grid))
    if dataset.num_filtered:
        log.info(
            "dropped %d of %d prompts longer than data.max_prompt_length=%d",
            dataset.num_filtered,
            len(rows),
            max_prompt_length,
        )
    return dataset


def prompt_dataset_from_config(
    data_cfg: Any,
    tokenizer: Any,
    split: Literal["train", "val"],
    *,
    check_ground_truth: GroundTruthCheck | None = None,
    tools: list[dict[str, Any]] | None = None,
    processor: ImageProcessor | None = None,
) -> PromptDataset:
    """The `PromptDataset` of `data.train_files` or `data.val_files`, per the `data.*` keys.

    `check_ground_truth` is `rlhf.reward.ground_truth_checker(cfg.reward)` (the reward layer
    sits above data, so the caller passes it): an unscorable rule row then fails here, at
    startup, as a `DataError` naming file, row and column, not mid-run at reward time.
    `tools` are the tool schemas the chat template lists in every prompt (multi-turn:
    `rlhf.rollout.multi_turn_config.tool_schemas`; None: none listed); `processor`: a
    vision-language policy's (`rlhf.data.images`), which takes rows with images.
    """
    key = f"data.{split}_files"
    rows = read_prompt_rows(
        getattr(data_cfg, f"{split}_files"),
        prompt_key=data_cfg.prompt_key,
        bad_rows=data_cfg.bad_rows,
        key=key,
        check_ground_truth=check_ground_truth,
        takes_images=processor is not None,
    )
    return build_prompt_dataset(
        rows,
        tokenizer,
        max_prompt_length=data_cfg.max_prompt_length,
        apply_chat_template=data_cfg.apply_chat_template,
        filter_overlong_prompts=data_cfg.filter_overlong_prompts,
        truncation=data_cfg.truncation,
        prompt_key=data_cfg.prompt_key,
        tools=tools,
        processor=processor,
    )
