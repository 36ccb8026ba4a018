"""A vision-language policy's inputs against transformers: a row with images encoded by the
model's processor (image tokens expanded, one per merged patch), our multimodal positions
equal to `get_rope_index` of transformers' Qwen2.5-VL for the same tokens, and a packed
micro-batch whose every sample has its own positions and its images in row order."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from rlhf.data.images import ImageProcessor
from rlhf.data.parquet import PromptRow
from rlhf.data.prompts import PromptError, build_prompt_dataset
from rlhf.engine.micro_batch import build_micro_batch
from rlhf.models.model_dir import check_model_dir
from rlhf.models.vision_arch import mrope_positions
from rlhf.quickstart.shapes_task import save_tiny_vlm
from rlhf.rollout.batch import RolloutBatch


def png(width: int, height: int, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(model dir, processor, transformers' model)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    path = save_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")
    return path, ImageProcessor(path), Qwen2_5_VLForConditionalGeneration.from_pretrained(path)


def hf_positions(model, ids: list[int], grids: torch.Tensor) -> torch.Tensor:
    tokens = torch.tensor([ids])
    kinds = (tokens == model.config.image_token_id).int()
    positions, _ = model.model.get_rope_index(tokens, kinds, image_grid_thw=grids)
    return positions[:, 0]


ROWS = [  # (prompt, images): wide and tall pictures, two in one prompt, text only
    ("Look: <image> what is it?", (png(112, 56, 1),)),
    ("<image> and <image>, which is darker?", (png(56, 56, 2), png(56, 112, 3))),
    ("No picture here.", ()),
]


@pytest.mark.parametrize("prompt, images", ROWS)
def test_positions_equal_transformers_get_rope_index(vlm, prompt, images):
    path, processor, model = vlm
    arch = check_model_dir(path)
    if images:
        ids, inputs = processor.encode(prompt, images)
        grids = inputs.grid_thw
        assert (torch.tensor(ids) == arch.vision.image_token_id).sum() == grids.prod(-1).sum() // 4
    else:
        ids, grids = processor.processor.tokenizer(prompt)["input_ids"], torch.zeros(0, 3).long()
    sequence = [*ids, 5, 6, 7]  # a response after the prompt
    ours = mrope_positions(sequence, [tuple(g) for g in grids.tolist()], arch.vision)
    if images:
        want = hf_positions(model, sequence, grids)
        assert not torch.equal(want[1], want[2])  # a wide picture: rows and columns differ
    else:
        want = torch.arange(len(sequence)).expand(3, -1)
    assert torch.equal(ours, want)


def test_a_packed_micro_batch_gives_each_sample_its_positions_and_images(vlm):
    path, processor, model = vlm
    arch = check_model_dir(path)
    encoded = [processor.encode(prompt, images) for prompt, images in ROWS[:2]]
    batch = RolloutBatch(
        prompt_ids=[ids for ids, _ in encoded],
        response_ids=[[5, 6], [7]],
        scores_b=torch.zeros(2),
        data_sources=["shapes"] * 2,
        uids=["a", "b"],
        images=[inputs for _, inputs in encoded],
    )
    mb = build_micro_batch(batch, [1, 0], vision=arch.vision)  # the second sample first
    assert mb.position_ids.shape == (3, 1, mb.row_len)
    start = 0
    for i in (1, 0):
        sequence = batch.prompt_ids[i] + batch.response_ids[i]
        want = hf_positions(model, sequence, encoded[i][1].grid_thw)
        assert torch.equal(mb.position_ids[:, 0, start : start + len(sequence)], want)
        start += len(sequence)
    assert mb.images is not None
    assert torch.equal(
        mb.images.grid_thw, torch.cat([encoded[1][1].grid_thw, encoded[0][1].grid_thw])
    )
    assert torch.equal(
        mb.images.pixel_values[: len(encoded[1][1].pixel_values)], encoded[1][1].pixel_values
    )


def test_an_image_prompt_is_never_cut(vlm):
    _, processor, _ = vlm
    row = PromptRow(
        "shapes", "<image> count", {"style": "rule", "ground_truth": "1"}, images=(png(56, 56, 4),)
    )
    tokenizer = processor.processor.tokenizer
    with pytest.raises(PromptError, match="a prompt with images is never cut"):
        build_prompt_dataset(
            [row, row], tokenizer, max_prompt_length=5, truncation="left", processor=processor
        )
    (encoded,) = build_prompt_dataset(
        [row], tokenizer, max_prompt_length=64, processor=processor
    ).prompts
    assert encoded.grids == ((1, 4, 4),)


def test_an_image_token_the_policy_generates_is_text(vlm):
    """A response that holds the image token (a policy may sample it) has no picture behind
    it: it is positioned and embedded as a word, as SGLang treats it (transformers, given
    the token kinds that say so, agrees)."""
    from rlhf.models.vision_arch import image_token_mask

    path, processor, model = vlm
    arch = check_model_dir(path)
    ids, inputs = processor.encode(*ROWS[0])
    image = arch.vision.image_token_id
    sequence = [*ids, 5, image, image, 6]
    mask = image_token_mask(sequence, 1, image)
    assert sum(mask) == sum(t == image for t in ids) and not any(mask[len(ids) :])
    kinds = torch.tensor([mask]).int()
    want, _ = model.model.get_rope_index(
        torch.tensor([sequence]), kinds, image_grid_thw=inputs.grid_thw
    )
    assert torch.equal(mrope_positions(sequence, inputs.grids, arch.vision), want[:, 0])
