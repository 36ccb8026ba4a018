"""Model rewards equal HF's pooled sequence-classification logits (one process, TP = PP = 1)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from rlhf.config import load_config
from rlhf.models.mapping import Placement
from rlhf.quickstart.tiny_model import TinyModelSpec, tiny_hf_config
from rlhf.reward import RewardInput, RewardScorer
from rlhf.reward.model_reward import ModelReward, last_token_values, load_reward_model

PAD = 0


@pytest.fixture(scope="module")
def one_rank():
    """A 1-rank gloo world with Megatron's parallel state."""
    from rlhf.distributed.bootstrap import init_parallel, seed_everything, teardown

    init_parallel("cpu")
    seed_everything(0)
    yield
    teardown()


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("reward_model")
    config = tiny_hf_config(TinyModelSpec(family="qwen2"), 300, PAD, 1)
    config.num_labels = 1
    torch.manual_seed(3)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    return out


def test_last_token_values_by_hand():
    values = torch.arange(12.0).reshape(2, 6, 1)
    assert last_token_values(values, torch.tensor([2, 6])).tolist() == [1.0, 11.0]


def test_scores_match_hf_pooled_logits(one_rank, reward_dir):
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(2, 300, (n,), generator=gen).tolist() for n in (5, 11, 3, 8)]
    scorer = ModelReward(load_reward_model(str(reward_dir), Placement()), PAD, micro_batch_size=2)
    got = scorer(sequences)

    hf = AutoModelForSequenceClassification.from_pretrained(reward_dir).eval()
    width = max(len(s) for s in sequences)
    batch = torch.tensor([s + [PAD] * (width - len(s)) for s in sequences])
    with torch.no_grad():  # HF pools the last non-pad token of each row
        expected = hf(batch, attention_mask=(batch != PAD).long()).logits[:, 0]
    torch.testing.assert_close(torch.tensor(got), expected, rtol=0, atol=1e-4)

    rows = [RewardInput("rm", "", style="model", token_ids=s) for s in sequences[:2]]
    rows.insert(1, RewardInput("gsm8k", "#### 1", "1"))
    cfg = load_config(None).reward
    combined = RewardScorer.from_config(cfg, model_fn=scorer)(rows)
    assert combined[1] == 1.0
    torch.testing.assert_close(torch.tensor(combined[::2]), expected[:2], rtol=0, atol=1e-4)


def test_reward_model_path_errors(tiny_qwen2_dir, tmp_path):
    with pytest.raises(ValueError, match=r"has no 'score\.weight'; a reward model must be an HF"):
        load_reward_model(str(tiny_qwen2_dir), Placement())
    with pytest.raises(FileNotFoundError, match=r"reward\.model_path: directory not found"):
        load_reward_model(str(tmp_path / "none"), Placement())
    with pytest.raises(ValueError, match=r"reward\.model_path is not set"):
        ModelReward.from_config(load_config(None).reward, Placement(), PAD)
