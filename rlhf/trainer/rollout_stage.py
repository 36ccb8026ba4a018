"""The rollout and reward stages: prompts -> SGLang -> scored responses (rank 0 only).

Rank 0 owns the SGLang engine; it generates, scores and then broadcasts the batch so every
training rank holds the same `RolloutBatch`.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf.config.schema import RLHFConfig
from rlhf.data.prompts import EncodedPrompt
from rlhf.rollout.engine import SamplingParams
from rlhf.trainer.batch import RolloutBatch

log = logging.getLogger(__name__)


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


def sampling_params(cfg: RLHFConfig) -> SamplingParams:
    """Training sampling: `actor_rollout_ref.rollout` and `data.max_response_length`."""
    return SamplingParams.from_config(cfg.actor_rollout_ref.rollout, cfg.data.max_response_length)


def val_sampling_params(cfg: RLHFConfig) -> SamplingParams:
    """Validation sampling (`rollout.val_kwargs`); greedy unless do_sample."""
    kw = cfg.actor_rollout_ref.rollout.val_kwargs
    return SamplingParams(
        n=kw.n,
        temperature=kw.temperature if kw.do_sample else 0.0,
        top_p=kw.top_p if kw.do_sample else 1.0,
        top_k=kw.top_k if kw.do_sample else -1,
        max_new_tokens=cfg.data.max_response_length,
    )


def kv_cache_tokens(cfg: RLHFConfig, num_prompts: int) -> int:
    """Tokens of KV cache the largest generation needs (CPU servers are sized to this)."""
    per_sample = cfg.data.max_prompt_length + cfg.data.max_response_length
    n = max(cfg.actor_rollout_ref.rollout.n, cfg.actor_rollout_ref.rollout.val_kwargs.n)
    return max(2048, num_prompts * n * per_sample)


def generate_and_score(
    engine, tokenizer, reward_fn, prompts: list[EncodedPrompt], uids: list[str], indices: list[int],
    params: SamplingParams,
) -> tuple[RolloutBatch, list[RolloutRecord]]:  # fmt: skip
    """Generate `params.n` responses per prompt and score each with `reward_fn`.

    Returns the batch, its records and the seconds spent in the reward function.
    """
    samples = engine.generate([p.input_ids for p in prompts], params)
    start = time.perf_counter()
    records, sources = [], []
    for sample in samples:
        prompt = prompts[sample.prompt_index]
        text = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        row = prompt.row
        score = reward_fn(row.data_source, text, row.ground_truth, row.extra_info)
        sources.append(row.data_source)
        records.append(
            RolloutRecord(
                prompt_index=indices[sample.prompt_index],
                uid=uids[sample.prompt_index],
                prompt_ids=prompt.input_ids,
                response_ids=sample.response_ids,
                response_logprobs=sample.logprobs,
                finish_reason=sample.finish_reason,
                response_text=text,
                score=float(score),
            )
        )
    batch = RolloutBatch(
        prompt_ids=[r.prompt_ids for r in records],
        response_ids=[r.response_ids for r in records],
        scores_b=torch.tensor([r.score for r in records], dtype=torch.float32),
        data_sources=sources,
        uids=[r.uid for r in records],
    )
    return batch, records, time.perf_counter() - start


def broadcast_batch(batch: RolloutBatch | None) -> RolloutBatch:
    """Rank 0's batch on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert batch is not None
        return batch
    return RolloutBatch.from_objects(broadcast_object(batch.to_objects() if batch else None))


def broadcast_object(obj):
    """Rank 0's picklable object on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def rollout_metrics(batch: RolloutBatch, max_response_length: int) -> dict[str, float]:
    """verl-named length metrics of one rollout batch."""
    lengths = [len(r) for r in batch.response_ids]
    return {
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": max(lengths),
        "response_length/min": min(lengths),
        "response_length/clip_ratio": sum(n >= max_response_length for n in lengths) / len(lengths),
        "prompt_length/mean": sum(len(p) for p in batch.prompt_ids) / batch.size,
    }


def score_by_source(batch: RolloutBatch) -> dict[str, float]:
    """`val/test_score/<data_source>`: mean score per data source."""
    groups: dict[str, list[float]] = defaultdict(list)
    for source, score in zip(batch.data_sources, batch.scores_b.tolist()):
        groups[source].append(score)
    return {f"val/test_score/{s}": sum(v) / len(v) for s, v in sorted(groups.items())}


def write_records(records: list[RolloutRecord], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))
