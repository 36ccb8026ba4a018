"""The SGLang servers that serve the policy, and the weight version they hold: one owner.

Every rank holds a `PolicyServers`; the ranks that own servers hold the engine:

- one node (or `rollout.server_urls` given, i.e. disaggregated servers): global rank 0 owns
  the engine and generates every prompt;
- several nodes, colocated (servers launched by the job): each node's local rank 0 owns a
  server group on its node. A step's prompts are split across the nodes in order, each
  node generates and scores its share, and rank 0 gathers them back in prompt order, so
  the batch is the one a single engine would produce.

It does three things, each behind one call (all ranks call):

- `generate` / `validate`: scored responses, the same `RolloutResult` on every rank, stamped
  with the weight version that generated them (`RolloutResult.policy_version`);
- `load_weights(policy, v)`: wake sleeping servers, move the policy's weights into them as
  version v (`rlhf.weight_sync`: gather + transport), restart and reload a server lost on
  the way, and check log-prob parity on a probe sequence; afterwards every server serves v;
- `release_memory`: colocated GPU servers free their weights, KV cache and CUDA graphs for
  training.

A launched server that dies is restarted by its `ServerGroup`; the restart hook registered
here reloads the current version into it (`WeightSyncer.reload`), so a generation that
outlives a server crash still samples from the current policy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlhf import sglang_api
from rlhf.config.engine_args import launched_rollout
from rlhf.config.schema import (
    ActorRolloutRefConfig,
    DataConfig,
    RLHFConfig,
    RolloutConfig,
    TrainerConfig,
)
from rlhf.data.images import ImageInputs, ImageProcessor, one_token_per_image
from rlhf.data.prompts import EncodedPrompt
from rlhf.distributed.collectives import all_gather_objects, broadcast_object, gather_objects
from rlhf.distributed.context import ParallelContext
from rlhf.memory.ledger import ledger
from rlhf.memory.planner import planned_kv_cache_tokens
from rlhf.models.families import ModelArch
from rlhf.models.lora import lora_spec
from rlhf.reward.scorer import RewardInput, RewardScorer
from rlhf.rollout.batch import RolloutBatch, RolloutRecord, RolloutResult
from rlhf.rollout.engine import RolloutEngine, RolloutSample, SamplingParams, SGLangEngine
from rlhf.rollout.multi_turn import Conversation, MultiTurnRollout, ToolStats
from rlhf.rollout.multi_turn_config import multi_turn_rollout
from rlhf.rollout.partial import end_of_sample_ids, first_and_last_version
from rlhf.rollout.sglang_server import check_servable
from rlhf.sglang_api import ServerLost
from rlhf.tools.base import Tool
from rlhf.utils import empty_device_cache, split_evenly
from rlhf.weight_sync.adapters import ADAPTER, AdapterSyncer
from rlhf.weight_sync.factory import Syncer, build_weight_syncer
from rlhf.weight_sync.gather import SyncTopology
from rlhf.weight_sync.probe import (
    ProbeSequence,
    check_parity,
    image_probe,
    logprob_diff_max,
    probe_tokens,
)
from rlhf.weight_sync.syncer import SyncStats

log = logging.getLogger(__name__)
# SGLang's memory-saver tags (sglang.srt.constants): what wakes for the sync, what after it
WEIGHT_TAGS = ["weights"]
CACHE_TAGS = ["kv_cache", "cuda_graph"]
SGLANG = "sglang"  # the servers' owner name in the device ledger


@dataclass(frozen=True)
class PauseHandling:
    """How samples cut by a pause are finished (`SGLangEngine.generate_through_pauses`):
    `stop_ids` end a sample; `keep_tokens`: go on from its tokens, else start again."""

    stop_ids: frozenset[int]
    keep_tokens: bool = True


def sampling_params(aro: ActorRolloutRefConfig, max_response_length: int) -> SamplingParams:
    """Training sampling: `actor_rollout_ref.rollout` and `data.max_response_length`; the
    routed experts come back with rollout routing replay (`actor.router_replay.mode=R3`)."""
    rollout = aro.rollout
    params = SamplingParams.from_config(rollout, max_response_length, rollout.sampling_seed)
    r3 = aro.actor.router_replay.mode == "R3"
    return dataclasses.replace(params, routed_experts=r3)


def val_sampling_params(rollout: RolloutConfig, max_response_length: int) -> SamplingParams:
    """Validation sampling (`rollout.val_kwargs`); greedy unless do_sample."""
    kw = rollout.val_kwargs
    return SamplingParams(
        n=kw.n,
        temperature=kw.temperature if kw.do_sample else 0.0,
        top_p=kw.top_p if kw.do_sample else 1.0,
        top_k=kw.top_k if kw.do_sample else -1,
        max_new_tokens=max_response_length,
        seed=rollout.sampling_seed if kw.do_sample else None,
    )


def kv_cache_tokens(data: DataConfig, rollout: RolloutConfig, num_prompts: int) -> int:
    """Tokens of KV cache the largest generation needs (CPU servers are sized to this)."""
    per_sample = data.max_prompt_length + data.max_response_length
    n = max(rollout.n, rollout.val_kwargs.n)
    return max(2048, num_prompts * n * per_sample)


@dataclass(frozen=True)
class PolicyWeights:
    """What `load_weights` serves: this rank's shard of the trained policy (`module`, its
    weights on the device: the caller's residency, `PPOEngine.serving`) and what the
    servers' log-probs are compared with after the sync: the policy's
    log p(token_t | tokens_<t), t >= 1, of `PolicyServers.probe_sequence` through its training
    forward path (`probe_logprobs`, computed by the trainer; nothing here calls back)."""

    module: nn.Module
    probe_logprobs: Tensor


@dataclass(frozen=True)
class WeightLoad:
    """One `load_weights`: what moved, and how far the servers' log-probs are from the
    policy's on the probe (`rollout/logprob_diff_max`)."""

    version: int
    stats: SyncStats
    logprob_diff_max: float

    def metrics(self) -> dict[str, float]:
        phases = {f"timing_s/update_weights_{k}": v for k, v in self.stats.phase_s.items()}
        return {
            "perf/weight_sync_bytes": float(self.stats.num_bytes),
            "rollout/logprob_diff_max": self.logprob_diff_max,
            **phases,
        }


