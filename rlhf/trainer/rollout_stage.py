"""The rollout and reward stages of a PPO step: prompts -> SGLang -> scored responses.

Until the PPO update lands, `rlhf-train` runs these stages once: it is the first real piece
of the loop (config -> distributed bootstrap -> Parquet prompts through the sampler ->
generation with the SGLang rollout engine -> rule/custom rewards -> records in the run
directory).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from rlhf.config.schema import RLHFConfig
from rlhf.data.prompts import load_tokenizer, prompt_dataset_from_config
from rlhf.data.sampler import PromptSampler
from rlhf.reward import build_reward_fn
from rlhf.rollout.engine import SamplingParams, SGLangEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutRecord:
    """One scored sample: its prompt (dataset index, uid, ids), response ids and log-probs."""

    prompt_index: int
    uid: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str
    response_text: str
    score: float


def sampling_params(cfg: RLHFConfig) -> SamplingParams:
    """Sampling parameters from `actor_rollout_ref.rollout` and `data.max_response_length`."""
    return SamplingParams.from_config(cfg.actor_rollout_ref.rollout, cfg.data.max_response_length)


def kv_cache_tokens(cfg: RLHFConfig) -> int:
    """Tokens of KV cache one step's batch needs (CPU servers are sized to this)."""
    per_sample = cfg.data.max_prompt_length + cfg.data.max_response_length
    return max(2048, cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n * per_sample)


def rollout_once(cfg: RLHFConfig, run_dir: Path, device: str) -> list[RolloutRecord]:
    """Sample one step's prompts, generate `rollout.n` responses each, score them."""
    model_path = cfg.actor_rollout_ref.model.path
    if not Path(model_path, "config.json").is_file():
        raise FileNotFoundError(
            f"actor_rollout_ref.model.path={model_path}: no config.json there (an HF model "
            "directory is expected; 'make quickstart' builds a tiny one)"
        )
    tokenizer = load_tokenizer(model_path)
    dataset = prompt_dataset_from_config(cfg.data, tokenizer, "train")
    rollout = cfg.actor_rollout_ref.rollout
    batch = PromptSampler(
        len(dataset.prompts), cfg.data.train_batch_size, rollout.n, cfg.data.seed
    ).next_batch()
    prompts = [dataset.prompts[i] for i in batch.prompt_indices]
    with SGLangEngine(
        rollout,
        model_path,
        log_dir=run_dir / "logs",
        device=device,
        seed=cfg.data.seed,
        max_total_tokens=kv_cache_tokens(cfg) if device == "cpu" else None,
    ) as engine:
        samples = engine.generate([p.input_ids for p in prompts], sampling_params(cfg))
        stats = engine.last_stats
    reward_fn = build_reward_fn(cfg.reward)
    records = []
    for sample in samples:
        prompt = prompts[sample.prompt_index]
        text = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        row = prompt.row
        score = reward_fn(row.data_source, text, row.ground_truth, row.extra_info)
        records.append(
            RolloutRecord(
                prompt_index=batch.prompt_indices[sample.prompt_index],
                uid=batch.uids[sample.prompt_index],
                prompt_ids=prompt.input_ids,
                response_ids=sample.response_ids,
                response_logprobs=sample.logprobs,
                finish_reason=sample.finish_reason,
                response_text=text,
                score=float(score),
            )
        )
    mean_score = sum(r.score for r in records) / len(records)
    log.info(
        "rollout: %d samples, %d response tokens in %.2f s (%.1f tokens/s); mean score %.3f",
        stats.samples,
        stats.generated_tokens,
        stats.wall_s,
        stats.tokens_per_s,
        mean_score,
    )
    return records


def rollout_metrics(records: list[RolloutRecord], max_response_length: int) -> dict[str, float]:
    """verl-named metrics of one rollout batch."""
    lengths = [len(r.response_ids) for r in records]
    return {
        "critic/score/mean": sum(r.score for r in records) / len(records),
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": max(lengths),
        "response_length/clip_ratio": sum(n >= max_response_length for n in lengths) / len(lengths),
        "prompt_length/mean": sum(len(r.prompt_ids) for r in records) / len(records),
    }


def write_records(records: list[RolloutRecord], path: Path) -> None:
    path.write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))
