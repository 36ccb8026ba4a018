"""A vision-language model on Megatron: Qwen2.5-VL's vision tower in front of the GPT.

The language model is Megatron's `GPTModel` with multimodal rotary positions ("mrope":
position ids [3, b, s], one axis each for time, height and width). The vision tower is
transformers' own module (its window attention, 2-D rotary embedding and patch merger
as the checkpoint's authors wrote them), built from the checkpoint's `vision_config` on
the first pipeline stage and held whole on every tensor-parallel rank: ~0.7B parameters
for Qwen2.5-VL-7B..72B, beside 7-72B split over TP. Its parameters are named
`vision_model.*` here and `visual.*` in the HF checkpoint (`rlhf.models.mapping`).

`VisionLanguageGPT.forward` takes the images of a batch (`pixel_values`, the processor's
flattened patches, and `image_grid_thw`, each image's patch grid) and puts the tower's
output where the text holds the image token, as transformers does (images in batch-major
order of their tokens); without images it is the GPT with every position axis equal.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel

from rlhf.models.vision_arch import VisionArch


class VisionLanguageGPT(GPTModel):
    """Megatron's GPT with a vision tower on the first stage (see the module)."""

    vision: VisionArch  # set by `rlhf.models.gpt.build_gpt_model`, with `vision_model` (a
    # submodule, so not declared here) on the first stage

    def forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        decoder_input=None,
        *args,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
        **kwargs,
    ):
        if position_ids is not None and position_ids.dim() == 2:  # text: the axes agree
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        if self.pre_process and decoder_input is None and pixel_values is not None:
            if image_grid_thw is None:
                raise ValueError("pixel_values without image_grid_thw (each image's grid)")
            decoder_input = self.embed_with_images(
                input_ids, pixel_values, image_grid_thw, image_mask
            )
        return super().forward(
            input_ids, position_ids, attention_mask, decoder_input, *args, **kwargs
        )

    def embed_with_images(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor,
        grid_thw: torch.Tensor,
        image_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder input [s, b, h] (this rank's slice of s under sequence parallelism):
        the word embeddings, and the vision tower's output at the images' tokens
        (`image_mask` [b, s]; None: every image token, as in a prompt alone)."""
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        words = self.embedding(input_ids=input_ids, position_ids=None)
        dtype = next(self.vision_model.parameters()).dtype
        images = self.vision_model(pixel_values.to(dtype), grid_thw=grid_thw).pooler_output
        is_image = input_ids == self.vision.image_token_id if image_mask is None else image_mask
        if int(is_image.sum()) != images.shape[0]:
            raise ValueError(
                f"the batch has {int(is_image.sum())} image tokens but its images make "
                f"{images.shape[0]} (image_grid_thw {grid_thw.tolist()})"
            )
        placed = words.new_zeros(*is_image.shape, images.shape[-1])
        placed = placed.masked_scatter(is_image.unsqueeze(-1), images.to(words.dtype))
        keep = (~is_image).unsqueeze(-1).to(words.dtype)
        placed, keep = placed.transpose(0, 1).contiguous(), keep.transpose(0, 1).contiguous()
        if self.config.sequence_parallel:
            placed = scatter_to_sequence_parallel_region(placed)
            keep = scatter_to_sequence_parallel_region(keep)
        return words * keep + placed


def freeze_vision_tower(chunks) -> int:
    """Keep the vision tower of `chunks` (a model's parts) as loaded: its parameters need
    no gradient, so Megatron's DDP and optimizer leave them out. Returns how many there are
    (0 on stages without the tower)."""
    frozen = 0
    for chunk in chunks:
        tower = getattr(chunk, "vision_model", None)
        if tower is not None:
            for param in tower.parameters():
                param.requires_grad_(False)
                frozen += param.numel()
    return frozen
