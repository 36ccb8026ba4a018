"""Images in prompt rows (verl's `images` column), and what a vision-language model takes.

A row's `images` list holds, per image, its encoded file (PNG, JPEG, ...) as one of what
verl's and HF datasets' writers leave in Parquet: the bytes themselves, a struct
{bytes, path} (HF `datasets.Image`; `bytes` null when only the path is set), or a path
string (absolute, or relative to the Parquet file's folder). The prompt marks where each
image goes with an `<image>` placeholder, one per image, as verl's geo3k rows do. Every
image is read and decoded when the file loads, so a broken one fails at startup with its
file, row and column; the rows then hold the encoded bytes (the raw pixels of a
large set would not fit in memory; `ImageProcessor` turns each step's images into pixel
values).

The processor of the model (transformers' `AutoProcessor`, the same files SGLang loads)
renders the messages (each placeholder becomes an image item of the chat template),
expands each image into its image tokens and gives each image's patch grid.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

IMAGE_PLACEHOLDER = "<image>"


@dataclass(frozen=True)
class ImageInputs:
    """A prompt's images as the model takes them: `pixel_values` [patches, channels x
    temporal patch x patch x patch] (the processor's flattened patches, images in order)
    and `grid_thw` [images, 3] (each image's patch grid: frames, rows, columns)."""

    pixel_values: Tensor
    grid_thw: Tensor

    @property
    def grids(self) -> list[tuple[int, int, int]]:
        return [(int(t), int(h), int(w)) for t, h, w in self.grid_thw.tolist()]

    @staticmethod
    def concat(inputs: list[ImageInputs]) -> ImageInputs | None:
        """The images of several samples in order (None when there are none)."""
        if not inputs:
            return None
        return ImageInputs(
            torch.cat([x.pixel_values for x in inputs]), torch.cat([x.grid_thw for x in inputs])
        )


def image_bytes(item: Any, folder: Path | None) -> bytes:
    """The encoded file of one `images` entry (see the module); ValueError saying why not."""
    if isinstance(item, dict):
        item = item.get("bytes") or item.get("path") or item.get("image")
    if isinstance(item, bytes | bytearray):
        if not item:
            raise ValueError("empty bytes")
        return bytes(item)
    if isinstance(item, str) and item:
        path = Path(item.removeprefix("file://"))
        if not path.is_absolute() and folder is not None:
            path = folder / path
        if not path.is_file():
            raise ValueError(f"no image file at {path}")
        return path.read_bytes()
    raise ValueError(f"expected bytes, a path or a {{bytes, path}} struct, got {str(item)[:60]}")


def decode(data: bytes):
    """The image in `data` as an RGB PIL image (ValueError when it is not an image)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"not an image ({e})") from e


def count_placeholders(prompt: str | list[dict[str, str]]) -> int:
    if isinstance(prompt, str):
        return prompt.count(IMAGE_PLACEHOLDER)
    return sum(m["content"].count(IMAGE_PLACEHOLDER) for m in prompt)


def row_images(
    value: Any, prompt: Any, folder: Path | None
) -> tuple[tuple[bytes, ...], str | None]:
    """A row's images (encoded), or what is wrong with its `images` value: an entry that is
    not an image, or a count unlike the prompt's `<image>` placeholders."""
    items = list(value or [])
    images = []
    for k, item in enumerate(items):
        try:
            data = image_bytes(item, folder)
            decode(data)
        except ValueError as e:
            return (), f"image {k}: {e}"
        images.append(data)
    placeholders = count_placeholders(prompt) if prompt else 0
    if placeholders != len(images):
        return (), (
            f"{len(images)} images but the prompt has {placeholders} {IMAGE_PLACEHOLDER} "
            "placeholders (one per image, where it goes)"
        )
    return tuple(images), None


def multimodal_messages(prompt: str | list[dict[str, str]]) -> list[dict[str, Any]]:
    """Chat messages whose content is a list of text and image items, an image item where
    each `<image>` placeholder was (what a vision-language chat template renders)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    out = []
    for message in messages:
        parts: list[dict[str, Any]] = []
        for k, text in enumerate(message["content"].split(IMAGE_PLACEHOLDER)):
            if k:
                parts.append({"type": "image"})
            if text:
                parts.append({"type": "text", "text": text})
        out.append({"role": message["role"], "content": parts})
    return out


def one_token_per_image(ids: list[int], image_token_id: int) -> list[int]:
    """`ids` with each run of image tokens cut to one: what SGLang takes with the images (it
    expands each image token itself, and takes every image token for an image)."""
    return [t for k, t in enumerate(ids) if t != image_token_id or ids[k - 1] != t or k == 0]


class ImageProcessor:
    """A vision-language model's processor (`AutoProcessor` of its directory): prompts with
    images -> token ids with the image tokens expanded, and images -> `ImageInputs`."""

    def __init__(self, path: str | Path):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(path), local_files_only=True)
        self.image_token_id = int(self.processor.image_token_id)

    def encode(
        self, prompt: str | list[dict[str, str]], images: tuple[bytes, ...]
    ) -> tuple[list[int], ImageInputs]:
        """The prompt's token ids (chat template, generation prompt, one image token per
        merged patch) and its images' inputs."""
        text = self.processor.apply_chat_template(
            multimodal_messages(prompt), add_generation_prompt=True, tokenize=False
        )
        out = self.processor(text=[text], images=[decode(d) for d in images], return_tensors="pt")
        inputs = ImageInputs(out["pixel_values"], out["image_grid_thw"])
        return out["input_ids"][0].tolist(), inputs

    def inputs(self, images: tuple[bytes, ...]) -> ImageInputs:
        """The images' pixel values and grids alone (the token ids are known)."""
        out = self.processor.image_processor(
            images=[decode(d) for d in images], return_tensors="pt"
        )
        return ImageInputs(out["pixel_values"], out["image_grid_thw"])