def server_kv_cache_tokens(
    data: DataConfig,
    rollout: RolloutConfig,
    ctx: ParallelContext,
    max_prompts: int,
    arch: ModelArch,
) -> int:
    """The KV cache a launched server gets: on CPU what the largest generation needs; on
    GPU the memory plan's share (`rlhf.memory.planner.planned_kv_cache_tokens`)."""
    if ctx.device.type == "cpu":
        return kv_cache_tokens(data, rollout, max_prompts)
    gpu_bytes = torch.cuda.get_device_properties(ctx.device).total_memory
    return planned_kv_cache_tokens(rollout, arch, gpu_bytes)


def wait_for_servers(engine: SGLangEngine | None) -> None:
    """All ranks: until this node's launched servers are up (the trainer allocates after)."""
    if engine is not None:
        engine.wait_ready()
    if dist.is_initialized():
        dist.barrier()


def _conversations_and_pauses(
    rollout: RolloutConfig,
    trainer: TrainerConfig,
    max_response_length: int,
    model_path: str,
    tokenizer,
    tools: dict[str, Tool],
) -> tuple[MultiTurnRollout | None, PauseHandling | None]:
    """The engine owner's multi-turn rollout (None: single-turn) and, under
    `trainer.rollout_mode=async`, how weight loads pause generation (else None)."""
    multi_turn = multi_turn_rollout(rollout.multi_turn, max_response_length, tokenizer, tools)
    if trainer.rollout_mode != "async":
        return multi_turn, None
    stop_ids = end_of_sample_ids(model_path, tokenizer)
    pauses = PauseHandling(frozenset(stop_ids), trainer.async_rollout.partial_rollout)
    return multi_turn, pauses


