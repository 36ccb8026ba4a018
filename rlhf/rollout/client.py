"""Async client for SGLang's /generate: token ids in, tokens + log-probs + finish reasons out.

A rollout batch must be complete or the step must fail loudly, so every request (one per
prompt, carrying `n`; batched, all the samples one server gets) is retried with exponential
backoff after a connection error, a 5xx, a timeout or a server-side abort. Before a retry
the client asks its `recover` hook (the server group) for the URL to use next; the group
restarts a dead server there or names a healthy one. The last failure raises
`GenerateError` naming the URL and the attempt count.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import numpy as np
import torch

from rlhf.config.engine_args import ROUTES_FLAG
from rlhf.config.schema import RolloutConfig
from rlhf.errors import ExternalError
from rlhf.sglang_api import API_KEY_ENV, auth_headers

log = logging.getLogger(__name__)

RETRIES_KEY = "actor_rollout_ref.rollout.request_retries"

_AUTH_HINT = f"; the server wants an API key: set {API_KEY_ENV} to the key it was started with"

T = TypeVar("T")
# One /generate within a `GenerateClient.session`: (request index, payload) -> its result
Request = Callable[[int, dict[str, Any]], Awaitable["RequestResult"]]

# Given the URL a request just failed on, return the URL to retry it on (may block while a
# dead server is restarted; raises when there is none to retry on).
Recover = Callable[[str], str]


class GenerateError(RuntimeError, ExternalError):
    """A /generate request failed for good (bad request, bad response, or retries exhausted)."""

    kind = "rollout failed"


class _Retryable(Exception):
    """A failure worth retrying: the server may come back or another one may answer."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a failed request is re-issued."""

    retries: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> RetryPolicy:
        return cls(retries=rollout.request_retries, backoff_s=rollout.retry_backoff_s)

    def delay_s(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1-based): backoff_s * 2**(retry-1)."""
        return min(self.backoff_s * 2 ** (retry - 1), self.max_backoff_s)


@dataclass(frozen=True)
class Generation:
    """One sampled response: its token ids, their log-probs and why generation stopped."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    engine_latency_s: float | None = None  # SGLang's meta_info.e2e_latency
    # [prompt + output - 1, layers x top-k] int16: the experts each token was routed to
    # (asked for with `return_routed_experts`; `decode_routed_experts`), else None
    routed_experts: torch.Tensor | None = None
    # (version, start, end): the weight version that sampled output tokens [start, end)
    # (SGLang's meta_info.weight_versions; empty when the server does not say)
    weight_versions: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True)
class RequestResult:
    """The `n` generations of one request and what it took to get them."""

    generations: list[Generation]
    url: str  # where the successful attempt went
    attempts: int
    request_s: float  # client-side time of the successful attempt
    engine_s: float | None  # SGLang-reported time inside the server (max over the samples)
    tried_urls: list[str] = field(default_factory=list)


def generate_payload(
    prompt_ids: list[int],
    sampling_params: dict[str, Any],
    routed_experts: bool = False,
    images: tuple[bytes, ...] = (),
) -> dict[str, Any]:
    """The /generate body for one prompt (its `n` samples come back as a list);
    `routed_experts`: each token's experts come back too (mixture-of-experts policies,
    rollout routing replay; the server must run with --enable-return-routed-experts);
    `images`: the prompt's encoded image files, in order (sent base64-encoded)."""
    payload: dict[str, Any] = {
        "input_ids": prompt_ids,
        "sampling_params": sampling_params,
        "return_logprob": True,
    }
    if routed_experts:
        payload["return_routed_experts"] = True
    if images:
        payload["image_data"] = [base64.b64encode(image).decode() for image in images]
    return payload


def decode_routed_experts(encoded: str, num_tokens: int) -> torch.Tensor:
    """SGLang's `meta_info.routed_experts` (base64 of int32 [tokens, layers, top-k], in
    descending router probability) -> [num_tokens, layers x top-k] int16 (expert ids)."""
    flat = np.frombuffer(base64.b64decode(encoded, validate=True), dtype=np.int32)
    if num_tokens <= 0 or flat.size == 0 or flat.size % num_tokens:
        raise ValueError(f"{flat.size} expert ids do not split into {num_tokens} tokens")
    return torch.from_numpy(flat.reshape(num_tokens, -1).astype(np.int16))


