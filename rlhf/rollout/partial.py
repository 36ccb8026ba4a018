"""Partial rollouts: a sample cut off by a pause goes on from where it stopped.

Asynchronous training updates the servers' weights while they generate. The servers are
paused first (`sglang_api.pause_generation`, SGLang's abort mode): every /generate in flight
is answered at once with the tokens it has (finish reason "abort"), so when the pause
returns, the client holds every cut sample's tokens and the server holds no request. The
weights are synced and generation continued; each cut sample is then sent again as its
prompt + the tokens it has, with the rest of its token budget, token in, token out: nothing
is generated twice and nothing is lost. SGLang keeps one token sampled after the cut without
checking it against the end of the sample, so that is done here: a cut sample whose last
token ends it (an end-of-sequence or stop token) or whose budget is spent is finished.

Each output token keeps the weight version that sampled it (`Generation.weight_versions`,
SGLang's spans, offset into the whole sample), which is where staleness is read from.
A connection error or timeout within a segment is retried by the client from the same
state: a segment's tokens are kept only from an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rlhf.rollout.client import (
    GenerateClient,
    GenerateError,
    Generation,
    Request,
    RequestResult,
    gather_or_cancel,
    generate_payload,
)

ABORT = "abort"
SEGMENT_SEED_STRIDE = 1 << 24  # a continued segment's sampling seed stays clear of others'
GATE_POLL_S = 0.005  # how often a request held by a closed gate looks again
GATE_ABORT_WAIT_S = 0.05  # how long a pause waits for aborted requests before aborting again


async def generate_through_pauses(
    request: Request,
    index: int,
    prompt_ids: list[int],
    sampling: dict[str, Any],
    stop_ids: set[int],
    max_segments: int = 16,
    keep_tokens: bool = True,
) -> tuple[Generation, list[RequestResult]]:
    """One sample of `sampling` (n=1) for `prompt_ids`, continued after every pause, and
    every /generate answer it took. `request` must keep aborted answers
    (`GenerateClient(keep_aborted=True)`); `stop_ids`: the tokens that end a sample.
    `keep_tokens=False`: a cut sample starts again from its prompt (its tokens dropped,
    so every token of the result comes from one weight version)."""
    budget = int(sampling["max_new_tokens"])
    ids: list[int] = []
    logprobs: list[float] = []
    spans: list[tuple[str, int, int]] = []
    results: list[RequestResult] = []
    for segment in range(max_segments):
        if not keep_tokens:
            ids, logprobs, spans = [], [], []
        params = {**sampling, "n": 1, "max_new_tokens": budget - len(ids)}
        if "sampling_seed" in sampling:
            params["sampling_seed"] = sampling["sampling_seed"] + segment * SEGMENT_SEED_STRIDE
        result = await request(index, generate_payload(prompt_ids + ids, params))
        results.append(result)
        cut = result.generations[0]
        offset = len(ids)
        ids += cut.output_ids
        logprobs += cut.logprobs
        for version, start, end in cut.weight_versions:
            if spans and spans[-1][0] == version and spans[-1][2] == offset + start:
                spans[-1] = (version, spans[-1][1], offset + end)  # one span per version run
            else:
                spans.append((version, offset + start, offset + end))
        reason = _finish(cut.finish_reason, ids, budget, stop_ids)
        if reason is not None:
            kept = min(len(ids), budget)
            clipped = [(v, s, min(e, kept)) for v, s, e in spans if s < kept]
            whole = Generation(ids[:kept], logprobs[:kept], reason, weight_versions=tuple(clipped))
            return whole, results
    raise GenerateError(
        f"/generate request {index} was cut off by {max_segments} pauses without finishing"
    )


class GenerationGate:
    """This process's own pause of its continued requests (`through_pauses`), cheaper than
    SGLang's: `/pause_generation` in abort mode checks once a second whether its aborts are
    done (1.0 s per pause measured on the CPU server, whatever the batch). Here the gate is
    closed (requests about to be sent wait), the servers abort every request in flight
    (`sglang_api.abort_all_requests`; each comes back with its tokens), and `pause` returns
    once none of ours is in flight; opening the gate lets the cut samples go on. SGLang's
    weight updates wait for requests in flight anyway, so one that slipped past the abort
    only delays the update, never sees half-updated weights."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = True
        self._in_flight = 0

    async def enter(self) -> None:
        """Wait until the gate is open, then count a request in flight."""
        while True:
            with self._cond:
                if self._open:
                    self._in_flight += 1
                    return
            await asyncio.sleep(GATE_POLL_S)

    def leave(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def closed(self, abort: Callable[[], None], timeout_s: float) -> Iterator[None]:
        """Inside: no request of ours is in flight or sent (`abort` cuts those in flight,
        again until they have all come back)."""
        with self._cond:
            self._open = False
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                abort()
                with self._cond:
                    if self._cond.wait_for(lambda: self._in_flight == 0, GATE_ABORT_WAIT_S):
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"requests still in flight {timeout_s:.0f} s after abort")
            yield
        finally:
            with self._cond:
                self._open = True


async def through_pauses(
    client: GenerateClient,
    specs: list[tuple[int, list[int], int | None]],
    sampling: dict[str, Any],
    stop_ids: set[int],
    keep_tokens: bool,
    gate: GenerationGate,
) -> tuple[list[Generation], list[RequestResult]]:
    """`generate_through_pauses` for each (prompt index, prompt ids, seed) of `specs`,
    concurrently in one client session, every request through `gate`: the samples in
    order, and every answer."""
    results: list[RequestResult] = []
    async with client.session() as send:

        async def request(index: int, payload: dict[str, Any]) -> RequestResult:
            await gate.enter()
            try:
                return await send(index, payload)
            finally:
                gate.leave()

        async def one(index: int, prompt: list[int], seed: int | None) -> Generation:
            params = sampling if seed is None else {**sampling, "sampling_seed": seed}
            generation, answers = await generate_through_pauses(
                request, index, prompt, params, stop_ids, keep_tokens=keep_tokens
            )
            results.extend(answers)
            return generation

        done = await gather_or_cancel([one(k, p, seed) for k, (_, p, seed) in enumerate(specs)])
        return done, results


def _finish(reason: str, ids: list[int], budget: int, stop_ids: set[int]) -> str | None:
    """Why the sample is finished after this segment, or None when it goes on."""
    if reason != ABORT:
        return reason
    if len(ids) >= budget:
        return "length"
    if ids and ids[-1] in stop_ids:
        return "stop"
    return None


def end_of_sample_ids(model_path: str | Path, tokenizer) -> set[int]:
    """The tokens SGLang ends a sample at: the tokenizer's end-of-sequence token and the
    model's `generation_config.json` eos_token_id (an id or a list)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    config = Path(model_path) / "generation_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids


def first_and_last_version(
    spans: tuple[tuple[str, int, int], ...], default: int | None
) -> tuple[int | None, int | None]:
    """The oldest and newest weight version among a sample's token spans (versions that are
    not step numbers, and samples without spans, count as `default`)."""
    versions = [int(v) if v.isdigit() else default for v, _, _ in spans] or [default]
    known = [v for v in versions if v is not None]
    return (min(known), max(known)) if known else (None, None)
