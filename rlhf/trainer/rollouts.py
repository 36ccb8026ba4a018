"""Where a step's scored batch comes from, and how its weights reach the servers: the rollout
strategies (docs/architecture.md).

Where a step's scored batch comes from: the rollout strategy (docs/architecture.md).

`SynchronousRollout` generates the batch at the start of the step with the weights the
servers hold (the previous step's policy: no lag). This is the seam the asynchronous
strategies (`rlhf.trainer.rollouts`, `trainer.rollout_mode`) replace: `next_batch(step)`
returns a `StepBatch` whose rounds carry the policy version that generated them, and
`publish(policy, version)` is how the step's new weights reach the servers.

The synchronous batch includes DAPO's two changes to it:

- Dynamic sampling (`algorithm.filter_groups`): a prompt whose samples all score the same
  (`metric`: the reward functions' score, or the shaped `seq_reward`) gives every sample the
  same group advantage, i.e. no signal. Such groups are dropped and
  more prompts are generated, round after round, until the step has
  `data.train_batch_size` informative groups (the first ones, in order), or the run fails
  after `max_num_gen_batches` rounds.
- Overlong shaping (`reward.overlong_buffer`): a response of L tokens, with limit
  L_max = `data.max_response_length` and buffer B, gets
  min(0, (L_max - B - L) / B) x penalty_factor added to its score: nothing up to L_max - B
  tokens, then a penalty growing linearly to -penalty_factor at the limit.

Every rank runs this identically (same sampler, same broadcast results), so every rank
takes the same decisions.

Generation ahead of training: `trainer.rollout_mode` one_step_off and async.

The sampler's prompts are cut into rounds (one step's prompts each, as the synchronous
strategy draws them). Rounds are generated two at a time, oldest first, by background
threads on the engine's rank (`PolicyServers.generate_here`: HTTP and rule scoring, no
collectives), and consumed, in order, by the step that needs it: every rank waits for it,
receives it (`PolicyServers.share`) and the step's batch is built from it exactly as the
synchronous one is (dynamic sampling and overlong shaping included: a step that needs more
rounds takes the next ones, submitting one when none is ahead). After each weight load the
queue is topped up to 1 + `ahead` rounds:

- one_step_off (`ahead` = 1, verl's one-step-off policy): the round of step N+1 generates
  while step N trains. No pause: the load waits until every round ahead is complete, then
  syncs, so each round comes wholly from one version, one older than the policy that
  trains on it.
- async (`ahead` = `trainer.async_rollout.max_staleness` = K): K rounds generate while a
  step trains, and the load pauses generation around the sync
  (`PolicyServers.load_weights(pause=True)` -> `SGLangEngine.paused`): every request in
  flight is aborted and answered with its tokens, so no KV cache computed by the old
  weights survives the update and the cache flush succeeds, and the client holds its
  requests until the sync is done. SGLang's own `/pause_generation` (abort mode) does the
  same but polls once a second (1.0 s per pause here); its retract mode recomputes the KV
  and in_place keeps stale KV, and both spin a core while paused on CPU. Cut samples go
  on from their tokens under the new weights (partial rollouts; `partial_rollout=false`:
  they start again), and each records the versions of its tokens.

Staleness of a sample = the version being trained (the servers' version when its step
starts) minus the version of its oldest token. A round submitted after the load of version v
is consumed at step v+1+K at the latest (each step consumes at least one round), so its
staleness is at most K. The bound is also checked, not only planned: a prompt group with a
sample older than that would be dropped and counted (`async/dropped_stale`), never trained.
A rollback (`trainer.early_stop`) loads the good checkpoint's weights as the next version;
the rounds already ahead, sampled by the rolled-back policy, are still trained (within the
bound, importance-weighted against their own log-probs).

Exactly once: a round is popped by one step and each of its samples is then trained on or
counted (dynamic sampling's and staleness drops). The sampler state a checkpoint stores is
the one after the last consumed round's prompts were drawn, so a resumed run draws the rounds
that were ahead again, in the same order, and regenerates them from the resumed weights.

Training from stored rollouts (`data.rollout_files`): samples generated earlier, by this
run's steps (`rollouts/step_N.parquet`) or any other writer of `rlhf.data.rollout_files`.

The stored samples are grouped by uid (a prompt group, in file order). Each step takes
k = `data.stored_fraction` x `data.train_batch_size` groups from them, in an order shuffled
per epoch by its own `PromptSampler` (seeded by `data.seed`, saved in checkpoints), and
generates the other `train_batch_size` - k prompt groups from `data.train_files` as the
synchronous strategy does (none when the fraction is 1). Stored groups keep their samples
and log-probs as written (the behaviour policy's, which truncated importance sampling or
bypass mode corrects for); their uids get a `stored:` prefix so that no stored group
merges with a generated one. A stored sample without a score is scored now: a rule row by
the run's reward function on its decoded response (on the main rank, shared with the
others), a `style: model` row by the run's reward model (`score_model_rows`).

Metrics: `stored/groups` and `stored/samples` per step (the mix, exactly), and the usual
`rollout_corr/*` against the stored log-probs.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlhf.config.algorithm import AlgorithmConfig, FilterGroupsConfig
from rlhf.config.schema import (
    ActorRolloutRefConfig,
    DataConfig,
    OverlongBufferConfig,
    RewardConfig,
    TrainerConfig,
)
from rlhf.config.validate import stored_groups_per_step
from rlhf.data.files import resolve_files
from rlhf.data.prompts import PromptDataset
from rlhf.data.rollout_files import RolloutChecks, StoredSample, read_rollout_files
from rlhf.data.sampler import PromptSampler
from rlhf.distributed.collectives import broadcast_object
from rlhf.engine.reward_model import RewardModelScorer, score_model_rows
from rlhf.reward import check_ground_truth
from rlhf.reward.scorer import RewardInput
from rlhf.rollout.batch import RolloutBatch, RolloutRecord, RolloutResult
from rlhf.rollout.engine import SamplingParams
from rlhf.rollout.multi_turn import ToolStats
from rlhf.rollout.policy_servers import PolicyServers, PolicyWeights, WeightLoad, sampling_params
from rlhf.trainer.metrics import reward_style_metrics
from rlhf.weight_sync.probe import ProbeSequence


class Policy(Protocol):
    """The trained policy as a strategy publishes it (the engine, `PPOEngine.weights`)."""

    def serving(
        self, probe: ProbeSequence, weights_only: bool
    ) -> AbstractContextManager[PolicyWeights]: ...


@dataclass(frozen=True)
class BatchShaping:
    """How the strategies make a step's batch: `train_batch_size` prompt groups, responses
    sampled with `params` (at most `max_response_length` tokens), DAPO's dynamic sampling
    (`filter_groups`) and overlong shaping (`overlong`); with stored rollouts,
    `stored_per_step` of the groups come from them, in an order seeded by `seed`."""

    train_batch_size: int
    max_response_length: int
    params: SamplingParams
    filter_groups: FilterGroupsConfig
    overlong: OverlongBufferConfig
    stored_per_step: int = 0
    seed: int = 0

    @classmethod
    def of(
        cls,
        aro: ActorRolloutRefConfig,
        data: DataConfig,
        algorithm: AlgorithmConfig,
        reward: RewardConfig,
    ) -> BatchShaping:
        return cls(
            data.train_batch_size,
            data.max_response_length,
            sampling_params(aro, data.max_response_length),
            algorithm.filter_groups,
            reward.overlong_buffer,
            stored_groups_per_step(data),
            data.seed,
        )


@dataclass(frozen=True)
class StepBatch:
    """The batch a step learns from, every generation round that made it (records on the
    main rank, the policy version that generated it), and the metrics of dynamic sampling
    and overlong shaping (when enabled)."""

    batch: RolloutBatch
    rounds: list[RolloutResult]
    metrics: dict[str, float]

    @property
    def reward_s(self) -> float:
        """Seconds spent scoring (rules and reward model), over all rounds."""
        return sum(r.reward_s for r in self.rounds)


class RolloutStrategy(Protocol):
    """How a step gets its scored batch and how new weights reach the servers (collective:
    every rank calls, every rank gets the same)."""

    def next_batch(self, step: int) -> StepBatch: ...

    def publish(self, policy: Policy, version: int) -> WeightLoad: ...

    def sampler_state(self) -> dict[str, Any]:
        """Where the prompts of the next step not yet generated begin (for checkpoints)."""
        ...

    def load_sampler_state(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's `sampler_state`."""
        ...

    def close(self) -> None: ...


