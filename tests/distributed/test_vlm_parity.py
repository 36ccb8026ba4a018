"""A tiny Qwen2.5-VL built with transformers (a Qwen2 language model with multimodal rotary
positions, a two-block vision tower with window and full attention) loads into Megatron at
1 rank, TP2 and PP2, and gives transformers' logits on prompts with images (fp32, within
1e-5): two rows, one image each of a 4 x 4 and a 4 x 6 patch grid, at overlapping offsets
(the images must go to their own rows: transformers fills them in batch-major order).
HF -> Megatron -> HF is bitwise (`rlhf-convert`, 2 ranks at TP2), and `rlhf-convert verify`
passes on the converted checkpoint with a picture in every row (its vision tower checked too).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from tests.distributed.test_moe_parity import read_all, rlhf_convert
from tests.helpers import run_torchrun

VOCAB, IMAGE, START, END = 400, 390, 392, 393
CONFIG = dict(
    text_config=dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    ),
    vision_config=dict(
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
    ),
    image_token_id=IMAGE,
    video_token_id=391,
    vision_start_token_id=START,
    vision_end_token_id=END,
    initializer_range=0.1,
)
GRIDS = [(1, 4, 4), (1, 4, 6)]  # patches per image: t x h x w; image tokens: / 2 x 2
LAYOUTS = {"1rank": (1, []), "tp2": (2, ["--tp", "2"]), "pp2": (2, ["--pp", "2"])}


def image_row(prefix: int, grid: tuple[int, int, int], suffix: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    tokens = grid[0] * grid[1] * grid[2] // 4
    text = torch.randint(0, 380, (prefix + suffix,), generator=gen).tolist()
    return text[:prefix] + [START] + [IMAGE] * tokens + [END] + text[prefix:]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(model dir, inputs file, transformers' logits)."""
    root = tmp_path_factory.mktemp("vlm")
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**CONFIG)).eval()
    model.save_pretrained(root / "hf")
    rows = [image_row(3, GRIDS[0], 9, 1), image_row(2, GRIDS[1], 8, 2)]  # images overlap
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    grid = torch.tensor(GRIDS)
    patches = int(grid.prod(-1).sum())
    pixel_values = torch.randn(patches, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(3))
    kinds = (input_ids == IMAGE).int()
    position_ids, _ = model.model.get_rope_index(input_ids, kinds, image_grid_thw=grid)
    batch = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "pixel_values": pixel_values,
        "image_grid_thw": grid,
    }
    torch.save(batch, root / "inputs.pt")
    with torch.no_grad():  # with the token kinds, as the processor gives: 3-D positions
        logits = model(
            input_ids=input_ids,
            pixel_values=pixel_values,
            image_grid_thw=grid,
            mm_token_type_ids=kinds,
        ).logits
    return root / "hf", root / "inputs.pt", logits, position_ids


def test_image_tokens_get_their_grid_positions(vlm):
    _, _, _, position_ids = vlm
    assert position_ids.shape[0] == 3
    assert not torch.equal(position_ids[1], position_ids[2])  # height and width differ


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_vlm_logits_match_transformers(vlm, tmp_path, layout):
    hf_dir, inputs, want, _ = vlm
    nproc, extra = LAYOUTS[layout]
    out = tmp_path / "logits.pt"
    run_torchrun(
        "vlm_parity.py",
        nproc,
        ["--model", str(hf_dir), "--inputs", str(inputs), "--out", str(out), *extra],
    )
    got = torch.load(out)
    diff = (got - want).abs().max().item()
    print(f"qwen2_5_vl {layout}: max |logit diff| {diff:.2e} (logits up to {want.abs().max():.2f})")
    assert diff < 1e-5


def test_round_trip_through_tp2_is_bitwise(vlm, tmp_path):
    hf_dir, _, _, _ = vlm
    mcore, back = tmp_path / "mcore", tmp_path / "hf_back"
    rlhf_convert(2, tmp_path / "to_mcore.out", "hf-to-mcore", hf_dir, mcore, "--tp", 2)
    rlhf_convert(1, tmp_path / "to_hf.out", "mcore-to-hf", mcore, back)
    original, restored = read_all(hf_dir), read_all(back)
    assert sorted(original) == sorted(restored)
    for name, tensor in original.items():
        assert torch.equal(tensor, restored[name]), name
    verify = rlhf_convert(2, tmp_path / "verify.out", "verify", hf_dir, mcore, "--tp", 2)
    assert verify.strip().endswith("OK"), verify
    assert "with a picture each" in verify  # the vision tower checked too
