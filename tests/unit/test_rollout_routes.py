"""Rollout routing replay's data path (router_replay.mode=R3), by hand: SGLang's
`meta_info.routed_experts` decoded per sample, kept by the batch's operations, laid out in
a packed micro-batch row (each sample at its start, -1 where no token was routed), cut to
a Ulysses rank's zig-zag positions and to a sequence-parallel TP rank's slice, with
experts 0..top-k-1 where there is no route."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from rlhf.engine.micro_batch import build_micro_batch
from rlhf.engine.route_replay import rank_routes
from rlhf.parallel.ulysses import SequenceShard
from rlhf.rollout.batch import RolloutBatch
from rlhf.rollout.client import GenerateError, decode_routed_experts, parse_response

LAYERS, TOPK = 2, 2


def encode(routes: np.ndarray) -> str:
    """What SGLang sends: base64 of the int32 [tokens, layers, top-k] array."""
    return base64.b64encode(routes.astype(np.int32).tobytes()).decode()


def sglang_item(output_ids: list[int], routes: np.ndarray | None) -> dict:
    meta: dict = {
        "output_token_logprobs": [[-0.5, t, None] for t in output_ids],
        "finish_reason": {"type": "stop"},
    }
    if routes is not None:
        meta["routed_experts"] = encode(routes)
    return {"output_ids": output_ids, "meta_info": meta}


def test_routed_experts_are_decoded_per_token_and_layer():
    # prompt of 3 tokens, 2 generated: the model saw 4 tokens (not the last generated one)
    routes = np.arange(4 * LAYERS * TOPK).reshape(4, LAYERS, TOPK) % 7
    (g,) = parse_response([sglang_item([5, 6], routes)], 1, "http://s", routed_prompt_lens=[3])
    assert g.routed_experts is not None
    assert g.routed_experts.dtype == torch.int16
    assert g.routed_experts.tolist() == routes.reshape(4, LAYERS * TOPK).tolist()
    (plain,) = parse_response([sglang_item([5, 6], routes)], 1, "http://s")
    assert plain.routed_experts is None  # not asked for


def test_missing_or_malformed_routes_name_the_server_and_the_flag():
    with pytest.raises(GenerateError, match=r"http://s.*--enable-return-routed-experts"):
        parse_response([sglang_item([5, 6], None)], 1, "http://s", routed_prompt_lens=[3])
    three_rows = np.ones((3, LAYERS, TOPK))  # 12 ids for the 5 tokens the model saw
    with pytest.raises(GenerateError, match=r"bad meta_info\.routed_experts"):
        parse_response([sglang_item([5, 6, 7], three_rows)], 1, "http://s", routed_prompt_lens=[3])
    with pytest.raises(ValueError, match="do not split"):
        decode_routed_experts(encode(np.zeros(6)), 4)


def routes_of(length: int, base: int) -> torch.Tensor:
    """Distinct routes per sample: row r = [base + r] * (layers x top-k)."""
    return (base + torch.arange(length - 1, dtype=torch.int16))[:, None].repeat(1, LAYERS * TOPK)


def batch_with_routes() -> RolloutBatch:
    prompts, responses = [[1, 2], [3], [4, 5, 6]], [[7, 8], [9, 10], [11]]
    return RolloutBatch(
        prompt_ids=prompts,
        response_ids=responses,
        scores_b=torch.zeros(3),
        data_sources=["d"] * 3,
        uids=["a", "b", "c"],
        routed_experts=[routes_of(4, 10), routes_of(3, 20), routes_of(4, 30)],
    )


def test_the_batch_keeps_routes_through_select_concat_and_broadcast():
    batch = batch_with_routes()
    picked = batch.select([2, 0])
    assert picked.routed_experts is not None
    assert [int(r[0, 0]) for r in picked.routed_experts] == [30, 10]
    both = RolloutBatch.concat([batch, picked])
    assert both.routed_experts is not None and len(both.routed_experts) == 5
    again = RolloutBatch.from_objects(batch.to_objects())
    assert again.routed_experts is not None
    assert all(torch.equal(a, b) for a, b in zip(again.routed_experts, batch.routed_experts))
    with pytest.raises(ValueError, match="routed experts"):
        RolloutBatch(**{**vars(batch), "routed_experts": [routes_of(5, 0)] * 3})


def test_row_routes_put_each_sample_at_its_start_and_mark_the_rest():
    mb = build_micro_batch(batch_with_routes(), [0, 2, 1], tp_split=4)  # row padded to 12
    assert mb.routes is not None and mb.row_len == 12
    first = mb.routes[:, 0].tolist()
    # sample 0 at 0..3 (routes 10,11,12; its last token none), sample 2 at 4..7, 1 at 8..10
    assert first == [10, 11, 12, -1, 30, 31, 32, -1, 20, 21, -1, -1]


def test_a_ulysses_rank_keeps_its_zig_zag_positions():
    batch = batch_with_routes()
    whole = build_micro_batch(batch, [0, 2])  # 8 tokens, SP2: quarters of 2
    ranks = [build_micro_batch(batch, [0, 2], sp=SequenceShard(None, r, 2)) for r in (0, 1)]
    assert whole.routes is not None and ranks[0].routes is not None
    held = [[0, 1, 6, 7], [2, 3, 4, 5]]  # rank r: quarters r and 3 - r
    for rank, positions in zip(ranks, held):
        assert rank.routes is not None
        assert rank.routes[:, 0].tolist() == [whole.routes[p, 0].item() for p in positions]


def test_rank_routes_take_the_tp_slice_and_fill_missing_routes():
    routes = torch.tensor(
        [[0, 1, 2, 3], [3, 2, 1, 0], [-1, -1, -1, -1], [1, 3, 0, 2]], dtype=torch.int16
    )
    whole = rank_routes(routes, LAYERS, TOPK)
    assert whole.shape == (4, LAYERS, TOPK) and whole.dtype == torch.long
    assert whole[1].tolist() == [[3, 2], [1, 0]]  # layer-major, as SGLang sends them
    assert whole[2].tolist() == [[0, 1], [0, 1]]  # no route: experts 0..top-k-1
    second = rank_routes(routes, LAYERS, TOPK, tp_size=2, tp_rank=1)
    assert second.tolist() == [[[0, 1], [0, 1]], [[1, 3], [0, 2]]]
    with pytest.raises(ValueError, match="3 layers x top-2"):
        rank_routes(routes, 3, TOPK)
