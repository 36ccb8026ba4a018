"""One PPO step, top to bottom.

    generate -> score -> old/ref log-probs and values -> advantages -> critic update
    -> actor update -> weights to the servers -> metrics

`PPOStep.run(step)` is that sequence (the trainer's loop calls it once per step);
`learn_from_batch` is its middle part, from a scored batch to the updated models, which the
trainer tests also run on synthetic batches. The batch comes from the rollout strategy
(`rlhf.trainer.rollouts`); the models are the engine's (`rlhf.engine.engine.PPOEngine`):
`logprobs`, `values`, then `update` (one optimizer step per mini-batch, its loss against
the experience built here); the weights go to the servers through the strategy's `publish`
(`PolicyServers.load_weights`).

The step returns a typed `StepResult`; its `metrics` are the logging view of it and are
never read back to decide anything.

The experience (`Experience`, `build_experience`) is what a step computes from its rollouts
before the updates, as one typed record: token rewards (score - beta x KL), advantages and
returns, and the rollout-correction weights.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from rlhf.algo import compute_advantages, kl_penalty, masked_mean, token_level_rewards
from rlhf.algo.kl import AdaptiveKLController, FixedKLController
from rlhf.algo.rollout_correction import mismatch_metrics, truncated_is_weights
from rlhf.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
from rlhf.config.schema import ActorConfig, TrainerConfig
from rlhf.config.validate import kl_in_reward
from rlhf.engine.engine import PPOEngine
from rlhf.engine.nonfinite import (
    NonFiniteError,
    check_scores,
    nonfinite_marks,
    nonfinite_tensors,
)
from rlhf.logging import Timer
from rlhf.memory.ledger import ledger
from rlhf.rollout.batch import RolloutBatch, StepRolloutWriter
from rlhf.rollout.policy_servers import PolicyServers, WeightLoad
from rlhf.trainer.metrics import StepMeter, rollout_metrics
from rlhf.trainer.rollouts import RolloutStrategy, StepBatch

log = logging.getLogger(__name__)
KLController = FixedKLController | AdaptiveKLController


@dataclass(frozen=True)
class Learned:
    """What one batch taught the models.

    skipped: a tensor of the experience was not finite, so no update ran
    (`trainer.on_nonfinite=skip`); nonfinite: the names of what was not finite (the
    experience's tensors, or the gradients of updates that were skipped).
    """

    experience: Experience
    skipped: bool
    nonfinite: list[str]
    metrics: dict[str, float]


@dataclass(frozen=True)
class StepResult:
    """One step: its batch's mean score and KL to the reference (what the early stop reads),
    what was skipped, the weight version the servers now serve, and the metrics to log."""

    step: int
    experience: Experience
    mean_score: float
    reward_kl: float | None
    skipped: bool
    nonfinite: list[str]
    weights: WeightLoad
    metrics: dict[str, float]


@dataclass(frozen=True)
class Learning:
    """What a step's learning reads of the config: the algorithm section (advantages,
    rollout correction), whether the KL goes into the reward, the actor's KL-loss
    coefficient (None without a KL loss), `trainer.on_nonfinite` and
    `trainer.critic_warmup`."""

    algorithm: AlgorithmConfig
    kl_in_reward: bool
    kl_loss_coef: float | None
    on_nonfinite: str = "stop"
    critic_warmup: int = 0

    @classmethod
    def of(cls, algorithm: AlgorithmConfig, actor: ActorConfig, trainer: TrainerConfig) -> Learning:
        coef = actor.kl_loss_coef if actor.use_kl_loss else None
        in_reward = kl_in_reward(algorithm, actor)
        return cls(algorithm, in_reward, coef, trainer.on_nonfinite, trainer.critic_warmup)

    def actor_trains(self, step: int) -> bool:
        """Whether step `step` (from 1) updates the actor: not in `trainer.critic_warmup`."""
        return step > self.critic_warmup


class PPOStep:
    """The step of a run: its models, servers, rollout strategy and KL controller."""

    def __init__(
        self,
        learning: Learning,
        max_response_length: int,
        engine: PPOEngine,
        servers: PolicyServers,
        rollout: RolloutStrategy,
        kl_ctrl: KLController,
        meter: StepMeter,
        rollouts_dir: Path | None,
    ):
        """`max_response_length`: `data.max_response_length` (the rollout metrics' clip
        length); `meter`: the step's performance metrics; `rollouts_dir`: where the main rank
        writes each step's samples (None on the other ranks)."""
        self.learning, self.max_response_length = learning, max_response_length
        self.engine, self.servers, self.rollout = engine, servers, rollout
        self.kl_ctrl, self.meter = kl_ctrl, meter
        self.files = StepRolloutWriter(rollouts_dir) if rollouts_dir is not None else None

    def files_written(self) -> None:
        """Every step's rollout files so far are on disk (raises what a write failed with)."""
        if self.files is not None:
            self.files.wait()

    def close(self) -> None:
        if self.files is not None:
            self.files.close()

    def run(self, step: int) -> StepResult:
        timer, start = Timer(), time.perf_counter()
        # generate and score (rule rewards on the engine rank, the reward model here)
        with stage(timer, "gen"):
            scored = self.rollout.next_batch(step)
        batch = scored.batch
        check_scores(batch)
        self.servers.release_memory()  # GPU, colocated: training gets SGLang's memory
        timer.seconds["gen"] -= scored.reward_s  # scoring ran inside the gen stage
        timer.seconds["reward"] = scored.reward_s
        try:  # old/ref log-probs and values -> advantages -> critic, actor updates
            actor = self.learning.actor_trains(step)
            learned = learn_from_batch(
                self.engine, batch, self.learning, self.kl_ctrl, timer, actor
            )
            with stage(timer, "update_weights"):  # the servers serve version `step`
                weights = self.rollout.publish(self.engine, step)
        finally:  # the step's samples, a failed step's too
            self.keep_samples(scored, step, timer)
        step_s = time.perf_counter() - start
        exp = learned.experience
        metrics = learned.metrics | scored.metrics | weights.metrics()
        metrics |= rollout_metrics(batch, self.max_response_length)
        # what no stage timed (a new per-step cost shows here until it gets its own stage)
        other = step_s - sum(timer.seconds.values())
        metrics |= timer.metrics() | {"timing_s/step": step_s, "timing_s/other": other}
        if self.files is not None:  # the last finished write, in its thread
            metrics["timing_s/write_rollouts_thread"] = self.files.written_s
        metrics |= self.meter.metrics(batch, step_s)
        if exp.old_entropy_bt is not None:  # not under rollout_correction.bypass_mode
            metrics["actor/entropy_old"] = float(masked_mean(exp.old_entropy_bt, batch.mask_bt()))
        kl = exp.reward_kl  # a skipped step's KL may be NaN: not a KL to act on
        return StepResult(
            step,
            exp,
            float(batch.scores_b.mean()),
            kl if kl is not None and math.isfinite(kl) else None,
            learned.skipped,
            learned.nonfinite,
            weights,
            metrics,
        )

    def keep_samples(self, scored: StepBatch, step: int, timer: Timer) -> None:
        """Hand the step's samples to the thread that writes them (main rank), at the step's
        end: they are written while the next step generates and its trainer waits on HTTP
        (written before the old-log-prob pass, the writer's Python held the GIL against
        it)."""
        if self.files is not None:
            with stage(timer, "write_rollouts"):
                self.files.submit([record for r in scored.rounds for record in r.records], step)