class PolicyServers:
    """The policy's SGLang servers on their owning ranks, and the weights they serve."""

    def __init__(
        self,
        ctx: ParallelContext,
        engine: SGLangEngine | None,
        syncer: Syncer,
        rollout: RolloutConfig,
        *,
        tokenizer=None,
        scorer: RewardScorer | None = None,
        per_node: bool = False,
        sleeps: bool = False,
        colocated: bool = False,
        multi_turn: MultiTurnRollout | None = None,
        pauses: PauseHandling | None = None,
        processor: ImageProcessor | None = None,
    ):
        """`engine` on the ranks that own servers (None elsewhere); `syncer` on every rank;
        `sleeps`: colocated servers release their memory between generations (the release
        itself is a CUDA call: on the CPU the same decisions run and only the device
        ledger records it); `colocated`: a server of this rank's node uses this rank's
        device; `multi_turn` (on the engine ranks): every sample is a conversation with
        tools; `pauses`: weight loads may pause generation (`trainer.rollout_mode=async`),
        and how the samples they cut are finished; `processor`: a vision-language
        policy's, for the pixel values of prompts with images."""
        self.ctx, self.engine, self.syncer = ctx, engine, syncer
        # LoRA adapters synced alone: the servers serve none until the first sync
        self.lora = ADAPTER if isinstance(syncer, AdapterSyncer) else None
        self.processor = processor
        self.multi_turn, self.pauses = multi_turn, pauses
        self.tokenizer, self.scorer = tokenizer, scorer
        self.per_node, self.sleeps, self.colocated = per_node, sleeps, colocated
        self.asleep: set[str] = set()
        # every rank alike: a weight load must come first
        self.weights_released = self.lora is not None
        vocab, vision = syncer.arch.vocab_size, syncer.arch.vision
        self.probe_sequence = (
            ProbeSequence.text(probe_tokens(vocab))
            if vision is None or processor is None
            else image_probe(vocab, vision, processor)
        )
        self.probe_threshold = rollout.logprob_diff_threshold
        # launched servers load model.path, which the actor starts from: version 0; external
        # servers may hold anything until the first load
        self.initial_version = None if rollout.server_urls else 0
        if engine is not None:
            engine.on_server_restart(self._reload)

    @property
    def version(self) -> int | None:
        """The weight version the servers serve: the last one synced, else the initial one."""
        synced = self.syncer.version
        return self.initial_version if synced is None else synced

    @classmethod
    def launch(
        cls,
        cfg: RLHFConfig,
        ctx: ParallelContext,
        run_dir: Path,
        tokenizer,
        max_prompts: int,
        arch: ModelArch,
        tools: dict[str, Tool],
        processor: ImageProcessor | None = None,
    ) -> PolicyServers:
        """Start the servers (without waiting: the caller builds its models meanwhile and then
        calls `wait_ready`) and the weight syncer of this rank's node; `tools`: the configured
        tools (`load_configured_tools`), which the owner ranks' conversations call;
        `processor`: a vision-language policy's (`rlhf.data.images`)."""
        check_servable(arch)
        rollout = cfg.actor_rollout_ref.rollout
        per_node = rollout.server_urls is None and ctx.num_nodes > 1
        owner = ctx.local_rank == 0 if per_node else ctx.is_main
        node_dir = run_dir / f"node{ctx.node_rank}" if per_node else run_dir
        engine = scorer = multi_turn = pauses = None
        launched = rollout.server_urls is None
        colocated = launched and ctx.local_rank < rollout.num_servers * (
            rollout.tensor_model_parallel_size
        )
        sleeps = launched and rollout.free_cache_engine
        model = cfg.actor_rollout_ref.model
        adapters = None if model.lora_merge else lora_spec(model)  # LoRA synced alone
        if owner:
            scorer = RewardScorer.from_config(cfg.reward)
            multi_turn, pauses = _conversations_and_pauses(
                rollout,
                cfg.trainer,
                cfg.data.max_response_length,
                cfg.actor_rollout_ref.model.path,
                tokenizer,
                tools,
            )
            kv_tokens = server_kv_cache_tokens(cfg.data, rollout, ctx, max_prompts, arch)
            lora = adapters is not None
            engine = _engine(cfg.actor_rollout_ref, cfg.data.seed, ctx, node_dir, kv_tokens, lora)
        try:
            urls = node_server_urls(ctx, engine, per_node)
            topology = SyncTopology.of(ctx, per_node=per_node)
            syncer = build_weight_syncer(
                rollout,
                urls,
                arch,
                topology,
                run_dir=node_dir,
                model_path=model.path,
                adapters=adapters,
            )
            if sleeps and ctx.device.type == "cuda":  # SGLang sizes its memory from what
                wait_for_servers(engine)  # is free as it starts: the trainer allocates after
        except BaseException:
            if engine is not None:
                engine.shutdown()
            raise
        servers = cls(
            ctx,
            engine,
            syncer,
            rollout,
            tokenizer=tokenizer,
            scorer=scorer,
            per_node=per_node,
            sleeps=sleeps,
            colocated=colocated,
            multi_turn=multi_turn,
            pauses=pauses,
            processor=processor,
        )
        servers.note_started()
        servers.release_memory()  # asleep while the trainer builds its models (the first
        return servers  # load_weights wakes them with the actor's weights)

    @property
    def server_urls(self) -> list[str]:
        """The servers of this rank's node (the ones its weight sync reaches)."""
        return self.syncer.server_urls

    def wait_ready(self) -> None:
        """Until this rank's servers are healthy (they were launched without waiting)."""
        if self.engine is not None:
            self.engine.wait_ready()

    # ---- generation ---------------------------------------------------------------------

    def generate(
        self,
        prompts: list[EncodedPrompt],
        uids: list[str],
        indices: list[int],
        params: SamplingParams,
    ) -> RolloutResult:
        """`params.n` scored responses per prompt, in prompt order, on every rank."""
        return self.share(self.generate_here(prompts, uids, indices, params))

    def generate_here(
        self,
        prompts: list[EncodedPrompt],
        uids: list[str],
        indices: list[int],
        params: SamplingParams,
    ) -> RolloutResult | None:
        """The first half of `generate`, without collectives (a background thread may run
        it): this rank's engine generates its share of the prompts (None on other ranks)."""
        if not self.per_node:
            return self._generate(prompts, uids, indices, params) if self.ctx.is_main else None
        if self.engine is None:
            return None
        nodes, node = self.ctx.num_nodes, self.ctx.node_rank
        return self._generate(
            split_evenly(prompts, nodes)[node],
            split_evenly(uids, nodes)[node],
            split_evenly(indices, nodes)[node],
            params,
        )

    def share(self, mine: RolloutResult | None) -> RolloutResult:
        """The second half of `generate` (collective): the shares of `generate_here` as one
        result, on every rank."""
        return _share(_concat(gather_objects(mine)) if self.per_node else mine)

    def validate(self, prompts: list[EncodedPrompt], params: SamplingParams) -> RolloutResult:
        """Validation responses of every prompt (generated on rank 0's engine), on every rank."""
        mine = None
        if self.ctx.is_main:
            uids = [f"val-{i}" for i in range(len(prompts))]
            mine = self._generate(prompts, uids, list(range(len(prompts))), params)
        return _share(mine)

    def _generate(
        self,
        prompts: list[EncodedPrompt],
        uids: list[str],
        indices: list[int],
        params: SamplingParams,
    ) -> RolloutResult:
        assert self.engine is not None and self.scorer is not None
        return generate_and_score(
            self.engine,
            self.tokenizer,
            self.scorer,
            prompts,
            uids,
            indices,
            params,
            self.version,
            self.multi_turn,
            self.pauses,
            self.processor,
        )

    # ---- weights ------------------------------------------------------------------------

    def load_weights(self, policy: PolicyWeights, version: int, pause: bool = False) -> WeightLoad:
        """Every server serves `policy`'s weights as `version` (all ranks call): sync,
        recover a server lost on the way, then the log-prob probe (raises above
        `rollout.logprob_diff_threshold`).

        `pause`: the servers are generating (`trainer.rollout_mode=async`). Their owner
        pauses its requests first (`SGLangEngine.paused`: every request in flight is
        aborted and answered with the tokens it has; `generate_through_pauses` sends it
        again once the sync is done) and the probe runs among the continued requests.

        Colocated GPU servers that slept while training wake in two steps (the caller holds
        only the policy's weights on the device meanwhile, `sleeps`: its gradients and
        optimizer state off it for the whole load): SGLang's weights wake and the sync runs;
        then its KV cache and CUDA graphs wake for the probe. The allocator's cache is
        emptied before each wake. What the config keeps resident comes back afterwards,
        next to the woken servers (the planner's rollout phase)."""
        self.wake(WEIGHT_TAGS)
        paused = self._pause() if pause else contextlib.nullcontext()
        with paused:
            stats = self.syncer.sync(policy.module, version)
            for url in stats.lost:
                self._recover(url)
        self.wake(CACHE_TAGS)
        diff = self.probe(policy)
        self.weights_released = False
        return WeightLoad(version, stats, diff)

    def _pause(self) -> AbstractContextManager[None]:
        """This rank's servers generate nothing of ours inside (on the engine's ranks)."""
        return self.engine.paused() if self.engine is not None else contextlib.nullcontext()

    def probe(self, policy: PolicyWeights) -> float:
        """rollout/logprob_diff_max: the largest |server - policy| log-prob of the probe
        sequence over this node's servers, the same on every rank; raises above the
        threshold. A server lost meanwhile is recovered and asked again."""
        diff = logprob_diff_max(
            policy.probe_logprobs,
            self._server_logprobs,
            self.server_urls,
            self.syncer.topology.is_sender,
            self.ctx.device,
            self.probe_sequence.compared,
        )
        log.debug("weights v%s: rollout/logprob_diff_max = %.3e", self.version, diff)
        check_parity(diff, self.probe_threshold)
        return diff

    def _server_logprobs(self, url: str) -> list[float]:
        probe = self.probe_sequence
        try:
            return sglang_api.prompt_logprobs(url, probe.server_tokens, probe.images, self.lora)
        except sglang_api.SGLangAPIError as e:
            if not e.unreachable:
                raise
            log.warning("SGLang server %s lost during the log-prob probe: %s", url, e)
        self._recover(url)
        return sglang_api.prompt_logprobs(url, probe.server_tokens, probe.images, self.lora)

    def _recover(self, url: str) -> None:
        """A server stopped answering: restart it if it died (within
        `rollout.max_server_restarts`), then make it hold the synced version. External
        servers are never restarted."""
        if self.engine is None:
            raise ServerLost(f"SGLang server {url} was lost on a rank that does not own it")
        restarts = self.engine.group.restarts
        before = restarts.get(url, 0)
        if self.engine.recover(url) != url:
            raise ServerLost(
                f"external SGLang server at {url} was lost; external servers are never "
                "restarted by the trainer: restart it, then resume the run"
            )
        if restarts.get(url, 0) > before:  # a new process holds all its memory (GPU)
            self.asleep.discard(url)
        if sglang_api.weight_version(url) != str(self.syncer.version):
            # alive (it answered too late), with the sync's update window still open
            with contextlib.suppress(sglang_api.SGLangAPIError):
                sglang_api.end_weight_update(url)
            self.syncer.reload(url)
        log.warning(
            "SGLang server %s holds the weights of version %s again", url, self.syncer.version
        )

    def _reload(self, url: str) -> None:
        """Restart hook: a restarted server came back with the initial weights."""
        self.syncer.reload(url)

    # ---- memory (colocated GPU servers) ---------------------------------------------------

    def note_started(self) -> None:
        """Launched servers hold all their memory on this rank's device (device ledger)."""
        if self.colocated:
            for tag in (*WEIGHT_TAGS, *CACHE_TAGS):
                ledger().came(SGLANG, tag)

    def release_memory(self) -> None:
        """Sleep (all ranks call): the engine's servers free their weights, KV cache and
        CUDA graphs (colocated), and no rank goes on before every server has (a rank
        reloading its model state next to a server still holding its memory would run out
        of it)."""
        if not self.sleeps:
            return
        if self.engine is not None:
            for url in self.engine.server_urls:
                self._release(url)
                self.asleep.add(url)
        if dist.is_initialized():
            dist.barrier()
        self.weights_released = True
        if self.colocated:
            for tag in (*WEIGHT_TAGS, *CACHE_TAGS):
                ledger().left(SGLANG, tag)

    def _release(self, url: str) -> None:
        if self.ctx.device.type == "cuda":  # SGLang's release is a CUDA call
            sglang_api.release_memory_occupation(url, [*WEIGHT_TAGS, *CACHE_TAGS])

    def wake(self, tags: list[str]) -> None:
        """Wake `tags` of the sleeping servers once every rank has emptied its allocator
        cache (a server's shards live on all of its node's GPUs): WEIGHT_TAGS before a
        weight sync, then CACHE_TAGS before generating (the released weights are stale
        until synced)."""
        if not self.sleeps:
            return
        empty_device_cache()
        if dist.is_initialized():
            dist.barrier()
        for url in sorted(self.asleep):
            if self.ctx.device.type == "cuda":
                sglang_api.resume_memory_occupation(url, tags)
        if set(CACHE_TAGS) <= set(tags):
            self.asleep.clear()
        if self.colocated:
            for tag in tags:
                ledger().came(SGLANG, tag)

    def shutdown(self) -> None:
        try:
            self.syncer.close()
        finally:
            if self.scorer is not None:
                self.scorer.close()
            if self.engine is not None:
                self.engine.shutdown()


