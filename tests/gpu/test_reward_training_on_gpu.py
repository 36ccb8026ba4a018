"""`rlhf-train-rm` on CUDA in bf16 (fp32 master weights and Adam state): the run trains,
checkpoints and exports, and transformers' scores of the export give the run's held-out
means within bf16's rounding. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import math

import pytest

from tests.distributed.test_reward_training import STEPS, hf_scores, train_rm
from tests.helpers import metrics_by_step

pytest.importorskip("megatron.core")


def test_reward_model_trains_in_bf16_on_cuda(tiny_qwen2_dir, tmp_path):
    from rlhf.data.parquet import write_rows
    from rlhf.quickstart.preferences import make_preference_pairs

    pairs = make_preference_pairs(80, seed=3)
    write_rows(pairs[:64], tmp_path / "train.parquet")
    write_rows(pairs[64:], tmp_path / "val.parquet")
    extra = ["trainer.device=cuda", "model.megatron.dtype=bfloat16"]
    run = train_rm(tmp_path, tiny_qwen2_dir, tmp_path / "run", 1, *extra)
    logged = metrics_by_step(run)[STEPS]
    assert all(math.isfinite(logged[f"rm/{k}"]) for k in ("loss", "grad_norm"))
    chosen, rejected = hf_scores(run / "reward_model_hf", tmp_path)
    assert logged["val/rm/chosen_mean"] == pytest.approx(float(chosen.mean()), abs=3e-2)
    assert logged["val/rm/rejected_mean"] == pytest.approx(float(rejected.mean()), abs=3e-2)
