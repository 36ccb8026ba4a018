"""Prompt sampler: per-epoch shuffles, n samples per prompt, exact resume at every step."""

from __future__ import annotations

import json

import pytest

from rlhf.data.sampler import PromptSampler


def batches(sampler: PromptSampler, count: int) -> list[tuple]:
    out = []
    for _ in range(count):
        b = sampler.next_batch()
        out.append((b.step, b.epoch, tuple(b.prompt_indices), tuple(b.uids)))
    return out


@pytest.mark.parametrize(("num", "batch"), [(10, 3), (12, 4), (7, 7)])
def test_resume_after_any_step_equals_uninterrupted(num, batch):
    total = 4 * (num // batch) + 2  # crosses several epoch boundaries
    reference = batches(PromptSampler(num, batch, n=2, seed=5), total)
    for k in range(total + 1):
        first = PromptSampler(num, batch, n=2, seed=5)
        assert batches(first, k) == reference[:k]
        state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
        resumed = PromptSampler(num, batch, n=2, seed=5)
        resumed.load_state_dict(state)
        assert batches(resumed, total - k) == reference[k:], f"resume after step {k}"


def test_each_epoch_is_a_fresh_shuffle_without_repeats():
    sampler = PromptSampler(num_prompts=10, batch_size=3, seed=1)
    assert sampler.steps_per_epoch == 3
    epochs: dict[int, list[int]] = {}
    for _ in range(9):
        b = sampler.next_batch()
        epochs.setdefault(b.epoch, []).extend(b.prompt_indices)
    assert sorted(epochs) == [0, 1, 2]
    for order in epochs.values():
        assert len(order) == 9 and len(set(order)) == 9 and set(order) <= set(range(10))
    assert epochs[0] != epochs[1] != epochs[2]
    again = PromptSampler(10, 3, seed=1)
    assert [again.next_batch().prompt_indices for _ in range(3)] == [
        epochs[0][i : i + 3] for i in (0, 3, 6)
    ]
    other = PromptSampler(10, 3, seed=2)
    assert [i for _ in range(3) for i in other.next_batch().prompt_indices] != epochs[0]


def test_samples_repeat_each_prompt_n_times_with_one_uid():
    batch = PromptSampler(num_prompts=8, batch_size=4, n=3, seed=0).next_batch()
    assert len(batch.sample_prompt_indices) == 12 and len(set(batch.uids)) == 4
    for j, index in enumerate(batch.prompt_indices):
        assert batch.sample_prompt_indices[3 * j : 3 * j + 3] == [index] * 3
        assert batch.sample_uids[3 * j : 3 * j + 3] == [batch.uids[j]] * 3


def test_empty_or_too_small_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="prompt dataset is empty"):
        PromptSampler(0, 4)
    with pytest.raises(ValueError, match=r"data.train_batch_size=8 is larger than the dataset \(5"):
        PromptSampler(5, 8)


def test_restoring_a_state_from_another_dataset_fails():
    state = PromptSampler(10, 2, seed=3).state_dict()
    with pytest.raises(ValueError, match="saved with num_prompts=10 but this run has 11"):
        PromptSampler(11, 2, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="saved with batch_size=2 but this run has 5"):
        PromptSampler(10, 5, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="sampler state lacks position"):
        PromptSampler(10, 2).load_state_dict({k: v for k, v in state.items() if k != "position"})


def test_checkpoint_seed_wins_over_config_seed():
    saved = PromptSampler(10, 2, seed=3)
    saved.next_batch()
    resumed = PromptSampler(10, 2, seed=99)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.next_batch().prompt_indices == saved.next_batch().prompt_indices