def parse_response(
    body: Any,
    expected: int,
    url: str,
    routed_prompt_lens: list[int] | None = None,
    keep_aborted: bool = False,
) -> list[Generation]:
    """SGLang's /generate answer -> `expected` generations; raise on any other shape.
    `routed_prompt_lens`: the routed experts were asked for, for prompts of these lengths
    (one per generation).
    A sample the server aborted (a pause, a weight update) is a retryable failure, or with
    `keep_aborted` a generation with finish reason "abort" and the tokens it got."""
    items = body if isinstance(body, list) else [body]
    aborted = [_abort_message(item) for item in items if _abort_message(item) is not None]
    if aborted and not keep_aborted:
        raise _Retryable(f"request aborted by the server: {aborted[0]}")
    if len(items) != expected:
        raise GenerateError(
            f"SGLang at {url} returned {len(items)} samples for a request with n={expected}"
        )
    generations = [_parse_item(item, url) for item in items]
    if routed_prompt_lens is None:
        return generations
    return [
        dataclasses.replace(g, routed_experts=_routes(item, length, g, url))
        for item, length, g in zip(items, routed_prompt_lens, generations)
    ]


def _routes(item: dict, prompt_len: int, generation: Generation, url: str) -> torch.Tensor:
    """The routed experts of one sample: every token the model saw (all but the last)."""
    encoded = item["meta_info"].get("routed_experts")
    if not isinstance(encoded, str):
        raise GenerateError(
            f"SGLang at {url} returned no meta_info.routed_experts (rollout routing replay, "
            f"router_replay.mode=R3): start the server with --{ROUTES_FLAG.replace('_', '-')}"
        )
    try:
        return decode_routed_experts(encoded, prompt_len + len(generation.output_ids) - 1)
    except (binascii.Error, ValueError) as e:
        raise GenerateError(f"SGLang at {url}: bad meta_info.routed_experts: {e}") from e


def _abort_message(item: Any) -> str | None:
    """The server's message when it aborted this sample (e.g. for a weight update)."""
    finish = item.get("meta_info", {}).get("finish_reason") if isinstance(item, dict) else None
    if isinstance(finish, dict) and finish.get("type") == "abort":
        return str(finish.get("message", ""))
    return None


def _parse_item(item: Any, url: str) -> Generation:
    try:
        meta = item["meta_info"]
        output_ids = [int(t) for t in item["output_ids"]]
        logprobs = [float(entry[0]) for entry in meta["output_token_logprobs"]]
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise GenerateError(
            f"unexpected /generate response from {url} ({type(e).__name__}: {e}); "
            f"expected output_ids and meta_info.output_token_logprobs: {str(item)[:300]}"
        ) from e
    finish = meta.get("finish_reason")
    reason = finish.get("type", "unknown") if isinstance(finish, dict) else str(finish)
    if len(logprobs) != len(output_ids):
        raise GenerateError(
            f"SGLang at {url} returned {len(output_ids)} tokens but {len(logprobs)} log-probs"
        )
    latency = meta.get("e2e_latency")
    return Generation(
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=reason,
        engine_latency_s=float(latency) if latency is not None else None,
        weight_versions=_weight_versions(meta.get("weight_versions"), url),
    )


def _weight_versions(spans: Any, url: str) -> tuple[tuple[str, int, int], ...]:
    if spans is None:
        return ()
    try:
        return tuple((str(s["version"]), int(s["start"]), int(s["end"])) for s in spans)
    except (KeyError, TypeError, ValueError) as e:
        raise GenerateError(f"SGLang at {url}: bad meta_info.weight_versions {spans!r}") from e


