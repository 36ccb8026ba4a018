"""Routing replay (`actor_rollout_ref.actor.router_replay.mode`, verl's names and modes).

R2 (`RouteReplay`): the update's forwards send every token to the experts the old-log-prob
pass chose for it, instead of routing anew with the weights as they are after the previous
mini-batches. R3 (`RolloutRouteReplay`, rollout routing replay): the old-log-prob, reference
and update forwards send every token to the experts the rollout engine (SGLang) routed it
to, carried by the batch (`RolloutBatch.routed_experts`, one row per micro-batch position
in `MicroBatch.routes`), so the trainer's and the engine's log-probs differ by numerics
only, not by tokens routed elsewhere.

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
The weight-sync probe never replays (it runs outside `replaying()` and has no routes).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from rlhf.distributed.context import ParallelContext
from rlhf.engine.micro_batch import MicroBatch

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

    rollout_routes = False  # R2: the routes come from this model's own old-log-prob pass

    def before_forward(self, chunk_index: int, mb: MicroBatch) -> None:
        """Set this chunk's routers up for the micro-batch about to run forward."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self.mode is None:
            return
        sample_ids = mb.sample_ids
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

    def after_forward(self, chunk_index: int, mb: MicroBatch) -> None:
        """Keep the routes the chunk's routers just chose (recording)."""
        if self.mode != "record":
            return
        recorded = [r.get_recorded_indices() for r in self.routers[chunk_index]]
        self.routes[(chunk_index, tuple(mb.sample_ids))] = [
            indices.to("cpu", torch.int16) for indices in recorded
        ]


class RolloutRouteReplay(RouteReplay):
    """R3: inside `replaying()` every forward takes the routes the rollout engine chose for
    its micro-batch's tokens (`MicroBatch.routes`); the router of layer l (Megatron's
    `layer_number` l + 1) reads column l. Positions without a route (padding, each
    sample's last token: their outputs are never gathered) get experts 0..top-k-1."""

    rollout_routes = True

    def __init__(self, chunks, ctx: ParallelContext):
        from megatron.core.transformer.moe.router import TopKRouter

        super().__init__(chunks)
        self.layers = [
            [m.layer_number - 1 for m in chunk.modules() if isinstance(m, TopKRouter)]
            for chunk in chunks
        ]
        config = chunks.config
        self.num_layers, self.topk = config.num_layers, config.moe_router_topk
        # Megatron's sequence parallelism: a TP rank's routers see its contiguous slice
        self.tp_size, self.tp_rank = (
            (ctx.tp_size, ctx.tp_rank) if config.sequence_parallel else (1, 0)
        )

    @contextmanager
    def recording(self) -> Iterator[None]:
        raise RuntimeError(
            "rollout routing replay (R3) takes the engine's routes: nothing to record"
        )
        yield

    def before_forward(self, chunk_index: int, mb: MicroBatch) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self.mode is None:
            return
        routers = self.routers[chunk_index]
        if mb.routes is None:
            if mb.sample_ids:
                raise RuntimeError(
                    f"rollout routing replay (R3): samples {mb.sample_ids[:10]} have no routed "
                    "experts from the rollout engine"
                )
            for replay in routers:  # an interleaved pipeline's filler: nothing is gathered
                replay.clear_router_replay_action()
            return
        routes = rank_routes(mb.routes, self.num_layers, self.topk, self.tp_size, self.tp_rank)
        for replay, layer in zip(routers, self.layers[chunk_index]):
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            replay.target_topk_idx = routes[:, layer]

    def after_forward(self, chunk_index: int, mb: MicroBatch) -> None:
        return


def rank_routes(
    routes: torch.Tensor, num_layers: int, topk: int, tp_size: int = 1, tp_rank: int = 0
) -> torch.Tensor:
    """[T, layers x top-k] int16 (-1: no route) -> [T / tp_size, layers, top-k] int64: TP rank
    `tp_rank`'s contiguous slice of the positions (Megatron's sequence parallelism), with
    experts 0..top-k-1 where there is no route."""
    if routes.shape[1] != num_layers * topk:
        raise ValueError(
            f"rollout routing replay (R3): the engine's routes have {routes.shape[1]} experts "
            f"a token, the model {num_layers} layers x top-{topk}: not the policy's model?"
        )
    size = routes.shape[0] // tp_size
    mine = routes[tp_rank * size : (tp_rank + 1) * size].reshape(size, num_layers, topk).long()
    dummy = torch.arange(topk).expand_as(mine)
    return torch.where(mine < 0, dummy, mine)
