"""The rollout engine contract and its SGLang implementation.

The trainer only needs "token-id prompts in, `n` samples per prompt with log-probs out",
plus health and shutdown; `RolloutEngine` is that contract, so the PPO loop does not
depend on how servers are launched, routed or restarted. `SGLangEngine` fulfils it with a
`ServerGroup` (processes) and a `GenerateClient` (HTTP, retries). Weight updates are not
part of it: `rlhf.weight_sync` sends them to `server_urls`, and a handler registered with
`on_server_restart` is told when a restarted server needs the current weights again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from rlhf import sglang_api
from rlhf.config.schema import RolloutConfig
from rlhf.rollout.client import GenerateClient, RequestResult, RetryPolicy, generate_payload
from rlhf.rollout.multi_turn import (
    Conversation,
    ConversationRequest,
    MultiTurnRollout,
    run_conversations,
)
from rlhf.rollout.partial import GenerationGate, through_pauses
from rlhf.rollout.server_group import ServerGroup


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; `to_sglang()` gives SGLang's names.

    `seed` is the base of per-sample seeds: with `prompt_keys` (what each prompt of the
    call is, e.g. its uid) sample j of prompt i uses a hash of (seed, prompt_keys[i], j),
    which no other prompt or draw shares; without, seed + i*n + j. SGLang honours
    `sampling_seed` under deterministic inference, and on the CPU engine through
    `rlhf.rollout.seeded_sampling`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    routed_experts: bool = False  # ask for each token's experts (rollout routing replay, R3)
    prompt_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        checks = [
            (self.n > 0, "n must be > 0"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k > 0, "top_k must be -1 (off) or > 0"),
            (self.max_new_tokens > 0, "max_new_tokens must be > 0"),
        ]
        errors = [message for ok, message in checks if not ok]
        if errors:
            raise ValueError(f"invalid SamplingParams ({'; '.join(errors)}): {self}")

    @classmethod
    def from_config(
        cls, rollout: RolloutConfig, max_new_tokens: int, seed: int | None = None
    ) -> SamplingParams:
        """From `actor_rollout_ref.rollout` (n, temperature, top_p, top_k) and a length."""
        return cls(
            n=rollout.n,
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            max_new_tokens=max_new_tokens,
            seed=seed,
        )

    def sample_seed(self, prompt: int, sample: int) -> int | None:
        """The seed of sample `sample` of prompt `prompt` (None without a base seed)."""
        if self.seed is None:
            return None
        if self.prompt_keys:
            return derived_seed(self.seed, self.prompt_keys[prompt], sample)
        return self.seed + prompt * self.n + sample

    def for_prompts(self, keys: list[str]) -> SamplingParams:
        """These params for a call on prompts `keys` (seeded per prompt key when seeded)."""
        return self if self.seed is None else dataclasses.replace(self, prompt_keys=tuple(keys))

    def to_sglang(self) -> dict[str, Any]:
        """The `sampling_params` object of SGLang's /generate."""
        params: dict[str, Any] = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
        }
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        return params


def derived_seed(seed: int, key: str, sample: int) -> int:
    """A request seed in [0, 2^62) from (run seed, prompt key, sample index): a hash, so
    that nearby inputs give unrelated seeds (headroom for the strides that later turns and
    continued segments add)."""
    digest = hashlib.blake2b(f"{seed}/{key}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


@dataclass(frozen=True)
class RolloutSample:
    """One response to prompt `prompt_index`: its tokens, their log-probs, why it stopped."""

    prompt_index: int
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    routed_experts: torch.Tensor | None = (
        None  # [prompt + response - 1, layers x top-k] int16 when asked for
    )
    # (weight version, start, end) over the response tokens, when SGLang says
    weight_versions: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True)