class StageTimer(Protocol):
    """What `learn_from_batch` reports its stages to: the step's `Timer`, or a meter of each
    stage's memory (`rlhf.trainer.memory_simulation`)."""

    def stage(self, name: str) -> AbstractContextManager[None]: ...


@contextmanager
def stage(timer: StageTimer, name: str) -> Iterator[None]:
    """A stage of the step: timed (`timing_s/<name>`) and a phase of the device ledger
    (`rlhf.memory.ledger`: what each stage holds on the device is asserted on the CPU)."""
    with timer.stage(name), ledger().phase(name):
        yield


def learn_from_batch(
    engine: PPOEngine,
    batch: RolloutBatch,
    learning: Learning,
    kl_ctrl: KLController,
    timer: StageTimer,
    update_actor: bool = True,
) -> Learned:
    """Old log-probs (the engine's under `rollout_correction.bypass_mode`), reference
    log-probs and values (when those models exist), advantages, then the critic's and (with
    `update_actor`) the actor's updates. The KL controller moves only when the KL is applied
    in the reward."""
    old: tuple[Tensor, Tensor | None]
    if learning.algorithm.rollout_correction.bypass_mode:
        old = engine_logprobs(batch)
    else:
        with stage(timer, "old_log_prob"):
            old = engine.logprobs(batch, "actor")
    ref = values = None
    if engine.ref is not None:
        with stage(timer, "ref"):
            ref, _ = engine.logprobs(batch, "ref")
    if engine.critic is not None:
        with stage(timer, "values"):
            values = engine.values(batch)
    with stage(timer, "adv"):
        beta = kl_ctrl.value if learning.kl_in_reward else 0.0
        exp, metrics = build_experience(batch, old, ref, values, learning.algorithm, beta)
    bad = nonfinite_experience(exp)
    if bad:  # identical on every rank: all skip or all stop
        if learning.on_nonfinite == "stop":
            raise NonFiniteError(
                f"not finite before the updates: {', '.join(bad)} (trainer.on_nonfinite=stop)"
            )
        finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
        return Learned(
            exp, True, bad, finite | {"training/skipped_step": 1.0} | nonfinite_marks(bad)
        )
    if learning.kl_in_reward:
        assert exp.reward_kl is not None, "the KL in the reward needs the reference"
        kl_ctrl.update(exp.reward_kl, batch.size)
    found: list[str] = []
    if engine.critic is not None:
        with stage(timer, "update_critic"):
            critic = engine.update("critic", batch, exp)
        metrics |= critic.metrics
        found += critic.nonfinite
    if update_actor:
        with stage(timer, "update_actor"):
            actor = engine.update("actor", batch, exp)
        metrics |= actor.metrics
        found += actor.nonfinite
    else:
        metrics["actor/frozen_for_critic_warmup"] = 1.0
    if learning.kl_loss_coef is not None:
        metrics["actor/kl_coef"] = learning.kl_loss_coef
    return Learned(exp, False, found, metrics | nonfinite_marks(found))


