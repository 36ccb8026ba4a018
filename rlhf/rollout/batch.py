"""A step's scored rollouts: prompts, responses, scores, as every training rank holds them.

Rank 0 (or each node's engine owner) generates and scores them; `rlhf.rollout.policy_servers`
broadcasts the batch, so every rank holds all B samples. Per-token tensors derived from it
are [B, R] over the *policy's tokens*: column j of row i is the j-th token sample i's policy
generated, R = the most any sample has, right-padded and masked by `mask_bt`. In a
single-turn batch those are all the response tokens; in a multi-turn one (`response_masks`)
the tool messages between assistant turns are left out, so that every per-token quantity
(log-probs, entropies, values, KL, token rewards, advantages, GAE's recursion, importance
weights, losses) sees the policy's tokens only, in order, and the code computing them is the
same for both. The models still process the whole sequence; `rlhf.engine.micro_batch` reads
each policy token's output at its position. Which rank processes which sample is decided
later by the micro-batch plan.
"""

from __future__ import annotations

import dataclasses
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlhf.data.images import ImageInputs
from rlhf.data.rollout_files import StoredSample, write_rollout_file
from rlhf.rollout.multi_turn import ToolStats
from rlhf.utils import field_values


@dataclass(frozen=True)
class RolloutBatch:
    """B scored samples of one step (prompt i of the step has `rollout.n` samples).

    prompt_ids / response_ids: token ids per sample; scores_b: [B] rewards from the reward
    functions; data_sources, uids: per sample (uid identifies the prompt, for GRPO/RLOO);
    rollout_logprobs: the engine's log-prob of each response token as it sampled it (None
    when the batch did not come from an engine); reward_styles: each sample's
    `reward_model.style` ('rule' or 'model'; None: all rule); routed_experts: per sample
    [prompt + response - 1, layers x top-k] int16, the experts the engine routed each
    token to (every token but the last, which the engine never fed through the model;
    rollout routing replay, `router_replay.mode=R3`), or None; response_masks: per sample
    and response token, 1 where the policy generated it and 0 on tokens appended for it
    (tool messages of a multi-turn rollout), or None (every response token is the policy's);
    images: per sample its prompt's images as the model takes them (None for a text
    sample; the samples of one prompt share one object), or None (a text batch).
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    scores_b: Tensor
    data_sources: list[str]
    uids: list[str]
    rollout_logprobs: list[list[float]] | None = None
    reward_styles: list[str] | None = None
    routed_experts: list[Tensor] | None = None
    response_masks: list[list[int]] | None = None
    images: list[ImageInputs | None] | None = None

    def __post_init__(self) -> None:
        sizes = {len(self.prompt_ids), len(self.response_ids), len(self.data_sources)}
        sizes |= {len(self.uids), int(self.scores_b.numel())}
        optionals = (self.rollout_logprobs, self.reward_styles, self.routed_experts)
        for optional in (*optionals, self.response_masks, self.images):
            if optional is not None:
                sizes.add(len(optional))
        if len(sizes) != 1:
            raise ValueError(f"RolloutBatch fields disagree on the number of samples: {sizes}")
        logprobs = self.rollout_logprobs or []
        bad = [i for i, lp in enumerate(logprobs) if len(lp) != len(self.response_ids[i])]
        if bad:
            raise ValueError(f"samples {bad[:10]} have a log-prob count unlike their tokens")
        masks = self.response_masks or []
        bad = [i for i, m in enumerate(masks) if len(m) != len(self.response_ids[i])]
        bad += [i for i, m in enumerate(masks) if not set(m) <= {0, 1}]
        if bad:
            raise ValueError(f"samples {bad[:10]} have a response mask unlike their tokens")
        routes = self.routed_experts or []
        lengths = self.sequence_lengths
        bad = [i for i, r in enumerate(routes) if r.dim() != 2 or len(r) != lengths[i] - 1]
        if bad:
            raise ValueError(
                f"samples {bad[:10]} have routed experts for other than all tokens but the last"
            )

    @property
    def size(self) -> int:
        return len(self.prompt_ids)

    def policy_positions(self, i: int) -> list[int]:
        """Where in sample `i`'s response the policy's tokens are (all of it by default)."""
        if self.response_masks is None:
            return list(range(len(self.response_ids[i])))
        return [t for t, m in enumerate(self.response_masks[i]) if m]

    @property
    def policy_lengths(self) -> list[int]:
        """The policy's tokens per sample (the response length without tool messages)."""
        if self.response_masks is None:
            return [len(r) for r in self.response_ids]
        return [sum(m) for m in self.response_masks]

    @property
    def response_width(self) -> int:
        """R: the most policy tokens of a sample (at least 1 so that tensors are never empty)."""
        return max(1, max(self.policy_lengths))

    @property
    def sequence_lengths(self) -> list[int]:
        """Prompt + response tokens per sample (what the models process)."""
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids)]

    def mask_bt(self) -> Tensor:
        """[B, R] bool: True on each sample's policy tokens (left-aligned, see above)."""
        lengths = torch.tensor(self.policy_lengths)
        return torch.arange(self.response_width)[None, :] < lengths[:, None]

    def rollout_logprobs_bt(self) -> Tensor | None:
        """[B, R] fp32: the engine's log-prob of each policy token (0 beyond), or None."""
        if self.rollout_logprobs is None:
            return None
        out = torch.zeros(self.size, self.response_width)
        for i, logprobs in enumerate(self.rollout_logprobs):
            picked = [logprobs[t] for t in self.policy_positions(i)]
            out[i, : len(picked)] = torch.tensor(picked, dtype=torch.float32)
        return out

    def select(self, indices: list[int]) -> RolloutBatch:
        """The samples at `indices`, in that order."""
        logprobs, styles, routes = self.rollout_logprobs, self.reward_styles, self.routed_experts
        masks, images = self.response_masks, self.images
        return RolloutBatch(
            prompt_ids=[self.prompt_ids[i] for i in indices],
            response_ids=[self.response_ids[i] for i in indices],
            scores_b=self.scores_b[indices],
            data_sources=[self.data_sources[i] for i in indices],
            uids=[self.uids[i] for i in indices],
            rollout_logprobs=None if logprobs is None else [logprobs[i] for i in indices],
            reward_styles=None if styles is None else [styles[i] for i in indices],
            routed_experts=None if routes is None else [routes[i] for i in indices],
            response_masks=None if masks is None else [masks[i] for i in indices],
            images=None if images is None else [images[i] for i in indices],
        )

    def full_response_masks(self) -> list[list[int]]:
        """Each sample's response mask (all 1 in a single-turn batch)."""
        return self.response_masks or [[1] * len(r) for r in self.response_ids]

    def styles(self) -> list[str]:
        """Each sample's reward style."""
        return self.reward_styles or ["rule"] * self.size

    def num_response_tokens(self, indices: list[int] | None = None) -> int:
        """The policy's tokens among `indices` (what token-level losses count)."""
        rows = range(self.size) if indices is None else indices
        lengths = self.policy_lengths
        return sum(lengths[i] for i in rows)

    def num_responses(self, indices: list[int] | None = None) -> int:
        """Responses with a policy token among `indices` (what sequence-level losses count)."""
        rows = range(self.size) if indices is None else indices
        lengths = self.policy_lengths
        return sum(1 for i in rows if lengths[i])

    def to_objects(self) -> dict:
        """Plain objects for `broadcast_object_list`."""
        return {
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "scores": self.scores_b.tolist(),
            "data_sources": self.data_sources,
            "uids": self.uids,
            "rollout_logprobs": self.rollout_logprobs,
            "reward_styles": self.reward_styles,
            "routed_experts": self.routed_experts,
            "response_masks": self.response_masks,
            "images": self.images,
        }

    @classmethod
    def concat(cls, parts: list[RolloutBatch]) -> RolloutBatch:
        """The samples of `parts`, in order (engine log-probs and routed experts kept when
        every part has them)."""
        logprobs = [b.rollout_logprobs for b in parts]
        routes = [b.routed_experts for b in parts]
        styled = any(b.reward_styles is not None for b in parts)
        masked = any(b.response_masks is not None for b in parts)
        imaged = any(b.images is not None for b in parts)
        return cls(
            prompt_ids=[p for b in parts for p in b.prompt_ids],
            response_ids=[r for b in parts for r in b.response_ids],
            scores_b=torch.cat([b.scores_b for b in parts]),
            data_sources=[d for b in parts for d in b.data_sources],
            uids=[u for b in parts for u in b.uids],
            rollout_logprobs=None
            if any(lp is None for lp in logprobs)
            else [x for lp in logprobs if lp is not None for x in lp],
            reward_styles=[s for b in parts for s in b.styles()] if styled else None,
            routed_experts=None
            if any(r is None for r in routes)
            else [x for r in routes if r is not None for x in r],
            response_masks=[m for b in parts for m in b.full_response_masks()] if masked else None,
            images=[x for b in parts for x in (b.images or [None] * b.size)] if imaged else None,
        )

    @classmethod
    def from_objects(cls, obj: dict) -> RolloutBatch:
        return cls(
            prompt_ids=obj["prompt_ids"],
            response_ids=obj["response_ids"],
            scores_b=torch.tensor(obj["scores"], dtype=torch.float32),
            data_sources=obj["data_sources"],
            uids=obj["uids"],
            rollout_logprobs=obj.get("rollout_logprobs"),
            reward_styles=obj.get("reward_styles"),
            routed_experts=obj.get("routed_experts"),
            response_masks=obj.get("response_masks"),
            images=obj.get("images"),
        )


