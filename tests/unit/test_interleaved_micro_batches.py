"""Micro-batches for Megatron's interleaved pipeline: a count that is a multiple of PP, and the
empty fillers that reach it when a rank holds fewer samples, which must add nothing."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algo.losses import BatchCounts
from rlhf.config import load_config
from rlhf.data.packing import first_fit_bins, plan_micro_batches
from rlhf.engine.heads import PolicyLossHead, ValueLossHead
from rlhf.engine.micro_batch import build_micro_batch
from rlhf.models.logprobs import VocabShard
from rlhf.rollout.batch import RolloutBatch
from rlhf.trainer.step import Experience

VOCAB = 17


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=2, max_size=24),
    budget=st.integers(40, 120),
    dp=st.sampled_from([1, 2]),
    multiple=st.sampled_from([1, 2, 3, 4]),
)
def test_count_is_a_multiple_and_fillers_only_when_samples_run_out(lengths, budget, dp, multiple):
    lengths = lengths[: len(lengths) - len(lengths) % dp]
    plan = plan_micro_batches(
        lengths, max_tokens_per_micro_batch=budget, dp_size=dp, count_multiple=multiple
    )
    (mini,) = plan.assignments
    per_rank = len(lengths) // dp
    needed = max(first_fit_bins(rank_ids, lengths, budget) for rank_ids in _ranks(mini))
    for rank in mini:
        assert len(rank) % multiple == 0
        assert len(rank) == -(-needed // multiple) * multiple  # rounded up, no further
        empty = sum(1 for micro in rank if not micro)
        assert empty == max(0, len(rank) - per_rank)
        assert all(sum(lengths[i] for i in micro) <= budget for micro in rank)
    placed = sorted(i for rank in mini for micro in rank for i in micro)
    assert placed == list(range(len(lengths)))


def _ranks(mini: list[list[list[int]]]) -> list[list[int]]:
    return [[i for micro in rank for i in micro] for rank in mini]


def _batch() -> RolloutBatch:
    gen = torch.Generator().manual_seed(5)
    responses = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 5, 2)]
    return RolloutBatch(
        prompt_ids=[[4, 5, 6], [7, 8], [9, 10, 11, 12]],
        response_ids=responses,
        scores_b=torch.tensor([1.0, 0.0, 0.5]),
        data_sources=["synthetic"] * 3,
        uids=["a", "b", "c"],
    )


def _experience(batch: RolloutBatch) -> Experience:
    gen = torch.Generator().manual_seed(6)
    shape, mask = (batch.size, batch.response_width), batch.mask_bt()

    def rand(scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale + shift) * mask

    old = rand(0.3, -3.0)
    return Experience(batch, old, rand(), old, rand(), rand(), rand(), rand())


def test_a_filler_micro_batch_is_padding_that_adds_nothing_to_losses_or_metrics():
    """A mini-batch of two real micro-batches plus an empty filler gives the same summed loss
    and metrics (policy and value) as the two alone; the filler's loss is exactly 0 and its
    outputs get no gradient."""
    batch = _batch()
    exp = _experience(batch)
    real = [build_micro_batch(batch, [0, 2]), build_micro_batch(batch, [1])]
    filler = build_micro_batch(batch, [], tp_split=2)
    assert filler.num_tokens == 2 and filler.sample_ids == []
    assert filler.gather_index.shape == (0, batch.response_width)
    counts = BatchCounts(int(batch.mask_bt().sum()), batch.size)
    cfg = load_config(None, [])
    policy = PolicyLossHead(VocabShard(0, VOCAB), 0.8, cfg.actor_rollout_ref.actor, 8, exp, counts)
    value = ValueLossHead(cfg.critic, 8, exp, counts)
    gen = torch.Generator().manual_seed(7)
    for head, width in ((policy, VOCAB), (value, 1)):
        outputs = {}
        for mb in [*real, filler]:
            out = torch.randn(1, mb.num_tokens, width, generator=gen, requires_grad=True)
            loss, metrics = head(out, mb)
            loss.backward()
            outputs[id(mb)] = (loss.detach(), metrics, out.grad)
        loss_f, metrics_f, grad_f = outputs[id(filler)]
        assert loss_f.item() == 0.0 and torch.count_nonzero(grad_f) == 0
        assert all(torch.isfinite(v).all() and float(v) == 0.0 for v in metrics_f.values())
        total = sum(outputs[id(mb)][0] for mb in real)
        with_filler = total + loss_f
        assert torch.equal(with_filler, total) and total.abs() > 0


def test_global_layer_names_go_back_to_a_stages_local_ones_for_format_1():
    """Format /1 optimizer files name a stage's layers from 0: stage 1 of 2 with 4 layers."""
    from rlhf.engine.optimizer_shards import local_names

    names = {
        1: "decoder.layers.2.mlp.linear_fc1.weight",
        2: "decoder.layers.3.self_attention.linear_qkv.weight",
        3: "decoder.final_layernorm.weight",
    }
    assert local_names(names) == {
        1: "decoder.layers.0.mlp.linear_fc1.weight",
        2: "decoder.layers.1.self_attention.linear_qkv.weight",
        3: "decoder.final_layernorm.weight",
    }
