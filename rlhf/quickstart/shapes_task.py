"""The vision-language quickstart: count the squares in a picture, with a tiny Qwen2.5-VL.

Each prompt shows a 56 x 56 picture (2 x 2 image tokens for Qwen2.5-VL's 14-pixel patches,
merged 2 x 2) of 1 to 3 coloured squares on black, and asks how many there are; the answer
is scored by the gsm8k rule after `####`, like the arithmetic quickstart. The squares are
drawn apart, so the count shows in how much of the picture is lit: a tiny vision tower can
learn it, and it cannot be read from the text, which is the same for every row.

`save_tiny_vlm` writes the model directory transformers and SGLang load: the config, random
weights, the tokenizer with Qwen's vision tokens, a chat template that puts
`<|vision_start|><|image_pad|><|vision_end|>` where an image item is, and Qwen2-VL's image
processor sized for these pictures. `shapes_warm_start` then fine-tunes it into a weak
counter (right about `p_correct` of the time), as `rlhf.quickstart.warm_start` does for
arithmetic.
"""

from __future__ import annotations

import io
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf.data.images import decode, multimodal_messages
from rlhf.quickstart.tokenizer import build_tiny_tokenizer
from rlhf.quickstart.warm_start import WarmStartConfig, WarmStartResult, tail_mean, train

DATA_SOURCE = "shapes"
SIZE = 56  # pixels a side: 4 x 4 patches of 14, 2 x 2 image tokens
MAX_COUNT = 3
QUESTION = "<image>How many squares are in the picture? Give the number after ####."
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def draw_squares(count: int, rng: random.Random) -> bytes:
    """A PNG of `count` squares (side 10-14 pixels, random colours) on black, apart."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE))
    draw = ImageDraw.Draw(image)
    cells = rng.sample([(x, y) for x in range(3) for y in range(3)], count)
    for cx, cy in cells:  # one square per cell of a 3 x 3 grid of 18-pixel cells
        side = rng.randint(10, 14)
        x, y = cx * 18 + rng.randint(1, 17 - side), cy * 18 + rng.randint(1, 17 - side)
        colour = tuple(rng.randint(120, 255) for _ in range(3))
        draw.rectangle([x, y, x + side - 1, y + side - 1], fill=colour)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def make_shape_rows(num: int, seed: int) -> list[dict]:
    """`num` rows in verl's schema with an `images` column (HF datasets' {bytes, path})."""
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        count = rng.randint(1, MAX_COUNT)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": QUESTION}],
                "images": [{"bytes": draw_squares(count, rng), "path": None}],
                "ability": "vision",
                "reward_model": {"style": "rule", "ground_truth": str(count)},
                "extra_info": {"index": i},
            }
        )
    return rows


def build_vlm_tokenizer():
    """The quickstart tokenizer trained on this task's text, with Qwen's vision tokens."""
    corpus = ["system user assistant", QUESTION] + [f"#### {n}" for n in range(10)]
    tokenizer = build_tiny_tokenizer(vocab_size=300, corpus=corpus, added_tokens=VISION_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_vlm_config(vocab_size: int, token_ids: dict[str, int], pad: int, eos: int):
    """A Qwen2.5-VL config: a 2-layer, 64-wide language model, a 2-block vision tower."""
    from transformers import Qwen2_5_VLConfig

    text = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        pad_token_id=pad,
        eos_token_id=eos,
        bos_token_id=eos,
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[1],
    )
    top: dict[str, Any] = dict(  # the end token at the top too, for SGLang and generate()
        pad_token_id=pad, eos_token_id=eos, tie_word_embeddings=False, torch_dtype="float32"
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        **top,
    )


def save_tiny_vlm(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the tiny Qwen2.5-VL (random weights), its tokenizer and processor to `out_dir`."""
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    out = Path(out_dir)
    tokenizer = build_vlm_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    config = tiny_vlm_config(len(tokenizer), ids, tokenizer.pad_token_id, tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.save_pretrained(out, safe_serialization=True)
    pixels = {"min_pixels": SIZE * SIZE, "max_pixels": 4 * SIZE * SIZE}
    images = Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2, **pixels)
    videos = Qwen2VLVideoProcessor(patch_size=14, merge_size=2, temporal_patch_size=2)
    processor = Qwen2_5_VLProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        video_processor=videos,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    return out


