"""The rollout engine contract without servers: sampling parameters in SGLang's names,
one request per prompt (per sample when seeded), batch statistics, the router command line."""

from __future__ import annotations

import pytest

from rlhf.config.schema import RolloutConfig
from rlhf.rollout.client import Generation, RequestResult
from rlhf.rollout.engine import (
    RolloutEngine,
    RolloutStats,
    SamplingParams,
    SGLangEngine,
    request_payloads,
)
from rlhf.rollout.sglang_server import build_router_args


def test_to_sglang_uses_sglang_names():
    params = SamplingParams(
        n=4, temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=12, stop_token_ids=(2, 9), seed=5
    )
    assert params.to_sglang() == {
        "n": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 50,
        "max_new_tokens": 12,
        "stop_token_ids": [2, 9],
        "sampling_seed": 5,
    }
    plain = SamplingParams().to_sglang()
    assert "stop_token_ids" not in plain and "sampling_seed" not in plain


def test_from_config_reads_rollout_keys():
    rollout = RolloutConfig(n=3, temperature=0.5, top_p=0.8, top_k=7)
    params = SamplingParams.from_config(rollout, max_new_tokens=16)
    assert params == SamplingParams(n=3, temperature=0.5, top_p=0.8, top_k=7, max_new_tokens=16)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be > 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": 0}, "top_k must be -1"),
        ({"max_new_tokens": 0}, "max_new_tokens must be > 0"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
    ],
)
def test_invalid_sampling_params_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_one_request_per_prompt_carrying_n():
    prompts = [[1, 2], [3], [4, 5, 6]]
    requests = request_payloads(prompts, SamplingParams(n=4, max_new_tokens=3))
    assert [i for i, _ in requests] == [0, 1, 2]
    for (_, payload), prompt in zip(requests, prompts):
        assert payload["input_ids"] == prompt
        assert payload["sampling_params"]["n"] == 4
        assert payload["return_logprob"] is True


def test_seeded_sampling_gives_each_sample_its_own_seed():
    requests = request_payloads([[1], [2]], SamplingParams(n=3, seed=10))
    assert [i for i, _ in requests] == [0, 0, 0, 1, 1, 1]
    seeds = [p["sampling_params"]["sampling_seed"] for _, p in requests]
    assert seeds == [10, 11, 12, 13, 14, 15]
    assert all(p["sampling_params"]["n"] == 1 for _, p in requests)


def result(tokens: list[int], attempts: int, request_s: float, engine_s: float | None):
    gens = [Generation(list(range(t)), [-1.0] * t, "length", engine_s) for t in tokens]
    return RequestResult(gens, "http://a", attempts, request_s, engine_s)


def test_stats_sum_requests():
    stats = RolloutStats.of([result([3, 2], 1, 2.0, 1.5), result([4, 1], 2, 2.0, 0.5)], 4.0)
    assert (stats.requests, stats.samples, stats.generated_tokens) == (2, 4, 10)
    assert stats.tokens_per_s == 2.5
    assert stats.engine_share == 0.5
    assert stats.retried_requests == 1
    unknown = RolloutStats.of([result([1], 1, 1.0, None)], 1.0)
    assert unknown.engine_s is None and unknown.engine_share is None


def test_sglang_engine_satisfies_the_protocol():
    assert issubclass(SGLangEngine, RolloutEngine)


def test_router_command_line():
    urls = ["http://127.0.0.1:4001", "http://127.0.0.1:4002"]
    launch = build_router_args(urls, port=5000, metrics_port=5001, startup_timeout_s=60)
    argv = launch.argv
    assert argv[1:4] == ["-m", "rlhf.rollout.keyed_launch", "sglang_router.launch_router"]
    i = argv.index("--worker-urls")
    assert argv[i + 1 : i + 3] == urls
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "5000"
    assert argv[argv.index("--prometheus-port") + 1] == "5001"
    assert argv[argv.index("--worker-startup-timeout-secs") + 1] == "60"
    assert launch.url == "http://127.0.0.1:5000"


def test_router_flags_exist_in_installed_router():
    """Every flag we pass is one the installed sglang-router accepts."""
    from sglang_router.launch_router import parse_router_args

    launch = build_router_args(["http://127.0.0.1:4001"], port=5000, metrics_port=5001)
    args = parse_router_args(launch.argv[4:])
    assert args.worker_urls == ["http://127.0.0.1:4001"]
    assert (args.port, args.prometheus_port, args.policy) == (5000, 5001, "round_robin")
