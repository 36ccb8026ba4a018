"""Partial rollouts on the CPU SGLang server: a sample cut off by a pause (SGLang's abort
mode), while the server's weights get a new version, goes on from its tokens and ends with
exactly the tokens and log-probs of the same sample generated without the pause (greedy, the
weights unchanged); every token keeps the version that sampled it.
"""

from __future__ import annotations

import asyncio

import pytest

from rlhf import sglang_api
from rlhf.rollout.client import GenerateClient, generate_payload
from rlhf.rollout.partial import generate_through_pauses

PROMPT = [5, 6, 7, 8, 9]
SAMPLING = {"temperature": 0.0, "max_new_tokens": 500, "ignore_eos": True}


async def cut_once(url: str, version: str):
    """The sample, paused once while it generates; the weights relabelled `version`."""
    async with GenerateClient([url], keep_aborted=True).session() as request:
        task = asyncio.ensure_future(generate_through_pauses(request, 0, PROMPT, SAMPLING, set()))
        await asyncio.sleep(0.3)  # into the generation (500 tokens: 1.7 s here)
        await asyncio.to_thread(sglang_api.pause_generation, url)
        try:
            assert not task.done(), "the sample finished before the pause: make it longer"
            await asyncio.to_thread(sglang_api.update_weight_version, url, version)
        finally:
            await asyncio.to_thread(sglang_api.continue_generation, url)
        return await task


def test_a_sample_cut_by_a_pause_goes_on_to_the_tokens_of_the_uncut_one(sglang_server):
    url = sglang_server.url
    before = sglang_api.weight_version(url)
    (reference,) = GenerateClient([url]).generate([generate_payload(PROMPT, {**SAMPLING, "n": 1})])
    expected = reference.generations[0]
    try:
        whole, answers = asyncio.run(cut_once(url, "partial-test"))
    finally:
        sglang_api.update_weight_version(url, before or "default")
    first = answers[0].generations[0]
    assert first.finish_reason == "abort" and 0 < len(first.output_ids) < 500
    assert len(answers) == 2 and whole.finish_reason == "length"
    assert whole.output_ids == expected.output_ids  # nothing lost, nothing twice
    assert whole.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    cut = len(first.output_ids)
    assert whole.weight_versions == ((before, 0, cut), ("partial-test", cut, 500))
