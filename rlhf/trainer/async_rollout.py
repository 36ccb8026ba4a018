"""Generation ahead of training: `trainer.rollout_mode` one_step_off and async.

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
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from rlhf.config.schema import RLHFConfig
from rlhf.data.prompts import PromptDataset
from rlhf.data.sampler import PromptSampler
from rlhf.engine.reward_model import RewardModelScorer, score_model_rows
from rlhf.rollout.generation import RolloutResult, sampling_params
from rlhf.rollout.policy_servers import PolicyServers, PolicyWeights, WeightLoad
from rlhf.trainer.rollout_strategy import StepBatch, collect_step_batch, prompt_groups

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
        cfg: RLHFConfig,
        reward_model: RewardModelScorer | None,
        last_step: int | None = None,
    ):
        """`last_step`: the run's last step (no round is generated ahead for later ones)."""
        self.servers, self.sampler, self.data, self.cfg = servers, sampler, data, cfg
        self.reward_model, self.last_step = reward_model, last_step
        mode = cfg.trainer.rollout_mode
        assert mode in ("one_step_off", "async"), mode
        self.pause = mode == "async"
        self.ahead = cfg.trainer.async_rollout.max_staleness if self.pause else 1
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
        args = (prompts, sampled.uids, sampled.prompt_indices, sampling_params(self.cfg))
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
        got = collect_step_batch(self.next_round, self.cfg)
        self.busy_since = time.time()
        return StepBatch(got.batch, got.rounds, got.metrics | self.account.metrics())

    def publish(self, policy: PolicyWeights, version: int) -> WeightLoad:
        """Load `version` (one_step_off: once every round ahead is complete; async: pausing
        the servers around the sync), then top the rounds ahead up."""
        if not self.pause:
            for round_ in self.queue:
                round_.future.result()
        loaded = self.servers.load_weights(policy, version, pause=self.pause)
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
