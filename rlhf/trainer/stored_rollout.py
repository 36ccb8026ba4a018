"""Training from stored rollouts (`data.rollout_files`): samples generated earlier, by this
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

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.config.schema import RLHFConfig
from rlhf.config.stored_rules import stored_groups_per_step
from rlhf.data.files import resolve_files
from rlhf.data.rollout_files import RolloutChecks, StoredSample, read_rollout_files
from rlhf.data.sampler import PromptSampler
from rlhf.distributed.collectives import broadcast_object
from rlhf.engine.reward_model import score_model_rows
from rlhf.reward import check_ground_truth
from rlhf.reward.scorer import RewardInput
from rlhf.rollout.batch import RolloutBatch
from rlhf.rollout.generation import RolloutRecord, RolloutResult
from rlhf.trainer.rollout_strategy import StepBatch, SynchronousRollout, collect_step_batch

STORED_UID = "stored:"


def load_stored_groups(cfg: RLHFConfig, vocab_size: int) -> list[list[StoredSample]] | None:
    """The samples of `data.rollout_files` grouped by uid, in file order (None without),
    checked whole before anything starts (`rlhf.data.rollout_files.RolloutChecks`): token
    ids in the policy's vocabulary, the run's length limits, `rollout.n` samples a group,
    and every unscored row scorable by this run's reward."""
    if not cfg.data.rollout_files:
        return None
    files = resolve_files(cfg.data.rollout_files, "data.rollout_files")
    checks = RolloutChecks(
        vocab_size=vocab_size,
        max_lengths=(cfg.data.max_prompt_length, cfg.data.max_response_length),
        group_size=cfg.actor_rollout_ref.rollout.n,
        # stored rule rows are scored by the rules (or reward.custom_fn, which scores all)
        scorable=None if cfg.reward.custom_fn else check_ground_truth,
        model_scorer=bool(cfg.reward.model_path),
    )
    groups: dict[str, list[StoredSample]] = {}
    for sample in read_rollout_files(files, checks=checks):
        groups.setdefault(sample.uid, []).append(sample)
    k = stored_groups_per_step(cfg)
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
        self.per_step = stored_groups_per_step(self.cfg)
        self.generated = self.cfg.data.train_batch_size - self.per_step
        self.stored_sampler = PromptSampler(len(self.groups), self.per_step, 1, self.cfg.data.seed)

    def next_batch(self, step: int) -> StepBatch:
        got = collect_step_batch(self.mixed_round, self.cfg)
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
