"""The run's SGLang engines as the trainer sees them: which ranks own servers, who generates.

- One node (or `rollout.server_urls` given, i.e. disaggregated servers): global rank 0 owns
  the engine and generates every prompt.
- Several nodes, colocated (servers launched by the job): each node's local rank 0 owns a
  server group on its node. A step's prompts are split across the nodes in order, each
  node generates and scores its share, and rank 0 gathers them back in prompt order, so the
  batch is the one a single engine would produce.

Either way `generate` and `validate` return the same `RolloutResult` on every rank. Weight
sync is not done here: `server_urls` says which servers this rank's node syncs
(`rlhf.weight_sync`), and `on_server_restart` registers who re-syncs a restarted server.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from rlhf.config.schema import RLHFConfig
from rlhf.data.prompts import EncodedPrompt
from rlhf.distributed.collectives import all_gather_objects, broadcast_object, gather_objects
from rlhf.distributed.context import ParallelContext
from rlhf.reward.scorer import RewardScorer
from rlhf.rollout import sglang_api
from rlhf.rollout.batch import RolloutBatch
from rlhf.rollout.engine import SamplingParams, SGLangEngine
from rlhf.rollout.generation import RolloutResult, generate_and_score, kv_cache_tokens
from rlhf.rollout.server_group import ServerLost
from rlhf.utils import split_evenly

log = logging.getLogger(__name__)


class RolloutFleet:
    """Engines on their owning ranks; generation and scoring whose result every rank gets."""

    def __init__(
        self,
        cfg: RLHFConfig,
        ctx: ParallelContext,
        run_dir: Path,
        tokenizer,
        max_prompts: int,
    ):
        rollout = cfg.actor_rollout_ref.rollout
        self.ctx, self.tokenizer = ctx, tokenizer
        self.per_node = rollout.server_urls is None and ctx.num_nodes > 1
        owner = ctx.local_rank == 0 if self.per_node else ctx.is_main
        self.node_dir = run_dir / f"node{ctx.node_rank}" if self.per_node else run_dir
        self.engine: SGLangEngine | None = None
        self.scorer: RewardScorer | None = None
        if owner:
            self.scorer = RewardScorer.from_config(cfg.reward)
            cpu = ctx.device.type == "cpu"
            self.engine = SGLangEngine(
                rollout,
                cfg.actor_rollout_ref.model.path,
                log_dir=self.node_dir / "logs",
                device=ctx.device.type,
                seed=cfg.data.seed,
                max_total_tokens=kv_cache_tokens(cfg, max_prompts) if cpu else None,
                wait=False,  # PPOTrainer builds its models while SGLang loads: wait_ready()
            )
        self.server_urls = self._node_server_urls()
        # Colocated on GPUs: SGLang gives its memory to training between generations.
        launched = rollout.server_urls is None
        self.sleeps = launched and rollout.free_cache_engine and ctx.device.type != "cpu"
        self.asleep: set[str] = set()
        if launched and rollout.free_cache_engine and not self.sleeps and ctx.is_main:
            log.info(
                "rollout.free_cache_engine: no effect on CPU (SGLang's memory release needs "
                "CUDA); the servers keep their weights and KV cache"
            )

    def wait_ready(self) -> None:
        """Until this rank's servers are healthy (they were launched without waiting)."""
        if self.engine is not None:
            self.engine.wait_ready()

    def release_memory(self) -> None:
        """Sleep: the engine's servers free their weights and KV cache (GPU, colocated)."""
        if not self.sleeps or self.engine is None:
            return
        for url in self.engine.server_urls:
            sglang_api.release_memory_occupation(url, ["weights", "kv_cache"])
            self.asleep.add(url)

    def resume_memory(self, tags: list[str]) -> None:
        """Wake `tags` of the sleeping servers: "weights" before a weight sync, then
        "kv_cache" before generating (the released weights are stale until synced)."""
        if self.engine is None:
            return
        for url in sorted(self.asleep):
            sglang_api.resume_memory_occupation(url, tags)
        if "kv_cache" in tags:
            self.asleep.clear()

    def _node_server_urls(self) -> list[str]:
        """The server URLs of this rank's node (every rank of a node gets the same list)."""
        everyone = all_gather_objects(self.engine.server_urls if self.engine else None)
        owner = self.ctx.node_rank * self.ctx.local_world_size if self.per_node else 0
        urls = everyone[owner]
        assert urls is not None, f"rank {owner} owns an engine"
        return urls

    def restart_server(self, url: str) -> None:
        """One of this rank's servers stopped answering (weight sync, probe): restart it if
        it died, within `rollout.max_server_restarts`; the `on_server_restart` handler then
        gives it the current weights. External servers are never restarted."""
        assert self.engine is not None, "called on the rank that owns the servers"
        restarts = self.engine.group.restarts
        before = restarts.get(url, 0)
        if self.engine.recover(url) != url:
            raise ServerLost(
                f"external SGLang server at {url} was lost; external servers are never "
                "restarted by the trainer: restart it, then resume the run"
            )
        if restarts.get(url, 0) > before:  # a new process holds all its memory (GPU)
            self.asleep.discard(url)

    def on_server_restart(self, handler: Callable[[str], None]) -> None:
        """Call `handler(url)` (on the owning rank) after one of its servers restarted."""
        if self.engine is not None:
            self.engine.on_server_restart(handler)

    def _generate(
        self,
        prompts: list[EncodedPrompt],
        uids: list[str],
        indices: list[int],
        params: SamplingParams,
    ) -> RolloutResult:
        assert self.engine is not None and self.scorer is not None
        return generate_and_score(
            self.engine, self.tokenizer, self.scorer, prompts, uids, indices, params
        )

    def generate(
        self,
        prompts: list[EncodedPrompt],
        uids: list[str],
        indices: list[int],
        params: SamplingParams,
    ) -> RolloutResult:
        """`params.n` scored responses per prompt, in prompt order, on every rank."""
        if not self.per_node:
            mine = self._generate(prompts, uids, indices, params) if self.ctx.is_main else None
        else:
            share = None
            if self.engine is not None:
                nodes, node = self.ctx.num_nodes, self.ctx.node_rank
                share = self._generate(
                    split_evenly(prompts, nodes)[node],
                    split_evenly(uids, nodes)[node],
                    split_evenly(indices, nodes)[node],
                    params,
                )
            mine = _concat(gather_objects(share))
        return _share(mine)

    def validate(self, prompts: list[EncodedPrompt], params: SamplingParams) -> RolloutResult:
        """Validation responses of every prompt (generated on rank 0's engine), on every rank."""
        mine = None
        if self.ctx.is_main:
            uids = [f"val-{i}" for i in range(len(prompts))]
            mine = self._generate(prompts, uids, list(range(len(prompts))), params)
        return _share(mine)

    def shutdown(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
        if self.engine is not None:
            self.engine.shutdown()


def _concat(parts: list[RolloutResult | None] | None) -> RolloutResult | None:
    """On rank 0: the node leaders' results (in rank = node order) as one; None elsewhere."""
    if parts is None:
        return None
    results = [p for p in parts if p is not None]
    batch = RolloutBatch.concat([r.batch for r in results])
    records = [record for r in results for record in r.records]
    return RolloutResult(batch, records, max(r.reward_s for r in results))


def _share(result: RolloutResult | None) -> RolloutResult:
    """Rank 0's result on every rank (records stay on rank 0)."""
    sent = None if result is None else (result.batch.to_objects(), result.reward_s)
    received = broadcast_object(sent)
    if result is not None:
        return result
    assert received is not None, "rank 0 generated"
    objects, reward_s = received
    return RolloutResult(RolloutBatch.from_objects(objects), [], reward_s)