class GenerateClient:
    """Sends one /generate per payload over `urls` (round-robin), at most `max_concurrent`
    in flight on each server; with `batched`, the payloads of one `generate` call that a
    server gets go to it as one batched /generate when they are at most `max_concurrent`
    (they would all be in flight at once anyway) and carry no images (`batch_payload`).

    `keep_aborted`: a sample the server cut off (`sglang_api.pause_generation`) comes back
    as it is, finish reason "abort", for `rlhf.rollout.partial` to continue from its tokens,
    instead of being generated again from the start. `lora`: every request is served with
    the LoRA adapter of that name (`rlhf.weight_sync.adapters`)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        max_concurrent: int = 64,
        timeout_s: float = 120.0,
        retry: RetryPolicy | None = None,
        recover: Recover | None = None,
        keep_aborted: bool = False,
        lora: str | None = None,
        batched: bool = False,
    ):
        if not urls:
            raise ValueError("GenerateClient needs at least one server URL")
        self.urls = list(urls)
        self.max_concurrent = max_concurrent
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self.recover = recover
        self.keep_aborted = keep_aborted
        self.lora = lora
        self.batched = batched

    def generate(self, payloads: list[dict[str, Any]]) -> list[RequestResult]:
        """Blocking `generate_async` (one event loop per batch)."""
        return asyncio.run(self.generate_async(payloads))

    async def generate_async(self, payloads: list[dict[str, Any]]) -> list[RequestResult]:
        """One result per payload, in payload order; raises if any request fails for good."""
        async with self.session() as request:
            if self._batches(payloads):
                return await self._batched(request, payloads)
            return await gather_or_cancel([request(i, p) for i, p in enumerate(payloads)])

    async def _batched(
        self, request: Request, payloads: list[dict[str, Any]]
    ) -> list[RequestResult]:
        """Each server's payloads (round-robin, as unbatched) as one batched request, after
        one that prefills the prompts they share (`shared_prompts`); its answer split back
        per payload. A retried prefill counts as a retry of its batch's payloads."""
        servers = range(min(len(self.urls), len(payloads)))
        groups = [list(range(u, len(payloads), len(self.urls))) for u in servers]
        results: list[RequestResult | None] = [None] * len(payloads)

        async def serve(group: list[int]) -> None:
            mine = [payloads[i] for i in group]
            batch = batch_payload(mine)
            prefill = shared_prompts(batch)
            retried = (await request(group[0], prefill)).attempts - 1 if prefill else 0
            answer = await request(group[0], batch)
            answer = dataclasses.replace(answer, attempts=answer.attempts + retried)
            for i, part in zip(group, split_result(answer, mine)):
                results[i] = part

        await gather_or_cancel([serve(group) for group in groups])
        served = [result for result in results if result is not None]
        assert len(served) == len(payloads), "a batch left payloads unanswered"
        return served

    def _batches(self, payloads: list[dict[str, Any]]) -> bool:
        """Whether `generate_async` sends each server's payloads as one batched request."""
        per_server = -(-len(payloads) // len(self.urls))
        pictures = any(p.get("image_data") for p in payloads)
        fits = len(payloads) > 1 and per_server <= self.max_concurrent
        return self.batched and fits and not pictures

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[Request]:
        """`request(index, payload)` within one HTTP session and concurrency limit: requests
        issued one after another (the turns of a conversation) share the connections.
        `index` picks the server (round-robin) and names the request in logs; each server
        has at most `max_concurrent` of them in flight."""
        limits: dict[str, asyncio.Semaphore] = collections.defaultdict(
            lambda: asyncio.Semaphore(self.max_concurrent)
        )
        connector = aiohttp.TCPConnector(limit=self.max_concurrent * len(self.urls))
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, headers=auth_headers()
        ) as session:

            async def request(index: int, payload: dict[str, Any]) -> RequestResult:
                return await self._request(session, limits, index, payload)

            yield request

    async def _request(
        self,
        session: aiohttp.ClientSession,
        limits: dict[str, asyncio.Semaphore],
        index: int,
        payload: dict,
    ) -> RequestResult:
        url = self.urls[index % len(self.urls)]
        attempts = self.retry.retries + 1
        tried: list[str] = []
        for attempt in range(1, attempts + 1):
            tried.append(url)
            try:
                async with limits[url]:
                    return await self._post(session, url, payload, attempt, tried)
            except _Retryable as e:
                error = e
            if attempt == attempts:
                break
            next_url = await asyncio.to_thread(self.recover, url) if self.recover else url
            delay = self.retry.delay_s(attempt)
            log.warning(
                "re-issuing /generate request %d: attempt %d/%d at %s failed (%s); "
                "retrying at %s in %.1f s",
                index,
                attempt,
                attempts,
                url,
                error,
                next_url,
                delay,
            )
            url = next_url
            await asyncio.sleep(delay)
        where = ", ".join(dict.fromkeys(tried))
        raise GenerateError(
            f"/generate at {where} failed after {attempts} attempts ({RETRIES_KEY}="
            f"{self.retry.retries}); last error: {error}"
        )

    async def _post(
        self, session: aiohttp.ClientSession, url: str, payload: dict, attempt: int, tried: list
    ) -> RequestResult:
        start = time.perf_counter()
        try:
            sent = payload if self.lora is None else {**payload, "lora_path": self.lora}
            async with session.post(f"{url}/generate", json=sent) as response:
                if response.status >= 500:
                    raise _Retryable(f"HTTP {response.status}: {(await response.text())[:300]}")
                if response.status != 200:
                    raise GenerateError(
                        f"SGLang /generate at {url} rejected the request with HTTP "
                        f"{response.status}: {(await response.text())[:500]}"
                        f"{_AUTH_HINT if response.status in (401, 403) else ''}"
                    )
                body = await response.json(content_type=None)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from e
        except TimeoutError as e:
            raise _Retryable(f"no answer within {self.timeout_s:g} s") from e
        elapsed = time.perf_counter() - start
        lengths = prompt_lengths(payload)
        routed = lengths if payload.get("return_routed_experts") else None
        generations = parse_response(body, len(lengths), url, routed, self.keep_aborted)
        latencies = [g.engine_latency_s for g in generations if g.engine_latency_s is not None]
        return RequestResult(
            generations=generations,
            url=url,
            attempts=attempt,
            request_s=elapsed,
            engine_s=max(latencies) if latencies else None,
            tried_urls=list(tried),
        )