@dataclass
class SynchronousRollout:
    """Generate and score the step's batch now, from the policy the servers serve."""

    servers: PolicyServers
    sampler: PromptSampler
    data: PromptDataset
    shaping: BatchShaping
    reward_model: RewardModelScorer | None  # scores the reward_model.style=model rows

    def next_batch(self, step: int) -> StepBatch:
        return collect_step_batch(self.generate_round, self.shaping)

    def generate_round(self) -> RolloutResult:
        """The next prompts of the sampler, generated and scored now."""
        sampled = self.sampler.next_batch()  # every rank advances its sampler identically
        prompts = [self.data[i] for i in sampled.prompt_indices]
        params = self.shaping.params
        generated = self.servers.generate(prompts, sampled.uids, sampled.prompt_indices, params)
        return score_model_rows(generated, self.reward_model)

    def publish(self, policy: Policy, version: int) -> WeightLoad:
        """The servers are idle between steps: load the weights."""
        with policy.serving(self.servers.probe_sequence, self.servers.sleeps) as weights:
            return self.servers.load_weights(weights, version)

    def sampler_state(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_sampler_state(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def close(self) -> None:
        pass


def prompt_groups(batch: RolloutBatch) -> list[list[int]]:
    """The sample indices of each prompt (uid), in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, uid in enumerate(batch.uids):
        groups.setdefault(uid, []).append(i)
    return list(groups.values())


def informative_groups(batch: RolloutBatch, values_b: torch.Tensor) -> list[list[int]]:
    """The prompt groups whose samples do not all have the same value (`values_b`, [B])."""
    values = values_b.tolist()
    return [g for g in prompt_groups(batch) if len({values[i] for i in g}) > 1]


def filter_metric(batch: RolloutBatch, shaping: BatchShaping) -> torch.Tensor:
    """[B] what dynamic sampling compares (`algorithm.filter_groups.metric`): the reward
    functions' score, or (seq_reward) the score after overlong shaping."""
    overlong = shaping.overlong
    if shaping.filter_groups.metric == "seq_reward" and overlong.enable:
        return batch.scores_b + overlong_penalties(batch, shaping.max_response_length, overlong)
    return batch.scores_b


def overlong_penalties(batch: RolloutBatch, max_length: int, cfg: OverlongBufferConfig):
    """[B] penalty (<= 0) of each response's length under `reward.overlong_buffer`."""
    start = max_length - cfg.len
    lengths = torch.tensor([len(r) for r in batch.response_ids], dtype=torch.float32)
    return ((start - lengths) / cfg.len).clamp(max=0) * cfg.penalty_factor


def collect_step_batch(next_round: Callable[[], RolloutResult], shaping: BatchShaping) -> StepBatch:
    """Take scored rounds of prompts from `next_round` until the step has
    `data.train_batch_size` prompt groups."""
    wanted = shaping.train_batch_size
    filtering = shaping.filter_groups
    results: list[RolloutResult] = []
    kept: list[list[int]] = []  # groups, as indices into the concatenation of the rounds
    offset = dropped = 0
    while len(kept) < wanted:
        if filtering.max_num_gen_batches and len(results) == filtering.max_num_gen_batches:
            raise RuntimeError(
                f"dynamic sampling found {len(kept)} of {wanted} prompt groups whose samples "
                f"score differently in {len(results)} generation rounds "
                "(algorithm.filter_groups.max_num_gen_batches): raise it, or disable "
                "algorithm.filter_groups"
            )
        results.append(next_round())
        batch = results[-1].batch
        if filtering.enable:
            groups = informative_groups(batch, filter_metric(batch, shaping))
        else:
            groups = prompt_groups(batch)
        kept += [[offset + i for i in g] for g in groups]
        dropped += len(prompt_groups(batch)) - len(groups)
        offset += batch.size
    batch = RolloutBatch.concat([r.batch for r in results])
    batch = batch.select([i for g in kept[:wanted] for i in g])
    metrics = reward_style_metrics(batch)
    tool_stats = [r.tool_stats for r in results if r.tool_stats is not None]
    if tool_stats:  # every round's conversations, dropped groups' included
        metrics |= sum(tool_stats, ToolStats()).metrics()
    if filtering.enable:
        metrics |= {
            "dynamic_sampling/gen_rounds": float(len(results)),
            "dynamic_sampling/dropped_groups": float(dropped),
            "dynamic_sampling/kept_groups": float(len(kept)),
        }
    if shaping.overlong.enable:
        penalty = overlong_penalties(batch, shaping.max_response_length, shaping.overlong)
        batch = dataclasses.replace(batch, scores_b=batch.scores_b + penalty)
        metrics["reward/overlong_penalty/mean"] = float(penalty.mean())
    return StepBatch(batch, results, metrics)


Interval = tuple[float, float]


@dataclass
class Round:
    """One round of prompts ahead: the sampler's state after drawing them, and (on every
    rank) the future of this rank's share of the generation and its wall-clock interval."""

    sampler_state: dict[str, int]
    future: Future[RolloutResult | None]
    interval: list[float] = field(default_factory=list)  # [start, end], set by the thread


@dataclass
class StepAccount:
    """What the rounds consumed by one step did, for its metrics."""

    staleness: list[int] = field(default_factory=list)  # per kept sample
    dropped_stale: int = 0
    partial: int = 0  # kept samples whose tokens come from more than one version
    wait_s: float = 0.0
    overlap_s: float = 0.0

    def metrics(self) -> dict[str, float]:
        stale = self.staleness or [0]
        return {
            "async/staleness_mean": sum(stale) / len(stale),
            "async/staleness_max": float(max(stale)),
            "async/dropped_stale": float(self.dropped_stale),
            "async/partial_samples": float(self.partial),
            "async/wait_s": self.wait_s,
            "async/overlap_s": self.overlap_s,
        }


def fresh_groups(
    result: RolloutResult, trained_version: int, max_staleness: int
) -> tuple[list[int], list[int]]:
    """(indices of the samples to keep, staleness of each kept sample): whole prompt groups
    whose every sample's oldest token is at most `max_staleness` versions older than
    `trained_version`. A sample's oldest version is its own (`sample_versions`) or the
    round's; an unknown one (servers whose weights were never loaded) counts as too old."""
    versions = result.sample_versions or [(result.policy_version,) * 2] * result.batch.size
    too_old = trained_version - max_staleness - 1
    stale = [trained_version - (too_old if v[0] is None else v[0]) for v in versions]
    groups = prompt_groups(result.batch)
    kept = [i for g in groups if max(stale[i] for i in g) <= max_staleness for i in g]
    return kept, [stale[i] for i in kept]


def overlap(interval: Interval, busy: list[Interval]) -> float:
    """Seconds of `interval` inside the (disjoint) `busy` intervals."""
    start, end = interval
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)


class AheadRollout:
    """The `RolloutStrategy` of rollout_mode one_step_off and async (module docstring)."""

    def __init__(
        self,
        servers: PolicyServers,
        sampler: PromptSampler,
        data: PromptDataset,
        shaping: BatchShaping,
        reward_model: RewardModelScorer | None,
        trainer: TrainerConfig,
        last_step: int | None = None,
    ):
        """`trainer`: its `rollout_mode` and `async_rollout`; `last_step`: the run's last
        step (no round is generated ahead for later ones)."""
        self.servers, self.sampler, self.data, self.shaping = servers, sampler, data, shaping
        self.reward_model, self.last_step = reward_model, last_step
        mode = trainer.rollout_mode
        assert mode in ("one_step_off", "async"), mode
        self.pause = mode == "async"
        self.ahead = trainer.async_rollout.max_staleness if self.pause else 1
        self.queue: deque[Round] = deque()
        # two rounds at a time, oldest first: the one the next step waits for, and the next,
        # whose samples fill the server while the first one's longest samples finish
        self.executor = ThreadPoolExecutor(2, thread_name_prefix="rollout-ahead")
        self.consumed_state = sampler.state_dict()
        self.busy: list[Interval] = []  # the trainer's time outside next_batch
        self.busy_since: float | None = None
        self.account = StepAccount()

    # ---- rounds -------------------------------------------------------------------------

    def submit(self) -> None:
        """Draw the next prompts (every rank, identically) and start generating them."""
        sampled = self.sampler.next_batch()
        prompts = [self.data[i] for i in sampled.prompt_indices]
        args = (
            prompts,
            sampled.uids,
            sampled.prompt_indices,
            self.shaping.params,
        )
        interval: list[float] = []

        def generate() -> RolloutResult | None:
            interval.append(time.time())
            try:
                return self.servers.generate_here(*args)
            finally:
                interval.append(time.time())

        future = self.executor.submit(generate)
        self.queue.append(Round(self.sampler.state_dict(), future, interval))

    def top_up(self, version: int | None = None) -> None:
        """1 + `ahead` rounds ahead, fewer near the last step (the servers now hold
        `version`; its step trains next)."""
        wanted = 1 + self.ahead
        if self.last_step is not None and version is not None:
            wanted = min(wanted, self.last_step - version)
        while len(self.queue) < wanted:
            self.submit()

    def next_round(self) -> RolloutResult:
        """The oldest round ahead (one is submitted now when none is), received by every rank,
        its stale prompt groups dropped."""
        if not self.queue:
            self.submit()
        round_ = self.queue.popleft()
        start = time.perf_counter()
        mine = round_.future.result()
        self.account.wait_s += time.perf_counter() - start
        if len(round_.interval) == 2:  # this rank generated: how much of it overlapped
            self.account.overlap_s += overlap((round_.interval[0], round_.interval[1]), self.busy)
        result = score_model_rows(self.servers.share(mine), self.reward_model)
        self.consumed_state = round_.sampler_state
        trained = self.servers.version
        assert trained is not None, "the servers' weights were loaded before the first step"
        kept, staleness = fresh_groups(result, trained, self.ahead)
        self.account.dropped_stale += result.batch.size - len(kept)
        self.account.staleness += staleness
        if result.sample_versions is not None:
            self.account.partial += sum(
                result.sample_versions[i][0] != result.sample_versions[i][1] for i in kept
            )
        return result.select(kept) if len(kept) < result.batch.size else result

    # ---- the strategy -------------------------------------------------------------------

    def next_batch(self, step: int) -> StepBatch:
        if self.busy_since is not None:  # rounds consumed now started within 2 + K steps
            self.busy = [*self.busy[-(self.ahead + 2) :], (self.busy_since, time.time())]
        self.account = StepAccount()
        if not self.queue:
            self.top_up()
        got = collect_step_batch(self.next_round, self.shaping)
        self.busy_since = time.time()
        return StepBatch(got.batch, got.rounds, got.metrics | self.account.metrics())

    def publish(self, policy: Policy, version: int) -> WeightLoad:
        """Load `version` (one_step_off: once every round ahead is complete; async: pausing
        the servers around the sync), then top the rounds ahead up."""
        if not self.pause:
            for round_ in self.queue:
                round_.future.result()
        with policy.serving(self.servers.probe_sequence, self.servers.sleeps) as weights:
            loaded = self.servers.load_weights(weights, version, pause=self.pause)
        self.top_up(version)
        return loaded

    def sampler_state(self) -> dict[str, int]:
        return self.consumed_state

    def load_sampler_state(self, state: dict[str, int]) -> None:
        """Resume: the rounds that were ahead are drawn again (the queue is empty here)."""
        assert not self.queue, "resumed before any round was drawn"
        self.sampler.load_state_dict(state)
        self.consumed_state = self.sampler.state_dict()

    def close(self) -> None:
        """Rounds not started are cancelled; those generating finish in their threads."""
        self.executor.shutdown(wait=False, cancel_futures=True)


STORED_UID = "stored:"


def load_stored_groups(
    data: DataConfig,
    reward: RewardConfig,
    group_size: int,
    vocab_size: int,
    image_token_id: int | None = None,
) -> list[list[StoredSample]] | None:
    """The samples of `data.rollout_files` grouped by uid, in file order (None without),
    checked whole before anything starts (`rlhf.data.rollout_files.RolloutChecks`): token
    ids in the policy's vocabulary, the run's length limits, `rollout.n` samples a group,
    and every unscored row scorable by this run's reward (`group_size`: `rollout.n`); a
    vision-language policy's (`image_token_id`) refuses prompts with images."""
    if not data.rollout_files:
        return None
    files = resolve_files(data.rollout_files, "data.rollout_files")
    checks = RolloutChecks(
        vocab_size=vocab_size,
        max_lengths=(data.max_prompt_length, data.max_response_length),
        group_size=group_size,
        # stored rule rows are scored by the rules (or reward.custom_fn, which scores all)
        scorable=None if reward.custom_fn else check_ground_truth,
        model_scorer=bool(reward.model_path),
        image_token_id=image_token_id,
    )
    groups: dict[str, list[StoredSample]] = {}
    for sample in read_rollout_files(files, checks=checks):
        groups.setdefault(sample.uid, []).append(sample)
    k = stored_groups_per_step(data)
    if len(groups) < k:
        raise ValueError(
            f"data.rollout_files hold {len(groups)} prompt groups; each step takes {k} "
            "(data.stored_fraction x data.train_batch_size)"
        )
    return list(groups.values())


@dataclass
class MixedRollout(SynchronousRollout):
    """`SynchronousRollout` with each step's stored prompt groups in front (docstring)."""

    groups: list[list[StoredSample]] | None = None
    tokenizer: Any = None
    is_main: bool = True

    def __post_init__(self) -> None:
        assert self.groups is not None, "MixedRollout needs the stored groups"
        self.per_step = self.shaping.stored_per_step
        self.generated = self.shaping.train_batch_size - self.per_step
        self.stored_sampler = PromptSampler(len(self.groups), self.per_step, 1, self.shaping.seed)

    def next_batch(self, step: int) -> StepBatch:
        got = collect_step_batch(self.mixed_round, self.shaping)
        stored = sum(uid.startswith(STORED_UID) for uid in got.batch.uids)
        counts = {"stored/groups": float(self.per_step), "stored/samples": float(stored)}
        return StepBatch(got.batch, got.rounds, got.metrics | counts)

    def mixed_round(self) -> RolloutResult:
        """This step's stored groups, then its generated ones (if any)."""
        stored = score_model_rows(self.stored_round(), self.reward_model)
        if not self.generated:
            return stored
        fresh = self.generate_round()
        return RolloutResult(
            RolloutBatch.concat([stored.batch, fresh.batch]),
            [*stored.records, *fresh.records],
            stored.reward_s + fresh.reward_s,
            fresh.policy_version,
            fresh.tool_stats,
        )

    def stored_round(self) -> RolloutResult:
        """The next stored groups (every rank draws them identically), rule-scored where
        the file has no score."""
        drawn = self.stored_sampler.next_batch()
        samples = [s for i in drawn.prompt_indices for s in self.groups[i]]  # type: ignore[index]
        start = time.perf_counter()
        texts = self.texts(samples) if self.is_main else None
        received = broadcast_object(None if texts is None else self.scores(samples, texts))
        assert received is not None, "the main rank scored the stored samples"
        scores: list[float] = received
        masks = [s.response_mask for s in samples]
        batch = RolloutBatch(
            prompt_ids=[s.prompt_ids for s in samples],
            response_ids=[s.response_ids for s in samples],
            scores_b=torch.tensor(scores, dtype=torch.float32),
            data_sources=[s.data_source for s in samples],
            uids=[STORED_UID + s.uid for s in samples],
            rollout_logprobs=[s.rollout_logprobs for s in samples],
            reward_styles=[s.reward_style for s in samples],
            response_masks=None
            if all(m is None for m in masks)
            else [m or [1] * len(s.response_ids) for m, s in zip(masks, samples)],
        )
        records = [] if texts is None else stored_records(samples, texts, scores)
        return RolloutResult(batch, records, time.perf_counter() - start)

    def texts(self, samples: list[StoredSample]) -> list[str]:
        return [self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]

    def scores(self, samples: list[StoredSample], texts: list[str]) -> list[float]:
        """The stored scores; rule rows without one scored by the reward function (the
        servers' scorer: the main rank always owns an engine; model rows without one stay
        NaN for the reward model)."""
        scorer = self.servers.scorer
        assert scorer is not None, "the main rank owns the servers' reward scorer"
        todo = [i for i, s in enumerate(samples) if s.score is None and s.reward_style == "rule"]
        inputs = [
            RewardInput(s.data_source, texts[i], s.ground_truth, s.extra_info, s.reward_style)
            for i, s in ((i, samples[i]) for i in todo)
        ]
        scored = dict(zip(todo, scorer(inputs) if inputs else []))
        return [
            scored.get(i, math.nan if s.score is None else s.score) for i, s in enumerate(samples)
        ]

    def sampler_state(self) -> dict[str, Any]:
        return {**self.sampler.state_dict(), "stored": self.stored_sampler.state_dict()}

    def load_sampler_state(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self.stored_sampler.load_state_dict(state["stored"])


def stored_records(
    samples: list[StoredSample], texts: list[str], scores: list[float]
) -> list[RolloutRecord]:
    """What `rollouts/step_N.jsonl` shows of the stored samples a step trained on."""
    return [
        RolloutRecord(
            prompt_index=-1 if s.prompt_index is None else s.prompt_index,
            uid=STORED_UID + s.uid,
            prompt_ids=s.prompt_ids,
            response_ids=s.response_ids,
            response_logprobs=s.rollout_logprobs,
            finish_reason="stored",
            response_text=text,
            score=score,
            policy_version=s.policy_version,
            response_mask=s.response_mask,
            data_source=s.data_source,
            reward_style=s.reward_style,
            ground_truth=s.ground_truth,
            extra_info=s.extra_info,
        )
        for s, text, score in zip(samples, texts, scores)
    ]
