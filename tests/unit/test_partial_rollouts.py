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


def test_a_closed_gate_holds_new_requests_and_waits_for_those_in_flight():
    """The pause of `SGLangEngine.paused`: closing aborts what is in flight (again until all
    of it has come back), requests sent meanwhile wait, opening lets them go."""
    import threading

    from rlhf.rollout.partial import GenerationGate

    gate, order = GenerationGate(), []
    answered = threading.Event()  # the server answers the request in flight once aborted

    async def one(name: str, wait_for_answer: bool) -> None:
        await gate.enter()
        order.append(f"{name} sent")
        while wait_for_answer and not answered.is_set():
            await asyncio.sleep(0.001)
        gate.leave()
        order.append(f"{name} answered")

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    in_flight = asyncio.run_coroutine_threadsafe(one("cut", True), loop)
    while "cut sent" not in order:
        pass
    aborts = []

    def abort() -> None:
        aborts.append(1)
        if len(aborts) == 2:  # the first abort missed it: the gate aborts again
            answered.set()

    with gate.closed(abort, timeout_s=10):
        assert order == ["cut sent", "cut answered"] and len(aborts) == 2
        held = asyncio.run_coroutine_threadsafe(one("continued", False), loop)
        with pytest.raises(TimeoutError):
            held.result(timeout=0.1)  # waits at the closed gate
        order.append("weights synced")
    held.result(timeout=10)
    in_flight.result(timeout=10)
    assert order[2:] == ["weights synced", "continued sent", "continued answered"]
    loop.call_soon_threadsafe(loop.stop)