@dataclass(frozen=True)
class ShapeExamples:
    """Warm-start rows, prompt + `#### k<|im_end|>` each, all of the same length T:
    input_ids_nt [N, T], pixel_values [N x patches, D], grid_thw [N, 3], mm_token_type_ids
    [N, T] (1 at image tokens: transformers then takes 3-D positions), response_at: the
    first response token's column, counts [N], digit_ids [MAX_COUNT] (the tokens of 1..3),
    p_correct: the final targets' weight on the true count."""

    input_ids_nt: torch.Tensor
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    mm_token_type_ids: torch.Tensor
    response_at: int
    counts: torch.Tensor
    digit_ids: torch.Tensor
    p_correct: float


def shape_examples(processor, num: int, seed: int, p_correct: float) -> ShapeExamples:
    """`num` pictures drawn with `seed`, each followed by its correct answer."""
    rows = make_shape_rows(num, seed)
    prompt = processor.apply_chat_template(
        multimodal_messages(rows[0]["prompt"]), add_generation_prompt=True, tokenize=False
    )
    counts = [int(row["reward_model"]["ground_truth"]) for row in rows]
    texts = [f"{prompt}#### {count}<|im_end|>" for count in counts]
    images = [decode(row["images"][0]["bytes"]) for row in rows]
    out = processor(text=texts, images=images, return_tensors="pt")
    alone = processor(text=[prompt], images=images[:1], return_tensors="pt")["input_ids"]
    ids = out["input_ids"]
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    digits = [processor.tokenizer.convert_tokens_to_ids(str(n)) for n in range(1, 4)]
    return ShapeExamples(
        input_ids_nt=ids,
        pixel_values=out["pixel_values"],
        grid_thw=out["image_grid_thw"],
        mm_token_type_ids=(ids == image_id).int(),
        response_at=alone.shape[1],
        counts=torch.tensor(counts),
        digit_ids=torch.tensor(digits),
        p_correct=p_correct,
    )


def shapes_loss(model, examples: ShapeExamples, idx: torch.Tensor, mix: float):
    """Cross-entropy of the response tokens, the answer digit's against (1 - mix) the true
    count + mix the targets that put `p_correct` on it and the rest evenly on the others."""
    patches = int(examples.grid_thw[0].prod())
    rows = torch.cat([torch.arange(i * patches, (i + 1) * patches) for i in idx.tolist()])
    ids = examples.input_ids_nt[idx]
    logits = model(
        input_ids=ids,
        pixel_values=examples.pixel_values[rows],
        image_grid_thw=examples.grid_thw[idx],
        mm_token_type_ids=examples.mm_token_type_ids[idx],
    ).logits.float()
    start = examples.response_at
    logp = torch.log_softmax(logits[:, start - 1 : -1], dim=-1)  # predicts each response token
    labels = ids[:, start:]
    token_logp = torch.gather(logp, 2, labels[..., None]).squeeze(-1)
    digit = labels.shape[1] - 2  # the response is "####", " ", digit, end
    format_loss = -torch.cat([token_logp[:, :digit], token_logp[:, digit + 1 :]], 1).mean()
    digit_logp = logp[:, digit][:, examples.digit_ids]  # [n, 3] over the answers
    truth = (examples.counts[idx] - 1)[:, None]
    p = examples.p_correct
    targets = torch.full_like(digit_logp, (1 - p) / (MAX_COUNT - 1)).scatter_(1, truth, p)
    clean = -digit_logp.gather(1, truth).mean()
    mixed = -(targets * digit_logp).sum(-1).mean()
    return format_loss + (1 - mix) * clean + mix * mixed, None


SHAPES_WARM_START = WarmStartConfig(
    num_problems=512, p_correct=0.4, num_steps=800, clean_fraction=0.6, batch_size=32, lr=3e-3
)


def shapes_warm_start(
    model_dir: str | Path, cfg: WarmStartConfig = SHAPES_WARM_START
) -> WarmStartResult:
    """Fine-tune the tiny VLM in `model_dir` into a weak counter and save it in place."""
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    model_dir = Path(model_dir)
    torch.manual_seed(cfg.seed)
    processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    examples = shape_examples(processor, cfg.num_problems, cfg.data_seed, cfg.p_correct)
    start = time.perf_counter()
    losses, _ = train(model, examples, cfg, shapes_loss)
    seconds = time.perf_counter() - start
    model.save_pretrained(model_dir, safe_serialization=True)
    p = cfg.p_correct  # a perfect fit: the digit's targets' entropy (the rest is certain)
    entropy = -p * math.log(p) - (1 - p) * math.log((1 - p) / (MAX_COUNT - 1))
    return WarmStartResult(len(losses), tail_mean(losses), entropy, seconds)
