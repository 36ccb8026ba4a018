"""The vision part of a vision-language model (Qwen2.5-VL) as config.json describes it.

`VisionArch` is what the rest of the system needs to know: the vision tower's own config
(transformers builds the tower from it, `rlhf.models.vision`), which token ids stand for an
image in the text, how many patches merge into one image token, and the multimodal rotary
sections (mRoPE: each head's rotary frequencies split into temporal, height and width
sections, each turned by its own position axis).
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class VisionArch:
    """A vision tower and how its tokens enter the language model (`config_json`: the HF
    `vision_config`, as JSON so that the description stays hashable)."""

    family: str
    config_json: str
    image_token_id: int
    vision_start_token_id: int
    mrope_section: tuple[int, ...]

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
        )
