"""Seeded sampling for SGLang's CPU engine (`rlhf.rollout.seeded_sampling`): the hash is
MurmurHash3_x86_32 (checked against a byte-wise implementation written here from the
algorithm), a seeded row's token depends on nothing but its seed, position and log-probs,
and the draws follow the distribution."""

from __future__ import annotations

import struct

import torch

from rlhf.rollout.seeded_sampling import murmur_hash32, seeded_argmax, seeded_top_k_top_p


def murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """The reference algorithm, one byte string at a time (length a multiple of 4)."""

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF

    h = seed
    for (k,) in struct.iter_unpack("<I", data):
        k = rotl((k * 0xCC9E2D51) & 0xFFFFFFFF, 15)
        h ^= (k * 0x1B873593) & 0xFFFFFFFF
        h = (rotl(h, 13) * 5 + 0xE6546B64) & 0xFFFFFFFF
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_hash_is_murmur3_of_seed_position_and_column():
    seeds = torch.tensor([0, 1, 42, 0x123456789ABCDEF, 2**63 - 1])
    positions = torch.tensor([0, 7, 123, 4096, 2**31 + 5])
    columns = torch.tensor([0, 1, 17, 151935])
    got = murmur_hash32(seeds, positions, columns)
    for i, (s, p) in enumerate(zip(seeds.tolist(), positions.tolist())):
        for j, c in enumerate(columns.tolist()):
            key = struct.pack("<IIII", s & 0xFFFFFFFF, s >> 32, p & 0xFFFFFFFF, c)
            assert int(got[i, j]) == murmur3_x86_32(key), (s, p, c)


def test_a_seeded_row_samples_alike_in_any_batch():
    torch.manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(4, 50), dim=-1)
    seeds = torch.tensor([[7, 1], [9, 1], [0, 0], [7, 1]])
    positions = torch.tensor([10, 10, 10, 11])
    batch = seeded_argmax(logprobs, seeds, positions)[:, 0]
    alone = [
        int(seeded_argmax(logprobs[i : i + 1], seeds[i : i + 1], positions[i : i + 1]))
        for i in (0, 1, 3)
    ]
    assert [int(batch[0]), int(batch[1]), int(batch[3])] == alone
    again = seeded_argmax(logprobs[[3, 0]], seeds[[3, 0]], positions[[3, 0]])[:, 0]
    assert again.tolist() == [int(batch[3]), int(batch[0])]
    # SGLang's own [n] seed tensor (every row seeded) samples the same tokens
    assert (
        seeded_argmax(logprobs[:2], seeds[:2, 0], positions[:2])[:, 0].tolist()
        == batch[:2].tolist()
    )


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 8000
    logprobs = probs.log().expand(n, 4)
    seeds = torch.stack([torch.full((n,), 1234), torch.ones(n, dtype=torch.long)], dim=1)
    tokens = seeded_argmax(logprobs, seeds, torch.arange(n))[:, 0]
    freq = torch.bincount(tokens, minlength=4).double() / n
    assert torch.allclose(freq, probs.double(), atol=0.02), freq
    other = seeded_argmax(logprobs, seeds + torch.tensor([1, 0]), torch.arange(n))[:, 0]
    assert (other != tokens).float().mean() > 0.3  # another seed, other draws


def test_top_k_and_top_p_sample_with_token_noise():
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(3, 30), dim=-1)
    seeds = torch.tensor([[5, 1], [6, 1], [7, 1]])
    positions = torch.tensor([3, 3, 3])

    def original(*args, **kwargs):
        raise AssertionError("a seeded batch must not reach SGLang's sampler")

    vocab = torch.full((3,), 30)
    ones = torch.ones(3)
    free = seeded_top_k_top_p(original, probs, vocab, ones, ones * 0, False, seeds, positions)
    assert free.tolist() == seeded_argmax(probs.log(), seeds, positions)[:, 0].tolist()
    greedy = seeded_top_k_top_p(
        original, probs, torch.ones(3, dtype=torch.long), ones, ones * 0, False, seeds, positions
    )
    assert greedy.tolist() == probs.argmax(dim=-1).tolist()
    # a row's draw does not change when another row of the batch asks for top-k 1
    mixed_k = torch.tensor([30, 1, 30])
    mixed = seeded_top_k_top_p(original, probs, mixed_k, ones, ones * 0, False, seeds, positions)
    assert mixed[[0, 2]].tolist() == free[[0, 2]].tolist() and int(mixed[1]) == int(
        probs[1].argmax()
    )


def test_request_seeds_follow_the_prompt_uid_and_sample():
    from rlhf.rollout.engine import SamplingParams, derived_seed, request_payloads

    params = SamplingParams(n=2, seed=11).for_prompts(["0:5", "0:9"])
    payloads = request_payloads([[1, 2], [3]], params)
    seeds = [body["sampling_params"]["sampling_seed"] for _, body in payloads]
    assert [i for i, _ in payloads] == [0, 0, 1, 1]
    assert seeds == [derived_seed(11, uid, j) for uid in ("0:5", "0:9") for j in (0, 1)]
    assert len(set(seeds)) == 4 and all(0 <= s < 2**62 for s in seeds)
    # the same prompt drawn in a later call (a resumed run) gets the same seeds
    again = SamplingParams(n=2, seed=11).for_prompts(["1:0", "0:9"])
    assert again.sample_seed(1, 1) == seeds[3] and again.sample_seed(0, 0) not in seeds
    assert SamplingParams(n=2).for_prompts(["0:5"]).sample_seed(0, 0) is None  # unseeded


def test_seeded_gpu_servers_run_deterministic_inference():
    from rlhf.config.rollout import RolloutConfig
    from rlhf.rollout.sglang_server import build_server_args

    seeded = RolloutConfig(sampling_seed=3)
    gpu = build_server_args(seeded, "/m", port=1, device="cuda").argv
    assert "--enable-deterministic-inference" in gpu
    cpu = build_server_args(seeded, "/m", port=1, device="cpu").argv  # the plugin seeds there
    assert "--enable-deterministic-inference" not in cpu
    plain = build_server_args(RolloutConfig(), "/m", port=1, device="cuda").argv
    assert "--enable-deterministic-inference" not in plain


def test_rows_without_a_seed_take_the_generators_noise_and_no_hash(monkeypatch):
    """Unseeded rows are not hashed (0.24 s of the sampler's 0.30 s for 32 unseeded
    requests at a 152k-token vocabulary): the same draws, the generator's noise."""
    from rlhf.rollout import seeded_sampling

    hashed: list[int] = []

    def counted(seeds, positions, columns):
        hashed.append(len(seeds))
        return murmur_hash32(seeds, positions, columns)

    monkeypatch.setattr(seeded_sampling, "murmur_hash32", counted)
    logprobs = torch.log_softmax(torch.randn(3, 40), dim=-1)
    unseeded, positions = torch.zeros(3, 2, dtype=torch.long), torch.tensor([4, 4, 4])
    torch.manual_seed(5)
    got = seeded_argmax(logprobs, unseeded, positions)[:, 0]
    torch.manual_seed(5)
    u = torch.rand(3, 40, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(u).clamp(max=-(2.0**-32)))
    assert got.tolist() == (gumbel + logprobs.double()).argmax(dim=1).tolist()
    assert hashed == []
    mixed = torch.tensor([[0, 0], [7, 1], [0, 0]])
    row = seeded_argmax(logprobs, mixed, positions)[1, 0]
    assert hashed == [1] and int(row) == int(
        seeded_argmax(logprobs[1:2], mixed[1:2], positions[1:2])
    )
