"""The /generate client against a tiny local aiohttp server: parsing, retries with backoff,
re-issue on another URL, bounded concurrency, and clear errors naming URL and attempts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest
from aiohttp import web

from rlhf.rollout.client import (
    GenerateClient,
    GenerateError,
    RetryPolicy,
    batch_payload,
    generate_payload,
    parse_response,
    shared_prompts,
)
from rlhf.utils import free_port

FAST = RetryPolicy(retries=2, backoff_s=0.01)


def sglang_item(ids: list[int], finish: str = "length") -> dict:
    return {
        "text": "",
        "output_ids": ids,
        "meta_info": {
            "finish_reason": {"type": finish},
            "output_token_logprobs": [[-0.5 - t, t, None] for t in ids],
            "e2e_latency": 0.25,
        },
    }


def canned(payload: dict) -> list[dict] | dict:
    """What SGLang answers: sample j of prompt p is [p[0], j]; a list when n > 1. A batched
    body (one sample an item) gets its items, the j-th of a prompt [p[0], j], no tokens
    where `max_new_tokens` is 0."""
    ids, sampling = payload["input_ids"], payload["sampling_params"]
    if isinstance(ids[0], list):
        samplings = sampling if isinstance(sampling, list) else [sampling] * len(ids)
        return [
            sglang_item([x[0], ids[:k].count(x)] if p.get("max_new_tokens", 1) else [])
            for k, (x, p) in enumerate(zip(ids, samplings))
        ]
    n = sampling.get("n", 1)
    items = [sglang_item([ids[0], j]) for j in range(n)]
    return items if n > 1 else items[0]


class FakeServer:
    """Answers /generate with `behaviour(request_number, payload)` -> web.Response."""

    def __init__(self, behaviour: Callable[[int, dict], web.StreamResponse] | None = None):
        self.behaviour = behaviour or (lambda i, payload: web.json_response(canned(payload)))
        self.requests = 0
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.delay_s = 0.0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        self.requests += 1
        self.bodies.append(payload)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            result = self.behaviour(self.requests, payload)
            return await result if asyncio.iscoroutine(result) else result
        finally:
            self.in_flight -= 1

    async def __aenter__(self) -> FakeServer:
        app = web.Application()
        app.router.add_post("/generate", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


def payloads(num: int, n: int = 2) -> list[dict]:
    return [generate_payload([100 + i, 7], {"n": n, "max_new_tokens": 2}) for i in range(num)]


def run(coro):
    return asyncio.run(coro)


def test_parse_list_and_single_responses():
    many = parse_response([sglang_item([5, 6]), sglang_item([7], "stop")], 2, "http://x")
    assert [g.output_ids for g in many] == [[5, 6], [7]]
    assert many[0].logprobs == [-5.5, -6.5]
    assert [g.finish_reason for g in many] == ["length", "stop"]
    assert many[0].engine_latency_s == 0.25
    (one,) = parse_response(sglang_item([9]), 1, "http://x")
    assert one.output_ids == [9] and one.logprobs == [-9.5]


@pytest.mark.parametrize(
    ("body", "expected", "message"),
    [
        ([sglang_item([1])], 2, r"returned 1 samples for a request with n=2"),
        ({"output_ids": [1], "meta_info": {}}, 1, r"output_token_logprobs"),
        (
            {"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-1.0, 1, None]]}},
            1,
            r"2 tokens but 1 log-probs",
        ),
    ],
)
def test_parse_rejects_malformed_responses(body, expected, message):
    with pytest.raises(GenerateError, match=message):
        parse_response(body, expected, "http://127.0.0.1:1")


def test_backoff_doubles_and_is_capped():
    policy = RetryPolicy(retries=5, backoff_s=0.5, max_backoff_s=3.0)
    assert [policy.delay_s(r) for r in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_results_in_payload_order_with_n_samples_each():
    async def main():
        async with FakeServer() as server:
            client = GenerateClient([server.url], retry=FAST)
            return await client.generate_async(payloads(5, n=3)), server.requests

    results, requests = run(main())
    assert requests == 5  # one request per prompt, carrying n
    for i, result in enumerate(results):
        assert [g.output_ids for g in result.generations] == [[100 + i, j] for j in range(3)]
        assert result.attempts == 1 and result.engine_s == 0.25


def test_5xx_is_retried_with_warning_and_recover_hook(caplog):
    recovered: list[str] = []

    def flaky(i: int, payload: dict) -> web.Response:
        if i <= 2:
            return web.Response(status=503, text="overloaded")
        return web.json_response(canned(payload))

    def recover(url: str) -> str:
        recovered.append(url)
        return url

    async def main():
        async with FakeServer(flaky) as server:
            client = GenerateClient([server.url], retry=FAST, recover=recover)
            return await client.generate_async(payloads(1)), server.url

    with caplog.at_level(logging.WARNING, logger="rlhf.rollout.client"):
        (result,), url = run(main())
    assert result.attempts == 3
    assert [g.output_ids for g in result.generations] == [[100, 0], [100, 1]]
    assert recovered == [url, url]
    reissues = [r for r in caplog.records if "re-issuing" in r.getMessage()]
    assert len(reissues) == 2 and all(url in r.getMessage() for r in reissues)


def test_persistent_5xx_fails_naming_url_and_attempts():
    async def main():
        async with FakeServer(lambda i, p: web.Response(status=500, text="boom")) as server:
            client = GenerateClient([server.url], retry=FAST)
            with pytest.raises(GenerateError) as info:
                await client.generate_async(payloads(1))
            return info.value, server

    error, server = run(main())
    assert server.requests == 3
    assert server.url in str(error) and "after 3 attempts" in str(error)
    assert "request_retries=2" in str(error) and "HTTP 500: boom" in str(error)


def test_client_error_is_not_retried():
    async def main():
        async with FakeServer(lambda i, p: web.Response(status=400, text="bad n")) as server:
            client = GenerateClient([server.url], retry=FAST)
            with pytest.raises(GenerateError, match=r"rejected the request with HTTP 400: bad n"):
                await client.generate_async(payloads(1))
            return server.requests

    assert run(main()) == 1


def test_unreachable_url_fails_after_bounded_retries():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    client = GenerateClient([url], retry=FAST)
    with pytest.raises(GenerateError, match=r"after 3 attempts") as info:
        client.generate(payloads(2))
    assert url in str(info.value)


def test_recover_can_move_requests_to_another_server():
    dead = f"http://127.0.0.1:{free_port()}"

    async def main():
        async with FakeServer() as healthy:
            client = GenerateClient([dead], retry=FAST, recover=lambda url: healthy.url)
            return await client.generate_async(payloads(3)), healthy.url

    results, healthy_url = run(main())
    assert all(r.url == healthy_url and r.tried_urls == [dead, healthy_url] for r in results)
    assert [r.generations[0].output_ids[0] for r in results] == [100, 101, 102]


def test_aborted_and_timed_out_requests_are_reissued():
    async def slow_first(i: int, payload: dict) -> web.Response:
        if i == 1:
            await asyncio.sleep(2.0)
        if i == 2:
            return web.json_response([sglang_item([1], finish="abort")])
        return web.json_response(canned(payload))

    async def main():
        async with FakeServer(slow_first) as server:
            client = GenerateClient([server.url], retry=FAST, timeout_s=0.5)
            return await client.generate_async(payloads(1))

    (result,) = run(main())
    assert result.attempts == 3 and len(result.generations) == 2


def test_concurrency_is_bounded():
    async def main():
        async with FakeServer() as server:
            server.delay_s = 0.05
            client = GenerateClient([server.url], max_concurrent=3, retry=FAST)
            results = await client.generate_async(payloads(12))
            return results, server.max_in_flight

    results, max_in_flight = run(main())
    assert len(results) == 12
    assert 1 <= max_in_flight <= 3


def test_concurrency_is_bounded_per_server():
    """`rollout.max_concurrent_requests` is per server: four servers each get their own
    limit (it was one limit over all of them: 64 requests in flight for 4 servers)."""

    async def main():
        async with FakeServer() as a, FakeServer() as b:
            a.delay_s = b.delay_s = 0.05
            client = GenerateClient([a.url, b.url], max_concurrent=3, retry=FAST)
            results = await client.generate_async(payloads(24))
            return results, (a.max_in_flight, b.max_in_flight)

    results, in_flight = run(main())
    assert len(results) == 24 and in_flight == (3, 3)


def test_batched_client_sends_each_server_its_samples_in_one_call():
    """Per server: each of its prompts prefilled once, then all its samples as one batch of
    n = 1 items; the results split back per payload, in payload order."""

    async def main():
        async with FakeServer() as one, FakeServer() as two:
            client = GenerateClient([one.url, two.url], retry=FAST, batched=True)
            return await client.generate_async(payloads(5, n=2)), one.bodies, two.bodies

    results, first, second = run(main())
    for i, result in enumerate(results):
        assert [g.output_ids for g in result.generations] == [[100 + i, 0], [100 + i, 1]]
        assert result.attempts == 1 and result.engine_s == 0.25
    for bodies, mine in ((first, [0, 2, 4]), (second, [1, 3])):
        prefill, batch = bodies
        assert prefill["input_ids"] == [[100 + i, 7] for i in mine]
        assert prefill["sampling_params"] == {"max_new_tokens": 0}
        assert batch["input_ids"] == [[100 + i, 7] for i in mine for _ in range(2)]
        assert batch["sampling_params"] == [{"n": 1, "max_new_tokens": 2}] * 2 * len(mine)
        assert batch["return_logprob"] is True


def test_batched_seeded_samples_keep_their_seeds_and_share_one_prefill():
    seeded = [
        generate_payload([100 + i // 2, 7], {"n": 1, "sampling_seed": 10 + i}) for i in range(4)
    ]

    async def main():
        async with FakeServer() as server:
            client = GenerateClient([server.url], retry=FAST, batched=True)
            return await client.generate_async(seeded), server.bodies

    results, (prefill, batch) = run(main())
    assert [r.generations[0].output_ids for r in results] == [
        [100, 0],
        [100, 1],
        [101, 0],
        [101, 1],
    ]
    assert prefill["input_ids"] == [[100, 7], [101, 7]]
    assert [p["sampling_seed"] for p in batch["sampling_params"]] == [10, 11, 12, 13]


def test_batched_client_retries_the_whole_batch():
    def flaky(i: int, payload: dict) -> web.Response:
        if i == 2:  # the samples' first attempt
            return web.Response(status=503, text="busy")
        return web.json_response(canned(payload))

    async def main():
        async with FakeServer(flaky) as server:
            client = GenerateClient([server.url], retry=FAST, batched=True)
            return await client.generate_async(payloads(3)), server.requests

    results, requests = run(main())
    assert requests == 3 and [r.attempts for r in results] == [2, 2, 2]
    assert [g.output_ids for g in results[2].generations] == [[102, 0], [102, 1]]


@pytest.mark.parametrize(
    ("many", "pictures"), [(3, False), (2, True)], ids=["over-max-concurrent", "images"]
)
def test_batched_client_sends_one_request_a_payload_beyond_a_batch(many, pictures):
    """More payloads for a server than `max_concurrent` (they would not all be in flight at
    once), or payloads with images: one request each, as unbatched."""
    sent = payloads(many)
    if pictures:
        sent = [
            generate_payload(p["input_ids"], p["sampling_params"], images=(b"png",)) for p in sent
        ]

    async def main():
        async with FakeServer() as server:
            client = GenerateClient([server.url], retry=FAST, max_concurrent=2, batched=True)
            return await client.generate_async(sent), server.bodies

    results, bodies = run(main())
    assert len(bodies) == many and all(b["sampling_params"]["n"] == 2 for b in bodies)
    assert [len(r.generations) for r in results] == [2] * many


def test_the_shared_prefill_generates_nothing_and_asks_for_no_routes():
    batch = batch_payload([generate_payload([1, 2], {"n": 2}, routed_experts=True)])
    assert batch["return_routed_experts"] and batch["input_ids"] == [[1, 2], [1, 2]]
    prefill = shared_prompts(batch)
    assert prefill is not None and "return_routed_experts" not in prefill
    assert prefill["input_ids"] == [[1, 2]] and prefill["sampling_params"] == {"max_new_tokens": 0}
    assert shared_prompts(batch_payload([generate_payload([1, 2], {"n": 1})])) is None