class RolloutStats:
    """What one `generate` call cost; `engine_share` = engine_s / request_s."""

    requests: int
    samples: int
    generated_tokens: int
    wall_s: float  # the whole batch, client side
    request_s: float  # sum over requests of the client-side time of the answered attempt
    engine_s: float | None  # sum of SGLang's meta_info.e2e_latency (None if not reported)
    retried_requests: int

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def engine_share(self) -> float | None:
        if self.engine_s is None or self.request_s <= 0:
            return None
        return self.engine_s / self.request_s

    @classmethod
    def of(cls, results: list[RequestResult], wall_s: float) -> RolloutStats:
        engine = [r.engine_s for r in results if r.engine_s is not None]
        return cls(
            requests=len(results),
            samples=sum(len(r.generations) for r in results),
            generated_tokens=sum(len(g.output_ids) for r in results for g in r.generations),
            wall_s=wall_s,
            request_s=sum(r.request_s for r in results),
            engine_s=sum(engine) if len(engine) == len(results) else None,
            retried_requests=sum(r.attempts > 1 for r in results),
        )


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates `n` samples per prompt; samples of a prompt are adjacent, in prompt order."""

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        images: list[tuple[bytes, ...]] | None = None,
    ) -> list[RolloutSample]:
        """Samples for token-id `prompts` (with each one's encoded `images`, a
        vision-language policy); complete, or an exception."""
        ...

    def health(self) -> dict[str, bool]:
        """Server URL -> healthy."""
        ...

    def shutdown(self) -> None:
        """Stop every process the engine started; idempotent."""
        ...


def request_payloads(
    prompts: list[list[int]],
    params: SamplingParams,
    images: list[tuple[bytes, ...]] | None = None,
) -> list[tuple[int, dict[str, Any]]]:
    """(prompt index, /generate body) per request, in sample order; `images`: each prompt's.

    One request per prompt carries all `n` samples. With a seed, SGLang would give all `n`
    samples of a request the same seed (identical samples), so each sample gets a request.
    """
    pictures = images or [()] * len(prompts)
    routed = params.routed_experts
    if params.seed is None:
        sampling = params.to_sglang()
        return [
            (i, generate_payload(p, sampling, routed, pictures[i])) for i, p in enumerate(prompts)
        ]
    payloads = []
    for i, prompt in enumerate(prompts):
        for j in range(params.n):
            one = dataclasses.replace(params, n=1, seed=params.sample_seed(i, j)).to_sglang()
            payloads.append((i, generate_payload(prompt, one, routed, pictures[i])))
    return payloads


class SGLangEngine:
    """`RolloutEngine` on SGLang servers; starts them on construction, use with `with`."""

    def __init__(
        self,
        rollout: RolloutConfig,
        model_path: str | Path | None = None,
        *,
        log_dir: str | Path,
        device: str = "cuda",
        seed: int = 0,
        max_total_tokens: int | None = None,
        on_restart: Callable[[str], None] | None = None,
        wait: bool = True,
        gpus_per_node: int | None = None,
        lora: str | None = None,
    ):
        """`wait=False`: return once the servers are launched; call `wait_ready()` before
        generating. On a GPU the servers take disjoint GPUs of this node, checked against
        `gpus_per_node` when given (`ServerGroup`). Servers launched here require an API
        key: `RLHF_SGLANG_API_KEY`, or a random one made for this process
        (`sglang_api.ensure_api_key`). `lora`: every request is served with the LoRA
        adapter of that name (`rlhf.weight_sync.adapters`)."""
        if not rollout.server_urls:
            sglang_api.ensure_api_key()
        self.group = ServerGroup(
            rollout,
            model_path,
            log_dir=log_dir,
            device=device,
            seed=seed,
            max_total_tokens=max_total_tokens,
            on_restart=on_restart,
            gpus_per_node=gpus_per_node,
        ).start(wait=False)
        self.rollout, self.lora = rollout, lora
        self.client: GenerateClient | None = None
        self.pausable_client: GenerateClient | None = None  # keeps samples a pause cut
        self.gate = GenerationGate()  # holds the pausable client's requests during a pause
        self.last_stats: RolloutStats | None = None
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Until every server (and the router) is healthy; then /generate can go to them."""
        if self.client is not None:
            return
        self.group.wait_ready()
        self.client, self.pausable_client = (
            GenerateClient(
                self.group.generate_urls,
                max_concurrent=self.rollout.max_concurrent_requests,
                timeout_s=self.rollout.request_timeout_s,
                retry=RetryPolicy.from_config(self.rollout),
                recover=self.group.recover,
                keep_aborted=keep,
                lora=self.lora,
                # one call per server (a router spreads requests, one at a time)
                batched=not keep and self.group.router is None,
            )
            for keep in (False, True)
        )

    @property
    def server_urls(self) -> list[str]:
        """Every SGLang server: weight updates go to each."""
        return self.group.server_urls

    @property
    def generate_urls(self) -> list[str]:
        """Where /generate goes (the router when there is one)."""
        return self.group.generate_urls

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        images: list[tuple[bytes, ...]] | None = None,
    ) -> list[RolloutSample]:
        empty = [i for i, p in enumerate(prompts) if not p]
        if empty:
            raise ValueError(f"prompts {empty[:10]} have no tokens")
        self.wait_ready()
        assert self.client is not None
        requests = request_payloads(prompts, params, images)
        start = time.perf_counter()
        results = self.client.generate([payload for _, payload in requests]) if requests else []
        self.last_stats = RolloutStats.of(results, time.perf_counter() - start)
        return [
            RolloutSample(index, g.output_ids, g.logprobs, g.finish_reason, g.routed_experts)
            for (index, _), result in zip(requests, results)
            for g in result.generations
        ]

    def one_request_per_sample(self, params: SamplingParams, what: str) -> dict[str, Any]:
        """SGLang's sampling parameters of one request per sample (n = 1; each request sets
        its own seed), once the servers are ready; `what` cannot return routed experts."""
        self.wait_ready()
        if params.routed_experts:
            raise ValueError(f"{what} cannot return routed experts (R3)")
        return dataclasses.replace(params, n=1, seed=None).to_sglang()

    def generate_through_pauses(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        stop_ids: set[int],
        keep_tokens: bool = True,
    ) -> list[RolloutSample]:
        """`generate`, one request per sample, where a sample cut by a pause (`paused`, or
        SGLang's own `/pause_generation`) goes on from its tokens (`keep_tokens`) or starts
        again, under the weights the servers hold then (`rlhf.rollout.partial`). Each sample
        carries the weight versions of its tokens. `stop_ids`: the tokens that end a sample
        (`end_of_sample_ids`)."""
        sampling = self.one_request_per_sample(params, "samples continued across pauses")
        assert self.pausable_client is not None
        specs = [
            (i, prompt, params.sample_seed(i, j))
            for i, prompt in enumerate(prompts)
            for j in range(params.n)
        ]
        start = time.perf_counter()
        client = self.pausable_client
        run = through_pauses(client, specs, sampling, stop_ids, keep_tokens, self.gate)
        generations, results = asyncio.run(run)
        self.last_stats = RolloutStats.of(results, time.perf_counter() - start)
        return [
            RolloutSample(i, g.output_ids, g.logprobs, g.finish_reason, None, g.weight_versions)
            for (i, _, _), g in zip(specs, generations)
        ]

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No request of `generate_through_pauses` in flight inside (the servers abort the
        ones in flight, which go on once the context exits)."""

        def abort() -> None:
            for url in self.server_urls:
                sglang_api.abort_all_requests(url)

        with self.gate.closed(abort, self.rollout.request_timeout_s):
            yield

    def converse(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        rollout: MultiTurnRollout,
        tools_kwargs: list[dict[str, Any]],
    ) -> list[Conversation]:
        """`params.n` multi-turn conversations per prompt (adjacent, in prompt order), with
        the tools of `rollout` created from each prompt's `tools_kwargs`; `max_new_tokens`
        is the budget of a whole conversation (rollout.settings.max_response_length)."""
        sampling = self.one_request_per_sample(params, "multi-turn rollouts")
        assert self.client is not None
        specs = [
            ConversationRequest(prompt, kwargs, params.sample_seed(i, j))
            for i, (prompt, kwargs) in enumerate(zip(prompts, tools_kwargs, strict=True))
            for j in range(params.n)
        ]
        start = time.perf_counter()
        run = run_conversations(self.client, rollout, specs, sampling)
        conversations, results = asyncio.run(run)
        self.last_stats = RolloutStats.of(results, time.perf_counter() - start)
        return conversations

    def recover(self, url: str) -> str:
        """`url` stopped answering: restart it if it died; the URL to use now."""
        return self.group.recover(url)

    def on_server_restart(self, handler: Callable[[str], None]) -> None:
        """Call `handler(url)` after a launched server was restarted (before requests resume)."""
        self.group.on_restart = handler

    def health(self) -> dict[str, bool]:
        return self.group.health()

    def shutdown(self) -> None:
        self.group.stop()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
