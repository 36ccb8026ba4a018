"""The run's SGLang engines as the trainer sees them: who owns which servers, who syncs them.

- One node (or `rollout.server_urls` given, i.e. disaggregated servers): global rank 0 owns
  the engine, generates every prompt and syncs every server (distributed transport for
  remote servers).
- Several nodes, colocated (servers launched by the job): each node's local rank 0 owns a
  server group on its node. A step's prompts are split across the nodes in order, each
  node generates its share, and rank 0 gathers them back in prompt order, so the batch is
  the one a single engine would produce. Each node's servers are synced from the data-
  parallel replica that holds its local rank 0 (tensor transport, same machine), which
  needs whole replicas per node: PP = 1 and TP x SP dividing the processes per node.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from rlhf.config import ConfigError
from rlhf.config.schema import RLHFConfig
from rlhf.distributed.bootstrap import DistEnv, nodes, sync_topology
from rlhf.rollout.engine import SamplingParams
from rlhf.trainer.batch import RolloutBatch
from rlhf.trainer.rollout_stage import generate_and_score, kv_cache_tokens
from rlhf.utils import split_evenly

log = logging.getLogger(__name__)


def check_colocated_layout(cfg: RLHFConfig) -> None:
    """Per-node servers need whole model replicas on every node."""
    actor, trainer = cfg.actor_rollout_ref.actor, cfg.trainer
    replica = actor.megatron.tensor_model_parallel_size * actor.ulysses_sequence_parallel_size
    pp = actor.megatron.pipeline_model_parallel_size
    if pp > 1 or trainer.n_gpus_per_node % replica:
        raise ConfigError(
            f"trainer.nnodes={trainer.nnodes} with servers launched by the job (colocated) needs "
            "a whole model replica on every node: actor_rollout_ref.actor.megatron."
            f"pipeline_model_parallel_size must be 1 (is {pp}) and tensor_model_parallel_size x "
            f"ulysses_sequence_parallel_size ({replica}) must divide trainer.n_gpus_per_node "
            f"({trainer.n_gpus_per_node}); otherwise run disaggregated servers "
            "(actor_rollout_ref.rollout.server_urls, see launch/sglang_servers.sh)"
        )


class RolloutFleet:
    """Engines (on their owning ranks), the weight syncer (on every rank), generation."""

    def __init__(self, cfg: RLHFConfig, env: DistEnv, run_dir: Path, arch, max_prompts: int):
        from rlhf.rollout.engine import SGLangEngine
        from rlhf.weight_sync.factory import build_weight_syncer

        rollout = cfg.actor_rollout_ref.rollout
        self.node, self.num_nodes = nodes()
        self.per_node = rollout.server_urls is None and self.num_nodes > 1
        if self.per_node:
            check_colocated_layout(cfg)
        self.env = env
        owner = env.local_rank == 0 if self.per_node else env.is_main
        where = run_dir / f"node{self.node}" if self.per_node else run_dir
        self.engine = None
        if owner:
            cpu = env.device.type == "cpu"
            self.engine = SGLangEngine(
                rollout, cfg.actor_rollout_ref.model.path, log_dir=where / "logs",
                device=env.device.type, seed=cfg.data.seed,
                max_total_tokens=kv_cache_tokens(cfg, max_prompts) if cpu else None,
            )  # fmt: skip
        self.syncer = build_weight_syncer(
            rollout,
            self._my_server_urls(),
            arch,
            sync_topology(per_node=self.per_node),
            run_dir=where,
            model_path=cfg.actor_rollout_ref.model.path,
        )
        if self.engine is not None:
            self.engine.attach_weight_syncer(self.syncer)

    def _my_server_urls(self) -> list[str]:
        """The server URLs of this rank's node (every rank of a node gets the same list)."""
        mine = self.engine.server_urls if self.engine is not None else None
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return mine
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if not self.per_node:
            return everyone[0]
        per_node = dist.get_world_size() // self.num_nodes
        return everyone[self.node * per_node]

    def generate(self, tokenizer, reward_fn, prompts, uids, indices, params: SamplingParams):
        """(batch, records, reward seconds) of every prompt on rank 0; Nones elsewhere."""
        if not self.per_node:
            if not self.env.is_main:
                return None, None, None
            return generate_and_score(
                self.engine, tokenizer, reward_fn, prompts, uids, indices, params
            )
        mine = None
        if self.engine is not None:
            share = [split_evenly(x, self.num_nodes)[self.node] for x in (prompts, uids, indices)]
            batch, records, reward_s = generate_and_score(
                self.engine, tokenizer, reward_fn, *share, params
            )
            mine = (batch.to_objects(), records, reward_s)
        gathered = [None] * dist.get_world_size() if self.env.is_main else None
        dist.gather_object(mine, gathered, dst=0)
        if not self.env.is_main:
            return None, None, None
        parts = [g for g in gathered if g is not None]  # node leaders, in rank (= node) order
        batch = RolloutBatch.concat([RolloutBatch.from_objects(b) for b, _, _ in parts])
        records = [r for _, node_records, _ in parts for r in node_records]
        return batch, records, max(seconds for _, _, seconds in parts)

    def validate(
        self, tokenizer, reward_fn, prompts, params: SamplingParams
    ) -> RolloutBatch | None:
        """Validation on rank 0's engine (None on other ranks)."""
        if not self.env.is_main:
            return None
        uids = [f"val-{i}" for i in range(len(prompts))]
        batch, _, _ = generate_and_score(
            self.engine, tokenizer, reward_fn, prompts, uids, list(range(len(prompts))), params
        )
        return batch

    def sync(self, model, version: int):
        return self.syncer.sync(model, version)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