def _engine(
    aro: ActorRolloutRefConfig,
    seed: int,
    ctx: ParallelContext,
    node_dir: Path,
    kv_tokens: int,
    lora: bool,
) -> SGLangEngine:
    """This node's servers, launched without waiting (`lora`: every request names the
    adapter the weight sync loads, `rlhf.weight_sync.adapters`)."""
    return SGLangEngine(
        launched_rollout(aro),
        aro.model.path,
        log_dir=node_dir / "logs",
        device=ctx.device.type,
        seed=seed,
        max_total_tokens=kv_tokens,
        wait=False,
        gpus_per_node=ctx.local_world_size,
        lora=ADAPTER if lora else None,
    )


def node_server_urls(ctx: ParallelContext, engine: SGLangEngine | None, per_node: bool):
    """The server URLs of this rank's node (every rank of a node gets the same list)."""
    everyone = all_gather_objects(engine.server_urls if engine else None)
    owner = ctx.node_rank * ctx.local_world_size if per_node else 0
    urls = everyone[owner]
    assert urls is not None, f"rank {owner} owns an engine"
    return urls


def _concat(parts: list[RolloutResult | None] | None) -> RolloutResult | None:
    """On rank 0: the node leaders' results (in rank = node order) as one; None elsewhere."""
    if parts is None:
        return None
    results = [p for p in parts if p is not None]
    batch = RolloutBatch.concat([r.batch for r in results])
    records = [record for r in results for record in r.records]
    reward_s = max(r.reward_s for r in results)
    stats = [r.tool_stats for r in results if r.tool_stats is not None]
    tool_stats = sum(stats, ToolStats()) if stats else None
    versions = [r.sample_versions for r in results]
    sample_versions = None if None in versions else [v for vs in versions if vs for v in vs]
    version = results[0].policy_version
    return RolloutResult(batch, records, reward_s, version, tool_stats, sample_versions)


