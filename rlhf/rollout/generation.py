"""Generation and scoring on one engine: prompts -> SGLang -> decoded, scored responses."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf.config.schema import RLHFConfig
from rlhf.data.prompts import EncodedPrompt
from rlhf.data.rollout_files import StoredSample, write_rollout_file
from rlhf.reward.scorer import RewardInput, RewardScorer
from rlhf.rollout.batch import RolloutBatch
from rlhf.rollout.engine import RolloutEngine, RolloutSample, SamplingParams, SGLangEngine
from rlhf.rollout.multi_turn import Conversation, MultiTurnRollout, ToolStats
from rlhf.rollout.partial import first_and_last_version


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


@dataclass(frozen=True)
class PauseHandling:
    """How samples cut by a pause are finished (`SGLangEngine.generate_through_pauses`):
    `stop_ids` end a sample; `keep_tokens`: go on from its tokens, else start again."""

    stop_ids: frozenset[int]
    keep_tokens: bool = True


def write_records(records: list[RolloutRecord], path: Path) -> None:
    """One JSON object per sample, for reading (rollouts/step_N.jsonl)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(asdict(r), default=str) + "\n" for r in records))


def write_step_rollouts(records: list[RolloutRecord], rollouts_dir: Path, step: int) -> None:
    """A step's samples, to read (`step_N.jsonl`) and to train from again (`step_N.parquet`,
    the stored-rollout format of `rlhf.data.rollout_files`)."""
    write_records(records, rollouts_dir / f"step_{step}.jsonl")
    write_rollout_file([r.stored(step) for r in records], rollouts_dir / f"step_{step}.parquet")


def sampling_params(cfg: RLHFConfig) -> SamplingParams:
    """Training sampling: `actor_rollout_ref.rollout` and `data.max_response_length`; the
    routed experts come back with rollout routing replay (`router_replay.mode=R3`)."""
    aro = cfg.actor_rollout_ref
    max_tokens = cfg.data.max_response_length
    params = SamplingParams.from_config(aro.rollout, max_tokens, aro.rollout.sampling_seed)
    return dataclasses.replace(params, routed_experts=aro.actor.router_replay.mode == "R3")


def val_sampling_params(cfg: RLHFConfig) -> SamplingParams:
    """Validation sampling (`rollout.val_kwargs`); greedy unless do_sample."""
    rollout = cfg.actor_rollout_ref.rollout
    kw = rollout.val_kwargs
    return SamplingParams(
        n=kw.n,
        temperature=kw.temperature if kw.do_sample else 0.0,
        top_p=kw.top_p if kw.do_sample else 1.0,
        top_k=kw.top_k if kw.do_sample else -1,
        max_new_tokens=cfg.data.max_response_length,
        seed=rollout.sampling_seed if kw.do_sample else None,
    )


def kv_cache_tokens(cfg: RLHFConfig, num_prompts: int) -> int:
    """Tokens of KV cache the largest generation needs (CPU servers are sized to this)."""
    per_sample = cfg.data.max_prompt_length + cfg.data.max_response_length
    n = max(cfg.actor_rollout_ref.rollout.n, cfg.actor_rollout_ref.rollout.val_kwargs.n)
    return max(2048, num_prompts * n * per_sample)


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
    records the versions of its tokens.
    """
    params = params.for_prompts(uids)  # seeded requests: each prompt's seeds from its uid
    samples, conversations = generate_samples(engine, prompts, params, multi_turn, pauses)
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
    records = [
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
        )
        for sample, score, item in zip(samples, scores, inputs)
    ]
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
    )
    stats = None if conversations is None else ToolStats.of(conversations)
    reward_s = time.perf_counter() - start
    return RolloutResult(batch, records, reward_s, policy_version, stats, versions)


def generate_samples(
    engine: RolloutEngine,
    prompts: list[EncodedPrompt],
    params: SamplingParams,
    multi_turn: MultiTurnRollout | None,
    pauses: PauseHandling | None,
) -> tuple[list[RolloutSample], list[Conversation] | None]:
    """The samples of `generate_and_score` (and the conversations of multi-turn ones)."""
    ids = [p.input_ids for p in prompts]
    if pauses is not None:
        assert isinstance(engine, SGLangEngine), "only SGLang servers pause"
        stop_ids = set(pauses.stop_ids)
        return engine.generate_through_pauses(ids, params, stop_ids, pauses.keep_tokens), None
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
