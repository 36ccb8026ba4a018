"""Algorithm settings that would silently train nothing or something else are refused, and the
pieces that mutation testing found unguarded (GRPO's epsilon, GSPO's importance weights, the
KL loss's aggregation and coefficient) are checked against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algo import compute_grpo_advantages, gspo_policy_loss
from rlhf.algo.kl import kl_penalty
from rlhf.algo.losses import BatchCounts
from rlhf.config import ConfigError, load_config, validate_config
from rlhf.config.validate import config_notes, kl_in_reward, uses_reference
from rlhf.engine.heads import PolicyLossHead
from rlhf.engine.micro_batch import build_micro_batch
from rlhf.models.logprobs import VocabShard
from rlhf.rollout.batch import RolloutBatch
from rlhf.trainer.step import Experience

QUICKSTART = "configs/quickstart_cpu.yaml"
AR = "actor_rollout_ref"
GSPO = f"{AR}.actor.policy_loss.loss_mode=gspo"


def check(*overrides: str):
    return validate_config(load_config(QUICKSTART, list(overrides)))


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_estimators_refuse_one_sample_per_prompt(estimator):
    with pytest.raises(ConfigError, match=rf"adv_estimator={estimator} .* rollout.n=1 every"):
        check(f"algorithm.adv_estimator={estimator}", f"{AR}.rollout.n=1")
    check(f"algorithm.adv_estimator={estimator}", f"{AR}.rollout.n=2")
    one = [f"{AR}.rollout.n=1", f"{AR}.actor.ppo_micro_batch_size_per_gpu=4"]
    check("algorithm.adv_estimator=reinforce_plus_plus", *one)


def test_a_critic_warmup_needs_a_critic():
    with pytest.raises(ConfigError, match=r"critic_warmup=3 .* adv_estimator=grpo has no critic"):
        check("trainer.critic_warmup=3", "algorithm.adv_estimator=grpo")
    check("trainer.critic_warmup=3", "algorithm.adv_estimator=gae")


def test_gspo_needs_the_sequence_mean_and_its_own_clip_range():
    clip = [f"{AR}.actor.clip_ratio_low=0.0003", f"{AR}.actor.clip_ratio_high=0.0004"]
    seq_mean = f"{AR}.actor.loss_agg_mode=seq-mean-token-mean"
    with pytest.raises(ConfigError, match=r"loss_agg_mode=seq-mean-token-mean \(is token-mean\)"):
        check(GSPO, *clip)
    with pytest.raises(ConfigError, match=r"clip_ratio=0.2 would never clip: set .*clip_ratio_low"):
        check(GSPO, seq_mean, clip[0])
    check(GSPO, seq_mean, *clip)
    check(f"{AR}.actor.clip_ratio=0.2")  # vanilla PPO keeps token-mean and clip 0.2


def test_dapo_needs_room_for_its_overlong_buffer_and_groups_of_several_samples():
    length = load_config(QUICKSTART).data.max_response_length
    buffer = ["reward.overlong_buffer.enable=true", f"reward.overlong_buffer.len={length}"]
    with pytest.raises(ConfigError, match=rf"overlong_buffer.len \({length}\) must be below"):
        check(*buffer)
    check(buffer[0], f"reward.overlong_buffer.len={length - 1}")
    one = [f"{AR}.rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"]
    one.append(f"{AR}.actor.ppo_micro_batch_size_per_gpu=4")
    with pytest.raises(ConfigError, match=r"filter_groups.enable needs .*rollout.n >= 2 \(is 1\)"):
        check("algorithm.filter_groups.enable=true", *one)


def test_the_kl_counts_once_unless_both_are_asked_for():
    loss = f"{AR}.actor.use_kl_loss=true"
    default = load_config(QUICKSTART, [])  # sets use_kl_in_reward: true
    assert kl_on(default) and uses_reference(default.algorithm, default.actor_rollout_ref.actor)
    assert not kl_in_reward(
        *(lambda c: (c.algorithm, c.actor_rollout_ref.actor))(load_config(None, []))
    )  # verl's default: off
    verl_grpo = load_config(None, ["algorithm.adv_estimator=grpo", loss])
    assert not kl_in_reward(verl_grpo.algorithm, verl_grpo.actor_rollout_ref.actor) and ref_on(
        verl_grpo
    )
    assert not any("twice" in note for note in config_notes(verl_grpo))
    unset = load_config(QUICKSTART, [loss, "algorithm.use_kl_in_reward=null"])
    assert not kl_in_reward(
        unset.algorithm, unset.actor_rollout_ref.actor
    )  # null: on unless the actor has a KL loss
    both = load_config(QUICKSTART, [loss])
    assert kl_on(both)
    assert any("the KL to the reference counts twice" in note for note in config_notes(both))
    neither = load_config(QUICKSTART, ["algorithm.use_kl_in_reward=false"])
    assert not kl_in_reward(neither.algorithm, neither.actor_rollout_ref.actor) and not ref_on(
        neither
    )


def test_grpo_gives_a_group_of_equal_scores_zero_advantages_not_nan():
    """The epsilon in (s - mean) / (std + eps) is what keeps such a group finite."""
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0])
    adv = compute_grpo_advantages(scores, ["a", "a", "a", "b", "b"], torch.ones(5, 2))
    std_b = math.sqrt(0.5)  # unbiased std of {0, 1}
    expected = torch.tensor([0.0, 0.0, 0.0, -0.5 / (std_b + 1e-6), 0.5 / (std_b + 1e-6)])
    torch.testing.assert_close(adv, expected[:, None].expand(5, 2))


def test_gspo_multiplies_each_token_by_its_importance_weight():
    """pg_t = -A_t * s_i * w_t inside the clip range, aggregated per response then averaged."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -1.0, 0.0]])
    old = logp - torch.tensor([[1e-4, -1e-4, 0.0], [2e-4, 0.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    weights = torch.tensor([[0.5, 2.0, 1.0], [1.5, 0.25, 0.0]])
    out = gspo_policy_loss(logp, old, adv, mask, 0.5, 0.5, weights_bt=weights)
    s = [math.exp(0.0), math.exp(1e-4)]  # sequence ratios: mean log-ratio of each response
    seq_means = [
        sum(-1.0 * s[0] * w for w in (0.5, 2.0, 1.0)) / 3,
        sum(2.0 * s[1] * w for w in (1.5, 0.25)) / 2,
    ]
    assert out.loss.item() == pytest.approx(sum(seq_means) / 2, rel=1e-6)


VOCAB = 11


def test_the_kl_loss_is_weighted_by_its_coefficient_and_aggregated_like_the_policy_loss():
    """loss(kl_loss_coef=c) - loss(kl off) = c x the KL aggregated by loss_agg_mode, by hand:
    per response the mean of low_var_kl over its tokens, then the mean over responses."""
    batch = RolloutBatch(
        prompt_ids=[[4, 5], [6], [7, 8, 9]],
        response_ids=[[3, 4, 5, 6], [7], [8, 9]],
        scores_b=torch.tensor([1.0, 0.0, 0.5]),
        data_sources=["t"] * 3,
        uids=["a", "b", "c"],
    )
    gen = torch.Generator().manual_seed(3)
    mask = batch.mask_bt()
    old = (torch.randn(mask.shape, generator=gen) * 0.3 - 2.4) * mask
    ref = (torch.randn(mask.shape, generator=gen) * 0.8 - 2.4) * mask
    adv = torch.randn(mask.shape, generator=gen) * mask
    exp = Experience(batch, old, None, ref, None, adv, adv, None)
    mb = build_micro_batch(batch, [0, 1, 2])
    logits = torch.randn(1, mb.num_tokens, VOCAB, generator=gen)
    counts = BatchCounts(int(mask.sum()), batch.size)
    agg = f"{AR}.actor.loss_agg_mode=seq-mean-token-mean"

    def loss(*overrides: str) -> tuple[float, dict]:
        actor = load_config(None, [agg, *overrides]).actor_rollout_ref.actor
        head = PolicyLossHead(VocabShard(0, VOCAB), 1.0, actor, 4, exp, counts)
        value, metrics = head(logits, mb)
        return value.item(), metrics

    kl_on = [f"{AR}.actor.use_kl_loss=true", f"{AR}.actor.kl_loss_type=low_var_kl"]
    base, _ = loss()
    with_kl, metrics = loss(*kl_on, f"{AR}.actor.kl_loss_coef=0.7")
    logp = _token_logprobs(logits, batch)
    per_token = kl_penalty(logp, ref, "low_var_kl")
    lengths = mask.sum(dim=1)
    expected_kl = float(((per_token * mask).sum(dim=1) / lengths).mean())
    assert metrics["actor/kl_loss"].item() == pytest.approx(expected_kl, rel=1e-5)
    assert with_kl - base == pytest.approx(0.7 * expected_kl, rel=1e-4)


def _token_logprobs(logits: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """[B, R] log-softmax of each response token from the packed row, by hand: the row is the
    samples' prompt + response, one after another, and token t is predicted at t - 1."""
    logp_all = torch.log_softmax(logits[0].double(), dim=-1).float()
    out = torch.zeros(batch.size, batch.response_width)
    start = 0
    for i, (prompt, response) in enumerate(zip(batch.prompt_ids, batch.response_ids)):
        for t, token in enumerate(response):
            out[i, t] = logp_all[start + len(prompt) + t - 1, token]
        start += len(prompt) + len(response)
    return out


def kl_on(cfg) -> bool:
    """Whether a loaded config puts the KL in the reward."""
    return kl_in_reward(cfg.algorithm, cfg.actor_rollout_ref.actor)


def ref_on(cfg) -> bool:
    """Whether a loaded config builds the reference."""
    return uses_reference(cfg.algorithm, cfg.actor_rollout_ref.actor)