def _share(result: RolloutResult | None) -> RolloutResult:
    """Rank 0's result on every rank (records stay on rank 0)."""
    sent = None
    if result is not None:  # every field but the records, the batch as plain objects
        fields = [f.name for f in dataclasses.fields(result) if f.name not in ("batch", "records")]
        sent = (result.batch.to_objects(), {name: getattr(result, name) for name in fields})
    received = broadcast_object(sent)
    if result is not None:
        return result
    assert received is not None, "rank 0 generated"
    objects, others = received
    return RolloutResult(RolloutBatch.from_objects(objects), [], **others)


# ---- generation and scoring on one engine ------------------------------------------


def generate_and_score(
    engine: RolloutEngine,
    tokenizer,
    scorer: RewardScorer,
    prompts: list[EncodedPrompt],
    uids: list[str],
    indices: list[int],
    params: SamplingParams,
    policy_version: int | None = None,
    multi_turn: MultiTurnRollout | None = None,
    pauses: PauseHandling | None = None,
    processor: ImageProcessor | None = None,
) -> RolloutResult:
    """Generate `params.n` responses per prompt on `engine` and score them with `scorer`
    (rule rows, and model rows when a reward endpoint is set; other model rows stay NaN for
    the trainer's reward model, `rlhf.engine.reward_model`).

    `uids` and `indices` (the prompts' positions in their dataset) go with each prompt;
    `policy_version` (the weights the engine serves) with the result and every record.
    With `multi_turn`, each sample is a conversation with its tools (created from the
    row's `extra_info.tools_kwargs`); its reward is the rule reward of the whole response
    text (tool messages included: the answer is read from the last turn) plus the tools'
    step rewards, and the batch carries which tokens the policy generated. With `pauses`,
    samples cut by a pause are finished under the weights that follow it, and each
    records the versions of its tokens. Prompts with images (a vision-language policy's
    `processor`) are sent with them, and each sample carries their pixel values.
    """
    params = params.for_prompts(uids)  # seeded requests: each prompt's seeds from its uid
    samples, conversations = generate_samples(
        engine, prompts, params, multi_turn, pauses, processor
    )
    start = time.perf_counter()
    texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    inputs = [
        _reward_input(prompts[s.prompt_index], text, tokenizer) for s, text in zip(samples, texts)
    ]
    scores = scorer(inputs)
    if conversations is not None:
        scores = [
            s + sum(c.reward for c in conv.tool_calls) for s, conv in zip(scores, conversations)
        ]
    records = _records(prompts, uids, indices, samples, scores, inputs, policy_version)
    if conversations is not None:
        records = [with_conversation(r, c) for r, c in zip(records, conversations)]
    versions = None
    if pauses is not None:
        records = [
            dataclasses.replace(r, weight_versions=list(s.weight_versions))
            for r, s in zip(records, samples)
        ]
        versions = [first_and_last_version(s.weight_versions, policy_version) for s in samples]
    batch = RolloutBatch(
        prompt_ids=[r.prompt_ids for r in records],
        response_ids=[r.response_ids for r in records],
        scores_b=torch.tensor(scores, dtype=torch.float32),
        data_sources=[prompts[s.prompt_index].row.data_source for s in samples],
        uids=[r.uid for r in records],
        rollout_logprobs=[r.response_logprobs for r in records],
        reward_styles=[item.style for item in inputs],
        routed_experts=_routed_experts(samples),
        response_masks=None if conversations is None else [c.response_mask for c in conversations],
        images=_sample_images(prompts, samples, processor),
    )
    stats = None if conversations is None else ToolStats.of(conversations)
    reward_s = time.perf_counter() - start
    return RolloutResult(batch, records, reward_s, policy_version, stats, versions)