# ---- a round of generation: its scored samples ------------------------------------


@dataclass(frozen=True)
class RolloutRecord:
    """One scored sample as written to `rollouts/step_<N>.jsonl` (for reading, not training)."""

    prompt_index: int
    uid: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str
    response_text: str
    score: float
    policy_version: int | None = None  # the weight version the servers held (RolloutResult)
    turns: int | None = None  # multi-turn: assistant turns
    response_mask: list[int] | None = None  # multi-turn: 1 on the policy's tokens
    tool_calls: list[dict] | None = None  # multi-turn: each call, its result and error
    # continued across pauses (trainer.rollout_mode=async): (version, start, end) spans
    weight_versions: list[tuple[str, int, int]] | None = None
    # what its reward function reads (the prompt row's), for stored rollouts
    data_source: str = ""
    reward_style: str = "rule"
    ground_truth: Any = None
    extra_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    # a prompt with images: its row ("row 12 of train.parquet"), where the images are
    images_from: str | None = None

    def stored(self, step: int | None = None) -> StoredSample:
        """This sample as a stored rollout (`rlhf.data.rollout_files`) of `step`."""
        return StoredSample(
            uid=self.uid,
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            rollout_logprobs=self.response_logprobs,
            data_source=self.data_source,
            response_mask=self.response_mask,
            reward_style=self.reward_style,
            ground_truth=self.ground_truth,
            extra_info=self.extra_info,
            score=self.score,
            policy_version=self.policy_version,
            step=step,
            prompt_index=self.prompt_index,
        )