async def gather_or_cancel(coroutines: list[Awaitable[T]]) -> list[T]:
    """The results of `coroutines`, run concurrently; if one raises, the others are
    cancelled (and awaited) before the error propagates."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def samples_of(payload: dict[str, Any]) -> int:
    """How many samples one request's /generate body asks for (its `n`)."""
    return int(payload.get("sampling_params", {}).get("n", 1))


def prompt_lengths(payload: dict[str, Any]) -> list[int]:
    """The prompt length of each generation a /generate body asks for: `n` of one prompt,
    or one per item of a batched body (`batch_payload`)."""
    ids = payload["input_ids"]
    if ids and isinstance(ids[0], list):
        return [len(one) for one in ids]
    return [len(ids)] * samples_of(payload)


def batch_payload(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """One /generate body (SGLang's batch form) for the samples of `payloads` (text only;
    the same flags), each sample an item of its own with n = 1, in payload order.

    SGLang prefills a batch's items together, where the requests of one prompt each, with
    n > 1, reach its scheduler a few at a time: it prefills each prompt first, then sends
    the samples (a CPU server here: 5 prefills of 1-20 requests before the first decode,
    each ~5-10 ms of fixed cost). Batched, with the prompts prefilled once before
    (`shared_prompts`), it takes two (a lone CPU server, 16 new prompts x 2 samples:
    236 -> 170-175 ms; 180-186 ms with each sample's prompt prefilled)."""
    items = [
        (payload["input_ids"], {**payload["sampling_params"], "n": 1})
        for payload in payloads
        for _ in range(samples_of(payload))
    ]
    body = {**payloads[0], "input_ids": [ids for ids, _ in items]}
    body["sampling_params"] = [sampling for _, sampling in items]
    return body


def shared_prompts(batch: dict[str, Any]) -> dict[str, Any] | None:
    """For a batched body whose items share prompts (a prompt's samples), a body that only
    prefills each of those prompts once (`max_new_tokens` 0), sent first: the samples then
    find their prompt in SGLang's prefix cache, as SGLang's own n > 1 requests do (the
    batch alone would prefill each sample's prompt again). None when no prompt repeats."""
    prompts = list({tuple(ids): None for ids in batch["input_ids"]})
    if len(prompts) == len(batch["input_ids"]):
        return None
    body = {k: v for k, v in batch.items() if k != "return_routed_experts"}  # none generated
    return {
        **body,
        "input_ids": [list(p) for p in prompts],
        "sampling_params": {"max_new_tokens": 0},
    }


def split_result(result: RequestResult, payloads: list[dict[str, Any]]) -> list[RequestResult]:
    """The answer to `batch_payload(payloads)` as one result per payload, each with its
    samples and the batch's attempt, in payload order."""
    parts, start = [], 0
    for payload in payloads:
        count = samples_of(payload)
        generations = result.generations[start : start + count]
        start += count
        latencies = [g.engine_latency_s for g in generations if g.engine_latency_s is not None]
        engine_s = max(latencies) if latencies else None
        parts.append(dataclasses.replace(result, generations=generations, engine_s=engine_s))
    return parts


def generate(
    url: str,
    prompts: list[list[int]],
    sampling_params: dict[str, Any],
    timeout_s: float = 300.0,
) -> list[Generation]:
    """Generate for a batch of token-id prompts on one server; samples of a prompt are adjacent."""
    client = GenerateClient([url], timeout_s=timeout_s)
    results = client.generate([generate_payload(p, sampling_params) for p in prompts])
    return [g for result in results for g in result.generations]