def _records(
    prompts: list[EncodedPrompt],
    uids: list[str],
    indices: list[int],
    samples: list[RolloutSample],
    scores: list[float],
    inputs: list[RewardInput],
    policy_version: int | None,
) -> list[RolloutRecord]:
    """What `rollouts/step_N.jsonl` shows of each sample (a prompt with images: where its
    row is, `images_from`)."""
    return [
        RolloutRecord(
            prompt_index=indices[sample.prompt_index],
            uid=uids[sample.prompt_index],
            prompt_ids=prompts[sample.prompt_index].input_ids,
            response_ids=sample.response_ids,
            response_logprobs=sample.logprobs,
            finish_reason=sample.finish_reason,
            response_text=item.response_text,
            score=score,
            policy_version=policy_version,
            data_source=item.data_source,
            reward_style=item.style,
            ground_truth=item.ground_truth,
            extra_info=item.extra_info,
            images_from=prompts[sample.prompt_index].row.origin
            if prompts[sample.prompt_index].row.images
            else None,
        )
        for sample, score, item in zip(samples, scores, inputs)
    ]


def _sample_images(
    prompts: list[EncodedPrompt], samples: list[RolloutSample], processor: ImageProcessor | None
) -> list[ImageInputs | None] | None:
    """Each sample's images as the model takes them (one object per prompt), or None when
    no prompt has any."""
    if not any(p.row.images for p in prompts):
        return None
    assert processor is not None, "prompts with images come with the policy's processor"
    inputs = [processor.inputs(p.row.images) if p.row.images else None for p in prompts]
    return [inputs[s.prompt_index] for s in samples]