@dataclass(frozen=True)
class RolloutResult:
    """One round of generation and scoring, as every rank receives it from `PolicyServers`.

    batch: the scored samples (identical on every rank); records: the same samples with their
    texts and SGLang log-probs (on the main rank; empty elsewhere); reward_s: seconds spent
    in the reward function (the slowest engine's, when several engines generated);
    policy_version: the weight version the servers held while generating (None: unknown,
    external servers before the first weight load). This is where a sample's policy
    version is recorded (docs/architecture.md). tool_stats: what the conversations of a
    multi-turn round did (on every rank; None for single-turn rounds).
    """

    batch: RolloutBatch
    records: list[RolloutRecord]
    reward_s: float
    policy_version: int | None = None
    tool_stats: ToolStats | None = None  # multi-turn rounds: turns and tool calls
    # per sample (oldest, newest) weight version of its tokens, when they may differ
    # (samples continued across pauses: trainer.rollout_mode=async); else None
    sample_versions: list[tuple[int | None, int | None]] | None = None

    def select(self, indices: list[int]) -> RolloutResult:
        """The samples at `indices` (records too, on the rank that has them)."""
        versions = self.sample_versions
        return dataclasses.replace(
            self,
            batch=self.batch.select(indices),
            records=[self.records[i] for i in indices] if self.records else [],
            sample_versions=None if versions is None else [versions[i] for i in indices],
        )


def write_records(records: list[RolloutRecord], path: Path) -> None:
    """One JSON object per sample, for reading (rollouts/step_N.jsonl)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(field_values(r), default=str) + "\n" for r in records))


def write_step_rollouts(records: list[RolloutRecord], rollouts_dir: Path, step: int) -> None:
    """A step's samples, to read (`step_N.jsonl`) and to train from again (`step_N.parquet`,
    the stored-rollout format of `rlhf.data.rollout_files`)."""
    write_records(records, rollouts_dir / f"step_{step}.jsonl")
    write_rollout_file([r.stored(step) for r in records], rollouts_dir / f"step_{step}.parquet")


class StepRolloutWriter:
    """Each step's samples written in a thread (`write_step_rollouts`), off the step's path.

    `submit` hands a step's records over once the previous step's are written (normally long
    since). `wait` returns once everything handed over is written (before a checkpoint, at
    the end of the run) and raises what a write failed with. `written_s`: the seconds the
    last finished write took in its thread."""

    def __init__(self, rollouts_dir: Path):
        self.rollouts_dir = rollouts_dir
        self.written_s = 0.0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-files")
        self._pending: Future[float] | None = None

    def submit(self, records: list[RolloutRecord], step: int) -> None:
        self.wait()
        self._pending = self._pool.submit(self._write, records, step)

    def _write(self, records: list[RolloutRecord], step: int) -> float:
        start = time.perf_counter()
        write_step_rollouts(records, self.rollouts_dir, step)
        return time.perf_counter() - start

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self.written_s = pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown()
