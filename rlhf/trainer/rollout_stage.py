"""The rollout stage of a PPO step: prompts -> SGLang server(s) -> responses with log-probs.

Until the PPO update lands, `rlhf-train` runs this stage once: it is the first real piece
of the loop (config -> distributed bootstrap -> tokenised prompts -> generation with the
SGLang rollout engine -> records in the run directory).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import AutoTokenizer

from rlhf.config.schema import RLHFConfig
from rlhf.data.arithmetic import make_problems
from rlhf.rollout.engine import RolloutSample, SamplingParams, SGLangEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutRecord:
    """One sample: prompt index, prompt and response token ids, response log-probs."""

    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str
    response_text: str


def sampling_params(cfg: RLHFConfig) -> SamplingParams:
    """Sampling parameters from `actor_rollout_ref.rollout` and `data.max_response_length`."""
    return SamplingParams.from_config(cfg.actor_rollout_ref.rollout, cfg.data.max_response_length)


def kv_cache_tokens(cfg: RLHFConfig) -> int:
    """Tokens of KV cache one step's batch needs (CPU servers are sized to this)."""
    per_sample = cfg.data.max_prompt_length + cfg.data.max_response_length
    return max(2048, cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n * per_sample)


def tokenize_prompts(tokenizer, rows: list[dict]) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for row in rows
    ]


def rollout_once(cfg: RLHFConfig, run_dir: Path, device: str) -> list[RolloutRecord]:
    """Start the rollout engine for the policy, generate one step's batch, stop it."""
    model_path = cfg.actor_rollout_ref.model.path
    if not Path(model_path, "config.json").is_file():
        raise FileNotFoundError(
            f"actor_rollout_ref.model.path={model_path}: no config.json there (an HF model "
            "directory is expected; 'make quickstart' builds a tiny one)"
        )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = tokenize_prompts(tokenizer, make_problems(cfg.data.train_batch_size, cfg.data.seed))
    with SGLangEngine(
        cfg.actor_rollout_ref.rollout,
        model_path,
        log_dir=run_dir / "logs",
        device=device,
        seed=cfg.data.seed,
        max_total_tokens=kv_cache_tokens(cfg) if device == "cpu" else None,
    ) as engine:
        samples = engine.generate(prompts, sampling_params(cfg))
        stats = engine.last_stats
    records = [_record(s, prompts[s.prompt_index], tokenizer) for s in samples]
    log.info(
        "rollout: %d samples, %d response tokens in %.2f s (%.1f tokens/s)",
        stats.samples,
        stats.generated_tokens,
        stats.wall_s,
        stats.tokens_per_s,
    )
    return records


def _record(sample: RolloutSample, prompt: list[int], tokenizer) -> RolloutRecord:
    return RolloutRecord(
        prompt_index=sample.prompt_index,
        prompt_ids=prompt,
        response_ids=sample.response_ids,
        response_logprobs=sample.logprobs,
        finish_reason=sample.finish_reason,
        response_text=tokenizer.decode(sample.response_ids, skip_special_tokens=True),
    )


def write_records(records: list[RolloutRecord], path: Path) -> None:
    path.write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))