# ---- forward passes -------------------------------------------------------------------


def engine_logprobs(batch: RolloutBatch) -> tuple[Tensor, None]:
    """`algorithm.rollout_correction.bypass_mode`: the engine's log-probs as the old ones (no
    entropies)."""
    logprobs_bt = batch.rollout_logprobs_bt()
    if logprobs_bt is None:
        raise ValueError(
            "algorithm.rollout_correction.bypass_mode needs the engine's log-probs of the "
            "sampled tokens, and this batch has none"
        )
    return logprobs_bt, None


def nonfinite_experience(exp: Experience) -> list[str]:
    """Which of the step's per-token tensors have a NaN/inf on a response token."""
    named = {
        "old_log_prob": exp.old_logprobs_bt,
        "ref_log_prob": exp.ref_logprobs_bt,
        "values": exp.values_bt,
        "advantages": exp.advantages_bt,
        "returns": exp.returns_bt,
    }
    return nonfinite_tensors(named, exp.batch.mask_bt())


@dataclass(frozen=True)
class Experience:
    """The step's samples and the per-token tensors the losses read.

    Every tensor is [B, R] fp32 on the CPU (B samples, R = the longest response), zero
    beyond each response (`batch.mask_bt()`), identical on every rank:

    old_logprobs_bt / old_entropy_bt: the actor's log-probs of the response tokens and its
        entropies before the update (at the rollout temperature); under
        `algorithm.rollout_correction.bypass_mode` the engine's log-probs and no entropies;
    ref_logprobs_bt: the frozen reference's log-probs (None without a reference);
    values_bt: the critic's values before the update (None without a critic);
    token_rewards_bt: score at the last token minus the KL penalty (beta x KL) per token;
    advantages_bt, returns_bt: from `algorithm.adv_estimator` (returns: the critic's
        regression targets, None for estimators without a critic);
    rollout_is_weights_bt: truncated importance weights pi_old / pi_rollout on the policy
        loss (`algorithm.rollout_correction.rollout_is`; None when off);
    reward_kl: the KL to the reference, the mean over responses of each response's mean
        per-token KL as in verl (what the KL controller and the early stop read; None
        without a reference).
    """

    batch: RolloutBatch
    old_logprobs_bt: Tensor
    old_entropy_bt: Tensor | None
    ref_logprobs_bt: Tensor | None
    values_bt: Tensor | None
    token_rewards_bt: Tensor
    advantages_bt: Tensor
    returns_bt: Tensor | None
    rollout_is_weights_bt: Tensor | None = None
    reward_kl: float | None = None


