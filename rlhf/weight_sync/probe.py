"""Log-probability parity between the trainer's actor and the SGLang servers after a sync.

A fixed probe sequence is scored twice: by each server (input-token log-probs of one
prefill) and by the actor, through the same packed forward the trainer trains with (the
trainer computes that side and passes it in). The largest absolute difference is
`rollout/logprob_diff_max`; above the configured threshold the step fails loudly instead of
training on mismatched rollouts.

A vision-language policy's probe holds a picture between its text (`image_probe`), so that
the vision tower's sync is checked too: SGLang takes the picture with one image token and
expands it; the trainer takes the expanded tokens and the picture's pixel values. The
log-probs of the image tokens themselves are not compared (an image token is never
predicted; SGLang reports them for token 0).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf.data.images import ImageInputs, ImageProcessor, one_token_per_image
from rlhf.models.vision_arch import VisionArch

PROBE_PICTURE = 112  # pixels a side: 4 x 4 image tokens at Qwen2.5-VL's 28-pixel merge


class LogprobMismatchError(RuntimeError):
    """SGLang's and the trainer's log-probs of the probe differ by more than allowed."""


def probe_tokens(
    vocab_size: int, length: int = 32, seed: int = 1234, avoid: tuple[int, ...] = ()
) -> list[int]:
    """Random token ids, none of `avoid` (a vision-language model's image tokens: SGLang
    would look for an image for each)."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([t for t in range(vocab_size) if t not in set(avoid)])
    return allowed[torch.randint(0, len(allowed), (length,), generator=gen)].tolist()


@dataclass(frozen=True)
class ProbeSequence:
    """What both sides score after a sync: `tokens` as the trainer takes them; with a
    picture, `images` (encoded) go to SGLang with `server_tokens` (one image token per
    image) and `inputs` (its pixel values) to the trainer; `compared` [len(tokens) - 1]:
    which log-probs (t >= 1) are compared (all but the image tokens')."""

    tokens: list[int]
    server_tokens: list[int]
    compared: torch.Tensor
    images: tuple[bytes, ...] = ()
    inputs: ImageInputs | None = None

    @classmethod
    def text(cls, tokens: list[int]) -> ProbeSequence:
        return cls(tokens, tokens, torch.ones(len(tokens) - 1, dtype=torch.bool))


def image_probe(vocab_size: int, vision: VisionArch, processor: ImageProcessor) -> ProbeSequence:
    """Random text, a picture of random pixels (seeded), random text: a vision-language
    policy's probe (its text avoids the vision tokens)."""
    from PIL import Image

    gen = torch.Generator().manual_seed(4321)
    pixels = torch.randint(0, 256, (PROBE_PICTURE, PROBE_PICTURE, 3), generator=gen)
    buffer = io.BytesIO()
    Image.fromarray(pixels.to(torch.uint8).numpy()).save(buffer, format="PNG")
    images = (buffer.getvalue(),)
    inputs = processor.inputs(images)
    text = probe_tokens(vocab_size, avoid=vision.token_ids)
    image = vision.image_token_id
    (grid,) = inputs.grids
    tokens = [*text[:12], *vision.picture_tokens(grid), *text[12:]]
    compared = torch.tensor([t != image for t in tokens[1:]])
    server = one_token_per_image(tokens, image)
    return ProbeSequence(tokens, server, compared, images, inputs)


def logprob_diff_max(
    actor_logprobs: torch.Tensor,
    server_logprobs: Callable[[str], list[float]],
    server_urls: list[str],
    is_sender: bool,
    device: torch.device,
    compared: torch.Tensor | None = None,
) -> float:
    """Max |SGLang - actor| over the probe and `server_urls` (queried by the senders only),
    the same on every rank. `actor_logprobs`: log p(token_t | tokens_<t) for t >= 1;
    `server_logprobs(url)`: the same from a server (`sglang_api.prompt_logprobs` of the
    probe tokens); `device`: where this rank's collectives run; `compared`: which of them
    count (None: all; `ProbeSequence.compared`)."""
    diff = torch.zeros((), dtype=torch.float32)
    if is_sender:
        for url in server_urls:
            sglang = torch.tensor(server_logprobs(url), dtype=torch.float32)
            gap = (sglang - actor_logprobs.float().cpu()).abs()
            gap = gap if compared is None else gap[compared]
            diff = torch.maximum(diff, gap.max())
    diff = diff.to(device)
    if dist.is_initialized():
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def check_parity(diff: float, threshold: float | None) -> None:
    if threshold is not None and diff > threshold:
        raise LogprobMismatchError(
            f"rollout/logprob_diff_max = {diff:.3e} exceeds "
            f"actor_rollout_ref.rollout.logprob_diff_threshold = {threshold:.1e}: SGLang and the "
            "trainer disagree on the synced weights"
        )
