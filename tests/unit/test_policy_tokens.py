"""Multi-turn batches train on the policy's tokens only: tool messages between assistant
turns never enter the log-probs, the KL, the advantages (GAE), the importance weights or
the losses, and their positions get no gradient.

The references here are written by hand from the response positions and the mask; the
code under test goes through the real micro-batch layout and heads, fed per-position
model outputs with huge values on the tool tokens' positions, so that any tool token that
leaked in would change the numbers.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algo.losses import global_batch_counts
from rlhf.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
from rlhf.config.schema import ActorConfig
from rlhf.engine.heads import CriticValueHead, LogprobHead, PolicyLossHead
from rlhf.engine.micro_batch import build_micro_batch
from rlhf.models.logprobs import VocabShard
from rlhf.rollout.batch import RolloutBatch
from rlhf.trainer.step import Experience, build_experience, rollout_correction

VOCAB = 32
# sample 0: turn 1 (3 tokens), a tool message (2 tokens), turn 2 (2 tokens)
# sample 1: one turn, no tools; sample 2: two tool messages
PROMPTS = [[4, 5, 6], [7, 8], [9, 10]]
RESPONSES = [[10, 11, 12, 20, 21, 13, 14], [15, 16, 17], [18, 22, 23, 19, 24, 25]]
MASKS = [[1, 1, 1, 0, 0, 1, 1], [1, 1, 1], [1, 0, 0, 1, 0, 1]]


def _batch(masks=MASKS) -> RolloutBatch:
    logprobs = [[-0.1 * (t + 1) - i for t in range(len(r))] for i, r in enumerate(RESPONSES)]
    return RolloutBatch(
        prompt_ids=PROMPTS,
        response_ids=RESPONSES,
        scores_b=torch.tensor([1.0, -0.5, 0.25]),
        data_sources=["synthetic"] * 3,
        uids=["a", "a", "b"],
        rollout_logprobs=logprobs,
        response_masks=masks,
    )


def _policy(i: int) -> list[int]:
    """Hand: the response positions of sample i's policy tokens."""
    return [t for t, m in enumerate(MASKS[i]) if m]


def _row_positions(mb, i: int) -> list[int]:
    """Hand: the packed-row positions whose outputs predict sample i's response tokens."""
    row = mb.sample_ids.index(i)
    start = sum(len(PROMPTS[j]) + len(RESPONSES[j]) for j in mb.sample_ids[:row])
    return [start + len(PROMPTS[i]) - 1 + t for t in range(len(RESPONSES[i]))]


def _tool_row_positions(mb) -> list[int]:
    return [
        p for i in mb.sample_ids for t, p in enumerate(_row_positions(mb, i)) if not MASKS[i][t]
    ]


def test_the_layout_holds_each_samples_policy_tokens_in_order():
    batch = _batch()
    assert batch.policy_lengths == [5, 3, 3]
    assert batch.response_width == 5
    assert batch.mask_bt().sum(dim=1).tolist() == [5, 3, 3]
    rollout = batch.rollout_logprobs_bt()
    for i in range(3):
        expected = [batch.rollout_logprobs[i][t] for t in _policy(i)]
        assert rollout[i, : len(expected)].tolist() == pytest.approx(expected)
    mb = build_micro_batch(batch, [0, 1, 2])
    for i in range(3):
        n = len(_policy(i))
        picked = mb.labels[0][mb.gather_index[i, :n]].tolist()
        assert picked == [RESPONSES[i][t] for t in _policy(i)]  # the label is the token
        assert mb.gather_index[i, :n].tolist() == [_row_positions(mb, i)[t] for t in _policy(i)]
    assert batch.num_response_tokens() == 11
    assert global_batch_counts([mb.mask]).num_seqs == 3  # a hole does not split a response


def test_masks_survive_select_concat_and_broadcast_and_must_match_the_tokens():
    batch = _batch()
    plain = RolloutBatch([[1]], [[2, 3]], torch.zeros(1), ["s"], ["u"])
    joined = RolloutBatch.concat([batch.select([2, 0]), plain])
    assert joined.response_masks == [MASKS[2], MASKS[0], [1, 1]]
    assert RolloutBatch.from_objects(joined.to_objects()).response_masks == joined.response_masks
    with pytest.raises(ValueError, match="response mask"):
        _batch([[1, 1], [1, 1, 1], MASKS[2]])
    with pytest.raises(ValueError, match="response mask"):
        _batch([MASKS[0], [1, 2, 1], MASKS[2]])


