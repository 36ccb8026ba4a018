"""`rlhf-train-rm` end to end on gloo ranks: the exported reward model scores as transformers'
`*ForSequenceClassification` does, DP2, TP2, PP2 and Ulysses SP2 train the same model as one
rank, and a run resumed from a checkpoint goes on exactly as the uninterrupted one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rlhf.data.parquet import write_rows
from rlhf.data.preference import read_preference_pairs, tokenize_pairs
from rlhf.quickstart.preferences import make_preference_pairs
from tests.helpers import metrics_by_step, run_torchrun

STEPS = 4
COMPARED = ("rm/loss", "rm/accuracy", "rm/gap_mean", "rm/grad_norm")
VALIDATION = ("val/rm/loss", "val/rm/accuracy", "val/rm/chosen_mean", "val/rm/rejected_mean")


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pairs")
    pairs = make_preference_pairs(80, seed=3)
    write_rows(pairs[:64], root / "train.parquet")
    write_rows(pairs[64:], root / "val.parquet")
    return root


def train_rm(pairs_dir: Path, model: Path, run_dir: Path, nproc: int = 1, *extra: str) -> Path:
    args = [
        f"data.train_files={pairs_dir / 'train.parquet'}",
        f"data.val_files={pairs_dir / 'val.parquet'}",
        "data.max_length=48",
        "data.train_batch_size=8",
        f"model.path={model}",
        "model.optim.lr=3e-3",
        "model.max_token_len_per_gpu=200",  # several micro-batches per step
        f"trainer.default_local_dir={run_dir}",
        f"trainer.n_gpus_per_node={nproc}",
        "trainer.device=cpu",
        "trainer.logger=[console]",
        f"trainer.total_training_steps={STEPS}",
        "trainer.save_freq=2",
        "trainer.val_before_train=false",
        *extra,
    ]
    run_torchrun("reward_training.py", nproc, args)
    return run_dir


@pytest.fixture(scope="module")
def one_rank(pairs_dir, tiny_qwen2_dir, tmp_path_factory) -> Path:
    return train_rm(pairs_dir, tiny_qwen2_dir, tmp_path_factory.mktemp("rm") / "one_rank")


def hf_scores(model_dir: Path, pairs_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen and rejected scores of the held-out pairs from transformers, one sequence at a
    time (HF pools the last token)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    pairs = read_preference_pairs([pairs_dir / "val.parquet"])
    tokenized, _ = tokenize_pairs(pairs, tokenizer, True, 48)
    scores = []
    with torch.no_grad():
        for pair in tokenized:
            for side in (pair.chosen, pair.rejected):
                ids = torch.tensor([pair.shared + side])
                scores.append(float(model.eval()(ids).logits[0, 0]))
    return torch.tensor(scores[0::2]), torch.tensor(scores[1::2])


def test_exported_reward_model_scores_as_transformers(one_rank, pairs_dir):
    exported = one_rank / "reward_model_hf"
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]
    assert config["num_labels"] == 1
    chosen, rejected = hf_scores(exported, pairs_dir)
    gap = chosen - rejected
    by_hand = {  # Bradley-Terry loss and metrics of transformers' scores, computed here
        "val/rm/loss": sum(math.log1p(math.exp(-g)) for g in gap.tolist()) / len(gap),
        "val/rm/accuracy": float((gap > 0).float().mean()),
        "val/rm/chosen_mean": float(chosen.mean()),
        "val/rm/rejected_mean": float(rejected.mean()),
    }
    logged = metrics_by_step(one_rank)[STEPS]
    for key, value in by_hand.items():
        assert logged[key] == pytest.approx(value, abs=1e-4), key
    assert gap.abs().max() > 1e-2  # the trained head tells the sides apart


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        (2, []),
        (2, ["model.megatron.tensor_model_parallel_size=2"]),
        (2, ["model.megatron.pipeline_model_parallel_size=2"]),
        (2, ["model.ulysses_sequence_parallel_size=2"]),
    ],
    ids=["dp2", "tp2", "pp2", "sp2"],
)
def test_layouts_train_as_one_rank(one_rank, pairs_dir, tiny_qwen2_dir, tmp_path, nproc, layout):
    run = train_rm(pairs_dir, tiny_qwen2_dir, tmp_path / "run", nproc, *layout)
    expected, got = metrics_by_step(one_rank), metrics_by_step(run)
    # Step 1 starts from the same weights: only the order of the sums differs. TP, PP and SP
    # then split the matmuls' sums (float32 reassociation) and Adam's normalisation carries
    # that into the weights: by step 4 the metrics differ by up to ~2e-4 relative (measured
    # at TP2 and SP2); a lost pair or reduction moves them by 1e-1 from step 1 on
    for step in range(1, STEPS + 1):
        rel, abs_ = (1e-5, 1e-6) if step == 1 else (1e-3, 1e-4)
        for key in COMPARED:
            assert got[step][key] == pytest.approx(expected[step][key], rel=rel, abs=abs_), (
                step,
                key,
            )
    for key in VALIDATION:
        assert got[STEPS][key] == pytest.approx(expected[STEPS][key], rel=1e-3, abs=1e-4), key


def test_resumed_run_goes_on_as_the_uninterrupted_one(
    one_rank, pairs_dir, tiny_qwen2_dir, tmp_path
):
    """From the uninterrupted run's step-2 checkpoint: steps 3-4 (data order, Adam state, LR
    schedule, weights) as that run logged them."""
    checkpoint = one_rank / "checkpoints" / "global_step_2"
    run = train_rm(
        pairs_dir, tiny_qwen2_dir, tmp_path / "resumed", 1, f"trainer.resume_mode={checkpoint}"
    )
    expected, got = metrics_by_step(one_rank), metrics_by_step(run)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        for key in (*COMPARED, "rm/lr"):
            assert got[step][key] == pytest.approx(expected[step][key], rel=1e-6, abs=1e-7), key
    for key in VALIDATION:
        assert got[STEPS][key] == pytest.approx(expected[STEPS][key], rel=1e-6, abs=1e-7), key
