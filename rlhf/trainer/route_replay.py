"""Routing replay R2 (`actor_rollout_ref.actor.router_replay.mode=R2`, verl's name): the
update's forwards send every token to the experts the old-log-prob pass chose for it,
instead of routing anew with the weights as they are after the previous mini-batches.

Megatron-Core's `RouterReplay` (one per `TopKRouter` when `moe_enable_routing_replay` is on)
records a forward's top-k expert indices or takes given ones in place of its top-k. Both
passes are planned alike: with R2 the old-log-prob pass uses the update's micro-batch plan
(`MicroBatchPlanner.plan` with the update's token budget and mini-batch size, deterministic),
so every rank sees the same micro-batches, rows and slices in both, and the routes never
leave the rank: recorded per (chunk, micro-batch samples) and router, replayed for the same
key. Memory: tokens of this rank x its MoE layers x top-k int16 indices in host memory (the
30B-A3B config: 48 layers x 8 x 2 bytes = 768 bytes a token). The gradient still reaches the
router through the replayed experts' probabilities.

Not with activation recompute: Megatron's recompute runs the forward again in the backward,
after later micro-batches' forwards under pipeline parallelism (refused in validation).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

Key = tuple[int, tuple[int, ...]]  # (chunk index, the micro-batch's sample ids)


class RouteReplay:
    """Records the routes of `chunks`' routers in one pass and replays them in later ones."""

    def __init__(self, chunks):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [
            [m.router_replay for m in chunk.modules() if isinstance(m, TopKRouter)]
            for chunk in chunks
        ]
        if not all(r is not None for routers in self.routers for r in routers):
            raise ValueError("routing replay needs the model built with moe_enable_routing_replay")
        self.routes: dict[Key, list[torch.Tensor]] = {}
        self.mode: str | None = None  # "record" | "replay" while a pass runs

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Inside: every forward records its routes (the old routes before dropped)."""
        self.routes.clear()
        with self._mode("record"):
            yield

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """Inside: every forward takes the routes recorded for its micro-batch."""
        with self._mode("replay"):
            yield

    @contextmanager
    def _mode(self, mode: str) -> Iterator[None]:
        self.mode = mode
        try:
            yield
        finally:
            self.mode = None
            for routers in self.routers:
                for replay in routers:
                    replay.clear_router_replay_action()
                    replay.clear_indices()

    def before_forward(self, chunk_index: int, sample_ids: list[int]) -> None:
        """Set this chunk's routers up for the micro-batch about to run forward."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self.mode is None:
            return
        routers = self.routers[chunk_index]
        if self.mode == "record":
            for replay in routers:
                replay.set_router_replay_action(RouterReplayAction.RECORD)
            return
        key = (chunk_index, tuple(sample_ids))
        if key not in self.routes:
            raise RuntimeError(f"routing replay: no routes recorded for micro-batch {key}")
        for replay, indices in zip(routers, self.routes[key]):
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            replay.target_topk_idx = indices.long()  # (not set_target_indices: it keeps a list)

    def after_forward(self, chunk_index: int, sample_ids: list[int]) -> None:
        """Keep the routes the chunk's routers just chose (recording)."""
        if self.mode != "record":
            return
        recorded = [r.get_recorded_indices() for r in self.routers[chunk_index]]
        self.routes[(chunk_index, tuple(sample_ids))] = [
            indices.to("cpu", torch.int16) for indices in recorded
        ]
