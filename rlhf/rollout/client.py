"""Minimal synchronous client for SGLang's /generate: token ids in, tokens + log-probs out."""

from __future__ import annotations

from dataclasses import dataclass

import requests


@dataclass(frozen=True)
class Generation:
    """One sampled response: its token ids, their log-probs and why generation stopped."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: str


def generate(
    url: str,
    prompts: list[list[int]],
    sampling_params: dict,
    timeout_s: float = 300.0,
) -> list[Generation]:
    """Generate for a batch of token-id prompts; with `n` > 1, samples of a prompt are adjacent."""
    payload = {"input_ids": prompts, "sampling_params": sampling_params, "return_logprob": True}
    try:
        response = requests.post(f"{url}/generate", json=payload, timeout=timeout_s)
    except requests.RequestException as e:
        raise ConnectionError(f"SGLang server at {url} unreachable: {e}") from e
    if response.status_code != 200:
        raise RuntimeError(
            f"SGLang server at {url} answered {response.status_code}: {response.text}"
        )
    items = response.json()
    items = items if isinstance(items, list) else [items]
    return [_parse(item) for item in items]


def _parse(item: dict) -> Generation:
    meta = item["meta_info"]
    logprobs = [float(lp) for lp, _token, *_ in meta["output_token_logprobs"]]
    finish = meta.get("finish_reason") or {}
    return Generation(
        output_ids=list(item["output_ids"]),
        logprobs=logprobs,
        finish_reason=finish.get("type", "unknown") if isinstance(finish, dict) else str(finish),
    )
