"""Value models (critic / reward model): the policy trunk with a scalar head.

From an HF `*ForSequenceClassification` checkpoint the per-token values equal HF's score
head on its last hidden states; from a causal-LM (actor) checkpoint the trunk is the actor's
and the head is fresh and seeded. Checked at TP1 and TP2 x PP2.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model, tiny_hf_config
from tests.helpers import run_torchrun


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("value")
    actor_dir = save_tiny_model(root / "actor", TinyModelSpec(family="qwen2", seed=5))
    reward_dir = root / "reward"
    config = tiny_hf_config(TinyModelSpec(family="qwen3"), 300, 0, 1)
    config.num_labels = 1
    torch.manual_seed(6)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(reward_dir)
    tokens = torch.randint(2, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    torch.save(tokens, root / "tokens.pt")
    return actor_dir, reward_dir, root / "tokens.pt", tokens


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2)], ids=["tp1", "tp2pp2"])
def test_values_match_hf(models, tmp_path, tp, pp):
    actor_dir, reward_dir, tokens_path, tokens = models
    args = [
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        "--tokens",
        str(tokens_path),
        "--out-dir",
        str(tmp_path),
    ]
    run_torchrun(
        "hf_model_parity.py",
        tp * pp,
        [
            *args,
            "--value-model",
            "--model",
            f"reward={reward_dir}",
            "--model",
            f"critic={actor_dir}",
        ],
    )
    reward = AutoModelForSequenceClassification.from_pretrained(reward_dir).eval()
    with torch.no_grad():
        hidden = reward.model(tokens).last_hidden_state
        expected = reward.score(hidden)[..., 0]
        pooled = reward(tokens).logits[:, 0]  # HF pools the last (non-pad) token
    got = torch.load(tmp_path / "reward.pt")
    torch.testing.assert_close(got["values"], expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(got["values"][:, -1], pooled, rtol=0, atol=1e-4)

    actor = AutoModelForCausalLM.from_pretrained(actor_dir).eval()
    critic = torch.load(tmp_path / "critic.pt")
    head = critic["head"]
    assert head.shape == (1, 64) and head.abs().sum() > 0
    fresh = torch.empty(1, 64).normal_(0.0, 64**-0.5, generator=torch.Generator().manual_seed(11))
    torch.testing.assert_close(head, fresh)  # seeded, the same on every layout
    with torch.no_grad():
        expected_critic = (actor.model(tokens).last_hidden_state @ head.t())[..., 0]
    torch.testing.assert_close(critic["values"], expected_critic, rtol=0, atol=1e-4)
