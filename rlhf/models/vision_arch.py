"""The vision part of a vision-language model (Qwen2.5-VL) as config.json describes it.

`VisionArch` is what the rest of the system needs to know: the vision tower's own config
(transformers builds the tower from it, `rlhf.models.vision`), which token ids stand for an
image in the text, how many patches merge into one image token, and the multimodal rotary
sections (mRoPE: each head's rotary frequencies split into temporal, height and width
sections, each turned by its own position axis).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisionArch:
    """A vision tower and how its tokens enter the language model (`config_json`: the HF
    `vision_config`, as JSON so that the description stays hashable)."""

    family: str
    config_json: str
    image_token_id: int
    vision_start_token_id: int
    mrope_section: tuple[int, ...]
    vision_end_token_id: int = -1
    video_token_id: int = -1

    def picture_tokens(self, grid: tuple[int, int, int]) -> list[int]:
        """The tokens that stand for one picture of patch grid `grid` (t, h, w): the vision
        start, one image token per merged patch, the vision end."""
        t, h, w = grid
        count = t * h * w // self.spatial_merge_size**2
        return [
            self.vision_start_token_id,
            *[self.image_token_id] * count,
            self.vision_end_token_id,
        ]

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every token of the vision part (none of them may appear in a probe's text)."""
        ids = (self.vision_start_token_id, self.image_token_id, self.vision_end_token_id)
        return (*ids, self.video_token_id)

    @property
    def config(self) -> dict:
        return json.loads(self.config_json)

    @property
    def spatial_merge_size(self) -> int:
        return int(self.config.get("spatial_merge_size", 2))

    @classmethod
    def from_hf(cls, hf: dict, family: str, mrope_section: list[int]) -> VisionArch:
        """From a Qwen2.5-VL config.json (the image token ids at the top level)."""
        if "vision_config" not in hf:
            raise ValueError(f"config.json of {family} has no vision_config")
        return cls(
            family=family,
            config_json=json.dumps(hf["vision_config"], sort_keys=True),
            image_token_id=int(hf["image_token_id"]),
            vision_start_token_id=int(hf["vision_start_token_id"]),
            mrope_section=tuple(int(x) for x in mrope_section),
            vision_end_token_id=int(hf.get("vision_end_token_id", -1)),
            video_token_id=int(hf.get("video_token_id", -1)),
        )


def image_token_mask(token_ids: list[int], num_images: int, image_token_id: int) -> list[bool]:
    """Which tokens are an image's: those of the first `num_images` runs of image tokens
    (the prompt's pictures). An image token the policy generated later is text: no picture
    stands behind it (SGLang embeds and positions it as a word)."""
    mask, runs, previous = [], 0, False
    for token in token_ids:
        image = token == image_token_id and (previous or runs < num_images)
        if image and not previous:
            runs += 1
        mask.append(image)
        previous = image
    return mask


def mrope_positions(
    token_ids: list[int],
    grids: list[tuple[int, int, int]],
    vision: VisionArch,
    is_image: list[bool] | None = None,
) -> torch.Tensor:
    """[3, L] multimodal rotary positions of one sequence (time, height, width), as
    transformers' `get_rope_index` gives them for the processor's rows.

    Text tokens advance all three axes together by one. An image (one of the first
    len(grids) runs of image tokens, `image_token_mask`; `grids[k]` = its patch grid
    t x h x w, merged `spatial_merge_size`^2 patches to a token) starts at the next text
    position p: its tokens take p + (frame, row, column) of the merged grid, and the text
    after it continues at p + max(rows, columns). `is_image`: the sequence's
    `image_token_mask`, when the caller has it already.
    """
    if is_image is None:
        is_image = image_token_mask(token_ids, len(grids), vision.image_token_id)
    merge = vision.spatial_merge_size
    pieces, position, k, i = [], 0, 0, 0
    while i < len(is_image):
        j = i
        while j < len(is_image) and is_image[j] == is_image[i]:
            j += 1
        if not is_image[i]:
            pieces.append(torch.arange(position, position + j - i).expand(3, -1))
            position += j - i
        else:
            t, h, w = (int(x) for x in grids[k])
            t_bt, h_bt, w_bt = torch.meshgrid(
                torch.arange(t), torch.arange(h // merge), torch.arange(w // merge), indexing="ij"
            )
            image = torch.stack([t_bt, h_bt, w_bt]).reshape(3, -1) + position
            if image.shape[1] != j - i:
                raise ValueError(
                    f"image {k} has {j - i} tokens but its grid {t}x{h}x{w} makes {image.shape[1]}"
                )
            pieces.append(image)
            position += max(h, w) // merge
            k += 1
        i = j
    if k != len(grids):
        raise ValueError(f"{len(grids)} image grids for {k} images in the tokens")
    return torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)


def build_vision_tower(vision: VisionArch, dtype: torch.dtype) -> torch.nn.Module:
    """Transformers' vision tower for `vision` (random weights: loaded after)."""
    if vision.family != "qwen2_5_vl":
        raise ValueError(f"no vision tower for {vision.family}")
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    config = Qwen2_5_VLVisionConfig(**vision.config)
    config._attn_implementation = "sdpa"
    return Qwen2_5_VisionTransformerPretrainedModel._from_config(config, dtype=dtype)


@functools.cache
def vision_tower_numels(vision: VisionArch) -> tuple[int, ...]:
    """The vision tower's parameter sizes in registration order (built on the meta device:
    no memory, exact for any checkpoint's `vision_config`)."""
    with torch.device("meta"):
        tower = build_vision_tower(vision, torch.float32)
    return tuple(p.numel() for p in tower.parameters())
