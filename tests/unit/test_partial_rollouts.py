"""The continuation rules of partial rollouts (`rlhf.rollout.partial`) on scripted answers:
what SGLang answers for a cut sample (the tokens so far and one token sampled after the cut,
finish reason "abort") cannot be timed on a live server, so the answers are written here."""

from __future__ import annotations

import asyncio

import pytest

from rlhf.rollout.client import GenerateError, Generation, RequestResult
from rlhf.rollout.partial import generate_through_pauses

EOS = 99


def scripted(answers: list[Generation]):
    """A `request` that answers `answers` in turn and records what it was sent."""
    sent: list[dict] = []

    async def request(index: int, payload: dict) -> RequestResult:
        sent.append(payload)
        return RequestResult([answers[len(sent) - 1]], "http://s", 1, 0.0, None)

    return request, sent


def cut(ids: list[int], version: str, reason: str = "abort") -> Generation:
    return Generation(ids, [-0.5] * len(ids), reason, weight_versions=((version, 0, len(ids)),))


def run(answers: list[Generation], budget: int = 6, max_segments: int = 16):
    request, sent = scripted(answers)
    sampling = {"temperature": 1.0, "max_new_tokens": budget, "sampling_seed": 7}
    whole, results = asyncio.run(
        generate_through_pauses(request, 0, [1, 2], sampling, {EOS}, max_segments)
    )
    return whole, sent, results


def test_a_cut_sample_goes_on_from_its_tokens_with_the_rest_of_its_budget():
    whole, sent, results = run(
        [cut([10, 11], "3"), cut([12], "4"), cut([13, 14, 15], "4", "length")]
    )
    assert [p["input_ids"] for p in sent] == [[1, 2], [1, 2, 10, 11], [1, 2, 10, 11, 12]]
    assert [p["sampling_params"]["max_new_tokens"] for p in sent] == [6, 4, 3]
    assert len({p["sampling_params"]["sampling_seed"] for p in sent}) == 3
    assert whole.output_ids == [10, 11, 12, 13, 14, 15] and whole.finish_reason == "length"
    assert whole.weight_versions == (("3", 0, 2), ("4", 2, 6))
    assert len(results) == 3


def test_the_token_kept_after_a_cut_can_end_the_sample():
    whole, sent, _ = run([cut([10, EOS], "3")])  # the extra token is an end of sequence
    assert len(sent) == 1 and whole.output_ids == [10, EOS] and whole.finish_reason == "stop"
    whole, sent, _ = run([cut([10, 11, 12, 13, 14], "3"), cut([15, 16], "4")])  # 7 > budget 6
    assert whole.output_ids == [10, 11, 12, 13, 14, 15] and whole.finish_reason == "length"
    assert whole.weight_versions == (("3", 0, 5), ("4", 5, 6))


def test_a_sample_cut_without_end_fails_after_its_segments():
    with pytest.raises(GenerateError, match="cut off by 3 pauses"):
        run([cut([10], "3")] * 3, budget=100, max_segments=3)
