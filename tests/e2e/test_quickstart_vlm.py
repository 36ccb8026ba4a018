"""`make quickstart-vlm` learns, and a vision-language policy trains at TP2 and PP2.

The tiny Qwen2.5-VL of `rlhf-make-tiny-model --family qwen2_5_vl --warm-start` (kept in
pytest's cache under the hash of the code that makes it; its warm start takes ~70 s) counts
the squares in pictures. A real `rlhf-train` run of configs/quickstart_vlm_cpu.yaml starts
its own SGLang CPU server, which generates with the pictures; the trainer's batches carry
their pixel values and multimodal positions; the weight sync moves the vision tower every
step. The independent reference for the trainer's numbers is SGLang: its log-probs of the
sampled tokens (its own vision tower, image processing and mRoPE) against the trainer's old
log-probs of the same samples (`rollout_corr/max_abs_diff`).
"""

from __future__ import annotations

import hashlib
import json

import pyarrow.parquet as pq
import pytest
import torch

from rlhf.cli.make_tiny_model import main as make_tiny_model
from rlhf.data.images import decode, multimodal_messages
from rlhf.quickstart.data import write_quickstart_data
from rlhf.quickstart.shapes_task import make_shape_rows
from tests.e2e.test_learning import code_hash
from tests.e2e.test_learning import train as train_quickstart
from tests.helpers import REPO

CONFIG = REPO / "configs" / "quickstart_vlm_cpu.yaml"
STEPS = 40
MIN_RISE = 0.2  # measured +0.33, +0.35, +0.41 (16 pictures a step: +0.09 .. +0.44)


@pytest.fixture(scope="module")
def random_vlm(tmp_path_factory):
    """The quickstart VLM before its warm start: what the parity checks need."""
    from rlhf.quickstart.shapes_task import save_tiny_vlm

    return save_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")


@pytest.fixture(scope="module")
def vlm_model(request, tmp_path_factory):
    """The warm-started quickstart VLM, as `make quickstart-vlm-assets` builds it."""
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    task = (REPO / "rlhf" / "quickstart" / "shapes_task.py").read_bytes()
    key = hashlib.sha256(code_hash().encode() + task).hexdigest()[:16]
    root = cache.mkdir(f"quickstart-vlm-{key}") if cache else tmp_path_factory.mktemp("v")
    assert make_tiny_model([str(root / "model"), "--family", "qwen2_5_vl", "--warm-start"]) == 0
    return root / "model"


def train(model, tmp_path, steps: int, *extra: str, nproc: int = 1) -> list[dict]:
    data = write_quickstart_data(tmp_path / "data", make_rows=make_shape_rows)
    return train_quickstart(
        CONFIG, (model, data), None, tmp_path / "run", steps, *extra, nproc=nproc
    )


@pytest.mark.slow(reason="the warm start (~70 s) and tens of GRPO steps")
def test_grpo_on_the_tiny_vlm_learns_to_count(vlm_model, tmp_path):
    """Validation (4 samples of each of 64 pictures) rises by 0.2; every step the trainer's
    log-probs of the image samples equal SGLang's, and the probe after each sync (a
    picture between random text) agrees; the prompt ids the rollout trained on are
    transformers' processor output for its row (image tokens expanded, one per merged
    patch), and its record names that row."""
    from transformers import AutoProcessor

    rows = train(vlm_model, tmp_path, STEPS)
    val = {r["step"]: r["val/test_score/all"] for r in rows if "val/test_score/all" in r}
    print(f"validation reward: {val}")
    assert val[STEPS] - val[0] >= MIN_RISE, val
    trained = [r for r in rows if r["step"] > 0]
    # fp32 rounding between SGLang's and Megatron's paths: the largest gap over a run's 40
    # steps read 4.4e-5 to 5.7e-4 in 7 runs (median step ~1e-5), commit b9257a5's code
    # included (1.3e-4); an image or weight out of place reads 1e-2 and more
    assert all(r["rollout_corr/max_abs_diff"] < 1e-3 for r in trained)
    assert all(r["rollout/logprob_diff_max"] < 1e-3 for r in trained)
    record = json.loads((tmp_path / "run" / "rollouts" / "step_1.jsonl").read_text().split("\n")[0])
    train_file = tmp_path / "data" / "train.parquet"
    assert record["images_from"] == f"row {record['prompt_index']} of {train_file}"
    row = pq.read_table(train_file).to_pylist()[record["prompt_index"]]
    processor = AutoProcessor.from_pretrained(vlm_model)
    text = processor.apply_chat_template(
        multimodal_messages(row["prompt"]), add_generation_prompt=True, tokenize=False
    )
    image = decode(row["images"][0]["bytes"])
    want = processor(text=[text], images=[image], return_tensors="pt")["input_ids"][0]
    assert record["prompt_ids"] == want.tolist()
    assert (torch.tensor(record["prompt_ids"]) == processor.image_token_id).sum() == 4


def test_two_ranks_at_pp2_train_it_as_sglang_serves_it(random_vlm, tmp_path):
    """At PP2 (multimodal positions reach the second stage; the tower lives on the first),
    two steps with the vision tower frozen: the trainer's log-probs of image samples equal
    SGLang's before and after each synced update, and the HF copy of the last checkpoint
    has the language model changed and the tower bitwise as loaded."""
    from safetensors.torch import load_file

    pp2 = [
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "actor_rollout_ref.actor.freeze_vision_tower=true",
        "trainer.save_hf=true",
    ]
    two_steps_on_two_ranks_agree_with_sglang(random_vlm, tmp_path, pp2)
    loaded = load_file(random_vlm / "model.safetensors")
    exported = {}
    for path in (tmp_path / "run" / "checkpoints" / "global_step_2" / "actor_hf").glob(
        "*.safetensors"
    ):
        exported |= load_file(path)
    assert set(exported) == set(loaded)
    changed = {k for k in loaded if not torch.equal(loaded[k], exported[k])}
    assert not {k for k in changed if k.startswith("visual.")}
    assert "lm_head.weight" in changed and "model.layers.1.mlp.up_proj.weight" in changed


@pytest.mark.slow(reason="a second two-rank VLM run (~45 s); PP2 stays in the fast tier")
def test_two_ranks_at_tp2_with_sequence_parallelism(random_vlm, tmp_path):
    """TP2 with Megatron's sequence parallelism (image embeddings placed in the whole row
    before the scatter), the tower trained and synced (whole on both TP ranks)."""
    tp2 = [
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.sequence_parallel=true",
    ]
    two_steps_on_two_ranks_agree_with_sglang(random_vlm, tmp_path, tp2)


def two_steps_on_two_ranks_agree_with_sglang(model, tmp_path, layout: list[str]) -> None:
    """Two steps at `layout` on two ranks: every step the trainer's log-probs of the image
    samples and of the probe are within 1e-4 of SGLang's."""
    rows = train(model, tmp_path, 2, "trainer.n_gpus_per_node=2", *layout, nproc=2)
    trained = [r for r in rows if r["step"] > 0]
    assert len(trained) == 2
    assert all(r["rollout_corr/max_abs_diff"] < 1e-4 for r in trained)
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in trained)