def _logits(mb, seed: int) -> torch.Tensor:
    """[1, T, V] logits; the positions predicting tool tokens are huge and peaked."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, mb.num_tokens, VOCAB, generator=gen)
    logits[0, _tool_row_positions(mb)] = 1e4 * torch.randn(
        len(_tool_row_positions(mb)), VOCAB, generator=gen
    )
    return logits


def _hand_logprobs(logits: torch.Tensor, mb, i: int) -> list[float]:
    logp = torch.log_softmax(logits[0].double(), dim=-1)
    positions = _row_positions(mb, i)
    return [float(logp[positions[t], RESPONSES[i][t]]) for t in _policy(i)]


def test_gae_kl_and_token_rewards_are_over_the_policy_tokens_only():
    """GAE, the KL to the reference and the score's placement, against a hand computation
    that walks each response's positions and skips the tool tokens."""
    batch = _batch()
    mb = build_micro_batch(batch, [0, 1, 2])
    vocab = VocabShard(0, VOCAB)
    actor, ref = _logits(mb, 1), _logits(mb, 2)
    values_t = torch.randn(1, mb.num_tokens, 1, generator=torch.Generator().manual_seed(3))
    values_t[0, _tool_row_positions(mb)] = 1e6
    old = LogprobHead(vocab)(actor, mb)[1]["logprobs"]
    ref_bt = LogprobHead(vocab)(ref, mb)[1]["logprobs"]
    values_bt = CriticValueHead()(values_t, mb)[1]["values"]
    algo = AlgorithmConfig(adv_estimator="gae", gamma=0.9, lam=0.8)
    exp, metrics = build_experience(batch, (old, None), ref_bt, values_bt, algo, beta=0.5)

    gamma, lam, kl_means = 0.9, 0.8, []
    for i in range(3):
        policy, positions = _policy(i), _row_positions(mb, i)
        lp, lr = _hand_logprobs(actor, mb, i), _hand_logprobs(ref, mb, i)
        kl = [a - b for a, b in zip(lp, lr)]
        kl_means.append(sum(kl) / len(kl))
        rewards = [-0.5 * k for k in kl]
        rewards[-1] += float(batch.scores_b[i])
        values = [float(values_t[0, positions[t], 0]) for t in policy]
        advantages, running = [0.0] * len(policy), 0.0
        for j in reversed(range(len(policy))):
            following = values[j + 1] if j + 1 < len(policy) else 0.0
            running = rewards[j] + gamma * following - values[j] + gamma * lam * running
            advantages[j] = running
        n = len(policy)
        assert exp.token_rewards_bt[i, :n].tolist() == pytest.approx(rewards, abs=1e-4)
        assert exp.returns_bt[i, :n].tolist() == pytest.approx(
            [a + v for a, v in zip(advantages, values)], abs=1e-4
        )
        assert old[i, :n].tolist() == pytest.approx(lp, abs=1e-4)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(sum(kl_means) / 3, abs=1e-5)
    assert math.isfinite(float(exp.advantages_bt.abs().max()))


def test_importance_weights_compare_the_policy_tokens_with_their_own_rollout_logprobs():
    batch = _batch()
    old = batch.rollout_logprobs_bt() + 0.25 * batch.mask_bt()
    settings = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)
    weights, _ = rollout_correction(batch, old, settings)
    for i in range(3):
        n = len(_policy(i))
        assert weights[i, :n].tolist() == pytest.approx([math.exp(0.25)] * n, abs=1e-6)


def test_the_policy_loss_gives_tool_positions_no_gradient_and_equals_the_hand_loss():
    """The clipped surrogate, the entropy bonus and the KL loss together: the gradient
    reaching the logits at positions that predict tool tokens is exactly zero, and the
    loss equals the token-mean over the policy tokens computed by hand."""
    batch = _batch()
    mb = build_micro_batch(batch, [0, 1, 2])
    vocab = VocabShard(0, VOCAB)
    logits = _logits(mb, 4).requires_grad_(True)
    old = LogprobHead(vocab)(logits.detach(), mb)[1]["logprobs"] - 0.05 * batch.mask_bt()
    advantages = torch.where(batch.mask_bt(), torch.linspace(-1, 1, 5).expand(3, 5), 0)
    ref = old - 0.1 * batch.mask_bt()
    exp = _experience(batch, old, ref, advantages)
    counts = global_batch_counts([mb.mask])
    settings = ActorConfig(entropy_coeff=0.01, use_kl_loss=True, kl_loss_type="k1")
    head = PolicyLossHead(vocab, 1.0, settings, 5, exp, counts)
    loss, _ = head(logits, mb)
    loss.backward()
    grads = logits.grad[0].abs().sum(dim=-1)
    tools = _tool_row_positions(mb)
    policy = [_row_positions(mb, i)[t] for i in range(3) for t in _policy(i)]
    assert float(grads[tools].max()) == 0.0
    assert float(grads[policy].min()) > 0.0

    hand, n = 0.0, 0
    for i in range(3):
        logp = torch.log_softmax(logits.detach()[0].double(), dim=-1)
        for j, t in enumerate(_policy(i)):
            position = _row_positions(mb, i)[t]
            lp = float(logp[position, RESPONSES[i][t]])
            ratio, adv = math.exp(lp - float(old[i, j])), float(advantages[i, j])
            surrogate = max(-adv * ratio, -adv * min(max(ratio, 0.8), 1.2))
            entropy = -float((logp[position].exp() * logp[position]).sum())
            hand += surrogate - 0.01 * entropy + settings.kl_loss_coef * (lp - float(ref[i, j]))
            n += 1
    assert float(loss) == pytest.approx(hand / n, abs=1e-5)


def _experience(batch, old, ref, advantages) -> Experience:
    return Experience(batch, old, None, ref, None, advantages, advantages, None)
