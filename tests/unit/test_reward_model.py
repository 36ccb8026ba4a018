"""The trainer's reward model (rlhf.engine.reward_model) scores the style=model rows of a
generation result with HF's pooled sequence-classification logit, through the trainer's
packed Megatron forward (one process, TP = PP = 1), and leaves rule rows as they were."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from rlhf.config import load_config
from rlhf.engine.micro_batch import MicroBatchPlanner
from rlhf.engine.reward_model import RewardModelScorer, require_scored
from rlhf.quickstart.tiny_model import TinyModelSpec, tiny_hf_config
from rlhf.rollout.batch import RolloutBatch, RolloutResult

PAD = 0


@pytest.fixture(scope="module")
def ctx(cpu_rank):
    return cpu_rank


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("reward_model")
    config = tiny_hf_config(TinyModelSpec(family="qwen2"), 300, PAD, 1)
    config.num_labels = 1
    torch.manual_seed(3)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    return out


def mixed_result() -> RolloutResult:
    gen = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(2, 300, (n,), generator=gen).tolist()  # noqa: E731
    prompts, responses = [ids(n) for n in (5, 7, 3, 6)], [ids(n) for n in (4, 2, 9, 1)]
    batch = RolloutBatch(
        prompt_ids=prompts,
        response_ids=responses,
        scores_b=torch.tensor([1.0, math.nan, 0.5, math.nan]),
        data_sources=["gsm8k", "rm", "gsm8k", "rm"],
        uids=["a", "b", "c", "d"],
        reward_styles=["rule", "model", "rule", "model"],
    )
    return RolloutResult(batch, [], reward_s=0.0)


def test_model_rows_get_hf_pooled_logits_rule_rows_unchanged(ctx, reward_dir):
    cfg = load_config(None, ["actor_rollout_ref.model.path=m", f"reward.model_path={reward_dir}"])
    scorer = RewardModelScorer.from_config(
        cfg.reward,
        cfg.actor_rollout_ref.actor.megatron.dtype,
        ctx,
        MicroBatchPlanner(ctx, thd=False),
        64,
    )
    assert scorer is not None
    before = mixed_result()
    after = scorer(before).batch
    hf = AutoModelForSequenceClassification.from_pretrained(reward_dir).eval()
    for i in (1, 3):
        sequence = torch.tensor([before.batch.prompt_ids[i] + before.batch.response_ids[i]])
        with torch.no_grad():
            expected = hf(sequence).logits[0, 0]
        assert after.scores_b[i].item() == pytest.approx(expected.item(), abs=1e-4)
    assert after.scores_b[[0, 2]].tolist() == [1.0, 0.5]
    assert require_scored(RolloutResult(after, [], 0.0)).batch is after


def test_model_rows_without_a_reward_model_are_an_error():
    with pytest.raises(ValueError, match=r"set reward\.model_path .* or reward\.url"):
        require_scored(mixed_result())


def test_a_reward_model_without_a_score_head_is_refused(ctx, tmp_path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(tiny_hf_config(TinyModelSpec(), 300, PAD, 1)).save_pretrained(
        tmp_path
    )
    cfg = load_config(None, ["actor_rollout_ref.model.path=m", f"reward.model_path={tmp_path}"])
    with pytest.raises(ValueError, match=r"has no 'score\.weight'"):
        RewardModelScorer.from_config(
            cfg.reward,
            cfg.actor_rollout_ref.actor.megatron.dtype,
            ctx,
            MicroBatchPlanner(ctx, thd=False),
            64,
        )