def build_experience(
    batch: RolloutBatch,
    old: tuple[Tensor, Tensor | None],
    ref_logprobs_bt: Tensor | None,
    values_bt: Tensor | None,
    algo: AlgorithmConfig,
    beta: float,
) -> tuple[Experience, dict[str, float]]:
    """Token rewards (score - beta * KL), advantages, returns; the step's KL and reward metrics.

    `old` is the actor's (log-probs, entropies), or the engine's log-probs and None
    (`rollout_correction.bypass_mode`: no mismatch to measure). With a reference, the KL
    reported (and fed to the controller) is the mean over responses of each response's mean
    per-token KL, as in verl; `beta`: the KL controller's coefficient when the KL is in the
    reward (`rlhf.config.validate.kl_in_reward`), else 0.
    """
    old_logprobs_bt, old_entropy_bt = old
    mask = batch.mask_bt()
    metrics: dict[str, float] = {}
    kl_bt = torch.zeros_like(old_logprobs_bt)
    reward_kl = None
    if ref_logprobs_bt is not None:
        kl = kl_penalty(old_logprobs_bt, ref_logprobs_bt, algo.kl_penalty)
        kl_bt = torch.where(mask, kl, 0)
        lengths = mask.sum(dim=1).clamp(min=1)
        reward_kl = float((kl_bt.sum(dim=1) / lengths).mean())
        metrics["actor/reward_kl_penalty"] = reward_kl
        metrics["actor/reward_kl_penalty_coeff"] = beta
    rewards = token_level_rewards(batch.scores_b, mask, kl_bt, beta)
    out = compute_advantages(
        algo.adv_estimator,
        rewards,
        mask,
        values_bt=values_bt,
        uids=batch.uids,
        gamma=algo.gamma,
        lam=algo.lam,
        norm_by_std=algo.norm_adv_by_std_in_grpo,
    )
    weights, metrics_is = None, dict[str, float]()
    if not algo.rollout_correction.bypass_mode:
        weights, metrics_is = rollout_correction(batch, old_logprobs_bt, algo.rollout_correction)
    experience = Experience(
        batch,
        old_logprobs_bt,
        old_entropy_bt,
        ref_logprobs_bt,
        values_bt,
        rewards,
        out.advantages_bt,
        out.returns_bt,
        weights,
        reward_kl,
    )
    metrics |= metrics_is
    metrics |= {
        "critic/score/mean": float(batch.scores_b.mean()),
        "critic/rewards/mean": float(rewards.sum(dim=1).mean()),
        "critic/advantages/mean": float(masked_mean(out.advantages_bt, mask)),
    }
    if out.returns_bt is not None:
        metrics["critic/returns/mean"] = float(masked_mean(out.returns_bt, mask))
    if values_bt is not None:
        metrics["critic/values/mean"] = float(masked_mean(values_bt, mask))
    return experience, metrics


def rollout_correction(
    batch: RolloutBatch, old_logprobs_bt: Tensor, settings: RolloutCorrectionConfig
) -> tuple[Tensor | None, dict[str, float]]:
    """Truncated importance weights (when `settings.rollout_is`) and the mismatch metrics
    `rollout_corr/*` of a batch that carries the engine's log-probs."""
    rollout_bt = batch.rollout_logprobs_bt()
    if rollout_bt is None:
        return None, {}
    mask = batch.mask_bt()
    metrics = mismatch_metrics(old_logprobs_bt, rollout_bt, mask)
    weights = None
    if settings.rollout_is is not None:
        weights, is_metrics = truncated_is_weights(
            old_logprobs_bt, rollout_bt, mask, settings.rollout_is, settings.rollout_is_threshold
        )
        metrics |= is_metrics
    return weights, {f"rollout_corr/{k}": v for k, v in metrics.items()}