def generate_samples(
    engine: RolloutEngine,
    prompts: list[EncodedPrompt],
    params: SamplingParams,
    multi_turn: MultiTurnRollout | None,
    pauses: PauseHandling | None,
    processor: ImageProcessor | None = None,
) -> tuple[list[RolloutSample], list[Conversation] | None]:
    """The samples of `generate_and_score` (and the conversations of multi-turn ones);
    prompts with images go with them, each image's tokens cut to one (SGLang expands them)."""
    ids = [p.input_ids for p in prompts]
    if pauses is not None:
        assert isinstance(engine, SGLangEngine), "only SGLang servers pause"
        stop_ids = set(pauses.stop_ids)
        return engine.generate_through_pauses(ids, params, stop_ids, pauses.keep_tokens), None
    if multi_turn is None and processor is not None and any(p.row.images for p in prompts):
        sent = [one_token_per_image(i, processor.image_token_id) for i in ids]
        return engine.generate(sent, params, [p.row.images for p in prompts]), None
    if multi_turn is None:
        return engine.generate(ids, params), None
    assert isinstance(engine, SGLangEngine), "multi-turn rollouts run on SGLang servers"
    kwargs = [p.row.tools_kwargs for p in prompts]
    conversations = engine.converse(ids, params, multi_turn, kwargs)
    samples = [
        RolloutSample(k // params.n, c.response_ids, c.logprobs, c.finish_reason)
        for k, c in enumerate(conversations)
    ]
    return samples, conversations


def with_conversation(record: RolloutRecord, conv: Conversation) -> RolloutRecord:
    """`record` with what its conversation did: turns, policy-token mask, tool calls."""
    calls = [dataclasses.asdict(c) for c in conv.tool_calls]
    return dataclasses.replace(
        record, turns=conv.turns, response_mask=conv.response_mask, tool_calls=calls
    )


def _routed_experts(samples: list[RolloutSample]) -> list[torch.Tensor] | None:
    """Each sample's routed experts when the engine returned them (not in the records)."""
    routes = [s.routed_experts for s in samples]
    return None if any(r is None for r in routes) else [r for r in routes if r is not None]


def _reward_input(prompt: EncodedPrompt, response_text: str, tokenizer) -> RewardInput:
    row = prompt.row
    prompt_text = ""
    if row.style == "model":  # what a remote judge reads
        prompt_text = tokenizer.decode(prompt.input_ids, skip_special_tokens=True)
    return RewardInput(
        row.data_source,
        response_text,
        row.ground_truth,
        row.extra_info,
        row.style,
        prompt_text,
        row.origin,
    )
